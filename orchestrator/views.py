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
from datetime import UTC, datetime
from typing import Any, TextIO

from pydantic import BaseModel, Field

from orchestrator import events as ev
from orchestrator.events import Event
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
def event_line(event: Event) -> str:
    """One plain line per event: metadata only, stable for scripts."""
    match event:
        case ev.Iteration():
            return f"turn {event.iteration} tool_calls={event.tool_calls} tokens={event.tokens_used}"
        case ev.ToolCall():
            return f"turn {event.iteration} tool {event.tool} success={_plain(event.success)}"
        case ev.Outcome():
            return f"outcome exit={event.exit} status={event.status} turn={event.iteration}"
        case ev.Text():  # streamed model text, JSON-quoted: its newlines stay on one line
            return f"turn {event.iteration} text {json.dumps(event.text)}"
        case ev.Approval():
            return approval_line(event)
        case ev.Child():
            return f"turn {event.iteration} child {event.agent} run={event.child} call={event.call_id}"
    details = " ".join(f"{k}={_plain(v)}" for k, v in _fields(event).items())
    return f"{event.type} {details}".strip()


def _fields(event: Event) -> dict[str, Any]:
    """The event's own fields, those it has (None: not set), a newer writer's extras last."""
    return {k: v for k, v in event if k not in ("id", "type", "ts") and v is not None}


def _plain(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, datetime):
        return value.isoformat(timespec="milliseconds")
    return str(value)


def approval_line(event: ev.Approval) -> str:
    """A call waiting for a person, or the decision taken on it."""
    call, tool = event.call_id, event.tool
    if event.decision == "pending":
        return (f"approval pending call={call} tool={tool} arguments={event.arguments or ''} "
                f"(tooloop approve|deny RUN {call})")  # fmt: skip
    return f"approval {event.decision} call={call} tool={tool} by={event.by or ''}"


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
    progress: str = "queued"  # queued until a turn's reply is recorded (or a resume), then running
    paused: bool = False  # a pause recorded, no resume since: whatever else lands, it stays paused
    aborting: bool = False
    outcome: str | None = None  # "<status> (<exit>)" once the run ended
    turn: int = 0
    tokens: int = 0
    calls: int = 0
    failed: int = 0
    started: datetime | None = None  # the `queued` event: the run's creation
    ended: datetime | None = None  # the `outcome` event
    lines: list[str] = field(default_factory=list)
    text: str = ""  # the model's streamed text, this turn
    turn_streaming: int | None = None
    waiting: int = 0  # calls waiting for a person's decision

    @property
    def status(self) -> str:
        # A paused run's in-flight reply (or a decided approval) still lands after the pause:
        # those events show progress, never a status the run does not have.
        if self.outcome:
            return self.outcome
        if self.aborting:
            return "aborting"
        if self.paused:
            return "paused"
        if self.waiting:
            return f"waiting for {self.waiting} approval(s)"
        return self.progress

    def apply(self, event: Event) -> None:
        if isinstance(event, ev.Text):  # shown as it grows, not as event lines
            same_turn = event.iteration == self.turn_streaming
            self.text = self.text + event.text if same_turn else event.text
            self.turn_streaming = event.iteration
            return
        self.lines.append(event_line(event))
        match event:
            case ev.Queued():
                self.started = event.ts
            case ev.Iteration():
                self.turn, self.tokens, self.progress = event.iteration, event.tokens_used, "running"
            case ev.ToolCall():
                self.calls += 1
                self.failed += not event.success
            case ev.Control():
                self._control(event.action)
            case ev.Approval():  # a call of a recorded reply: the run has started
                self.waiting += 1 if event.decision == "pending" else -1
                self.progress = "running"
            case ev.Outcome():
                self.outcome, self.ended = f"{event.status} ({event.exit})", event.ts

    def _control(self, action: str) -> None:
        if action == "pause":
            self.paused = True
        elif action == "resume":
            self.paused, self.progress = False, "running"
        elif action == "abort":
            self.aborting = True

    def elapsed_s(self) -> float:
        if self.started is None:
            return 0.0
        end = self.ended or datetime.now(UTC)
        return max(0.0, (end - self.started).total_seconds())

    def __rich__(self) -> Any:
        # Called on every refresh, so `elapsed` ticks between events.
        from rich.table import Table

        table = Table(title=f"run {self.run_id}", show_header=False, min_width=60)
        style = STATUS_STYLE.get(self.status.split(" ")[0], "")
        table.add_row("status", f"[{style}]{self.status}[/]" if style else self.status)
        table.add_row("turn", str(self.turn))
        table.add_row("tool calls", f"{self.calls} ({self.failed} failed)")
        table.add_row("tokens", str(self.tokens))
        table.add_row("elapsed", f"{self.elapsed_s():.1f}s")
        table.add_row("events", "\n".join(self.lines[-10:]))
        if self.text:
            table.add_row(f"text (turn {self.turn_streaming})", self.text[-TEXT_SHOWN:])
        return table


TEXT_SHOWN = 600  # characters of streamed text in the live view


def _watch_live(handle: Any) -> None:
    from rich.console import Console
    from rich.live import Live

    state = WatchState(handle.run_id)
    with Live(state, console=Console(), refresh_per_second=4):
        for event in handle.events():
            state.apply(event)
