"""What a hostile tool tries, as one call: the test matrix (tests/test_sandbox_matrix.py)
runs it as a strict ``@tool`` and as an MCP stdio server's tool, and says what happened.

Standard library only, no tooloop import: the MCP server (tests/mcp_server.py) imports it
as a top-level module, from whatever Python the sandbox's uid can run."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any


def battery(targets: dict[str, Any]) -> dict[str, Any]:
    """Each attempt, and its outcome ("ok: ..." or "<ErrorType>: message"):

    - ``token``: written to ``probe.txt`` in the working folder and read back (it ran, there);
    - ``outside``: paths to write, outside the run's folder;
    - ``neighbours``: files of other runs' folders to read;
    - ``network``: ``[host, port]`` pairs to connect to (Redis, a listener);
    - ``allocate_mb``: memory to allocate (beyond the call's limit);
    - and the whole environment, as the call sees it."""
    with open("probe.txt", "w") as f:
        f.write(targets["token"])
    with open("probe.txt") as f:
        wrote = f.read()
    return {
        "cwd": os.getcwd(),
        "uid": os.getuid(),
        "wrote": wrote,
        "outside": {path: attempt(lambda p=path: _write(p)) for path in targets["outside"]},
        "neighbours": {path: attempt(lambda p=path: _read(p)) for path in targets["neighbours"]},
        "network": {f"{h}:{p}": attempt(lambda h=h, p=p: _connect(h, p)) for h, p in targets["network"]},
        "memory": attempt(lambda: len(bytearray(targets["allocate_mb"] << 20))),
        "env": dict(os.environ),
    }


def attempt(action: Callable[[], Any]) -> str:
    try:
        return f"ok: {action()}"
    except Exception as exc:  # MemoryError included: the outcome is what the test reads
        return f"{type(exc).__name__}: {exc}"


def _write(path: str) -> str:
    with open(path, "w") as f:
        f.write("pwned")
    return "written"


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _connect(host: str, port: int) -> str:
    with socket.create_connection((host, port), timeout=3) as s:
        s.sendall(b"PING\r\n")
        return s.recv(64).decode(errors="replace")
