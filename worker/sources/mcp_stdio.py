"""The MCP host's stdio transport: the SDK's, with every message bounded and read in linear time.

``mcp.client.stdio.stdio_client`` joins each chunk it reads onto the line so far
(``buffer + chunk``) and bounds nothing: measured here, a 16 MiB tool result cost the
host ~10 s of CPU and a 32 MiB one ~40 s, in the one process that serves every MCP call
of the worker, and a server could grow its memory without end. This transport reads the
server's stdout into a ``bytearray``, looks for the newline only in the bytes just read,
and ends the connection when a message passes ``MAX_MESSAGE_BYTES``: the session sees it
close, and ``Output.too_large`` says why (the call is then ``OutputTooLarge``).

It also reads the server's stderr: each line still goes to the host's stderr (the
worker's log), and the last ones are kept, so that a server that cannot start is
reported with its cause (``cannot start ['mcp-x']: [Errno 2] ...``) on the same line.

The program runs with exactly the environment it is given (the sandbox's allowlist):
unlike ``stdio_client``, nothing of the host's own (``USER``, ``SHELL``...) is added.
"""

from __future__ import annotations

import codecs
import contextlib
import os
import signal
import sys
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import mcp_types
from anyio.abc import ByteReceiveStream, ByteSendStream, Process
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from mcp import StdioServerParameters
from mcp.shared.message import SessionMessage

from worker.sandbox.constants import MAX_RESULT_BYTES

# A tool result may come twice in one message (as text content and as structured content),
# plus its JSON-RPC envelope.
MAX_MESSAGE_BYTES = 2 * MAX_RESULT_BYTES + (1 << 20)
STDERR_LINES = 20  # kept for error messages
STDERR_LINE_CHARS = 500
STDERR_TAIL_CHARS = 1000  # in an error message
EXIT_GRACE_S = 2.0  # after stdin closes, then after SIGTERM (the SDK's own timings)
POLL_S = 0.01


@dataclass
class Output:
    """What a session's transport saw beside the messages."""

    too_large: bool = False
    stderr: deque[str] = field(default_factory=lambda: deque(maxlen=STDERR_LINES))
    stderr_done: anyio.Event = field(default_factory=anyio.Event)

    def tail(self, lines: int = 5) -> str:
        """The server's last stderr lines, as one line (a traceback's last lines say why)."""
        return " | ".join(list(self.stderr)[-lines:])[-STDERR_TAIL_CHARS:]


@contextlib.asynccontextmanager
async def bounded_stdio(params: StdioServerParameters, output: Output,
                        limit: int = MAX_MESSAGE_BYTES) -> AsyncIterator[tuple[Any, Any]]:  # fmt: skip
    """An MCP ``Transport``: (read stream, write stream) of a program speaking MCP on stdio."""
    process = await anyio.open_process([params.command, *params.args], env=params.env, cwd=params.cwd,
                                       start_new_session=True)  # fmt: skip
    incoming_w, incoming = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    outgoing, outgoing_r = anyio.create_memory_object_stream[SessionMessage](0)
    assert process.stdin is not None and process.stdout is not None and process.stderr is not None
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(_read_messages, process.stdout, incoming_w, output, limit)
        tasks.start_soon(_write_messages, process.stdin, outgoing_r, incoming_w)
        tasks.start_soon(_read_stderr, process.stderr, output)
        patient = True
        try:
            yield incoming, outgoing
        except anyio.get_cancelled_exc_class():
            patient = False  # cut short (a handshake that never ended, a call past its limit)
            raise
        finally:
            # Even when the caller is cancelled: every wait below is bounded.
            with anyio.CancelScope(shield=True):
                await _stop(process, patient)
                with anyio.move_on_after(1.0):  # the cause of an exit, when it wrote one
                    await output.stderr_done.wait()
                with anyio.move_on_after(1.0):  # its pipes: else their transports outlive the loop
                    await process.aclose()
                for stream in (incoming, outgoing, incoming_w, outgoing_r):
                    await stream.aclose()
            tasks.cancel_scope.cancel()


async def _read_messages(stdout: ByteReceiveStream, sink: MemoryObjectSendStream[Any], output: Output,
                         limit: int) -> None:  # fmt: skip
    buffer = bytearray()
    with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream):
        async with sink:
            async for chunk in stdout:
                start = len(buffer)
                buffer += chunk
                end = buffer.find(b"\n", start)  # only in the new bytes: linear in the message
                while end >= 0:
                    if end > limit:
                        break
                    line = bytes(buffer[:end])
                    del buffer[: end + 1]
                    if line.strip():
                        await sink.send(_parse(line))
                    end = buffer.find(b"\n")
                if end > limit or len(buffer) > limit:
                    output.too_large = True
                    return  # the connection ends here: the session sees it close


def _parse(line: bytes) -> SessionMessage | Exception:
    try:
        return SessionMessage(mcp_types.jsonrpc_message_adapter.validate_json(line, by_name=False))
    except ValueError as exc:  # the session reports it, as the SDK's transport does
        return exc


async def _write_messages(stdin: ByteSendStream, source: MemoryObjectReceiveStream[SessionMessage],
                          incoming: MemoryObjectSendStream[Any]) -> None:  # fmt: skip
    try:
        async with source:
            async for message in source:
                text = message.message.model_dump_json(by_alias=True, exclude_unset=True)
                await stdin.send(text.encode() + b"\n")
    except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
        await incoming.aclose()  # the server stopped reading: calls waiting on it end now


async def _read_stderr(stderr: ByteReceiveStream, output: Output) -> None:
    pending = b""
    text = codecs.getincrementaldecoder("utf-8")(errors="replace")
    try:
        async for chunk in stderr:
            sys.stderr.write(text.decode(chunk))  # the worker's log, as before
            sys.stderr.flush()
            *lines, pending = (pending + chunk).split(b"\n")
            pending = pending[-STDERR_LINE_CHARS:]
            for line in lines:
                if line.strip():
                    output.stderr.append(line.decode(errors="replace").strip()[:STDERR_LINE_CHARS])
    except (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream, OSError):
        pass
    finally:
        if pending.strip():
            output.stderr.append(pending.decode(errors="replace").strip())
        output.stderr_done.set()


async def _stop(process: Process, patient: bool) -> None:
    """Close stdin and let it exit (when ``patient``); then SIGTERM its process group (the
    sandbox's keeper kills the server and every process of its uid), then SIGKILL."""
    with contextlib.suppress(OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
        assert process.stdin is not None
        await process.stdin.aclose()
    for sig in ((None,) if patient else ()) + (signal.SIGTERM, signal.SIGKILL):
        if sig is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, sig)
        if await _exited(process, EXIT_GRACE_S):
            return


async def _exited(process: Process, timeout: float) -> bool:
    """By polling ``returncode``: ``wait()`` also waits for the pipes, which a child of the
    server may hold open."""
    with anyio.move_on_after(timeout):
        while process.returncode is None:
            await anyio.sleep(POLL_S)
    return process.returncode is not None
