"""``select.select`` without its limit on descriptor numbers: one of 1,024 or over raises
ValueError there (a fork server keeping 512 processes holds ~1,030 descriptors, so its
next wait for a process's exit did); ``poll(2)`` has no such limit."""

from __future__ import annotations

import math
import select
from typing import Any


def readable(items: list[Any], timeout: float | None) -> list[Any]:
    """Those of ``items`` (descriptors, or objects with ``fileno()``) ready to read, hung up or
    in error, waiting at most ``timeout`` seconds (None: until one is)."""
    poller = select.poll()
    by_fd: dict[int, Any] = {}
    for item in items:
        fd = item if isinstance(item, int) else item.fileno()
        by_fd[fd] = item
        poller.register(fd, select.POLLIN)
    ms = None if timeout is None else math.ceil(max(0.0, timeout) * 1000)
    return [by_fd[fd] for fd, _ in poller.poll(ms)]
