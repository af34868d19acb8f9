"""Built-in tools, registered on every worker, confined to the run's folder.

They always run under the strongest sandbox layer the host offers.
"""

from __future__ import annotations

import os
import subprocess

from worker.registry import builtin_tool

MAX_OUTPUT_CHARS = 20_000


class PathEscape(ValueError):
    """A path resolves outside the run's folder."""


def resolve_inside(sandbox_root: str, path: str) -> str:
    """The real path of ``path`` under ``sandbox_root``; refuses anything outside it."""
    root = os.path.realpath(sandbox_root)
    target = os.path.realpath(os.path.join(root, path))
    if target != root and not target.startswith(root + os.sep):
        raise PathEscape(f"{path!r} is outside the run's folder")
    return target


@builtin_tool
def shell(command: str, sandbox_root: str) -> dict:
    """Run a shell command in the run's folder; returns exit code, stdout and stderr.

    Args:
        command: the command line, run by /bin/sh
    """
    proc = subprocess.run(
        ["/bin/sh", "-c", command], cwd=sandbox_root, capture_output=True, text=True, check=False
    )
    return {
        "exit_code": proc.returncode,
        "stdout": proc.stdout[-MAX_OUTPUT_CHARS:],
        "stderr": proc.stderr[-MAX_OUTPUT_CHARS:],
    }


@builtin_tool
def read_file(path: str, sandbox_root: str) -> str:
    """Read a text file of the run's folder.

    Args:
        path: path relative to the run's folder
    """
    with open(resolve_inside(sandbox_root, path), encoding="utf-8", errors="replace") as f:
        return f.read(MAX_OUTPUT_CHARS)


@builtin_tool
def write_file(path: str, content: str, sandbox_root: str) -> int:
    """Write a text file in the run's folder (parents created); returns bytes written.

    Args:
        path: path relative to the run's folder
        content: the new content of the file
    """
    target = resolve_inside(sandbox_root, path)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(target, "w", encoding="utf-8") as f:
        return f.write(content)


@builtin_tool
def list_dir(sandbox_root: str, path: str = ".") -> list[str]:
    """List a folder of the run's folder (folders end with '/').

    Args:
        path: path relative to the run's folder
    """
    target = resolve_inside(sandbox_root, path)
    return sorted(e.name + ("/" if e.is_dir() else "") for e in os.scandir(target))
