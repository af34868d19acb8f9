"""Where a recovered step's stall went, from the run's events and the workers' logs.

``bench/chaos.py`` counts a stall per step the sweeper sent again: from the run's last
progress before the loss to its first progress after the re-send. This module splits
each one into the parts that make it up, in order:

  before   the lost step's own work, from the last progress to the loss (the kill -9 or
           SIGSTOP of the worker that had taken it; for a failed attempt, its failure)
  lease    the loss to its lease's lapse (``lost_since`` of the ``recovery`` event)
  sweep    the lapse to the sweep that sent the step again (the ``recovery`` event)
  queue    the re-send to a worker taking the new message (the worker's log: "Task ...
           received"): the publish, the queue in front of it, a worker with a free slot
  redo     that worker's taking it to the run's next progress event

The loss is matched to the bench's own actions on the worker whose log shows the lost
delivery; a part that cannot be told (no delivery logged, a message lost with Redis)
is left out, and the others still add up to at most the stall.
"""

from __future__ import annotations

import re
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

PARTS = ("before", "lease", "sweep", "queue", "redo")
RECEIVED = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}): INFO/[^\]]+\] "
                      r"Task tooloop\.(?:turn|tool)\[(\S+)\] received")  # fmt: skip
# turn-<run>-<iteration>-<gen> | tool-<run>-<iteration>.<index>-<gen>
TASK = re.compile(r"^(turn|tool)-(.+)-(\d+)(?:\.\d+)?-(\d+)$")


@dataclass(frozen=True)
class Action:
    """Something the bench did to a worker: kill, freeze, thaw, start, ready."""

    at: float  # epoch seconds
    what: str
    worker: str


@dataclass(frozen=True)
class Delivery:
    """A worker took a step's message (its log's "received" line)."""

    at: float
    worker: str
    gen: int


@dataclass
class Stall:
    run_id: str
    step: str  # "turn 3" | "call 2"
    total: float
    cause: str  # kill -9 | SIGSTOP | failed attempt | message lost | ?
    sent_at: float = 0.0  # the recovery event (epoch seconds)
    worker: str = ""  # the lost delivery's worker
    parts: dict[str, float] = field(default_factory=dict)
    queue_len: int | None = None  # messages waiting in the step's queues when it was re-sent
    workers_up: int | None = None  # workers ready, not frozen, when it was re-sent

    def describe(self) -> str:
        parts = " + ".join(f"{name} {self.parts[name]:.1f}" for name in PARTS if name in self.parts)
        where = f"{self.cause} of {self.worker}" if self.worker else self.cause
        context = []
        if self.queue_len is not None:
            context.append(f"{self.queue_len} queued")
        if self.workers_up is not None:
            context.append(f"{self.workers_up} workers up")
        tail = f"; {', '.join(context)}" if context else ""
        parts = parts or "no parts known"
        return f"{self.total:.1f}s  run {self.run_id[:12]} {self.step} ({where}): {parts}{tail}"


def read_deliveries(logs: dict[str, Path]) -> dict[tuple[str, str, int], list[Delivery]]:
    """(run id, 'turn'|'tool', iteration) -> the deliveries of its messages, in time order."""
    out: dict[tuple[str, str, int], list[Delivery]] = defaultdict(list)
    for worker, path in logs.items():
        if not path.exists():
            continue
        for line in path.read_text(errors="replace").splitlines():
            found = RECEIVED.match(line)
            task = TASK.match(found.group(2)) if found else None
            if task is None:
                continue
            # Celery logs local time; a naive datetime's astimezone() reads it as such
            at = datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f").astimezone().timestamp()
            kind, run_id, iteration, gen = task.groups()
            out[(run_id, kind, int(iteration))].append(Delivery(at, worker, int(gen)))
    for deliveries in out.values():
        deliveries.sort(key=lambda d: d.at)
    return out


def stalls_of_run(run_id: str, events: list, deliveries: dict, actions: list[Action]) -> list[Stall]:
    """One Stall per ``recovery`` event of the run that has progress on both sides."""
    out = []
    for i, event in enumerate(events):
        if event.type != "recovery":
            continue
        before = [e.ts.timestamp() for e in events[:i] if e.type != "recovery"]
        after = [e.ts.timestamp() for e in events[i + 1 :] if e.type != "recovery"]
        if not (before and after):
            continue
        kind = "turn" if event.step == "turn" else "tool"
        sent_at = event.ts.timestamp()
        step = f"{'turn' if kind == 'turn' else 'call'} {event.iteration}"
        stall = Stall(run_id, step, after[0] - before[-1], "?", sent_at)
        lost_since = event.lost_since.timestamp() if getattr(event, "lost_since", None) else None
        fill(stall, before[-1], sent_at, after[0], lost_since,
             deliveries.get((run_id, kind, event.iteration), []), actions)  # fmt: skip
        out.append(stall)
    return out


def fill(stall: Stall, last: float, sent_at: float, next_progress: float, lost_since: float | None,
         deliveries: list[Delivery], actions: list[Action]) -> None:  # fmt: skip
    """The parts of one stall (see the module's notes)."""
    lost = [d for d in deliveries if d.at <= sent_at]
    redo = [d for d in deliveries if d.at > sent_at]
    loss_at = None
    if lost:
        stall.worker = lost[-1].worker
        hit = [a for a in actions if a.worker == stall.worker and a.what in ("kill", "freeze")
               and lost[-1].at <= a.at <= sent_at]  # fmt: skip
        if hit:
            stall.cause, loss_at = ("kill -9" if hit[0].what == "kill" else "SIGSTOP"), hit[0].at
        else:
            stall.cause = "failed attempt"  # taken by a live worker and given back (it raised)
    else:
        stall.cause = "message lost"  # never taken: gone from its queue
    if loss_at is not None:
        stall.parts["before"] = max(0.0, loss_at - last)
    if lost_since is not None:
        start = loss_at if loss_at is not None else last
        stall.parts["lease"] = max(0.0, lost_since - start)
        stall.parts["sweep"] = max(0.0, sent_at - lost_since)
    if redo:
        stall.parts["queue"] = max(0.0, redo[0].at - sent_at)
        stall.parts["redo"] = max(0.0, next_progress - redo[0].at)


def workers_up(actions: list[Action], at: float) -> int:
    """Workers ready (published) and neither killed nor frozen at ``at``."""
    state: dict[str, str] = {}
    for action in sorted(actions, key=lambda a: a.at):
        if action.at > at:
            break
        if action.what == "ready" and state.get(action.worker) != "killed":
            state[action.worker] = "frozen" if state.get(action.worker) == "frozen" else "up"
        elif action.what == "kill":
            state[action.worker] = "killed"
        elif action.what == "freeze":
            state[action.worker] = "frozen"
        elif action.what == "thaw" and state.get(action.worker) == "frozen":
            state[action.worker] = "up"
    return sum(s == "up" for s in state.values())


def summary(stalls: list[Stall], actions: list[Action], top: int = 5) -> list[str]:
    """The report's lines: the largest stall and its parts, each part's median and max,
    the causes, and how long the replaced workers took to start."""
    if not stalls:
        return []
    ranked = sorted(stalls, key=lambda s: s.total, reverse=True)
    lines = [f"  largest stall   {ranked[0].describe()}"]
    lines += [f"                  {s.describe()}" for s in ranked[1:top]]
    cells = []
    for name in PARTS:
        values = [s.parts[name] for s in stalls if name in s.parts]
        if values:
            cells.append(f"{name} {statistics.median(values):.1f}/{max(values):.1f}")
    lines.append(f"  stall parts s   median/max: {'  '.join(cells)}")
    causes = defaultdict(int)
    for s in stalls:
        causes[s.cause] += 1
    ranked_causes = sorted(causes.items(), key=lambda kv: -kv[1])
    lines.append("  causes          " + ", ".join(f"{n} {cause}" for cause, n in ranked_causes))
    lines.append(f"  worker start    {startups(actions)}")
    return lines


def startups(actions: list[Action]) -> str:
    """How long each worker took from its start to its pools' publishing themselves."""
    started = {a.worker: a.at for a in actions if a.what == "start"}
    took = sorted(a.at - started[a.worker] for a in actions if a.what == "ready" and a.worker in started)
    if not took:
        return "none ready"
    return (f"{len(took)} started: ready after median {statistics.median(took):.1f}s, "
            f"max {took[-1]:.1f}s")  # fmt: skip
