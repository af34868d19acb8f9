"""Run folders: created under the sandbox root and, when the worker is root, handed to
the run's own group (``root:<gid> 2770``), which every call of the run joins."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat

from worker.sandbox.constants import GID_BASE, GID_COUNTER, GID_SPAN
from worker.sandbox.context import SandboxError
from worker.sandbox.paths import _ancestors

log = logging.getLogger(__name__)


def prepare_workdir(path: str, sandbox_root: str | None = None) -> str:
    """Create the run's folder; when root, hand it to the run's group (``root:<gid> 2770``).
    Never raises: a folder that cannot be prepared fails the call (``run_call``), not the task."""
    try:
        _prepare(path, _sandbox_root(sandbox_root))
    except (OSError, SandboxError) as exc:
        log.warning("sandbox: cannot prepare %s: %s", path, exc)
    return path


def _prepare(path: str, root: str) -> int | None:
    """Create the folder; the run's group when root (else None)."""
    known = _prepared.get(path)
    if known is not None and _still_prepared(*known):  # the calls of a run: one lstat
        return known[1]
    _check_root(root)
    os.makedirs(path, exist_ok=True)
    real = os.path.realpath(path)
    gid = _run_gid(real, root) if os.geteuid() == 0 else None
    if gid is not None:
        _prepared[path] = (real, gid)
    return gid


_prepared: dict[str, tuple[str, int]] = {}  # run folder -> (real path, the run's gid)


def _still_prepared(real: str, gid: int) -> bool:
    try:
        st = os.lstat(real)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_gid == gid and stat.S_IMODE(st.st_mode) == 0o2770


_checked_roots: set[str] = set()


def _check_root(root: str) -> None:
    """The folder of all runs: a real folder, and (when root) root's own. A folder in
    /tmp made by someone else would let them swap run folders for symlinks."""
    if root in _checked_roots:
        return
    os.makedirs(root, mode=0o711, exist_ok=True)
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode):
        raise SandboxError(f"sandbox root {root} is not a folder (a symlink?)")
    if os.geteuid() == 0 and st.st_uid != 0:
        raise SandboxError(f"sandbox root {root} belongs to uid {st.st_uid}, not root")
    mode = stat.S_IMODE(st.st_mode)
    if os.geteuid() == 0 and mode & 0o044 and not mode & 0o002:  # (never /tmp itself)
        os.chmod(root, (mode & ~0o044) | 0o011)  # calls may cross it, not list other runs
    _checked_roots.add(root)


def _sandbox_root(given: str | None) -> str:
    if given is not None:
        return given
    from orchestrator.settings import get_settings

    return get_settings().sandbox_root


def _is_run_gid(gid: int) -> bool:
    return GID_BASE < gid <= GID_BASE + GID_SPAN


def _run_gid(path: str, root: str) -> int:
    """The run's group, allocated the first time a call runs in this folder."""
    st = os.lstat(path)
    if not (_is_run_gid(st.st_gid) and stat.S_IMODE(st.st_mode) == 0o2770):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # two first calls of one run: one group
            st = os.fstat(fd)
            if not _is_run_gid(st.st_gid):
                _adopt_tree(fd, _next_gid(root))
            os.fchmod(fd, 0o2770)
            st = os.fstat(fd)
        finally:
            os.close(fd)
    _make_reachable(path)
    return st.st_gid


def _next_gid(root: str) -> int:
    for counter in (GID_COUNTER, os.path.join(root, ".gid-counter")):
        with contextlib.suppress(OSError):
            os.makedirs(os.path.dirname(counter), mode=0o700, exist_ok=True)
            fd = os.open(counter, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                last = int(os.pread(fd, 32, 0).strip() or 0)
                n = last % GID_SPAN + 1  # wraps after 16.7 M runs: see docs/sandbox.md
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{n}\n".encode(), 0)
                return GID_BASE + n
            finally:
                os.close(fd)
    raise SandboxError(f"cannot allocate a group for run folders ({GID_COUNTER} not writable)")


def _adopt_tree(dir_fd: int, gid: int) -> None:
    """Give a folder, and what is already in it, to the run's group.

    Through descriptors opened with O_NOFOLLOW, so a symlink swapped in cannot
    redirect a chown/chmod outside the folder; hard-linked files are skipped (a
    link to a file elsewhere would be handed over with it).
    """
    for _, dirs, files, fd in os.fwalk(".", dir_fd=dir_fd, follow_symlinks=False):
        for name in dirs + files:
            _adopt_entry(fd, name, gid)
    os.fchown(dir_fd, -1, gid)


def _adopt_entry(dir_fd: int, name: str, gid: int) -> None:
    st = os.lstat(name, dir_fd=dir_fd)
    if stat.S_ISLNK(st.st_mode):
        os.chown(name, -1, gid, dir_fd=dir_fd, follow_symlinks=False)
        return
    is_dir = stat.S_ISDIR(st.st_mode)
    if not (is_dir or (stat.S_ISREG(st.st_mode) and st.st_nlink == 1)):
        return
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError:
        return  # changed under us: leave it
    try:
        os.fchown(fd, -1, gid)
        extra = 0o2070 if is_dir else 0o060 | (0o010 if st.st_mode & 0o100 else 0)
        os.fchmod(fd, stat.S_IMODE(st.st_mode) | extra)
    finally:
        os.close(fd)


_reachable: set[str] = set()


def _make_reachable(path: str) -> None:
    """Sandbox uids must be able to walk to the run folder: add search (o+x, not read) on
    its root-owned ancestors; warn about the others."""
    parent = os.path.dirname(path)
    if parent in _reachable:
        return
    for ancestor in _ancestors(parent):
        st = os.stat(ancestor)
        if st.st_mode & stat.S_IXOTH:
            continue
        if st.st_uid == 0:
            os.chmod(ancestor, stat.S_IMODE(st.st_mode) | stat.S_IXOTH)
            log.warning("sandbox: added o+x to %s so sandbox uids can reach %s", ancestor, path)
        else:
            log.warning("sandbox: %s is not searchable by sandbox uids: %s is unreachable", ancestor, path)
    _reachable.add(parent)
