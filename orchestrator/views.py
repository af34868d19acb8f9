"""Terminal views for the CLI: the runs table and the live watch.

Rich only draws on a terminal; in a pipe, ``watch`` prints one plain line per
event (rich wraps at 80 columns in pipes, which breaks parsers).
"""

from __future__ import annotations

import sys
import time
from typing import Any

from orchestrator.models import RunResult


def runs_table(rows: list[dict[str, str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table("run", "status", "exit", "turns", "tokens", "model", "tenant", "created")
    for row in rows:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(int(row["created_at"]) / 1000))
        table.add_row(row["run_id"], row["status"], row["exit"] or "-", row["iteration"],
                      row["tokens_used"], row["model"], row["tenant"], created)  # fmt: skip
    Console().print(table)


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
    skip = {"type", "ts", "id"}
    details = " ".join(f"{k}={v}" for k, v in event.items() if k not in skip)
    return f"{kind} {details}".strip()


def watch_run(handle: Any) -> RunResult | None:
    if not sys.stdout.isatty():
        for event in handle.events():
            print(event_line(event), flush=True)
        return handle.result()
    return _watch_live(handle)


def _watch_live(handle: Any) -> RunResult | None:
    from rich.console import Console
    from rich.live import Live
    from rich.table import Table

    started = time.monotonic()
    state: dict[str, Any] = {"turn": 0, "tokens": 0, "calls": 0, "failed": 0, "status": "…"}
    lines: list[str] = []

    def render() -> Table:
        table = Table(title=f"run {handle.run_id}", show_header=False)
        table.add_row("status", str(state["status"]))
        table.add_row("turn", str(state["turn"]))
        table.add_row("tool calls", f"{state['calls']} ({state['failed']} failed)")
        table.add_row("tokens", str(state["tokens"]))
        table.add_row("elapsed", f"{time.monotonic() - started:.1f}s")
        table.add_row("events", "\n".join(lines[-10:]))
        return table

    with Live(render(), console=Console(), refresh_per_second=4) as live:
        for event in handle.events():
            lines.append(event_line(event))
            if event["type"] == "iteration":
                state.update(turn=event["iteration"], tokens=event["tokens_used"])
                state["status"] = "running"
            elif event["type"] == "tool_call":
                state["calls"] += 1
                state["failed"] += event.get("success") != "1"
            elif event["type"] == "control":
                state["status"] = event.get("action", state["status"])
            elif event["type"] == "outcome":
                state["status"] = f"{event['status']} ({event['exit']})"
            live.update(render())
    return handle.result()
