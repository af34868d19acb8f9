"""Spare processes: the fork, off the hot path, and away from the worker.

A spare is a process forked ahead of its call (detached: own session, no inherited
descriptors) that waits for its call, then confines itself as a fresh fork would. A
fork server's spare may then serve the same run's next calls (``reuse.py``); otherwise
one process per call, as before.

Where the tool is one the pool process's fork server (``worker/sandbox/zygote.py``)
imported, the server forks the spares: the worker itself never forks per call, which
was most of a tool-turn's CPU (its page tables copied and torn down, and every page
it wrote while a spare shared it copied). A server's spare is cheap for the worker, so
one is always kept, and one is asked for on demand when calls come back to back.

Otherwise (a tool the server could not import, or a call allowed onto the network,
whose Landlock ruleset lives in the worker) the pool process forks: it keeps a spare
only while calls reach it with a pause between them (BUSY_GAP_S), because while a
spare of its own waits, every page it writes is copied.

``settle()`` (after a call's result is recorded) reaps what the previous call left
and makes the next spare; ``_take_spare`` hands it the next call. The spare's own side
(what it does once forked) is ``spare_child.py``."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import worker.sandbox.reuse as reuse
import worker.sandbox.zygote as zygote
from worker.sandbox.child import _limits
from worker.sandbox.kernel import _net_fds
from worker.sandbox.plan import _Plan
from worker.sandbox.spare_child import fork_spare
from worker.sandbox.spare_process import _Spare
from worker.sandbox.zygote import Zygote

log = logging.getLogger(__name__)


BUSY_GAP_S = 0.005  # a call arriving sooner than this after the last settle(): busy

_spares: dict[int, _Spare] = {}  # pool process pid -> its spare
_spare_wanted: set[int] = set()  # pool processes that run forked calls, not busy
_pending: list[Callable[[], Any]] = []  # cleanups of calls whose result is in
_settled_at: dict[int, float] = {}  # pool process pid -> when its last settle() ended
_served: dict[int, Zygote | None] = {}  # pool process pid -> the fork server its last call used


def settle() -> None:
    """After a call's result is recorded: reap what the call left, and fork the next call's
    process now rather than when that call arrives."""
    _run_pending()
    if os.getpid() in _spare_wanted and os.getpid() not in _spares:
        try:
            _spares[os.getpid()] = _spawn_spare(_served.get(os.getpid()))
        except OSError:
            log.warning("sandbox: cannot fork a spare process; calls fork on demand", exc_info=True)
    _settled_at[os.getpid()] = time.monotonic()


def _run_pending() -> None:
    while _pending:
        cleanup = _pending.pop(0)
        try:
            cleanup()
        except Exception:
            log.exception("sandbox: cleaning up after a call failed")


def _take_spare(fn: Callable[..., Any], kwargs: dict[str, Any], plan: _Plan,
                run_id: str | None = None, deferred: bool = False) -> _Spare | None:  # fmt: skip
    """This process's spare (or the run's kept process), with the call sent to it; None:
    fork on demand. ``deferred``: the caller settles later (a kept process may stay)."""
    if plan.layer != "fork":
        return None
    name = _registered_name(fn)
    net_fd = plan.confine.net_fd if plan.confine is not None else None
    server = _server(name) if net_fd is None else None
    _served[os.getpid()] = server
    if server is not None:  # a spare from the fork server: cheap for this process, always kept
        _spare_wanted.add(os.getpid())
        may_stay = reuse.allowed(run_id, plan, deferred)
        kept = reuse.take(run_id, plan, server) if may_stay else None
        if kept is not None:
            try:
                kept.send((plan, None, name, kwargs, True))
                return kept
            except OSError:  # it died meanwhile: a fresh one
                kept.discard()
        spare = _spares.pop(os.getpid(), None)
        if spare is not None and spare.server is not server:
            spare.discard()
            spare = None
        try:
            spare = spare or _spawn_spare(server)
            spare.reusable = may_stay
            spare.send((plan, None, name, kwargs, may_stay))
        except OSError:  # it died meanwhile, or the server did: fork here
            if spare is not None:
                spare.discard()
            return None
        return spare
    busy = time.monotonic() - _settled_at.get(os.getpid(), 0.0) < BUSY_GAP_S
    (_spare_wanted.discard if busy else _spare_wanted.add)(os.getpid())
    spare = _spares.pop(os.getpid(), None)
    unfit = spare is None or name is None or spare.server is not None
    if unfit or (net_fd is not None and net_fd not in spare.kept):
        if spare is not None:
            _spares[os.getpid()] = spare
        return None
    limits = _limits(plan.policy, nproc=os.geteuid() == 0, fork=True, room=plan.room)
    try:
        spare.send((plan, limits, name, kwargs, False))
    except OSError:  # it died meanwhile (killed from outside?)
        spare.discard()
        return None
    return spare


def _server(name: str | None) -> Zygote | None:
    """This process's fork server, if it can run the tool ``name``."""
    if name is None or os.environ.get("TOOLOOP_SANDBOX_FORK_SERVER", "1") == "0":
        return None
    server = zygote.for_this_process()
    return server if server is not None and name in server.tools else None


def _registered_name(fn: Callable[..., Any]) -> str | None:
    from worker.registry import REGISTRY

    return next((name for name, t in REGISTRY.items() if t.fn is fn), None)


def _spawn_spare(server: Zygote | None = None) -> _Spare:
    """A spare process: forked by ``server``, or by this process."""
    if server is not None:  # from its stock, or forked now (worker/sandbox/zygote.py)
        pid, request_w, result_r = server.take()
        return _Spare(pid, request_w, result_r, (), server)
    request_r, request_w = os.pipe()
    result_r, result_w = os.pipe()
    try:
        kept = tuple(fd for (pid, _), fd in _net_fds.items() if pid == os.getpid())
        return _Spare(fork_spare(request_r, result_w, (request_w, result_r)), request_w, result_r, kept)
    except BaseException:
        os.close(request_w)
        os.close(result_r)
        raise
    finally:
        os.close(request_r)
        os.close(result_w)
