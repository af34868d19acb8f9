"""One long-lived asyncio event loop per process, for model calls.

Model calls are slow I/O: as coroutines on one loop, hundreds can be in flight
without a thread each. The loop runs ``run_forever`` in a daemon thread, made on
first use, and made again in a forked child (a loop's thread does not survive a
fork: the pid tells). One loop for the process's lifetime, never one per call:
litellm caches its async HTTP clients per loop, so a new loop per call would
open a new connection pool per call.

Sync code either waits for a coroutine's result (``run``) or hands it over and
goes on (``submit``: the turn task, see ``worker/deferred.py``). Blocking work a
coroutine needs (Redis scripts, publishing the next step) goes to a small pool of
threads with ``in_thread``, so the loop itself only ever waits on sockets.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import os
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_pid = 0
BLOCKING_THREADS = 8  # what the loop's coroutines hand off: short Redis and broker round trips
_blocking: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None


def loop() -> asyncio.AbstractEventLoop:
    """This process's loop, started on first use (and again after a fork)."""
    global _loop, _pid
    current = _loop
    if current is not None and _pid == os.getpid():
        return current
    with _lock:
        if _loop is None or _pid != os.getpid():
            _loop, _pid = _start(), os.getpid()
        return _loop


def _start() -> asyncio.AbstractEventLoop:
    new = asyncio.new_event_loop()
    running = threading.Event()
    new.call_soon(running.set)
    thread = threading.Thread(target=new.run_forever, name="tooloop-aio", daemon=True)
    thread.start()
    running.wait()
    return new


def run(coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """Run ``coro`` on the process's loop and wait for its result (from any thread but the
    loop's own). A wait past ``timeout`` cancels the coroutine and raises ``TimeoutError``."""
    future = asyncio.run_coroutine_threadsafe(coro, loop())
    try:
        return future.result(timeout)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise TimeoutError(f"no result within {timeout}s") from None
    except BaseException:
        future.cancel()  # the waiting thread was interrupted: nobody wants the result any more
        raise


def submit(coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
    """Start ``coro`` on the process's loop and return at once (the context goes along)."""
    return asyncio.run_coroutine_threadsafe(coro, loop())


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    """Run blocking ``fn(*args)`` on the blocking pool, in the caller's context (its
    contextvars: the run's log tags and trace span), without holding up the loop."""
    context = contextvars.copy_context()
    call = functools.partial(context.run, fn, *args)
    return await asyncio.get_running_loop().run_in_executor(_blocking_pool(), call)


def _blocking_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _blocking
    if _blocking is None or _blocking[0] != os.getpid():
        with _lock:
            if _blocking is None or _blocking[0] != os.getpid():
                pool = concurrent.futures.ThreadPoolExecutor(BLOCKING_THREADS, "tooloop-blocking")
                _blocking = (os.getpid(), pool)
    return _blocking[1]
