"""Run folders: checked, then created under their root and, when the worker is root,
handed to the run's own group (``root:<gid> 2770``), which every call of the run joins.

The order matters (issue 15): the folder's real path is checked against the roots the
operator allows (``orchestrator.sandbox_roots``) before anything is created, chowned
or chmodded, and nothing outside those roots ever is, ancestors included. On a root
worker each run group is recorded with its run (``<state>/groups/<n>``): a folder whose
group belongs to another run is refused, and a wrapped group counter skips the groups
of folders that still exist.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
import stat
from functools import lru_cache

from orchestrator.sandbox_roots import FolderRefused, allow_roots, home_of, inside, run_folder
from worker.sandbox.constants import GID_BASE, GID_SPAN, STATE_DIR, UID_BASE, UID_BLOCK, UID_SPAN
from worker.sandbox.context import SandboxError
from worker.sandbox.paths import _ancestors

log = logging.getLogger(__name__)


def checked_folder(path: str, run_id: str | None, sandbox_root: str, allowed: list[str] | None) -> str:
    """The real path of a run's folder, if it may be one; ``SandboxError`` otherwise.
    Pure path logic: nothing is created or changed."""
    try:
        return run_folder(sandbox_root, _allowed(allowed), run_id, path)
    except FolderRefused as exc:
        raise SandboxError(f"run folder refused: {exc}") from None


def _allowed(given: list[str] | None) -> list[str]:
    if given is not None:
        return [os.path.realpath(p) for p in given]
    from orchestrator.settings import get_settings

    return allow_roots(get_settings())


def _prepare(real: str, root: str, run_id: str | None, allowed: list[str] | None = None) -> int | None:
    """Create the (checked) folder inside its root; the run's group when root (else None)."""
    owner = run_id or os.path.basename(real)
    known = _prepared.get(real)
    if known is not None and known[0] == owner and _still_prepared(real, known[1]):
        return known[1]  # the calls of a run: one lstat
    home = home_of(real, root, _allowed(allowed))
    if home == os.path.realpath(root):
        _check_root(root)
    elif not os.path.isdir(home):
        raise SandboxError(f"allowed root {home} does not exist")
    _refuse_inside_other_runs(real, home, owner, root)  # before creating anything
    os.makedirs(real, exist_ok=True)  # real is strictly inside home: nothing made outside it
    gid = _run_gid(real, home, owner, root) if os.geteuid() == 0 else None
    if gid is not None:
        _prepared[real] = (owner, gid)
    return gid


_prepared: dict[str, tuple[str, int]] = {}  # real run folder -> (its run, the run's gid)


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


def _refuse_inside_other_runs(real: str, home: str, owner: str, root: str) -> None:
    """An existing folder between the root and the run's folder that is another run's:
    creating or using a folder in it would join that run's group."""
    for folder in _ancestors(real):
        if not inside(folder, home) or folder == home:
            continue
        try:
            st = os.lstat(folder)
        except FileNotFoundError:
            return
        if stat.S_ISLNK(st.st_mode):
            raise SandboxError(f"run folder refused: {folder} became a symlink")
        if os.geteuid() == 0 and _is_run_gid(st.st_gid) and _owner(st.st_gid, root) != owner:
            raise SandboxError(f"run folder refused: {folder} belongs to another run")


def _run_gid(path: str, home: str, owner: str, root: str) -> int:
    """The run's group, allocated the first time a call runs in this folder."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        ready = _is_run_gid(st.st_gid) and stat.S_IMODE(st.st_mode) == 0o2770
        if not (ready and _owner(st.st_gid, root) == owner):
            fcntl.flock(fd, fcntl.LOCK_EX)  # two first calls of one run: one group
            st = os.fstat(fd)
            if _is_run_gid(st.st_gid):
                if _owner(st.st_gid, root) != owner and not _claim_unrecorded(st.st_gid, path, owner, root):
                    # another run's, or a group handed to a newer run since (the counter wrapped)
                    raise SandboxError(f"run folder refused: {path} belongs to another run")
            else:
                _adopt_tree(fd, _next_gid(root, owner, path))
            os.fchmod(fd, 0o2770)
            st = os.fstat(fd)
    finally:
        os.close(fd)
    _make_reachable(path, home)
    return st.st_gid


# -- run groups: a host-wide counter and who owns each group ------------------------------
@lru_cache(maxsize=8)
def _state_dir(root: str) -> str:
    """Where counters and group records live: host-wide (so the runs of every deployment
    on a host differ), else inside the sandbox root."""
    for folder in (STATE_DIR, os.path.join(os.path.realpath(root), ".state")):
        with contextlib.suppress(OSError):
            os.makedirs(os.path.join(folder, "groups"), mode=0o700, exist_ok=True)
            flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW
            os.close(os.open(os.path.join(folder, "gid-counter"), flags, 0o600))
            return folder
    raise SandboxError(f"cannot keep run groups: {STATE_DIR} is not writable")


def _owner(gid: int, root: str) -> str | None:
    record = _record(gid, root)
    return record.get("run") if record else None


def _record(gid: int, root: str) -> dict | None:
    try:
        with open(os.path.join(_state_dir(root), "groups", str(gid - GID_BASE))) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _in_use(gid: int, root: str) -> bool:
    """A group whose recorded folder still exists with that group."""
    record = _record(gid, root)
    if not record:
        return False
    try:
        return os.lstat(record["folder"]).st_gid == gid
    except (OSError, KeyError, TypeError):
        return False


def _claim_unrecorded(gid: int, path: str, owner: str, root: str) -> bool:
    """A folder made before groups were recorded: ``<sandbox root>/<run_id>`` is its run's
    by name, so its group is recorded for it; any other folder stays refused."""
    if _record(gid, root) is not None or path != os.path.join(os.path.realpath(root), owner):
        return False
    _write(os.path.join(_state_dir(root), "groups", str(gid - GID_BASE)),
           json.dumps({"run": owner, "folder": path}))  # fmt: skip
    return True


MAX_GID_PROBES = 4096  # groups skipped (still in use) before looking past the highest one
COUNTER_WIDTH = 16


def _read_counter(fd: int) -> int | None:
    """The counter; 0 for a new (empty) one, None for one that cannot be read."""
    text = os.pread(fd, 64, 0).strip()
    return int(text) if text.isdigit() else None if text else 0


def _write_counter(fd: int, value: int) -> None:
    """One pwrite at a fixed width, never a truncate first: a worker killed between a
    truncate and its write left an empty counter, and the host's next runs took groups
    (and calls took uids) from 1 again."""
    os.pwrite(fd, f"{value:>{COUNTER_WIDTH}}\n".encode(), 0)


def _highest_group(state: str) -> int:
    names = os.listdir(os.path.join(state, "groups"))
    return max((int(name) for name in names if name.isdigit()), default=0)


def _free_group(root: str, last: int) -> int | None:
    for step in range(1, MAX_GID_PROBES + 1):
        n = (last + step - 1) % GID_SPAN + 1  # wraps after 16.7 M runs: skip groups in use
        if not _in_use(GID_BASE + n, root):
            return n
    return None


def _next_gid(root: str, owner: str, folder: str) -> int:
    state = _state_dir(root)
    fd = os.open(os.path.join(state, "gid-counter"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        last = _read_counter(fd)
        n = _free_group(root, _highest_group(state) if last is None else last)
        if n is None:  # a long row of groups in use ahead of the counter: go past the highest
            n = _free_group(root, _highest_group(state))
        if n is None:
            raise SandboxError(f"no free run group near {last}: expire old run folders")
        _write(os.path.join(state, "groups", str(n)), json.dumps({"run": owner, "folder": folder}))
        _write_counter(fd, n)
        return GID_BASE + n
    finally:
        os.close(fd)


def _write(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def next_uid(root: str) -> int:
    """A uid for one call, from a host-wide counter: not reused with pids (a file or socket
    a call leaves in /tmp or /dev/shm is not handed to a later call that gets its pid), and
    not reused until 16.7 M calls later. Taken in blocks, so one flock serves 64 calls."""
    block = _uid_blocks.get(os.getpid())
    if not block:
        block = _uid_blocks[os.getpid()] = _take_uids(root)
    return UID_BASE + block.pop(0)


_uid_blocks: dict[int, list[int]] = {}  # process -> the uids (offsets) it holds


def _take_uids(root: str) -> list[int]:
    fd = os.open(os.path.join(_state_dir(root), "uid-counter"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        last = _read_counter(fd)
        if last is None:  # unreadable: a random block, not the first again (uids in use there)
            log.warning("uid counter in %s unreadable; starting at a random block", _state_dir(root))
            last = secrets.randbelow(UID_SPAN - UID_BLOCK)
        first = last % (UID_SPAN - UID_BLOCK) + 1  # 0: never uid UID_BASE
        _write_counter(fd, first + UID_BLOCK - 1)
        return list(range(first, first + UID_BLOCK))
    finally:
        os.close(fd)


def make_tmp(real: str, gid: int | None) -> str:
    """The run's own temp folder, ``<run folder>/.tmp`` (TMPDIR of the fork and exec layers:
    the host's /tmp is shared with every other process)."""
    tmp = os.path.join(real, ".tmp")
    with contextlib.suppress(FileExistsError):  # the run's calls in parallel: one makes it
        os.mkdir(tmp, 0o770)
    st = os.lstat(tmp)
    if not stat.S_ISDIR(st.st_mode):
        raise SandboxError(f"{tmp} is not a folder")
    if gid is not None and (st.st_gid != gid or stat.S_IMODE(st.st_mode) != 0o2770):
        fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            os.fchown(fd, -1, gid)
            os.fchmod(fd, 0o2770)
        finally:
            os.close(fd)
    return tmp


# -- handing a folder to the run's group -----------------------------------------------------
def _adopt_tree(dir_fd: int, gid: int) -> None:
    """Give a folder, and what is already in it, to the run's group.

    Through descriptors opened with O_NOFOLLOW, so a symlink swapped in cannot
    redirect a chown/chmod outside the folder; hard-linked files are skipped (a
    link to a file elsewhere would be handed over with it), and so is whatever
    already belongs to a run group (another run's folder inside this one).
    """
    for _, dirs, files, fd in os.fwalk(".", dir_fd=dir_fd, follow_symlinks=False):
        for name in list(dirs):
            if not _adopt_entry(fd, name, gid):
                dirs.remove(name)  # not ours: do not descend
        for name in files:
            _adopt_entry(fd, name, gid)
    os.fchown(dir_fd, -1, gid)


def _adopt_entry(dir_fd: int, name: str, gid: int) -> bool:
    st = os.lstat(name, dir_fd=dir_fd)
    if _is_run_gid(st.st_gid):
        return False
    if stat.S_ISLNK(st.st_mode):
        os.chown(name, -1, gid, dir_fd=dir_fd, follow_symlinks=False)
        return True
    is_dir = stat.S_ISDIR(st.st_mode)
    if not (is_dir or (stat.S_ISREG(st.st_mode) and st.st_nlink == 1)):
        return False
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError:
        return False  # changed under us: leave it
    try:
        os.fchown(fd, -1, gid)
        extra = 0o2070 if is_dir else 0o060 | (0o010 if st.st_mode & 0o100 else 0)
        os.fchmod(fd, stat.S_IMODE(st.st_mode) | extra)
    finally:
        os.close(fd)
    return True


_reachable: set[str] = set()


def _make_reachable(path: str, home: str) -> None:
    """Sandbox uids must be able to walk to the run folder: add search (o+x, not read) on
    its root-owned ancestors inside its root (the root included); above the root nothing
    is changed, only a warning is logged."""
    parent = os.path.dirname(path)
    if parent in _reachable:
        return
    for ancestor in _ancestors(parent):
        st = os.stat(ancestor)
        if st.st_mode & stat.S_IXOTH:
            continue
        if st.st_uid == 0 and inside(ancestor, home):
            os.chmod(ancestor, stat.S_IMODE(st.st_mode) | stat.S_IXOTH)
            log.info("sandbox: added o+x to %s so sandbox uids can reach %s", ancestor, path)
        else:
            log.warning("sandbox: %s is not searchable by sandbox uids: %s is unreachable by path "
                        "(calls still start in it)", ancestor, path)  # fmt: skip
    _reachable.add(parent)
