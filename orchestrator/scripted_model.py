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
  ``"hold": threading.Event`` (answer only once it is set).
A request with ``"stream": true`` gets the same answer as server-sent chunks.
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


class ScriptedModel:
    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.scripts: dict[str, list[Step]] = {}
        self.requests: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.default_delay = 0.0
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

    def answer(self, request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        name = request.get("model", "")
        with self._lock:
            self.requests[name].append(request)
        steps = self.scripts.get(name)
        if steps is None:
            return 404, {"error": {"message": f"no script {name!r}", "type": "not_found"}}
        turn = sum(1 for m in request.get("messages", []) if m.get("role") == "assistant")
        step = steps[min(turn, len(steps) - 1)]
        step = step(request) if callable(step) else step
        if "hold" in step:
            step["hold"].wait(600)
        time.sleep(step.get("delay", self.default_delay))
        if "status" in step:
            return step["status"], {"error": {"message": step.get("error", "scripted failure"),
                                              "type": "server_error"}}  # fmt: skip
        return 200, completion(name, step)


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


def stream_body(body: dict[str, Any]) -> bytes:
    """The completion as server-sent chunks, as OpenAI streams it (usage in the last one)."""
    message = body["choices"][0]["message"]
    delta: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
    base = {k: body[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    finish = body["choices"][0]["finish_reason"]
    chunks = [
        {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
        {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}], "usage": body["usage"]},
    ]
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


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
            status, body = model.answer(request)
            streamed = status == 200 and bool(request.get("stream"))
            data = stream_body(body) if streamed else json.dumps(body).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "text/event-stream" if streamed else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the caller died meanwhile (a killed worker): nothing to answer

        def log_message(self, *_: Any) -> None:
            return

    return Handler
