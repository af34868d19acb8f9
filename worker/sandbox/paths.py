"""Where this interpreter and its modules live, and which folder holds which."""

from __future__ import annotations

import os
import stat
import sys
from functools import lru_cache


def _inside(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


@lru_cache(maxsize=1)
def _python_paths() -> tuple[str, ...]:
    """Where this interpreter and its modules live, outermost only."""
    candidates = {os.path.dirname(sys.executable), os.path.dirname(os.path.realpath(sys.executable)),
                  sys.prefix, sys.base_prefix, sys.exec_prefix, *_module_path()}  # fmt: skip
    real = {os.path.realpath(p) for p in candidates if p and os.path.exists(p)}
    return tuple(sorted(p for p in real if not any(q != p and _inside(p, q) for q in real)))


@lru_cache(maxsize=1)
def _module_path() -> tuple[str, ...]:
    """The worker's ``sys.path`` as absolute paths ('' is the worker's cwd, not the run's)."""
    return tuple(os.path.abspath(p or os.getcwd()) for p in sys.path if os.path.exists(p or "."))


def _ancestors(path: str) -> list[str]:
    """``/a/b/c`` -> ``['/', '/a', '/a/b', '/a/b/c']``."""
    out = [path]
    while path != os.path.dirname(path):
        path = os.path.dirname(path)
        out.append(path)
    return out[::-1]


def _reachable_by_others(path: str) -> bool:
    try:
        return all(os.stat(a).st_mode & stat.S_IXOTH for a in _ancestors(path))
    except OSError:
        return False
