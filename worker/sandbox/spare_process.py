"""A spare process as the worker holds it (spare.py makes them, reuse.py keeps them for a
run's next call): its pid, its two pipes, how to hand it a call, wait for it or end it."""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker.sandbox.zygote import Zygote


@dataclass
class _Spare:
    pid: int
    request_fd: int  # the worker writes the call here (pickle: worker -> its own fork)
    result_fd: int  # the call's framed JSON result comes back here
    kept: tuple[int, ...] = ()  # Landlock network rulesets it inherited (built once per process)
    server: Zygote | None = None  # forked by this process's fork server, not by this process
    reusable: bool = False  # its request pipe stays open: it may serve the run's next call (reuse.py)

    def wait(self) -> int:
        """Its exit status (it must be ending): reaped here, or by the fork server."""
        if self.server is not None:
            return self.server.wait(self.pid)
        return os.waitpid(self.pid, 0)[1]

    def ended(self) -> bool:
        """Exited (a zombie, or reaped)? For a spare of the fork server, which reaps it."""
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except (OSError, IndexError):
            return True

    def send(self, request: tuple[Any, ...]) -> None:
        data = pickle.dumps(request)
        view = memoryview(len(data).to_bytes(8, "big") + data)
        try:
            while view:
                view = view[os.write(self.request_fd, view) :]
        finally:
            if not self.reusable:
                os.close(self.request_fd)

    def discard(self) -> None:
        for fd in (self.request_fd, self.result_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            self.wait()
