"""Where a run's folder may be: the rule checked at submit and again by the worker.

A run's folder is handed to the run's tools (and, on a root worker, to the run's
group). So it must be a folder the operator meant for runs:

- ``$TOOLOOP_SANDBOX_ROOT/<run_id>``: a direct child of the sandbox root, named after the
  run (any other child is another run's folder);
- or a folder strictly inside one of ``TOOLOOP_SANDBOX_ALLOW`` (comma-separated), for
  specs that give ``context.sandbox_root``.

Paths are compared after resolving symlinks. Standard library only: the CLI and the
producer import this.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from orchestrator.settings import Settings

RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


class FolderRefused(ValueError):
    """A run folder outside the roots the operator allows, or another run's."""


def allow_roots(settings: Settings) -> list[str]:
    """``TOOLOOP_SANDBOX_ALLOW``, as real paths (relative entries are ignored: ambiguous)."""
    entries = [p.strip() for p in settings.sandbox_allow.split(",") if p.strip()]
    return [os.path.realpath(p) for p in entries if os.path.isabs(p)]


def inside(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def check_given(settings: Settings, given: str, run_id: str | None = None) -> str:
    """The submit-time check of ``context.sandbox_root``: what the worker will accept.

    Under the sandbox root a folder belongs to the run of its name, and the worker refuses
    it to any other run. Without ``run_id`` (the id is drawn at submit) no run can be
    named after it: refused now, not at every tool call of the run."""
    real = run_folder(settings.sandbox_root, allow_roots(settings), None, given)
    root = os.path.realpath(settings.sandbox_root)
    name = os.path.basename(real)
    if inside(real, root) and name != run_id:
        why = "this run's id is drawn at submit" if run_id is None else f"this run's id is {run_id!r}"
        raise FolderRefused(f"{given} is the folder of the run named {name!r} (TOOLOOP_SANDBOX_ROOT={root}), "
                            f"and {why}: leave sandbox_root out (the run gets <root>/<run_id>), submit "
                            f"with run_id={name!r}, or use a folder under TOOLOOP_SANDBOX_ALLOW")  # fmt: skip
    return real


def run_folder(sandbox_root: str, allowed: list[str], run_id: str | None, path: str) -> str:
    """The real path of a run's folder, or ``FolderRefused`` saying why.

    ``path`` is ``<sandbox root>/<run_id>`` or the spec's ``context.sandbox_root``.
    ``run_id`` None (at submit, before the id is drawn; unit tests): any plain name
    is accepted under the sandbox root."""
    if run_id is not None and not RUN_ID.fullmatch(run_id):
        raise FolderRefused(f"run id {run_id!r} is not a plain name ([A-Za-z0-9_-]{{1,64}})")
    if not os.path.isabs(path):
        raise FolderRefused(f"{path!r} is not an absolute path")
    root = os.path.realpath(sandbox_root)
    real = os.path.realpath(path)
    if inside(real, root):
        return _under_sandbox_root(real, root, run_id)
    for home in allowed:
        if inside(real, home) and real != home:
            return real
    listed = ", ".join(allowed) or "none"
    raise FolderRefused(f"{path} (real path {real}) is outside the sandbox roots "
                        f"(TOOLOOP_SANDBOX_ROOT={root}; TOOLOOP_SANDBOX_ALLOW: {listed})")  # fmt: skip


def home_of(real: str, sandbox_root: str, allowed: list[str]) -> str:
    """The root (sandbox root or allowed folder) that holds the real path ``real``."""
    for home in [os.path.realpath(sandbox_root), *allowed]:
        if inside(real, home):
            return home
    raise FolderRefused(f"{real} is outside the sandbox roots")


def _under_sandbox_root(real: str, root: str, run_id: str | None) -> str:
    name = os.path.relpath(real, root)
    if real == root or "/" in name or not RUN_ID.fullmatch(name):
        raise FolderRefused(f"{real} is not a run folder: under {root} only <root>/<run_id> is")
    if run_id is not None and name != run_id:
        raise FolderRefused(f"{real} belongs to another run ({name!r})")
    return real
