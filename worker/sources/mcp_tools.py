"""The tool worker's side of MCP: start the host, register its tools, send it calls.

``start_host`` runs in the tool worker's main process before the pool forks, so
every pool process inherits the registered tools and the host's socket path. A
call (``call``) is a tool task like any other: fenced, leased, recorded; it sends
one request to the host and waits for the reply, heartbeating the call's lease
every ``TICK_S``, and gives up at the time limit or when the run ends (the host
then closes that run's session: what the server was doing is cut short). A reply is
read into one buffer, at most ``MAX_REPLY_BYTES`` (a forked call's cap and an envelope).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from celery import signals

from worker.registry import ToolDef, register_remote
from worker.sandbox import CallOutcome
from worker.sources.mcp_config import MAX_REPLY_BYTES, TOO_LARGE, McpConfigError, load_servers

log = logging.getLogger(__name__)

TICK_S = 0.25  # heartbeat / abort check while a call waits
HOST_GRACE_S = 5.0  # the host enforces the time limit; this is the backstop
START_TIMEOUT_S = 120.0  # the host lists every server's tools within this

_host: subprocess.Popen[bytes] | None = None
_socket_path: str | None = None


@dataclass
class Started:
    """What ``start_host`` found: the tools registered, and the servers left out, with why."""

    tools: list[dict[str, Any]] = field(default_factory=list)
    unavailable: dict[str, str] = field(default_factory=dict)


def start_host(mcp_servers: str) -> Started:
    """Start the MCP host, wait for the catalog, register its tools (main process only).
    A file that cannot be used raises ``McpConfigError`` before anything starts; a host
    that fails leaves every server out (the worker still serves its other tools)."""
    global _host, _socket_path
    if not mcp_servers or _host is not None:
        return Started()
    servers = load_servers(mcp_servers)  # here, in the worker: the host would only die of it
    folder = tempfile.mkdtemp(prefix="tooloop-mcp-")  # 0700: sandboxed calls cannot connect
    _socket_path = os.path.join(folder, "host.sock")  # its folder is removed by stop_host
    _host = subprocess.Popen(
        [sys.executable, "-m", "worker.sources.mcp_host", _socket_path],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, preexec_fn=_die_with_parent,
    )  # fmt: skip
    try:
        catalog = _read_catalog(_host)
    except (RuntimeError, ValueError) as exc:
        log.error("MCP: %s: this worker serves no MCP tools", exc)
        return Started(unavailable={s.name: str(exc) for s in servers})
    for error in catalog.get("errors", []):
        log.warning("%s", error)
    tools = catalog.get("tools", [])
    for entry in tools:
        definition = ToolDef(entry["name"], entry["description"], entry["parameters"])
        register_remote(definition, "mcp", {"server": entry["server"], "tool": entry["tool"]})
    log.info("MCP: %d tool(s) from %s", len(tools), mcp_servers)
    return Started(tools, catalog.get("unavailable", {}))


def start_or_exit(mcp_servers: str) -> dict[str, str]:
    """``start_host`` for a starting worker: a file that cannot be used stops it, exit 2, with
    one line naming the file and the fault (never a worker that says ready and serves nothing)."""
    try:
        return start_host(mcp_servers).unavailable
    except McpConfigError as exc:
        print(exc, file=sys.stderr, flush=True)  # one line, as `tooloop worker` says it
        raise SystemExit(2) from None


def _die_with_parent() -> None:
    ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG: close sessions, exit


def _read_catalog(proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
    line = proc.stdout.readline() if ready else b""
    if not line:
        stop_host()
        raise RuntimeError(f"MCP host did not list the servers' tools (exit {proc.poll()})")
    return json.loads(line)


def stop_host() -> None:
    """Stop the host: it closes every session (and so every server process) first."""
    global _host
    proc, _host = _host, None
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc is not None and _socket_path:  # the host is gone: its socket's folder goes too
        shutil.rmtree(os.path.dirname(_socket_path), ignore_errors=True)


@signals.worker_shutdown.connect
def _on_worker_shutdown(**_: Any) -> None:
    stop_host()


def call(remote: dict[str, Any], arguments: dict[str, Any], request: dict[str, Any],
         on_tick: Callable[[], bool]) -> CallOutcome:  # fmt: skip
    """One call through the host; ``request`` carries the run's id, folder, policy, time limit."""
    started = time.perf_counter()
    outcome = _exchange({**request, **remote, "arguments": arguments}, on_tick)
    outcome.duration_ms = round((time.perf_counter() - started) * 1000, 3)
    return outcome


def _exchange(request: dict[str, Any], on_tick: Callable[[], bool]) -> CallOutcome:
    if _socket_path is None:
        return CallOutcome(False, error="McpError: this worker runs no MCP host (TOOLOOP_MCP_SERVERS)")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(_socket_path)
            sock.sendall(json.dumps(request).encode() + b"\n")
        except OSError as exc:
            return CallOutcome(False, error=f"McpError: the worker's MCP host is unreachable ({exc})")
        reply = _await_reply(sock, float(request["timeout_s"]), on_tick)
    if isinstance(reply, CallOutcome):
        return reply
    if reply.get("ok"):
        return CallOutcome(True, output=reply.get("output"))
    return CallOutcome(False, error=str(reply.get("error")))


def _await_reply(sock: socket.socket, timeout_s: float,
                 on_tick: Callable[[], bool]) -> dict[str, Any] | CallOutcome:  # fmt: skip
    deadline = time.monotonic() + timeout_s + HOST_GRACE_S
    next_tick = time.monotonic() + TICK_S
    buf = bytearray()  # bytes += would copy the reply so far on every chunk: quadratic
    while not buf.endswith(b"\n"):
        if len(buf) > MAX_REPLY_BYTES + 1:  # the host bounds its replies; this is the backstop
            return CallOutcome(False, error=TOO_LARGE)
        now = time.monotonic()
        if now >= deadline:
            return CallOutcome(False, error=f"Timeout: tool call exceeded {timeout_s:g}s")
        if now >= next_tick:
            next_tick = now + TICK_S
            if not _still_wanted(on_tick):
                return CallOutcome(False, error="Aborted: the run ended while the tool ran")
        ready, _, _ = select.select([sock], [], [], max(0.0, min(deadline, next_tick) - now))
        if ready:
            chunk = sock.recv(min(1 << 20, MAX_REPLY_BYTES + 2 - len(buf)))
            if not chunk:
                return CallOutcome(False, error="McpError: the worker's MCP host closed the call")
            buf += chunk
    try:
        return json.loads(buf)
    except ValueError:
        return CallOutcome(False, error="McpError: unreadable reply from the worker's MCP host")


def _still_wanted(on_tick: Callable[[], bool]) -> bool:
    """A failing heartbeat (Redis away) does not stop the call, as in the sandbox."""
    with contextlib.suppress(Exception):
        return on_tick()
    return True
