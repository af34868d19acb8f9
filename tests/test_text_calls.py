"""Tool calls written as text: the parser against recorded replies, then whole runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator import Status
from orchestrator.models import RunSpec
from worker import steps, textcalls

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "text_tool_calls.json").read_text())


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=lambda c: c["id"])
def test_recorded_reply(case):
    parsed = textcalls.parse(case["reply"], FIXTURE["tools"])
    got = [{"name": c.name, "arguments": json.loads(c.arguments)} for c in parsed.calls]
    assert got == case["calls"]
    assert parsed.attempted is case["attempted"]
    if "remainder" in case:
        assert parsed.remainder == case["remainder"]
    if parsed.attempted:
        assert parsed.problem and parsed.problem in textcalls.correction(parsed, FIXTURE["tools"])


def test_no_tools_means_no_text_calls():
    reply = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    parsed = textcalls.parse(reply, [])
    assert parsed.calls == [] and not parsed.attempted


def test_text_call_runs_the_tool(client, worker, spec, model_server):
    reply = 'Adding.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    s = spec([{"content": reply}, {"content": "5"}], tools=["add"])
    result = client.submit(s).wait(timeout=30)
    assert (result.status, result.content) == (Status.completed, "5")
    [record] = result.tool_calls
    assert (record.tool_name, record.inputs, record.output) == ("add", {"a": 2, "b": 3}, 5)
    # the model's next request carries the call as a native one, answered by a tool message
    history = model_server.calls(s["model"])[1]["messages"]
    assistant, tool_message = history[-2], history[-1]
    assert assistant["content"] == "Adding." and assistant["tool_calls"][0]["id"] == record.call_id
    assert assistant["tool_calls"][0]["function"]["name"] == "add"
    assert tool_message == {"role": "tool", "tool_call_id": record.call_id, "content": "5"}


def test_unparsable_attempt_is_corrected_twice_then_final(client, worker, spec, model_server):
    broken = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": }</tool_call>'
    s = spec([{"content": broken}, {"content": broken}, {"content": broken}], tools=["add"])
    result = client.submit(s).wait(timeout=30)
    assert (result.status, result.exit, result.iterations) == (Status.completed, "default", 3)
    assert result.content == broken and result.tool_calls == []
    requests = model_server.calls(s["model"])
    assert len(requests) == 3
    for request in requests[1:]:
        note = request["messages"][-1]
        assert note["role"] == "user" and "could not be read" in note["content"]
        assert "Available tools: add" in note["content"]
    assert sum("could not be read" in (m.get("content") or "") for m in requests[2]["messages"]) == 2


def test_native_calls_win_over_calls_written_as_text():
    spec = RunSpec(prompt="x", model="m", tools=["add", "mul"])
    text = '<tool_call>{"name": "mul", "arguments": {"a": 2, "b": 3}}</tool_call>'
    native = {"id": "call_n", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    decision = steps.decide({"content": text, "tool_calls": [native]}, spec, iteration=0)
    assert isinstance(decision, steps.RunTools)
    assert [(c.call_id, c.name) for c in decision.calls] == [("call_n", "add")]


def test_a_declared_http_tool_may_be_called_as_text():
    http = {"name": "get_item", "description": "Read one item.", "url": "http://127.0.0.1:9/items/{id}",
            "parameters": {"type": "object", "properties": {"id": {"type": "integer"}}},
            "allow_hosts": ["127.0.0.1:9"]}  # fmt: skip
    spec = RunSpec(prompt="x", model="m", tools=["add"], http_tools=[http])
    reply = '<tool_call>{"name": "get_item", "arguments": {"id": 7}}</tool_call>'
    decision = steps.decide({"content": reply}, spec, iteration=2)
    assert isinstance(decision, steps.RunTools)
    assert [(c.name, json.loads(c.arguments)) for c in decision.calls] == [("get_item", {"id": 7})]
    broken = '<tool_call>{"name": "get_item", "arguments": {"id": }</tool_call>'
    correction = steps.decide({"content": broken}, spec, iteration=2)
    assert isinstance(correction, steps.Correct) and "Available tools: add, get_item" in correction.text
