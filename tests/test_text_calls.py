"""Tool calls written as text: the parser against recorded replies, then whole runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator import Status
from worker import textcalls

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
