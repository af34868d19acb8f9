"""Built-in tools, registered on every worker, confined to the run's folder.

They always run under the strongest sandbox layer the host offers (bubblewrap
where it works): the checks below are the first line, the sandbox the second.
Paths are resolved inside the run's folder; ``..``, absolute paths outside it
and symlinks leading outside are refused. Files are opened through a verified
descriptor of their folder and ``O_NOFOLLOW``, so a symlink swapped in between
the check and the open (say, by a parallel ``shell`` call) is refused too.
"""

from __future__ import annotations

import contextlib
import errno
import os
import selectors
import stat
import subprocess
import time

from worker.registry import builtin_tool
from worker.shell_policy import CommandRefused, allowlisted_argv

MAX_OUTPUT_CHARS = 20_000  # per stream of `shell`, per file of `read_file`
MAX_ENTRIES = 1_000  # per `list_dir`
DRAIN_AFTER_EXIT_S = 0.2  # background jobs may hold the pipes open: stop reading then


class PathEscape(ValueError):
    """A path resolves outside the run's folder."""


# -- paths ---------------------------------------------------------------------------
def resolve_inside(sandbox_root: str, path: str) -> str:
    """The real path of ``path`` under ``sandbox_root``; refuses anything outside it."""
    root = os.path.realpath(sandbox_root)
    lexical = os.path.normpath(os.path.join(root, path))
    if not _within(lexical, root):
        raise PathEscape(f"{path!r} is outside the run's folder ('..' or an absolute path)")
    target = os.path.realpath(lexical)
    if not _within(target, root):
        raise PathEscape(f"{path!r} leads outside the run's folder through a symlink")
    return target


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _open_inside(sandbox_root: str, path: str, flags: int, mode: int = 0o660) -> int:
    """Open ``path`` without following a symlink anywhere the check did not see."""
    root = os.path.realpath(sandbox_root)
    target = resolve_inside(root, path)
    if target == root:
        return _verified(os.open(root, flags | os.O_DIRECTORY | os.O_NOFOLLOW), root, path)
    folder = _verified(os.open(os.path.dirname(target), os.O_RDONLY | os.O_DIRECTORY), root, path)
    try:
        return os.open(os.path.basename(target), flags | os.O_NOFOLLOW, mode, dir_fd=folder)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # the last part became a symlink after the check
            raise PathEscape(f"{path!r} is a symlink: it could lead outside the run's folder") from None
        raise
    finally:
        os.close(folder)


def _verified(fd: int, root: str, path: str) -> int:
    """``fd`` if what it opened really is inside ``root`` (else close it and refuse)."""
    real = os.readlink(f"/proc/self/fd/{fd}")
    if not _within(real, root):
        os.close(fd)
        raise PathEscape(f"{path!r} leads outside the run's folder")
    return fd


# -- file tools ------------------------------------------------------------------------
@builtin_tool
def read_file(path: str, sandbox_root: str) -> str:
    """Read a text file of the run's folder.

    Args:
        path: path relative to the run's folder
    """
    fd = _open_inside(sandbox_root, path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise IsADirectoryError(f"{path!r} is not a regular file")
        size = os.fstat(fd).st_size
        text = f.read(4 * MAX_OUTPUT_CHARS).decode("utf-8", errors="replace")
    if len(text) > MAX_OUTPUT_CHARS or size > 4 * MAX_OUTPUT_CHARS:
        return text[:MAX_OUTPUT_CHARS] + f"\n[... truncated: the file has {size} bytes]"
    return text


@builtin_tool
def write_file(path: str, content: str, sandbox_root: str) -> int:
    """Write a text file in the run's folder (parents created); returns the characters written.

    Args:
        path: path relative to the run's folder
        content: the new content of the file
    """
    target = resolve_inside(sandbox_root, path)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    fd = _open_inside(sandbox_root, path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        return f.write(content)


@builtin_tool
def list_dir(sandbox_root: str, path: str = ".") -> list[str]:
    """List a folder of the run's folder (folders end with '/').

    Args:
        path: path relative to the run's folder
    """
    fd = _open_inside(sandbox_root, path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with os.scandir(fd) as entries:
            names = sorted(e.name + ("/" if e.is_dir(follow_symlinks=False) else "") for e in entries)
    finally:
        os.close(fd)
    if len(names) > MAX_ENTRIES:
        return [*names[:MAX_ENTRIES], f"[... {len(names) - MAX_ENTRIES} more entries]"]
    return names


# -- shell -----------------------------------------------------------------------------
@builtin_tool
def shell(command: str, sandbox_root: str) -> dict:
    """Run a shell command in the run's folder; returns exit code, stdout and stderr.

    Args:
        command: the command line, run by /bin/sh
    """
    argv, env = _argv(command, sandbox_root)
    proc = subprocess.Popen(
        argv, cwd=sandbox_root, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, **env} if env else None,
    )  # fmt: skip
    stdout, stderr = _collect(proc)
    return {"exit_code": proc.returncode, "stdout": stdout, "stderr": stderr}


def _argv(command: str, sandbox_root: str) -> tuple[list[str], dict[str, str]]:
    """``/bin/sh -c command``; with the run's allowlist (``worker/shell_policy.py``), the
    command's words run without a shell (no pipes, redirections, ``;`` or ``$(...)``:
    those would make the first word moot), and never with an executing option."""
    checked = allowlisted_argv(command, sandbox_root)
    return checked if checked is not None else (["/bin/sh", "-c", command], {})


__all__ = ["CommandRefused", "PathEscape", "list_dir", "read_file", "shell", "write_file"]


class _Bounded:
    """The first and last bytes of a stream, whatever its length."""

    def __init__(self, limit: int = MAX_OUTPUT_CHARS) -> None:
        self.head_limit, self.tail_limit = limit // 4, limit - limit // 4
        self.head, self.tail = bytearray(), bytearray()
        self.dropped = 0

    def add(self, chunk: bytes) -> None:
        room = self.head_limit - len(self.head)
        self.head += chunk[:room]
        self.tail += chunk[max(room, 0) :]
        extra = len(self.tail) - self.tail_limit
        if extra > 0:
            del self.tail[:extra]
            self.dropped += extra

    def text(self) -> str:
        head = self.head.decode("utf-8", errors="replace")
        tail = self.tail.decode("utf-8", errors="replace")
        if self.dropped:
            return f"{head}\n[... {self.dropped} bytes omitted ...]\n{tail}"
        return head + tail


def _collect(proc: subprocess.Popen) -> tuple[str, str]:
    """Both streams, bounded, without threads; stops reading shortly after the command
    exits even if a background job keeps the pipes open (the sandbox kills it)."""
    assert proc.stdout is not None and proc.stderr is not None
    out, err = _Bounded(), _Bounded()
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ, out)
    selector.register(proc.stderr, selectors.EVENT_READ, err)
    stop_at = None
    while selector.get_map():
        for key, _ in selector.select(timeout=0.05):
            chunk = os.read(key.fd, 1 << 16)
            if chunk:
                key.data.add(chunk)
            else:
                selector.unregister(key.fileobj)
        if stop_at is None and proc.poll() is not None:
            stop_at = time.monotonic() + DRAIN_AFTER_EXIT_S
        if stop_at is not None and time.monotonic() > stop_at:
            break
    selector.close()
    for stream in (proc.stdout, proc.stderr):
        with contextlib.suppress(OSError):
            stream.close()
    proc.wait()
    return out.text(), err.text()
