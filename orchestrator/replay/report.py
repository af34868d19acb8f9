"""What a replay found (``orchestrator.testing.replay``; ``tooloop replay --json``)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from orchestrator.models import RunResult

WHATS = {
    "request": "the request to the model differs from the recorded one",
    "tool_missing": "the recorded reply calls a tool that no longer exists",
    "tool_arguments": "the tool's schema refuses the arguments the recorded reply gave",
    "tool_result": "the tool's result differs from the recorded one (live tools)",
    "exit": "the run ended otherwise",
    "turns": "the loop asked the model for a turn the cassette has no reply for",
    "approval": "a call waited for a person where the recorded one did not",
    "runaway": "the replay did not end",
}


class Divergence(BaseModel):
    """Where the replay parted from its cassette: the turn, what differs, both values."""

    iteration: int
    what: str = Field(description=", ".join(WHATS))
    recorded: Any = None
    now: Any = None

    def describe(self) -> str:
        return f"turn {self.iteration}: {self.what} ({WHATS.get(self.what, self.what)})"


class ReplayReport(BaseModel):
    same: bool  # no divergence: the loop did what the recording did
    divergences: list[Divergence] = Field(default_factory=list)  # the first, or all with keep_going
    result: RunResult | None = None  # the replayed run's result
    cassette: str = ""
    tools: str = "recorded"

    @property
    def first(self) -> Divergence | None:
        return self.divergences[0] if self.divergences else None
