"""A call's process kept for the next call of the same run (the worker's side).

A fresh process per call is most of a tool-turn's CPU (~10 ms here: the fork server's
fork, ~900 copy-on-write faults, the exit). So a process that served a call of a run
may serve that run's next calls, one at a time, in this pool process:

- only a spare of the fork server, running a plain forked call as a uid of its own (the
  worker is root), and only for calls of the same run with the same folder, group,
  policy and environment: the next call runs as that process's uid, under the limits it
  set itself (its file-size limit lowered, if need be, to what the run's folder may
  still take); never a call of another run;
- the process decides after each call whether it may serve another (spare_child.py):
  no process left (it is its calls' subreaper: whatever they started is its child until
  reaped), no thread the tool started, no descriptor it did not have, its pipes
  untouched, its peak memory grown by less than 16 MiB, and under ``REUSE_CPU_S`` of CPU
  in all (its CPU limit counts from its start: a later call gets at most that much less);
- a call that times out, is aborted, overflows or crashes ends its process as before
  (``call.py``), and the next call gets a fresh one;
- at most ``TOOLOOP_SANDBOX_REUSE`` processes kept per pool process (default 32; 0:
  one process per call, as before), each used within ``KEEP_IDLE_S`` of its last call,
  else ended at the pool process's next ``settle`` (or with the pool process); one
  that is no longer kept sees its request pipe close and exits.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker.sandbox.plan import _Plan
    from worker.sandbox.spare_process import _Spare
    from worker.sandbox.zygote import Zygote

KEEP_IDLE_S = 10.0  # a kept process unused for this long ends
DEFAULT_KEPT = 32


@dataclass
class _Kept:
    spare: _Spare
    key: tuple[Any, ...]
    uid: int
    used_at: float


_kept: dict[int, OrderedDict[str, _Kept]] = {}  # pool process pid -> run id -> its process


def most() -> int:
    """Processes kept per pool process (``TOOLOOP_SANDBOX_REUSE``; 0: no reuse)."""
    try:
        return max(0, int(os.environ.get("TOOLOOP_SANDBOX_REUSE", DEFAULT_KEPT)))
    except ValueError:
        return DEFAULT_KEPT


def allowed(run_id: str | None, plan: _Plan, deferred: bool) -> bool:
    """May this call's process stay for the run's next call? (Its uid is its own.)"""
    return bool(run_id and deferred and plan.layer == "fork" and plan.uid is not None and most())


def _key(plan: _Plan, server: Zygote) -> tuple[Any, ...]:
    return (plan.layer, plan.workdir, plan.gid, plan.policy.model_dump_json(), sorted(plan.env.items()),
            id(server))  # fmt: skip


def _ours() -> OrderedDict[str, _Kept]:
    return _kept.setdefault(os.getpid(), OrderedDict())


def take(run_id: str | None, plan: _Plan, server: Zygote) -> _Spare | None:
    """The run's kept process, if it fits this call (then ``plan.uid`` becomes its uid)."""
    kept = _ours().pop(run_id, None) if run_id else None
    if kept is None:
        return None
    fits = kept.key == _key(plan, server) and time.monotonic() - kept.used_at < KEEP_IDLE_S
    if not fits or not server.alive() or kept.spare.ended():
        _end(kept)
        return None
    plan.uid = kept.uid
    return kept.spare


def keep(run_id: str, plan: _Plan, spare: _Spare) -> None:
    """After a call that ended cleanly in a process that may stay: kept for the run."""
    assert plan.uid is not None and spare.server is not None
    ours = _ours()
    old = ours.pop(run_id, None)
    if old is not None and old.spare is not spare:
        _end(old)
    ours[run_id] = _Kept(spare, _key(plan, spare.server), plan.uid, time.monotonic())
    while len(ours) > most():
        _end(ours.popitem(last=False)[1])


def expire() -> None:
    """End the processes not used for KEEP_IDLE_S (after each call: ``settle``)."""
    ours = _ours()
    now = time.monotonic()
    for run_id in [r for r, k in ours.items() if now - k.used_at >= KEEP_IDLE_S]:
        _end(ours.pop(run_id))


def forget(run_id: str | None = None) -> None:
    """End the run's kept process (every one, without ``run_id``)."""
    ours = _ours()
    for key in [run_id] if run_id else list(ours):
        kept = ours.pop(key, None)
        if kept is not None:
            _end(kept)


def kept_pid(run_id: str) -> int | None:
    kept = _ours().get(run_id)
    return kept.spare.pid if kept else None


def _end(kept: _Kept) -> None:
    """Close its pipes: waiting for a request, it reads the end and exits (its fork
    server reaps it). No signal: once it exits, its pid may be another process's."""
    for fd in (kept.spare.request_fd, kept.spare.result_fd):
        with contextlib.suppress(OSError):
            os.close(fd)
