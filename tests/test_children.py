"""Child runs: a call of ``agent__<name>`` starts a run of its own, on any worker, whose
result is the call's output; budgets hold across the tree; pause and abort reach the
children; a killed worker loses nothing. Real workers, real Redis, the scripted model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from orchestrator import Status
from orchestrator.children import Lineage, child_id, tree
from orchestrator.client import load_spec
from orchestrator.keys import shard_of
from orchestrator.models import RunSpec
from orchestrator.validation import SpecError, check_spec
from tests.helpers import call, gate, tools, wait_for


def child(model_server, steps, **fields) -> dict:
    """An inline child spec playing ``steps`` on the scripted model."""
    return {"model": model_server.script(steps), "model_params": {"api_base": model_server.api_base}, **fields}


def results(client, run_ids: list[str]) -> dict:
    return {r: client.get(r).result() for r in run_ids}


def _cli(*args: str, cwd: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env=os.environ.copy())  # fmt: skip


# -- the loop ------------------------------------------------------------------------------------
def test_one_child_then_two_in_parallel_then_a_failing_one(client, worker, spec, model_server):
    met = {"a": threading.Event(), "b": threading.Event()}

    def meet(me: str, other: str):
        def step(request: dict) -> dict:  # answers only once the other child's model call came
            met[me].set()
            return {"content": f"{me} met {other}" if met[other].wait(60) else f"{me} alone"}

        return step

    researcher = child(model_server, [tools(call("add", {"a": 2, "b": 3})),
                                      {"content": '{"outcome": "found", "result": {"sum": 5}}'}],
                       tools=["add"], outcome={"enum": ["found", "none"]}, description="Adds numbers.")  # fmt: skip
    looper = child(model_server, [tools(call("add", {"a": 1, "b": 1}))], tools=["add"], max_iterations=1)
    s = spec([
        tools(call("agent__researcher", {"prompt": "add 2 and 3"}, call_id="c_r")),
        tools(call("agent__a", {"prompt": "go a"}, call_id="c_a"), call("agent__b", {"prompt": "go b"}, call_id="c_b")),
        tools(call("agent__looper", {"prompt": "loop"}, call_id="c_l")),
        {"content": "all done"},
    ], agents={"researcher": researcher, "a": child(model_server, [meet("a", "b")]),
               "b": child(model_server, [meet("b", "a")]), "looper": looper})  # fmt: skip
    handle = client.submit(s)
    result = handle.wait(timeout=120)
    assert (result.status, result.content) == (Status.completed, "all done")
    r, a, b, loop = result.tool_calls
    assert (r.call_id, r.tool_name, r.success, r.output) == ("c_r", "agent__researcher", True, {"sum": 5})
    assert r.inputs == {"prompt": "add 2 and 3"}
    assert (a.output, b.output) == ("a met b", "b met a")  # both ran at once
    assert (loop.success, loop.output) == (False, None)
    assert loop.error.startswith("ChildRun: child run ") and "ended on max_iterations" in loop.error
    # the tree: four children, each naming its parent and call, in the parent's shard
    assert len(result.children) == 4 == len(set(result.children))
    kids = results(client, result.children)
    by_call = {k.parent.call_id: k for k in kids.values()}
    assert {k.parent.run_id for k in kids.values()} == {handle.run_id}
    assert set(by_call) == {"c_r", "c_a", "c_b", "c_l"}
    assert all(shard_of(k) == shard_of(handle.run_id) for k in result.children)
    assert by_call["c_l"].exit == "max_iterations" and by_call["c_r"].exit == "found"
    # spend: each child's replies, and the parent's own, counted once into the parent
    assert [by_call[c].tokens_used for c in ("c_r", "c_a", "c_b", "c_l")] == [60, 30, 30, 30]
    assert result.tokens_used == 4 * 30 + 150
    # the model was offered the agents as tools and read the children's answers
    seen = model_server.calls(s["model"])
    offered = {t["function"]["name"]: t["function"] for t in seen[0]["tools"]}
    assert offered["agent__researcher"]["description"] == "Adds numbers."
    assert offered["agent__a"]["parameters"]["required"] == ["prompt"]
    fed = {m["tool_call_id"]: m["content"] for m in seen[3]["messages"] if m["role"] == "tool"}
    assert fed["c_r"] == '{"sum": 5}' and fed["c_a"] == "a met b"
    assert fed["c_l"].startswith("Error: ChildRun: child run ")
    # the child's prompt is the call's, under its own system prompt
    first = model_server.calls(researcher["model"])[0]["messages"]
    assert first[-1] == {"role": "user", "content": "add 2 and 3"} and first[0]["role"] == "system"
    # status shows the tree; watch the child events
    shown = _cli("status", handle.run_id).stdout
    assert all(k in shown for k in result.children) and "researcher  completed (found)" in shown
    watched = _cli("watch", handle.run_id).stdout
    assert f"turn 1 child researcher run={by_call['c_r'].run_id} call=c_r" in watched
