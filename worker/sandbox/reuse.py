"""A call's process kept for the next call of the same run (the worker's side).

A fresh process per call is most of a tool-turn's CPU (~10 ms here: the fork server's
fork, ~900 copy-on-write faults, the exit). So a process that served a call of a run
may serve that run's next calls, one at a time:

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
- the kept processes wait in the fork server (``fork_server.py``), the pool's one, so a
  run's next call finds its process whichever pool process takes it: at most
  ``TOOLOOP_SANDBOX_REUSE`` per server (default 512, ~3.3 MiB PSS each; 0: one process
  per call, as before), each used within 10 s of its last call, else ended; one that is no
  longer kept sees its request pipe close and exits.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING

import worker.sandbox.zygote as zygote
from worker.sandbox.spare_process import _Spare

if TYPE_CHECKING:
    from worker.sandbox.plan import _Plan
    from worker.sandbox.zygote import Zygote


def allowed(run_id: str | None, plan: _Plan, deferred: bool) -> bool:
    """May this call's process stay for the run's next call? (Its uid is its own.)"""
    return bool(run_id and deferred and plan.layer == "fork" and plan.uid is not None and zygote.kept_most())


def _key(plan: _Plan) -> str:
    """What a call must share with the run's last one to run in its process."""
    return repr((plan.layer, plan.workdir, plan.gid, plan.policy.model_dump_json(), sorted(plan.env.items())))


def take(run_id: str | None, plan: _Plan, server: Zygote) -> _Spare | None:
    """The run's kept process, if it fits this call (then ``plan.uid`` becomes its uid)."""
    if not run_id:
        return None
    try:
        kept = server.take_kept(run_id, _key(plan))
    except OSError:
        return None
    if kept is None:
        return None
    pid, uid, request_fd, result_fd = kept
    plan.uid = uid
    return _Spare(pid, request_fd, result_fd, (), server, reusable=True)


def keep(run_id: str, plan: _Plan, spare: _Spare) -> None:
    """After a call that ended cleanly in a process that may stay: given to its server for
    the run (this process closes its pipe ends)."""
    assert plan.uid is not None and spare.server is not None
    with contextlib.suppress(OSError):  # the server is gone, and the process with it
        spare.server.keep(run_id, _key(plan), plan.uid, spare.pid, (spare.request_fd, spare.result_fd))


def forget(run_id: str | None = None) -> None:
    """End the run's kept process (every one, without ``run_id``)."""
    server = zygote._zygotes.get(os.getpid())
    if server is not None:
        server.forget(run_id)


def kept_pid(run_id: str) -> int | None:
    server = zygote._zygotes.get(os.getpid())
    return server.kept_pid(run_id) if server is not None else None
