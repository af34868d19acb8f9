"""Child runs: a call of ``agent__<name>`` starts a run of its own, on any worker, whose
result is the call's output; budgets hold across the tree; pause and abort reach the
children; a killed worker loses nothing. Real workers, real Redis, the scripted model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from orchestrator import Status
from orchestrator.children import child_id
from orchestrator.client import load_spec
from orchestrator.keys import shard_of
from orchestrator.models import RunSpec
from orchestrator.validation import SpecError, check_spec
from tests.helpers import call, gate, redis_values, tools, wait_for


def child(model_server, steps, **fields) -> dict:
    """An inline child spec playing ``steps`` on the scripted model."""
    model = model_server.script(steps)
    return {"model": model, "model_params": {"api_base": model_server.api_base}, **fields}


def results(client, run_ids: list[str]) -> dict:
    return {r: client.get(r).result() for r in run_ids}


def console_page(client, run_id: str) -> str:
    """A run's page in the console, signed in with a token of the run's tenant."""
    import re

    from fastapi.testclient import TestClient

    from orchestrator.api import create_app
    from orchestrator.settings import Settings

    with TestClient(create_app(Settings(api_tokens="tok=default"), client)) as http:
        nonce = re.search(r'name="nonce" value="([^"]+)"', http.get("/login").text)[1]
        assert http.post("/login", data={"token": "tok", "nonce": nonce}).status_code in (200, 303)
        page = http.get(f"/runs/{run_id}")
        assert page.status_code == 200
        return page.text


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

    answer = {"content": '{"outcome": "found", "result": {"sum": 5}}'}
    researcher = child(model_server, [tools(call("add", {"a": 2, "b": 3})), answer], tools=["add"],
                       outcome={"enum": ["found", "none"]}, description="Adds numbers.")  # fmt: skip
    looper = child(model_server, [tools(call("add", {"a": 1, "b": 1}))], tools=["add"], max_iterations=1)
    s = spec([
        tools(call("agent__researcher", {"prompt": "add 2 and 3"}, call_id="c_r")),
        tools(call("agent__a", {"prompt": "go a"}, call_id="c_a"),
              call("agent__b", {"prompt": "go b"}, call_id="c_b")),
        tools(call("agent__looper", {"prompt": "loop"}, call_id="c_l"),
              call("agent__ghost", {"prompt": "boo"}, call_id="c_g")),  # not declared
        {"content": "all done"},
    ], agents={"researcher": researcher, "a": child(model_server, [meet("a", "b")]),
               "b": child(model_server, [meet("b", "a")]), "looper": looper})  # fmt: skip
    handle = client.submit(s)
    result = handle.wait(timeout=120)
    assert (result.status, result.content) == (Status.completed, "all done")
    r, a, b, loop, ghost = result.tool_calls
    assert (ghost.success, ghost.tool_name) == (False, "agent__ghost")
    assert ghost.error.startswith("UnknownTool")
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


PRICED = {"input_cost_per_token": 0.001, "output_cost_per_token": 0.002}  # 0.04 USD per 30-token reply


def test_children_share_what_is_left_of_the_parents_budgets(client, worker, spec, model_server):
    busy = [tools(call("add", {"a": i, "b": 1})) for i in range(10)]  # never answers by itself
    # two children at once, 60 tokens left when they start: each may spend at most that, and
    # the parent ends budget_exceeded at its next turn
    tokens = client.submit(spec([tools(call("agent__x", {"prompt": "x"}), call("agent__y", {"prompt": "y"})),
                                 {"content": "never"}], token_budget=90,
                                agents={"x": child(model_server, busy, tools=["add"]),
                                        "y": child(model_server, busy, tools=["add"], token_budget=500)}))
    # the cost budget likewise: $0.06 left of $0.10 after the parent's first reply
    priced = child(model_server, busy, tools=["add"])
    priced["model_params"].update(PRICED)
    cost = client.submit(spec([tools(call("agent__p", {"prompt": "p"})), {"content": "never"}],
                              model_params=PRICED, cost_budget_usd=0.1, agents={"p": priced}))
    # a parent whose own reply spent it all starts no child: a failed record
    spent = client.submit(spec([tools(call("agent__x", {"prompt": "x"}), tokens=100), {"content": "never"}],
                               token_budget=90, agents={"x": child(model_server, busy, tools=["add"])}))
    result = tokens.wait(timeout=120)
    assert (result.status, result.exit) == (Status.failed, "budget_exceeded")
    assert result.error_type == "BudgetExceeded"
    assert result.iterations == 1  # turn 2 ended at its top: the model was not asked again
    kids = list(results(client, result.children).values())
    assert len(kids) == 2 and all(k.exit == "budget_exceeded" for k in kids)
    for k in kids:
        assert client.store.spec(k.run_id).token_budget == 60  # what was left (y's own 500 is more)
        assert k.tokens_used <= 60  # no child spent past what was left when it started
    assert result.tokens_used == 30 + sum(k.tokens_used for k in kids)  # counted in, once
    assert 60 <= sum(k.tokens_used for k in kids) <= 60 + 30  # the tree stops at its next turn
    assert all(not r.success and "ended on budget_exceeded" in r.error for r in result.tool_calls)

    result = cost.wait(timeout=120)
    assert (result.exit, result.error_type) == ("budget_exceeded", "CostBudgetExceeded")
    [p] = results(client, result.children).values()
    assert client.store.spec(p.run_id).cost_budget_usd == pytest.approx(0.06)
    assert p.exit == "budget_exceeded" and p.cost_usd == pytest.approx(0.08)  # its second reply crossed it
    assert result.cost_usd == pytest.approx(0.04 + p.cost_usd)

    result = spent.wait(timeout=60)
    assert result.exit == "budget_exceeded" and result.children == []
    [refused] = result.tool_calls
    assert not refused.success
    assert refused.error.startswith("BudgetExceeded: nothing is left of the token budget")


def test_pause_and_abort_of_a_parent_reach_its_children(client, worker, spec, model_server, holds):
    # pause: the child pauses with its parent, and resumes with it
    hold = gate(holds)
    slow = child(model_server, [tools(call("add", {"a": 1, "b": 2}), hold=hold), {"content": "three"}],
                 tools=["add"])  # fmt: skip
    paused = client.submit(spec([tools(call("agent__slow", {"prompt": "add"})), {"content": "ok"}],
                                agents={"slow": slow}))  # fmt: skip
    wait_for(lambda: model_server.calls(slow["model"]), timeout=60)
    [kid] = paused.result().children
    page = console_page(client, paused.run_id)  # the console links the child, and the call to it
    assert page.count('data-testid="child-run"') == 1 and f'href="/runs/{kid}"' in page
    assert "waiting for its child run" in page
    waiting = lambda: int(client.store.state(paused.run_id).get("children_waiting") or 0)  # noqa: E731
    assert waiting() == 1  # what a scheduler reads: the run is parked on a child
    assert "waiting    for 1 child run(s)" in _cli("status", paused.run_id).stdout
    assert f'<a href="/runs/{paused.run_id}">' in console_page(client, kid)  # and the child its parent
    assert paused.pause() == "ok"
    assert client.get(kid).status() == Status.paused
    hold.set()  # its reply lands while paused: recorded, its call waits for the resume
    wait_for(lambda: any(e.type == "iteration" for e in client.get(kid).events(timeout=0.5)), timeout=30)
    assert client.get(kid).status() == Status.paused and paused.status() == Status.paused
    assert paused.resume() == "ok"
    result = paused.wait(timeout=60)
    assert (result.status, result.tool_calls[0].output) == (Status.completed, "three") and waiting() == 0

    # abort: at once, down the tree (a grandchild too), recorded on each
    hold = gate(holds)
    grand = child(model_server, [tools(call("add", {"a": 1, "b": 1}), hold=hold), {"content": "2"}],
                  tools=["add"])  # fmt: skip
    middle = child(model_server, [tools(call("agent__grand", {"prompt": "deeper"})), {"content": "done"}],
                   agents={"grand": grand})  # fmt: skip
    top = client.submit(spec([tools(call("agent__middle", {"prompt": "go"})), {"content": "ok"}],
                             agents={"middle": middle}))  # fmt: skip
    wait_for(lambda: model_server.calls(grand["model"]), timeout=60)
    [mid] = top.result().children
    [low] = client.get(mid).result().children
    assert top.abort(reason="enough") == "ok"
    for run_id in (mid, low):  # no wait: the abort's own step ended them
        r = client.get(run_id).result()
        assert (r.status, r.exit, r.error_type) == (Status.aborted, "aborted", "Aborted")
        assert f"its parent run {top.run_id if run_id == mid else mid} ended" in r.error
        control = [e for e in client.get(run_id).events(timeout=1) if e.type == "control"]
        assert [(e.action, e.by) for e in control][-1][0] == "abort"
    hold.set()  # the grandchild's reply in flight: discarded, and billed up the tree
    wait_for(lambda: client.get(low).result().tokens_used == 30, timeout=30)
    wait_for(lambda: top.result().tokens_used == 30 + 30 + 30, timeout=30)
    assert client.get(low).result().iterations == 0 and top.status() == Status.aborted

    # a child aborted on its own: its parent's call is a failed record, and the parent goes on
    hold = gate(holds)
    stuck = child(model_server, [{"content": "late", "hold": hold}])
    secret = "password=hunter2hunter2hunter2"  # a prompt the model wrote with a secret in it
    parent = client.submit(spec([tools(call("agent__stuck", {"prompt": f"wait; {secret}"})),
                                 {"content": "went on"}], agents={"stuck": stuck}))  # fmt: skip
    wait_for(lambda: model_server.calls(stuck["model"]), timeout=60)
    [kid] = parent.result().children
    seen = model_server.calls(stuck["model"])[0]["messages"][-1]["content"]
    assert seen.startswith("wait; password=") and "hunter2hunter2" not in seen  # masked, as a tool output
    stored = redis_values(client.store.redis, f"{client.store.keys.run(kid).rsplit(':', 1)[0]}:*")
    assert stored and not any(b"hunter2hunter2" in v for values in stored.values() for v in values)
    assert client.get(kid).abort(reason="not needed") == "ok"
    result = parent.wait(timeout=60)
    assert (result.status, result.content) == (Status.completed, "went on")
    [record] = result.tool_calls
    assert not record.success and record.error.startswith(f"ChildRun: child run {kid} ended on aborted: ")
    assert "not needed" in record.error
    hold.set()


# -- durability -------------------------------------------------------------------------------------
def test_a_killed_worker_and_a_redis_restart_mid_tree_lose_nothing(deployment, spec, model_server, aof_redis,
                                                                   holds):  # fmt: skip
    from worker.app import enqueue_call

    d = deployment(TOOLOOP_REDIS_URL=aof_redis.url)
    first = d.start_worker("-c", "2")
    one_held, two_held = gate(holds), gate(holds)
    one = child(model_server, [tools(call("add", {"a": 1, "b": 2}), hold=one_held), {"content": "three"}],
                tools=["add"])  # fmt: skip
    two = child(model_server, [{"content": "four", "hold": two_held}])
    handle = d.client.submit(spec([tools(call("agent__one", {"prompt": "1"}, call_id="c1")),
                                   tools(call("agent__two", {"prompt": "2"}, call_id="c2")),
                                   {"content": "done"}], agents={"one": one, "two": two}))  # fmt: skip
    # the child waits on the model, the parent on the child
    wait_for(lambda: model_server.calls(one["model"]), timeout=60)
    # the call's message delivered again (a redelivery, a re-check): the same child, parked again
    keys = d.store.keys
    payload = json.loads(d.store.redis.hget(keys.call_args(handle.run_id), "1.0"))
    gen = int(d.store.redis.hget(keys.call_state(handle.run_id), "1.0").decode().split("|")[3])
    for _ in range(2):
        enqueue_call(payload, gen, d.client.celery)
    d.start_worker("-c", "2")
    first.kill()  # kill -9 mid-child: its turn is lost with the worker, the parent's wait is not
    one_held.set()
    wait_for(lambda: model_server.calls(two["model"]), timeout=90)
    aof_redis.restart()  # mid-tree again, child two waiting on the model
    two_held.set()
    result = handle.wait(timeout=120)
    assert (result.status, result.content) == (Status.completed, "done")
    assert [(r.call_id, r.success, r.output) for r in result.tool_calls] == [("c1", True, "three"),
                                                                               ("c2", True, "four")]
    assert len(result.children) == 2 and len(d.store.list_runs(50)) == 3  # one child per call
    started = [e for e in handle.events(timeout=1) if e.type == "child"]
    assert [e.call_id for e in started] == ["c1", "c2"]
    first_child = d.client.get(result.children[0])
    assert first_child.result().tokens_used == 60  # its reply lost with the worker was never billed
    assert [e.step for e in first_child.events(timeout=1) if e.type == "recovery"] == ["turn"]
    assert result.tokens_used == 3 * 30 + 60 + 30


def test_a_turn_lost_before_it_started_its_child_is_made_good(client, worker, spec, model_server, store):
    """The parent's turn records its reply, then dies before starting the child (here: the
    test plays that turn, and stops there): the call's message was never sent, the sweeper
    finds it missing and sends it, and a tool worker starts the child."""
    import uuid

    from orchestrator.prompt import initial_messages
    from orchestrator.store import new_owner
    from worker.calls import stored_call

    kid = child(model_server, [{"content": "hello"}])
    s = RunSpec.model_validate(spec([tools(call("agent__kid", {"prompt": "hi"}, call_id="c1")),
                                     {"content": "done"}], agents={"kid": kid}))  # fmt: skip
    stored = check_spec(s, store).stored_spec
    run_id, owner = f"lost-{uuid.uuid4().hex[:8]}", new_owner()
    gen = store.create(run_id, stored, initial_messages(stored))  # no turn message: this test is the turn
    claim = store.claim_turn(run_id, 1, gen, owner)
    payload = stored_call(claim.spec, run_id, 1, 0, "c1", "agent__kid", '{"prompt": "hi"}', {})
    function = {"name": "agent__kid", "arguments": payload["arguments"]}
    asked = {"id": "c1", "type": "function", "function": function}
    reply = {"role": "assistant", "content": None, "tool_calls": [asked]}
    assert payload["agent"] == "kid"
    assert store.record_tool_calls(run_id, 1, owner, reply, 30, [payload]) == "dispatch"
    result = client.get(run_id).wait(timeout=90)  # the turn "died" here
    assert (result.status, result.content, result.tool_calls[0].output) == (Status.completed, "done", "hello")
    assert len(result.children) == 1 and [e.step for e in client.get(run_id).events(timeout=1)
                                          if e.type == "recovery"] == ["tool_calls"]  # fmt: skip


# -- at submit ------------------------------------------------------------------------------------
def test_a_cycle_and_a_too_deep_tree_are_refused_at_submit(tmp_path, client, store):
    (tmp_path / "a.yaml").write_text("prompt: plan\nmodel: openai/x\nagents:\n  helper: sub/b.yaml\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.yaml").write_text("model: openai/x\nagents:\n  back: ../a.yaml\n")
    out = _cli("submit", str(tmp_path / "a.yaml"))
    cycle = "agents.helper.agents.back: cycle of spec files: a.yaml -> b.yaml -> a.yaml"
    assert out.returncode == 2 and cycle in out.stderr, out.stderr
    assert _cli("validate", str(tmp_path / "a.yaml")).returncode == 1

    def nest(levels: int) -> dict:
        spec: dict = {"model": "openai/x"}
        for name in reversed("abcdefg"[:levels]):
            spec = {"model": "openai/x", "agents": {name: spec}}
        return spec

    before = len(client.list(1000))
    with pytest.raises(SpecError) as refused:
        client.submit({"prompt": "p", **nest(4)})
    assert refused.value.errors == [
        "agents.a.agents.b.agents.c.agents.d: a child run here would be at depth 4; max_depth allows 3"]
    with pytest.raises(SpecError) as refused:
        client.submit({"prompt": "p", "max_depth": 1, **nest(2)})
    assert refused.value.errors == [
        "agents.a.agents.b: a child run here would be at depth 2; max_depth allows 1"]
    assert len(client.list(1000)) == before  # nothing written
    assert check_spec(RunSpec(prompt="p", **nest(3)), None).errors == []


def test_each_child_spec_is_checked_as_if_submitted(tmp_path, store):
    from orchestrator.settings import Settings
    from orchestrator.store import RunStore

    agents_dir = tmp_path / "agents"
    (agents_dir / "team").mkdir(parents=True)
    (agents_dir / "team" / "coder.yaml").write_text("model: openai/x\ndescription: Codes.\ntools: [add]\n")
    (tmp_path / "elsewhere.yaml").write_text("model: openai/x\n")
    here = RunStore(store.redis, Settings(**{**store.settings.model_dump(), "agents_dir": str(agents_dir)}))
    ok = check_spec(RunSpec(prompt="p", model="openai/x", agents={"coder": "team/coder.yaml"}), here)
    assert ok.errors == []
    stored = ok.stored_spec.agents["coder"]
    assert stored["spec"]["tools"] == ["add"] and stored["source"] == str(agents_dir / "team" / "coder.yaml")
    assert "prompt" not in stored["spec"]
    bad = RunSpec(prompt="p", model="openai/x", tenant="acme", agents={
        "outside": str(tmp_path / "elsewhere.yaml"),  # not in the agents folder, nor the spec's
        "asks": {"model": "openai/x", "prompt": "mine"},
        "other": {"model": "openai/x", "tenant": "globex"},
        "typo": {"model": "openai/x", "toolz": []},
        "leaky": {"model": "openai/x", "model_params": {"api_base": "http://10.0.0.1/v1"}},
        "missing": "team/nope.yaml",
        "probe": "/etc/passwd",  # outside: said before looking whether it exists
    })  # fmt: skip
    errors = check_spec(bad, here).errors
    outside = f"agents.outside: {str(tmp_path / 'elsewhere.yaml')!r} resolves outside {agents_dir}"
    assert any(e.startswith(outside) for e in errors)
    assert "agents.asks.prompt: a child spec has no prompt: each call of agent__asks gives it" in errors
    assert "agents.other.tenant: a child run runs for its parent's tenant ('acme')" in errors
    assert "agents.typo.toolz: unknown field" in errors
    assert any(e.startswith("agents.leaky.model_params.api_base: 'http://10.0.0.1/v1'") for e in errors)
    assert any(e.startswith("agents.missing: spec file 'team/nope.yaml' not found") for e in errors)
    assert "agents.probe: '/etc/passwd' resolves outside " + str(agents_dir) in errors
    assert len(errors) == 7
    with pytest.raises(ValueError, match="agent__x"):
        RunSpec(prompt="p", model="m", tools=["agent__x"])
    with pytest.raises(ValueError, match="agent names"):
        RunSpec(prompt="p", model="m", agents={"a.b": {"model": "m"}})


def test_a_spec_file_reads_its_children_beside_it(tmp_path):
    (tmp_path / "plan.yaml").write_text("prompt: p\nmodel: openai/x\nagents:\n  r: researcher.yaml\n")
    (tmp_path / "researcher.yaml").write_text("model: openai/y\nmax_depth: 5\n")
    from tests.conftest import ROOT

    assert check_spec(load_spec(ROOT / "examples" / "planner.yaml"), None).errors == []
    report = check_spec(load_spec(tmp_path / "plan.yaml"), None)
    assert report.errors == []
    assert report.stored_spec.agents["r"]["spec"]["model"] == "openai/y"
    assert report.stored_spec.agents["r"]["spec"]["max_depth"] == 2  # what is left under the root's 3
    again = check_spec(report.stored_spec, None)  # a stored spec submitted again (a fork)
    assert again.errors == [] and again.stored_spec.agents == report.stored_spec.agents


def test_child_ids_are_stable_readable_and_in_the_parents_shard():
    assert child_id("run1", "2.0") == child_id("run1", "2.0") != child_id("run1", "2.1")
    assert child_id("run1", "2.0").startswith("run1-2-0-")
    long = "x" * 64
    for parent in ("run1", long, child_id(long, "1.0")):
        made = child_id(parent, "12.31")
        assert shard_of(made) == shard_of(parent) and len(made) <= 64


def test_start_child_writes_every_field_create_writes():
    """A child run is written by START_CHILD, a run by CREATE: the same fields (a field
    added to CREATE must be added there too)."""
    import re

    from orchestrator import children, scripts

    def fields(script: str) -> set[str]:
        hset = re.search(r"redis\.call\('HSET', C?RUN, (.*?)\)\n", script, re.S).group(1)
        return set(re.findall(r"'([a-z_]+)'", hset))

    assert fields(scripts.CREATE) <= fields(children.START_CHILD)
