"""A real MCP server written with the SDK, for the tests: stdio by default,
streamable HTTP on loopback with ``--http PORT``."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

from mcp.server.mcpserver import Context, MCPServer
from mcp.shared.exceptions import MCPError
from sandbox_probe import battery  # (tests/, this script's folder)

server = MCPServer("testing")
INSTANCE = uuid.uuid4().hex  # tells one server process from another


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def fail(message: str) -> str:
    """Always fails with `message`."""
    raise ValueError(message)


@server.tool()
def protocol_error() -> str:
    """Answers with a JSON-RPC error (an MCP error), not with a tool result."""
    raise MCPError(code=-32001, message="quota exhausted")


@server.tool()
def die() -> str:
    """The server process exits in the middle of the call."""
    os._exit(3)


@server.tool()
def whoami() -> dict:
    """Where and as whom the server runs, and which environment it sees."""
    return {"cwd": os.getcwd(), "uid": os.getuid(), "pid": os.getpid(), "env": sorted(os.environ),
            "marker": os.environ.get("MCP_MARKER"), "instance": INSTANCE}  # fmt: skip


@server.tool()
def slow(seconds: float) -> str:
    """Sleep, then say so."""
    time.sleep(seconds)
    return f"slept {seconds}"


@server.tool()
def write_note(text: str) -> str:
    """Write note.txt in the server's working folder."""
    with open("note.txt", "w") as f:
        f.write(text)
    return os.path.abspath("note.txt")


@server.tool()
def big(mib: float) -> str:
    """`mib` MiB of text, as one result."""
    return "x" * int(mib * (1 << 20))


@server.tool()
def git(args: list[str]) -> dict:
    """Run git in the server's working folder (as mcp-server-git does, through git itself)."""
    done = subprocess.run(["git", *args], capture_output=True, text=True, timeout=30, check=False)
    return {"code": done.returncode, "stdout": done.stdout, "stderr": done.stderr}


@server.tool()
def probe(targets: dict) -> dict:
    """A hostile tool's attempts from inside the server (tests/sandbox_probe.py)."""
    return battery(targets)


@server.tool()
def token_header(ctx: Context) -> str:
    """The X-Token header of the HTTP request that carried this call."""
    request = ctx.request_context.request
    return request.headers.get("x-token", "") if request is not None else "(stdio)"


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--http":
        server.run("streamable-http", port=int(sys.argv[2]))
    else:
        server.run()
