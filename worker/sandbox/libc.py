"""The C library, for ``prctl(2)`` (which ``os`` lacks), and the options the sandbox sets."""

from __future__ import annotations

import ctypes
from functools import lru_cache
from typing import Any

_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_SET_CHILD_SUBREAPER, _PR_SET_NO_NEW_PRIVS = 1, 4, 36, 38


@lru_cache(maxsize=1)
def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)
