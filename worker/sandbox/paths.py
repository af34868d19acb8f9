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
    """Where a fresh interpreter finds what the worker imported: its ``sys.path`` as absolute
    paths ('' is the worker's cwd, not the run's), then the folders holding ``worker``,
    ``orchestrator`` and each registered tool's module, found from the worker's own modules.
    ``python -S`` skips ``site``, so an editable install's import finder (a ``.pth`` hook, not
    a path) is gone: only these folders tell the runner where the code is. Computed at the
    first call, after the worker imported its tool modules."""
    entries = [os.path.abspath(p or os.getcwd()) for p in sys.path if os.path.exists(p or ".")]
    for root in _package_roots():
        if root not in entries:
            entries.append(root)
    return tuple(entries)


def _package_roots() -> list[str]:
    from worker.registry import REGISTRY

    names = {"worker", "orchestrator", *(getattr(t.fn, "__module__", "") or "" for t in REGISTRY.values())}
    roots: list[str] = []
    for name in sorted(n.split(".")[0] for n in names if n and n != "__main__"):
        module = sys.modules.get(name)
        locations = list(getattr(module, "__path__", None) or [])  # a package: its folder(s)
        if not locations and getattr(module, "__file__", None):
            locations = [module.__file__]  # a single-file module
        for location in locations:
            root = os.path.dirname(os.path.realpath(location))
            if root not in roots:
                roots.append(root)
    return roots


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
