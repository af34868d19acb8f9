"""A scripted OpenAI-compatible chat-completions server.

Used by the test suite, the benchmarks and ``tooloop demo`` (no internet here),
so litellm's real HTTP path runs everywhere. Scripts are chosen by the request's
``model`` (``openai/<script>`` in a spec), and the step by the number of
assistant messages already in the conversation, so a re-sent request (a turn
retried after a crash) gets the same answer: the server is stateless per run.

A step is a dict, or a callable ``(request) -> dict``:
  ``{"tool_calls": [{"name": "add", "arguments": {"a": 1}}]}``  call tools
  ``{"content": "the answer"}``                                 answer
  ``{"status": 500, "error": "boom"}``                          fail the HTTP call
  plus ``"delay": seconds``, ``"tokens": total_tokens`` (default 30),
  ``"hold": threading.Event`` (answer only once it is set),
  ``"fail": [429, 503, "hang", {"status": 400, "error": "..."}, ...]``: the first attempts
  at this step (same last message) fail with these (``"hang"``: no answer for 600 s) before it answers;
  ``"retry_after": s`` sends a Retry-After header with them;
  ``"trickle": seconds`` (send the answer's first bytes at once, then one byte every half
  second for that long: a reply that never times out on a per-read timeout).
A request with ``"stream": true`` gets the same answer as server-sent chunks: the
content in pieces of ``"chunk_chars"`` (default: all at once) ``"chunk_delay"``
seconds apart, usage in the last chunk; ``"stall": seconds`` waits after the first piece.
Requests whose system prompt starts with ``SUMMARY_MARKER`` (context compaction)
are answered by ``summaries[script]`` (default: a short summary), not by the script.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Step = dict[str, Any] | Callable[[dict[str, Any]], dict[str, Any]]
SUMMARY_MARKER = "You compress the history of an agent's run"  # worker/compaction.py's prompt
HANG_S = 600.0


class ScriptedModel:
    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.scripts: dict[str, list[Step]] = {}
        self.requests: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.default_delay = 0.0
        self.summaries: dict[str, Step] = {}  # script name -> the answer to compaction requests
        self.attempts: dict[tuple[str, int, str], int] = defaultdict(int)  # requests per step and point
        self._lock = threading.Lock()
        self._server = _Server((host, port), _handler(self))
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def api_base(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/v1"

    def start(self) -> ScriptedModel:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def script(self, steps: list[Step], name: str | None = None) -> str:
        """Register a script; returns the litellm model string that plays it."""
        name = name or f"script-{uuid.uuid4().hex[:10]}"
        self.scripts[name] = steps
        return f"openai/{name}"

    def calls(self, model: str) -> list[dict[str, Any]]:
        return self.requests[model.removeprefix("openai/")]

    def summary_requests(self, model: str) -> list[dict[str, Any]]:
        return [r for r in self.calls(model) if is_summary_request(r)]

    def turn_requests(self, model: str) -> list[dict[str, Any]]:
        return [r for r in self.calls(model) if not is_summary_request(r)]

    def answer(self, request: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, Any]]:
        """(HTTP status, body, the step: its streaming and header options)."""
        name = request.get("model", "")
        request["_received"] = time.time()  # for tests of pacing (rate limits)
        with self._lock:
            self.requests[name].append(request)
        steps = self.scripts.get(name)
        if steps is None:
            return 404, {"error": {"message": f"no script {name!r}", "type": "not_found"}}, {}
        if is_summary_request(request):
            step = self.summaries.get(name) or {"content": "Summary: earlier turns called tools."}
            index = -1
        else:
            index = sum(1 for m in request.get("messages", []) if m.get("role") == "assistant")
            index = min(index, len(steps) - 1)
            step = steps[index]
        step = step(request) if callable(step) else step
        # an attempt is a request for the same step at the same point of the conversation
        # (its last message): a retry, or a retry with a trimmed history
        point = (name, index, json.dumps((request.get("messages") or [None])[-1], sort_keys=True))
        with self._lock:
            self.attempts[point] += 1
            attempt = self.attempts[point]
        failures = step.get("fail") or []
        if attempt <= len(failures):
            return self._failure(failures[attempt - 1], step)
        if "hold" in step:
            step["hold"].wait(600)
        time.sleep(step.get("delay", self.default_delay))
        if "status" in step:
            return step["status"], {"error": {"message": step.get("error", "scripted failure"),
                                              "type": "server_error"}}, step  # fmt: skip
        return 200, completion(name, step), step

    @staticmethod
    def _failure(kind: Any, step: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, Any]]:
        """``kind``: a status, ``"hang"``, or ``{"status": 400, "error": "...", "code": "..."}``."""
        if kind == "hang":
            time.sleep(HANG_S)
            kind = 504
        given = kind if isinstance(kind, dict) else {"status": kind}
        status = int(given["status"])
        kinds = {429: "rate_limit_exceeded", 408: "timeout", 400: "invalid_request_error"}
        error = {"message": given.get("error", f"scripted {status}"),
                 "type": kinds.get(status, "server_error"), "code": given.get("code")}  # fmt: skip
        return status, {"error": error}, step


def completion(model: str, step: dict[str, Any]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": step.get("content")}
    if step.get("tool_calls"):
        message["tool_calls"] = [
            {
                "id": call.get("id") or f"call_{uuid.uuid4().hex[:12]}",
                "type": "function",
                "function": {
                    "name": call["name"],
                    "arguments": call["arguments"]
                    if isinstance(call.get("arguments"), str)
                    else json.dumps(call.get("arguments", {})),
                },
            }
            for call in step["tool_calls"]
        ]
    total = int(step.get("tokens", 30))
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:12]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message,
                     "finish_reason": "tool_calls" if step.get("tool_calls") else "stop"}],
        "usage": {"prompt_tokens": total - total // 3, "completion_tokens": total // 3,
                  "total_tokens": total},
    }  # fmt: skip


def is_summary_request(request: dict[str, Any]) -> bool:
    messages = request.get("messages") or [{}]
    return str(messages[0].get("content") or "").startswith(SUMMARY_MARKER)


def stream_events(body: dict[str, Any], chunk_chars: int | None = None) -> list[bytes]:
    """The completion as server-sent events, as OpenAI streams it: the content in pieces
    of ``chunk_chars``, tool calls in the last piece, usage in the final chunk."""
    message = body["choices"][0]["message"]
    content = message.get("content") or ""
    size = chunk_chars or max(1, len(content))
    pieces = [content[i : i + size] for i in range(0, len(content), size)] or [content or None]
    base = {k: body[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    chunks = []
    for i, piece in enumerate(pieces):
        delta: dict[str, Any] = {"content": piece} | ({"role": "assistant"} if i == 0 else {})
        if i == len(pieces) - 1 and message.get("tool_calls"):
            delta["tool_calls"] = [{"index": j, **c} for j, c in enumerate(message["tool_calls"])]
        chunks.append({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
    finish = body["choices"][0]["finish_reason"]
    chunks.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}],
                   "usage": body["usage"]})  # fmt: skip
    return [b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks] + [b"data: [DONE]\n\n"]


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 512


def _handler(model: ScriptedModel) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # else ~40 ms per reused connection

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            request = json.loads(self.rfile.read(length) or b"{}")
            request["_peer"] = self.client_address[0]  # which host called (tests of many hosts)
            status, body, step = model.answer(request)
            try:
                if status == 200 and request.get("stream"):
                    self._stream(body, step)
                    return
                data = json.dumps(body).encode()
                trickle = float(step.get("trickle") or 0) if status == 200 else 0.0
                if trickle:  # JSON may start with blanks: one per half second
                    data = b" " * int(trickle * 2) + data
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                if step.get("retry_after") is not None and status != 200:
                    self.send_header("Retry-After", str(step["retry_after"]))
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(self._trickle(data, trickle) if trickle else data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the caller died meanwhile (a killed worker): nothing to answer

        def _trickle(self, data: bytes, seconds: float) -> bytes:
            """Dribble the body one byte per half second for ``seconds``; returns the rest."""
            deadline = time.monotonic() + seconds
            while len(data) > 1 and time.monotonic() < deadline:
                self.wfile.write(data[:1])
                self.wfile.flush()
                data = data[1:]
                time.sleep(0.5)
            return data

        def _stream(self, body: dict[str, Any], step: dict[str, Any]) -> None:
            """Server-sent events, chunked, paced by the step's chunk_delay and stall."""
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i, event in enumerate(stream_events(body, step.get("chunk_chars"))):
                if i == 1 and step.get("stall"):
                    time.sleep(step["stall"])
                elif i and step.get("chunk_delay"):
                    time.sleep(step["chunk_delay"])
                self.wfile.write(f"{len(event):x}\r\n".encode() + event + b"\r\n")
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")

        def log_message(self, *_: Any) -> None:
            return

    return Handler
