"""Terminal views for the CLI: the runs table and the live watch.

Rich only draws on a terminal. In a pipe, ``list`` prints plain aligned columns
and ``watch`` one plain line per event (``event_line``, stable for scripts):
rich wraps at 80 columns in pipes, which breaks parsers.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TextIO

from pydantic import BaseModel, Field

from orchestrator.models import RunResult, Status

STATUS_STYLE = {"queued": "dim", "running": "cyan", "paused": "yellow",
                "completed": "green", "failed": "red", "aborted": "magenta"}  # fmt: skip


class RunSummary(BaseModel):
    """One row of ``tooloop list`` / ``GET /api/runs``."""

    run_id: str
    status: Status
    exit: str | None = None
    iteration: int = 0
    tokens_used: int = 0
    model: str = ""
    tenant: str = "default"
    created_at: int = Field(0, description="ms since the epoch")

    @classmethod
    def from_row(cls, row: dict[str, str]) -> RunSummary:
        """From a ``RunStore.list_runs`` row (all strings; '' when unset)."""
        return cls.model_validate({k: v for k, v in row.items() if v != ""})


# -- list ------------------------------------------------------------------------------
COLUMNS = ("run", "status", "exit", "turns", "tokens", "model", "tenant", "created")


def _cells(run: RunSummary) -> tuple[str, ...]:
    created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(run.created_at / 1000))
    return (run.run_id, run.status.value, run.exit or "-", str(run.iteration),
            str(run.tokens_used), run.model, run.tenant, created)  # fmt: skip


def runs_table(runs: list[RunSummary], out: TextIO | None = None) -> None:
    out = out or sys.stdout
    if not runs:
        print("no runs", file=sys.stderr)
    elif out.isatty():
        _rich_table(runs)
    else:
        print(plain_table([COLUMNS, *(_cells(r) for r in runs)]), file=out)


def plain_table(rows: Iterable[tuple[str, ...]]) -> str:
    """Columns padded to their widest cell, two spaces apart (``awk``-friendly)."""
    rows = list(rows)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                     for row in rows)  # fmt: skip


def _rich_table(runs: list[RunSummary]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(*COLUMNS, title=f"{len(runs)} recent runs")
    for column in table.columns[3:5]:
        column.justify = "right"
    for run in runs:
        cells = list(_cells(run))
        cells[1] = f"[{STATUS_STYLE.get(cells[1], '')}]{cells[1]}[/]"
        table.add_row(*cells)
    Console().print(table)


# -- watch -----------------------------------------------------------------------------
def event_line(event: dict[str, str]) -> str:
    """One plain line per event: metadata only, stable for scripts."""
    kind = event.get("type", "?")
    if kind == "iteration":
        return (f"turn {event['iteration']} tool_calls={event['tool_calls']} "
                f"tokens={event['tokens_used']}")  # fmt: skip
    if kind == "tool_call":
        ok = "true" if event.get("success") == "1" else "false"
        return f"turn {event['iteration']} tool {event['tool']} success={ok}"
    if kind == "outcome":
        return f"outcome exit={event['exit']} status={event['status']} turn={event['iteration']}"
    if kind == "text":  # streamed model text, JSON-quoted: its newlines stay on one line
        return f"turn {event['iteration']} text {json.dumps(event['text'])}"
    if kind == "approval":
        return approval_line(event)
    skip = {"type", "ts", "id"}
    details = " ".join(f"{k}={v}" for k, v in event.items() if k not in skip)
    return f"{kind} {details}".strip()


def approval_line(event: dict[str, str]) -> str:
    """A call waiting for a person, or the decision taken on it."""
    call, tool = event.get("call_id", "?"), event.get("tool", "?")
    if event.get("decision") == "pending":
        return (f"approval pending call={call} tool={tool} arguments={event.get('arguments', '')} "
                f"(tooloop approve|deny RUN {call})")  # fmt: skip
    return f"approval {event.get('decision')} call={call} tool={tool} by={event.get('by', '')}"


def watch_run(handle: Any) -> RunResult | None:
    """Follow a run until it ends (a finished run is replayed); its final result."""
    if sys.stdout.isatty():
        _watch_live(handle)
    else:
        for event in handle.events():
            # plain print, never a rich console: one line per event, unwrapped
            print(event_line(event), flush=True)
    return handle.result()


@dataclass
class WatchState:
    """What the live view shows, folded from the events seen so far."""

    run_id: str
    status: str = "queued"
    turn: str = "0"
    tokens: str = "0"
    calls: int = 0
    failed: int = 0
    started_ms: int | None = None  # the `queued` event: the run's creation
    ended_ms: int | None = None  # the `outcome` event
    lines: list[str] = field(default_factory=list)
    text: str = ""  # the model's streamed text, this turn
    turn_streaming: str = ""
    waiting: int = 0  # calls waiting for a person's decision

    def apply(self, event: dict[str, str]) -> None:
        kind, ts = event.get("type"), int(event.get("ts") or 0) or None
        if kind == "text":  # shown as it grows, not as event lines
            same_turn = event["iteration"] == self.turn_streaming
            self.text = self.text + event["text"] if same_turn else event["text"]
            self.turn_streaming = event["iteration"]
            return
        self.lines.append(event_line(event))
        if kind == "queued":
            self.started_ms = ts
        elif kind == "iteration":
            self.turn, self.tokens, self.status = event["iteration"], event["tokens_used"], "running"
        elif kind == "tool_call":
            self.calls += 1
            self.failed += event.get("success") != "1"
        elif kind == "control":
            self.status = _CONTROL_STATUS.get(event.get("action", ""), self.status)
        elif kind == "approval":
            self.waiting += 1 if event.get("decision") == "pending" else -1
            self.status = f"waiting for {self.waiting} approval(s)" if self.waiting else "running"
        elif kind == "outcome":
            self.status, self.ended_ms = f"{event['status']} ({event['exit']})", ts

    def elapsed_s(self) -> float:
        if self.started_ms is None:
            return 0.0
        end = self.ended_ms or time.time() * 1000
        return max(0.0, (end - self.started_ms) / 1000)

    def __rich__(self) -> Any:
        # Called on every refresh, so `elapsed` ticks between events.
        from rich.table import Table

        table = Table(title=f"run {self.run_id}", show_header=False, min_width=60)
        style = STATUS_STYLE.get(self.status.split(" ")[0], "")
        table.add_row("status", f"[{style}]{self.status}[/]" if style else self.status)
        table.add_row("turn", self.turn)
        table.add_row("tool calls", f"{self.calls} ({self.failed} failed)")
        table.add_row("tokens", self.tokens)
        table.add_row("elapsed", f"{self.elapsed_s():.1f}s")
        table.add_row("events", "\n".join(self.lines[-10:]))
        if self.text:
            table.add_row(f"text (turn {self.turn_streaming})", self.text[-TEXT_SHOWN:])
        return table


TEXT_SHOWN = 600  # characters of streamed text in the live view
_CONTROL_STATUS = {"pause": "paused", "resume": "running", "abort": "aborting"}


def _watch_live(handle: Any) -> None:
    from rich.console import Console
    from rich.live import Live

    state = WatchState(handle.run_id)
    with Live(state, console=Console(), refresh_per_second=4):
        for event in handle.events():
            state.apply(event)
