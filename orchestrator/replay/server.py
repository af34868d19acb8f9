"""The model a replay talks to: an OpenAI-compatible server on loopback, fed by a cassette.

The turn task calls it through litellm, as it calls any provider (the same request, the
same parsing of the reply, the same pricing of its usage); what it answers is the
recorded reply of the turn the replay is running (``turn``, set by the runner before each
turn), or that turn's compaction summary for a compaction request. A turn the cassette
has no reply for is answered with a 400 naming it, and noted (``unanswered``).

Built on the scripted model's server (orchestrator/scripted_model.py): plain and streamed
answers alike.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

from orchestrator.replay.cassette import Cassette
from orchestrator.scripted_model import ScriptedModel, is_summary_request

# A recorded model error as an HTTP status litellm maps back to the same kind of error.
ERROR_STATUS = {
    "AuthenticationError": 401, "PermissionDeniedError": 403, "NotFoundError": 404, "BadRequestError": 400,
    "UnprocessableEntityError": 422, "RateLimitError": 429, "Timeout": 408, "ServiceUnavailableError": 503,
    "BadGatewayError": 502,
}  # fmt: skip


class ReplayModel(ScriptedModel):
    def __init__(self, cassette: Cassette) -> None:
        super().__init__()
        self.cassette = cassette
        self.turn = 0  # the turn being replayed (the runner sets it)
        self.unanswered: list[int] = []  # turns asked for that the cassette has no reply for
        self._summaries: dict[int, int] = defaultdict(int)  # compaction requests answered, per turn
        self._lock_turn = threading.Lock()
        # polled often: a replay stops its server in ms, not in the default half second
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.02},
                                        daemon=True)  # fmt: skip

    def answer(self, request: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, Any]]:
        line = self.cassette.turns.get(self.turn) or {}
        if is_summary_request(request):
            return self._summary(line)
        reply, error = line.get("reply"), line.get("error")
        if error and not reply:
            status = ERROR_STATUS.get(str(error.get("type")), 500)
            return status, {"error": {"message": error.get("message") or "recorded error",
                                      "type": "replayed_error"}}, {}  # fmt: skip
        if not reply:
            with self._lock_turn:
                self.unanswered.append(self.turn)
            why = f"the cassette has no reply for turn {self.turn}"
            return 400, {"error": {"message": why, "type": "invalid_request_error"}}, {}
        return 200, body(reply, request.get("model", "")), {}

    def _summary(self, line: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, Any]]:
        """The turn's k-th compaction summary, as recorded (a failed one fails again)."""
        with self._lock_turn:
            k = self._summaries[self.turn]
            self._summaries[self.turn] += 1
        done = (line.get("compactions") or [])[k : k + 1]
        if done and done[0].get("fallback"):
            return 500, {"error": {"message": "the recorded summary call failed", "type": "server_error"}}, {}
        if done and done[0].get("reply"):
            return 200, body(done[0]["reply"], ""), {}
        text = str(done[0].get("summary") or "") if done else "Summary: earlier turns called tools."
        return 200, body({"content": text.split("\n", 1)[-1] if done else text}, ""), {}


def body(reply: dict[str, Any], model: str) -> dict[str, Any]:
    """A chat completion carrying ``reply`` as it was received."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.get("content")}
    if reply.get("tool_calls"):
        message["tool_calls"] = reply["tool_calls"]
    if reply.get("oversize"):  # a reply the run refused as too large: served at its size again
        shown = len(message["content"] or "") + sum(len(c["function"].get("arguments") or "")
                                                   for c in message.get("tool_calls") or [])  # fmt: skip
        message["content"] = (message["content"] or "") + "z" * max(0, int(reply["oversize"]) - shown)
    usage = dict(reply.get("usage") or {})
    total = int(usage.get("total_tokens") or 0)
    usage.setdefault("prompt_tokens", total - total // 3)
    usage.setdefault("completion_tokens", total - usage["prompt_tokens"])
    return {
        "id": "chatcmpl-replay", "object": "chat.completion", "created": 0,
        "model": reply.get("served") or reply.get("model") or model,
        "choices": [{"index": 0, "message": message,
                     "finish_reason": "tool_calls" if message.get("tool_calls") else "stop"}],
        "usage": {"prompt_tokens": int(usage["prompt_tokens"]),
                  "completion_tokens": int(usage["completion_tokens"]), "total_tokens": total},
    }  # fmt: skip
