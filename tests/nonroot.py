"""Run a command as a user that is not root, with this Python readable by it:

    python -m tests.nonroot --uid 4242 [--docker-default] -- python -m orchestrator.cli worker

A worker that is not root is a configuration of its own (every call runs as the worker's
user; only Landlock and bubblewrap keep a call out of other runs' folders), but this
machine's Python lives under root's home (pyenv, ``/root`` mode 0700), which another user
cannot enter. So, as root: a private mount namespace; an empty, searchable tmpfs over each
folder that hides Python from other users, with the Python paths bound back into it (the
command sees the host otherwise unchanged); with ``--docker-default``, the filter and
capabilities of Docker's default profile (``tests/docker_default.py``: no namespaces from
here on); then the uid (and group) drop, and the command, which dies with its parent.
Where this process may not make a mount namespace, it says so and exits 3.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import stat
import sys
import tempfile

CLONE_NEWNS, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 0x20000, 0x1000, 0x2000, 0x4000, 1 << 18
PR_SET_PDEATHSIG = 1
CANNOT = 3  # the exit status when the namespace cannot be made (the caller skips, saying why)


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    args = [None if v is None else v.encode() for v in (source, target, fstype, data)]
    _check(_libc().mount(args[0], args[1], args[2], ctypes.c_ulong(flags), args[3]), f"mount {target}")


def hidden_python() -> dict[str, list[str]]:
    """Folders that keep other users from this Python (no search bit), each with the Python
    paths under it: what must be made reachable."""
    from worker.sandbox.paths import _ancestors, _inside, _python_paths

    out: dict[str, list[str]] = {}
    for path in _python_paths():
        blocking = [a for a in _ancestors(path) if not os.stat(a).st_mode & stat.S_IXOTH]
        if blocking:
            out.setdefault(blocking[0], []).append(path)
    return {folder: [p for p in paths if not any(q != p and _inside(p, q) for q in paths)]
            for folder, paths in out.items()}  # fmt: skip


def reexpose(folders: dict[str, list[str]]) -> None:
    """In a private mount namespace: a searchable tmpfs over each folder, its Python paths back."""
    _check(_libc().unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _mount("none", "/", None, MS_REC | MS_PRIVATE)  # nothing of this goes back to the host
    for folder, keep in folders.items():
        stash = tempfile.mkdtemp(prefix="tooloop-nonroot-")
        held = []
        for n, path in enumerate(keep):
            os.mkdir(os.path.join(stash, str(n)))
            _mount(path, os.path.join(stash, str(n)), None, MS_BIND | MS_REC)
            held.append((os.path.join(stash, str(n)), path))
        _mount("tmpfs", folder, "tmpfs", 0, "mode=0755")
        for where, path in held:
            os.makedirs(path, mode=0o755, exist_ok=True)
            _mount(where, path, None, MS_MOVE)
            os.rmdir(where)
        os.rmdir(stash)


def become(uid: int) -> None:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    _check(_libc().prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0), "prctl")  # the drop cleared it


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--uid", type=int, required=True)
    parser.add_argument("--docker-default", action="store_true")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    folders = hidden_python()
    if folders:
        try:
            reexpose(folders)
        except OSError as exc:
            why = f"cannot make {sorted(folders)} reachable for uid {args.uid}: {exc}"
            sys.stderr.write(f"tests.nonroot: {why}\n")
            sys.exit(CANNOT)
    if args.docker_default:
        from tests.docker_default import confine

        confine()
        os.environ["TOOLOOP_TEST_DOCKER_DEFAULT"] = "1"
    become(args.uid)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()
