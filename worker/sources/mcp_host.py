"""The MCP host: one process per tool worker, holding that worker's MCP sessions.

``python -m worker.sources.mcp_host SOCKET`` is started by the tool worker's main
process (``mcp_tools.start_host``) when ``TOOLOOP_MCP_SERVERS`` is set. It

1. lists every server's tools and prints them, one JSON line on stdout (the worker
   publishes them in the catalog as ``<server>__<tool>``);
2. answers tool calls from the worker's pool processes on a Unix socket, one JSON
   request and one JSON reply per connection.

Why a process of its own: the pool processes fork sandboxed calls and sweep the
sandbox uids' processes among their children, so a server cannot be their child;
and one host per worker keeps at most one server process per server and run, whichever
pool process a call lands on. The MCP SDK (anyio, httpx2) is imported here only.

A stdio server runs in the sandbox (``worker.sandbox.sandboxed_command``), in the run's
folder, started on the run's first call to it and closed when the run ends (checked
every ``WATCH_S``), when a call is cut short (time limit, abort, lost caller: what it
was doing is unknown), or when the worker stops. A server that dies mid-call fails
that call; the next call starts it again.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx2

from worker.sources.mcp_config import McpServer, load_servers, tool_name

log = logging.getLogger("tooloop.mcp")

LIST_TIMEOUT_S = 60.0  # a server that cannot list its tools in this long is left out
WATCH_S = 2.0  # how often sessions of ended runs are looked for
CATALOG_FOLDER = "mcp-catalog-"  # + a random part: a folder under the sandbox root, for listing
MAX_REQUEST_BYTES = 16 << 20


@dataclass
class Session:
    """One connection to one server for one run; its ``async with`` lives in one task."""

    server: McpServer
    run_id: str
    opened: asyncio.Event = field(default_factory=asyncio.Event)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    dead: asyncio.Event = field(default_factory=asyncio.Event)
    client: Any = None
    error: BaseException | None = None
    task: asyncio.Task[None] | None = None
    stderr: StderrTail | None = None  # a stdio server's

    async def open(self, request: dict[str, Any], timeout_s: float) -> None:
        self.task = asyncio.create_task(self._hold(request))
        await asyncio.wait_for(self.opened.wait(), timeout_s)
        if self.client is None:
            # what it said before it died: bubblewrap's message, an interpreter's traceback
            said = await asyncio.to_thread(self.stderr.last) if self.stderr is not None else ""
            raise RuntimeError(f"cannot start: {_describe(self.error)}" + (f": {said}" if said else ""))

    async def _hold(self, request: dict[str, Any]) -> None:
        from mcp import Client

        self.stderr = StderrTail() if self.server.stdio else None
        try:
            async with Client(_transport(self.server, request, self.stderr)) as client:
                self.client = client
                self.opened.set()
                await self.stop.wait()
        except BaseException as exc:  # a server's failure is data: the call's error
            self.error = exc
        finally:
            self.client = None
            if self.stderr is not None:
                self.stderr.close()
            self.dead.set()
            self.opened.set()

    async def close(self) -> None:
        self.stop.set()
        if self.task is not None:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(self.task), 15)


class StderrTail:
    """A stdio server's stderr (its sandbox's, before it runs: bubblewrap's messages): passed
    on to this host's stderr (the worker's log), its last lines kept for the error of a
    server that could not start."""

    def __init__(self) -> None:
        read_fd, write_fd = os.pipe()
        self.writer = os.fdopen(write_fd, "w")
        self.lines: collections.deque[str] = collections.deque(maxlen=20)
        self.pump = threading.Thread(target=self._pump, args=(read_fd,), daemon=True, name="mcp-stderr")
        self.pump.start()

    def _pump(self, read_fd: int) -> None:
        with open(read_fd, errors="replace") as reader:
            for line in reader:
                sys.stderr.write(line)
                self.lines.append(line.rstrip())

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.writer.close()

    def last(self) -> str:
        """What it said, once its processes are gone (at most 1 s: a server that failed is)."""
        self.close()
        self.pump.join(1.0)
        return " / ".join(line for line in self.lines if line)[-2000:]


def _transport(server: McpServer, request: dict[str, Any], stderr: StderrTail | None) -> Any:
    if server.stdio:
        assert stderr is not None
        return _stdio(server, request, stderr)
    return _http(server)


def _stdio(server: McpServer, request: dict[str, Any], stderr: StderrTail) -> Any:
    from mcp import StdioServerParameters
    from mcp.client.stdio import stdio_client

    from orchestrator.models import SandboxPolicy
    from worker.sandbox import SandboxContext, sandboxed_command

    ctx = SandboxContext(
        workdir=request["workdir"], timeout_s=request.get("timeout_s", 300),
        policy=SandboxPolicy.model_validate(request.get("policy") or {}),
        mode=request.get("mode"), sandbox_root=request.get("sandbox_root"),
        run_id=request.get("run_id") or None,
    )  # fmt: skip
    assert server.command is not None
    command = sandboxed_command([server.command, *server.args], ctx, server.env)
    params = StdioServerParameters(command=command.argv[0], args=command.argv[1:], env=command.env,
                                   cwd=command.cwd)  # fmt: skip
    return stdio_client(params, errlog=stderr.writer)


class EnvHeaders(httpx2.Auth):
    """Header values read from the worker's environment for each request, never kept:
    the secret lives only in the request being sent, and a rotated one is used by the next."""

    def __init__(self, headers: dict[str, str]) -> None:
        self.headers = dict(headers)  # header -> name of an environment variable

    def auth_flow(self, request: httpx2.Request) -> Iterator[httpx2.Request]:
        for header, env in self.headers.items():
            value = os.environ.get(env)
            if value is not None:
                request.headers[header] = value
        yield request


def _http(server: McpServer) -> Any:
    from mcp.client.streamable_http import streamable_http_client

    assert server.url is not None
    # The SDK's own defaults: 30 s to connect or send, 300 s for a response stream to go quiet.
    http = httpx2.AsyncClient(auth=EnvHeaders(server.headers), timeout=httpx2.Timeout(30.0, read=300.0))
    return streamable_http_client(server.url, http_client=http)


def _describe(exc: BaseException | None) -> str:
    """The innermost message of an exception group (anyio wraps transport errors)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    if exc is None:
        return "the connection closed"
    return f"{type(exc).__name__}: {exc}"


def _output(result: Any) -> Any:
    """A tool result as one JSON value: a single text block is parsed as JSON when it is
    JSON (``5`` stays an int), else kept as text; other content stays as content blocks."""
    blocks = list(result.content or [])
    if len(blocks) == 1 and getattr(blocks[0], "type", None) == "text":
        text = blocks[0].text
        try:
            return json.loads(text)
        except ValueError:
            return text
    if not blocks and result.structured_content is not None:
        return result.structured_content
    return [block.model_dump(mode="json", exclude_none=True) for block in blocks]


@dataclass
class Opening:
    """The lock that makes a (server, run)'s concurrent first calls start one process, and
    how many calls hold or await it. Removed when that count is 0, not in ``drop``: a lock
    removed while a call awaits it would let the next call take a new one, and start a
    second process."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


class Host:
    def __init__(self, servers: list[McpServer]) -> None:
        self.servers = {s.name: s for s in servers}
        self.sessions: dict[tuple[str, str], Session] = {}
        self.opening: dict[tuple[str, str], Opening] = {}

    # -- the catalog ---------------------------------------------------------------
    async def catalog(self, sandbox_root: str) -> dict[str, Any]:
        """Every server's tools. stdio servers are started for it in a folder of their own
        (a name no run can guess), removed afterwards."""
        import shutil
        import uuid

        name = CATALOG_FOLDER + uuid.uuid4().hex
        workdir = os.path.join(sandbox_root, name)
        request = {"workdir": workdir, "sandbox_root": sandbox_root, "timeout_s": LIST_TIMEOUT_S,
                   "run_id": name}  # fmt: skip
        try:
            listed = await asyncio.gather(*(self._list(s, request) for s in self.servers.values()))
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        tools = [tool for found, _ in listed for tool in found]
        return {"tools": tools, "errors": [error for _, error in listed if error]}

    async def _list(self, server: McpServer, request: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
        session = Session(server, "")
        try:
            await session.open(request, LIST_TIMEOUT_S)
            found = await asyncio.wait_for(self._tools(session), LIST_TIMEOUT_S)
        except Exception as exc:
            return [], f"MCP server {server.name!r}: cannot list its tools: {_describe(exc)}"
        finally:
            await session.close()
        tools, skipped = [], []
        for tool in found:
            name = tool_name(server.name, tool.name)
            if name is None:
                skipped.append(tool.name)
                continue
            tools.append({"name": name, "description": tool.description or tool.title or tool.name,
                          "parameters": tool.input_schema or {"type": "object", "properties": {}},
                          "source": "mcp", "server": server.name, "tool": tool.name})  # fmt: skip
        error = f"MCP server {server.name!r}: tools {skipped} have names no model accepts" if skipped else ""
        return tools, error

    @staticmethod
    async def _tools(session: Session) -> list[Any]:
        found, cursor = [], None
        for _ in range(100):  # a paginator that never ends cannot hang the start
            page = await session.client.list_tools(cursor=cursor)
            found += page.tools
            cursor = page.next_cursor
            if not cursor:
                break
        return found

    # -- calls -------------------------------------------------------------------------
    async def call(self, request: dict[str, Any]) -> dict[str, Any]:
        server = self.servers.get(request["server"])
        if server is None:
            return {"ok": False, "error": f"McpError: this worker has no MCP server {request['server']!r}"}
        key = (server.name, request["run_id"])
        timeout = float(request["timeout_s"])
        try:
            session = await asyncio.wait_for(self._session(server, key, request), timeout)
        except TimeoutError:
            return _failed(f"Timeout: MCP server {server.name!r} did not start in {timeout:g}s")
        except Exception as exc:
            return {"ok": False, "error": f"McpError: MCP server {server.name!r}: {_describe(exc)}"}
        return await self._call(session, request, timeout)

    async def _session(self, server: McpServer, key: tuple[str, str], request: dict[str, Any]) -> Session:
        opening = self.opening.setdefault(key, Opening())
        opening.users += 1
        try:
            async with opening.lock:  # two first calls: one process
                return await self._open(server, key, request)
        finally:
            opening.users -= 1
            if not opening.users:  # none holds or awaits it: gone, else one per run for the worker's life
                del self.opening[key]

    async def _open(self, server: McpServer, key: tuple[str, str], request: dict[str, Any]) -> Session:
        session = self.sessions.get(key)
        if session is not None and not session.dead.is_set():
            return session
        session = Session(server, key[1])
        self.sessions[key] = session
        try:
            await session.open(request, float(request["timeout_s"]))
        except BaseException:
            await self.drop(key)
            raise
        return session

    async def _call(self, session: Session, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        from mcp import MCPError

        name, key = request["server"], (request["server"], request["run_id"])
        call = asyncio.create_task(session.client.call_tool(request["tool"], request["arguments"]))
        died = asyncio.create_task(session.dead.wait())
        try:
            done, _ = await asyncio.wait({call, died}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            died.cancel()
        if call not in done:
            call.cancel()
            await self.drop(key)  # whatever it was doing goes on no longer
            if died in done:
                return {"ok": False, "error": f"ServerDied: MCP server {name!r} exited during the call"}
            return {"ok": False, "error": f"Timeout: tool call exceeded {timeout:g}s"}
        try:
            result = call.result()
        except MCPError as exc:
            if session.dead.is_set() or "closed" in str(exc).lower():
                await self.drop(key)
                return _failed(f"ServerDied: MCP server {name!r} exited during the call ({exc})")
            return {"ok": False, "error": f"McpError: {exc}"}
        except Exception as exc:
            return {"ok": False, "error": f"McpError: {_describe(exc)}"}
        if result.is_error:
            return {"ok": False, "error": f"McpToolError: {_text(_output(result))}"}
        return {"ok": True, "output": _output(result)}

    async def drop(self, key: tuple[str, str]) -> None:
        session = self.sessions.pop(key, None)
        if session is not None:
            await session.close()

    async def drop_run(self, run_id: str) -> None:
        await asyncio.gather(*(self.drop(key) for key in list(self.sessions) if key[1] == run_id))

    async def close_all(self) -> None:
        await asyncio.gather(*(self.drop(key) for key in list(self.sessions)))

    # -- serving ---------------------------------------------------------------------------
    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = json.loads(await reader.readline())
            call = asyncio.create_task(self.call(request))
            gone = asyncio.create_task(reader.read(1))  # EOF: the caller left (time limit, abort)
            done, _ = await asyncio.wait({call, gone}, return_when=asyncio.FIRST_COMPLETED)
            gone.cancel()
            if call in done:
                writer.write(json.dumps(call.result()).encode() + b"\n")
                await writer.drain()
            else:
                call.cancel()
                await self.drop((request["server"], request["run_id"]))
        except Exception:
            log.warning("MCP host: a request failed", exc_info=True)
        finally:
            writer.close()

    async def watch_runs(self, stopping: asyncio.Event) -> None:
        """Close the sessions of runs that ended (or expired)."""
        import redis.asyncio as aioredis

        from orchestrator.keys import Keys
        from orchestrator.models import Status
        from orchestrator.settings import get_settings

        settings = get_settings()
        keys = Keys(settings.key_prefix)
        r = aioredis.Redis.from_url(settings.redis_url, decode_responses=True, socket_timeout=10)
        try:
            while not stopping.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopping.wait(), WATCH_S)
                runs = sorted({run_id for _, run_id in self.sessions})
                try:
                    statuses = [await r.hget(keys.run(run_id), "status") for run_id in runs]
                except Exception:
                    log.warning("MCP host: Redis unreachable; sessions kept", exc_info=True)
                    continue
                for run_id, status in zip(runs, statuses, strict=True):
                    if status is None or Status(status).ended:
                        await self.drop_run(run_id)
        finally:
            await r.aclose()


def _failed(error: str) -> dict[str, Any]:
    return {"ok": False, "error": error}


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


async def serve(socket_path: str, servers: list[McpServer], sandbox_root: str) -> None:
    host = Host(servers)
    catalog = await host.catalog(sandbox_root)
    sys.stdout.write(json.dumps(catalog) + "\n")
    sys.stdout.flush()
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    parent = os.getppid()
    server = await asyncio.start_unix_server(host.handle, socket_path, limit=MAX_REQUEST_BYTES)
    os.chmod(socket_path, 0o600)
    watcher = asyncio.create_task(host.watch_runs(stopping))
    try:
        while not stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), 1.0)
            if os.getppid() != parent:  # the worker is gone (even if PDEATHSIG was missed)
                break
    finally:
        server.close()
        stopping.set()
        await host.close_all()
        watcher.cancel()
        with contextlib.suppress(OSError):
            os.unlink(socket_path)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="[%(asctime)s: %(levelname)s/mcp-host] %(message)s")  # fmt: skip
    from orchestrator.settings import get_settings

    settings = get_settings()
    servers = load_servers(settings.mcp_servers)
    asyncio.run(serve(sys.argv[1], servers, settings.sandbox_root))


if __name__ == "__main__":
    main()
