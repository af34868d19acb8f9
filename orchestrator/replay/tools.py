"""A replayed tool call: the worker's own tool task (``worker.tool_task.ToolCall``), with what
the call does decided by the replay.

Everything but running the tool is the tool task's: the claim, the approval gate, the
stored call read back with the spec, the record (scrubbed, bounded) and the barrier that
sends the next turn. ``execute`` first checks the call against this process's registry (a
tool gone, or a schema that refuses the recorded arguments, is a divergence), then:

- recorded: the call's result is the recorded one, what the model read included;
- live: the tool runs in the replay's sandbox folder, and a result that differs from the
  recorded one (times, uuids and the run's folder normalised) is a divergence.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from pydantic import ValidationError

from orchestrator.journal import normalise
from orchestrator.replay.cassette import Cassette
from orchestrator.replay.report import Divergence
from orchestrator.store import CallStart
from worker import protect
from worker.registry import REGISTRY
from worker.sandbox import CallOutcome
from worker.tool_task import ToolCall, _brief

NEVER_FOUND = "UnknownTool"
REFUSED = ("ValidationError", "InvalidArguments")


class Replaying(Protocol):
    """What a replayed call needs of its replay (``orchestrator.replay.runner.Session``)."""

    cassette: Cassette
    live: bool
    recorded_tools: set[str]

    def note(self, divergence: Divergence) -> None: ...


class ReplayToolCall(ToolCall):
    def __init__(self, store: Any, message: dict[str, Any], gen: int, session: Replaying) -> None:
        super().__init__(store, message, gen)
        self.session = session

    def _start(self, approved: bool = False) -> CallStart:
        """As the tool task claims a call, this replay being the only worker: it takes every
        call, a tool it lacks included (``execute`` says so)."""
        here = REGISTRY.get(self.p.get("tool") or "")
        return self.store.start_call(
            self.held.run_id, self.held.iteration, int(self.p["index"]), self.gen, self.held.owner,
            self.p.get("tool") or "", True, bool(here and here.approval), True, approved,
        )  # fmt: skip

    def execute(self) -> tuple[CallOutcome, Any]:
        line = self.session.cassette.calls.get(self.p["key"])
        record = (line or {}).get("record") or {}
        inputs, parted = self._check(record)
        if self._served_elsewhere() and line is not None:  # an MCP server's: no host here
            return self._recorded(line), inputs
        if self.session.live or line is None:
            outcome, inputs = super().execute()
            if line is not None and not parted:
                self._compare(record, outcome, inputs)
            return outcome, inputs
        return self._recorded(line), inputs

    def _check(self, record: dict[str, Any]) -> tuple[Any, bool]:
        """The call against this process's tools: (its arguments as a record keeps them, a
        divergence found): a tool gone or arguments refused, where the recording had neither."""
        raw = self._raw_inputs()
        error = str(record.get("error") or "")
        call = {"call": self.p["key"], "tool": self.p["tool"]}
        if self.http is not None or (self.tool is not None and self.tool.remote is not None):
            return raw, False
        if self.tool is None:
            if error.startswith(NEVER_FOUND) or self._served_elsewhere():
                return raw, False
            return raw, self._diverge("tool_missing", {**call, "exists": True}, {**call, "exists": False})
        try:
            return self.tool.arguments.model_validate(raw).model_dump(mode="json"), False
        except ValidationError as exc:
            if error.startswith(REFUSED):
                return raw, False
            refused = {**call, "error": _brief(exc)}
            return raw, self._diverge("tool_arguments", {**call, "arguments": raw}, refused)

    def _served_elsewhere(self) -> bool:
        """An MCP server's tool (``<server>__<tool>``, offered when the run was recorded): a
        replay starts no MCP host, so its results come from the cassette, live or not."""
        name = str(self.p.get("tool") or "")
        if self.tool is not None and self.tool.remote is not None:
            return True
        return self.tool is None and "__" in name and name in self.session.recorded_tools

    def _recorded(self, line: dict[str, Any]) -> CallOutcome:
        """The recorded result; its output rebuilt from what the model read when the record's
        own copy was cut to the record's bound."""
        record = line["record"]
        if not record.get("success"):
            return CallOutcome(False, error=record.get("error") or "",
                               duration_ms=record.get("duration_ms") or 0.0)  # fmt: skip
        output, read = record.get("output"), line.get("message")
        if isinstance(read, str) and protect.model_text(output) != read:
            output = read if isinstance(output, str) else _json_or_text(read)
        return CallOutcome(True, output=output, duration_ms=record.get("duration_ms") or 0.0)

    def _compare(self, record: dict[str, Any], outcome: CallOutcome, inputs: Any) -> None:
        new, _ = protect.tool_result(self.p, outcome.ok, outcome.output, outcome.error, inputs, 0.0)
        run_id = self.p["run_id"]

        def seen(value: Any) -> str:
            return normalise(json.dumps(value, sort_keys=True, default=str), run_id)

        was = {"success": record.get("success"), "output": record.get("output"), "error": record.get("error")}
        now = {"success": new.success, "output": new.output, "error": new.error}
        if seen(was) != seen(now):
            self._diverge("tool_result", {"call": self.p["key"], "tool": self.p["tool"], **was},
                          {"call": self.p["key"], "tool": self.p["tool"], **now})  # fmt: skip

    def _diverge(self, what: str, recorded: Any, now: Any) -> bool:
        found = Divergence(iteration=int(self.p["iteration"]), what=what, recorded=recorded, now=now)
        self.session.note(found)
        return True


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text
