"""The direct route of OpenAI-compatible calls (worker/openai_route.py) against litellm's:
the same request on the wire, the same reply, the same errors. Real HTTP to the scripted
model, both routes in the same test."""

from __future__ import annotations

import pytest

from orchestrator.local import free_port
from worker import llm, openai_route

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]  # fmt: skip
MESSAGES = [{"role": "system", "content": "s"}, {"role": "user", "content": "2 + 3?"}]
ROUTES = ("direct", "litellm")


def call(monkeypatch, route: str, model: str, params: dict) -> llm.Reply:
    monkeypatch.setenv("TOOLOOP_MODEL_ROUTE", route)
    return llm.complete(model, MESSAGES, TOOLS, params, "default")


def error_of(monkeypatch, route: str, model: str, params: dict) -> llm.ModelError:
    with pytest.raises(llm.ModelError) as caught:
        call(monkeypatch, route, model, params)
    return caught.value


def test_the_direct_route_sends_and_reads_what_litellm_does(model_server, monkeypatch):
    step = {"tool_calls": [{"id": "call_1", "name": "add", "arguments": {"a": 2, "b": 3}}], "tokens": 42}
    model = model_server.script([step])
    params = {"api_base": model_server.api_base, "api_key": "k", "temperature": 0.2, "max_tokens": 50}
    assert openai_route.covers(model, {**params, "tools": TOOLS}, stream=False)
    openai_route._sessions.clear()
    replies = {route: call(monkeypatch, route, model, params) for route in ROUTES}
    assert openai_route._sessions, "the direct route was not taken"
    direct, full = replies["direct"], replies["litellm"]
    assert direct.message == full.message and direct.message["tool_calls"][0]["function"]["name"] == "add"
    assert (direct.tokens, direct.usage, direct.served) == (full.tokens, full.usage, full.served)
    assert direct.tokens == 42 and direct.cost_usd == full.cost_usd
    sent = [{k: v for k, v in request.items() if k != "_received"} for request in model_server.calls(model)]
    assert sent[0] == sent[1] and sent[0]["temperature"] == 0.2 and sent[0]["tools"] == TOOLS


@pytest.mark.parametrize("failure, error_type", [
    ({"status": 429, "error": "slow down", "retry_after": 7}, "RateLimitError"),
    ({"status": 503, "error": "overloaded"}, "ServiceUnavailableError"),
    ({"status": 401, "error": "bad key"}, "AuthenticationError"),
    ({"status": 400, "error": "This model's maximum context length is 10"}, "ContextWindowExceededError"),
])  # fmt: skip
def test_errors_are_litellms_on_both_routes(model_server, monkeypatch, failure, error_type):
    model = model_server.script([failure])
    params = {"api_base": model_server.api_base, "api_key": "k", "num_retries": 0}
    errors = {route: error_of(monkeypatch, route, model, params) for route in ROUTES}
    assert {e.error_type for e in errors.values()} == {error_type}
    assert errors["direct"].retryable == errors["litellm"].retryable
    assert errors["direct"].retry_after == errors["litellm"].retry_after == failure.get("retry_after")
    assert failure["error"] in str(errors["direct"])


def test_a_refused_connection_is_the_same_error_on_both_routes(monkeypatch):
    params = {"api_base": f"http://127.0.0.1:{free_port()}/v1", "api_key": "k", "num_retries": 0}
    monkeypatch.setenv("TOOLOOP_ALLOWED_API_BASES", params["api_base"])
    errors = {route: error_of(monkeypatch, route, "openai/nobody", params) for route in ROUTES}
    assert errors["direct"].error_type == errors["litellm"].error_type
    assert errors["direct"].retryable and errors["litellm"].retryable


def test_what_the_direct_route_leaves_to_litellm(model_server):
    base = {"api_base": model_server.api_base, "api_key": "k"}
    assert openai_route.covers("openai/m", base, stream=False)
    assert not openai_route.covers("openai/m", base, stream=True)  # streaming
    assert not openai_route.covers("anthropic/claude", base, stream=False)  # another provider
    assert not openai_route.covers("openai/m", {"api_key": "k"}, stream=False)  # the provider's default base
    assert not openai_route.covers("openai/m", {**base, "extra_headers": {"x": "1"}}, stream=False)
