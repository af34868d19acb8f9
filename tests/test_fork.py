"""Fork a run at turn N (orchestrator/fork.py): the fork's history is the parent's as it stood
when turn N began, nothing before N runs again, its budget counts from what the parent had
spent, and the parent goes on untouched. Real workers, Redis and the scripted model."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator import ForkError, Status
from orchestrator.events import Forked, ForkWarning
from tests.conftest import ROOT
from tests.helpers import call, gate, tools, wait_for

STEPS = [
    tools(call("append_line", {"text": "a"})),
    tools(call("add", {"a": 1, "b": 2})),
    tools(call("append_line", {"text": "b"}), call("lookup", {"key": "k"})),
    {"content": "done"},
]


def folder(run_id: str) -> Path:
    return Path(os.environ["TOOLOOP_SANDBOX_ROOT"]) / run_id


def effects(run_id: str) -> list[str]:
    path = folder(run_id) / "effects.txt"
    return path.read_text().splitlines() if path.exists() else []


def events(store, run_id: str) -> list:
    return store.read_events(run_id, "0", count=1000)


@pytest.fixture(scope="module")
def parent(client, worker, model_server):
    """A 4-turn run: a non-idempotent effect at turns 1 and 3, 30 tokens a turn."""
    model = model_server.script(STEPS)
    data = {"prompt": "do the task", "model": model, "model_params": {"api_base": model_server.api_base},
            "tools": ["append_line", "add", "lookup"]}  # fmt: skip
    handle = client.submit(data)
    result = handle.wait(timeout=60)
    assert (result.status, result.iterations, result.tokens_used) == (Status.completed, 4, 120)
    assert effects(handle.run_id) == ["a", "b"]
    return handle, model


def turn_requests(model_server, model: str) -> list[list[dict]]:
    return [r["messages"] for r in model_server.turn_requests(model)]


def test_fork_at_the_first_turn_the_middle_and_after_the_last(client, store, parent, model_server):
    handle, model = parent
    before = handle.result()
    parent_requests = turn_requests(model_server, model)[:4]
    forks = {at: handle.fork(at=at) for at in (1, 3, 5)}
    results = {at: fork.wait(timeout=60) for at, fork in forks.items()}
    requests = turn_requests(model_server, model)[4:]
    for at, result in results.items():
        assert result.status == Status.completed and result.content == "done", (at, result)
        assert result.forked_from.model_dump() == {"run_id": handle.run_id, "iteration": at}
        # its budget counted from what the parent had spent before `at`; then 30 a turn
        ran = max(4, at) - at + 1
        assert result.tokens_used == 30 * (at - 1) + 30 * ran and result.iterations == at - 1 + ran
        # the calls before `at` are the parent's records (not run again), then its own
        kept = [r for r in before.tool_calls if r.iteration < at]
        assert result.tool_calls[: len(kept)] == kept
        first_turn = next(e for e in events(store, forks[at].run_id) if e.type == "iteration")
        assert first_turn.iteration == at and first_turn.tokens_used == 30 * at
    # the fork at 3 asked the model with the history the parent's turn 3 had, and no more
    assert parent_requests[2] in requests
    # after the last turn: the whole history, the final answer included
    fork5 = forks[5].run_id
    assert store.messages(fork5)[: len(store.messages(handle.run_id))] == store.messages(handle.run_id)
    # the parent is untouched
    assert handle.result() == before and effects(handle.run_id) == ["a", "b"]
    # no side effect repeated: each fork ran only its own turns' calls, in a fresh folder
    assert effects(forks[1].run_id) == ["a", "b"]
    assert effects(forks[3].run_id) == ["b"]
    assert effects(fork5) == [] and not folder(fork5).exists()
    # turns it cannot be made at are refused, and nothing is written
    runs = len(client.list(limit=1000))
    for at in (0, 6, -1):
        with pytest.raises(ForkError, match=r"a fork is made at 1\.\.5"):
            handle.fork(at=at)
    assert len(client.list(limit=1000)) == runs


def test_a_fork_says_where_it_came_from_and_warns_of_effects_it_did_not_repeat(store, parent):
    handle, _ = parent
    fork = handle.fork(at=3)
    fork.wait(timeout=60)
    kinds = {type(e) for e in events(store, fork.run_id)}
    assert {Forked, ForkWarning} <= kinds
    [forked] = [e for e in events(store, fork.run_id) if isinstance(e, Forked)]
    assert (forked.parent, forked.iteration, forked.model, forked.prompt_appended) == (
        handle.run_id, 3, None, False)  # fmt: skip
    [warning] = [e for e in events(store, fork.run_id) if isinstance(e, ForkWarning)]
    # lookup is idempotent: not warned of
    assert (warning.iteration, warning.calls, warning.tools) == (3, 2, "add,append_line")
    quiet = handle.fork(at=1)  # nothing ran before turn 1
    quiet.wait(timeout=60)
    assert not any(isinstance(e, ForkWarning) for e in events(store, quiet.run_id))


def test_fork_with_another_model_and_an_appended_instruction(store, parent, model_server):
    handle, model = parent
    before = (handle.result(), store.messages(handle.run_id))
    other = model_server.script([{"content": f"unused {i}"} for i in range(3)] + [{"content": "fini"}])
    fork = handle.fork(at=4, prompt_append="Say it in French.", model=other)
    result = fork.wait(timeout=60)
    assert (result.content, result.iterations, result.tokens_used) == ("fini", 4, 120)
    # the other model got the parent's turn-4 request, and the instruction after it
    [request] = model_server.turn_requests(other)
    parents = turn_requests(model_server, model)
    assert request["messages"][:-1] in parents and request["messages"][-1] == {
        "role": "user", "content": "Say it in French."}  # fmt: skip
    assert json.loads(store.redis.hget(store.keys.run(fork.run_id), "spec"))["model"] == other
    [forked] = [e for e in events(store, fork.run_id) if isinstance(e, Forked)]
    assert (forked.model, forked.prompt_appended) == (other, True)
    assert (handle.result(), store.messages(handle.run_id)) == before  # the parent: untouched
    with pytest.raises(ForkError, match="must not be blank"):
        handle.fork(at=2, prompt_append="  ")
    with pytest.raises(ForkError, match="names an endpoint outside") as refused:  # as at submit
        handle.fork(at=2, model="huggingface/https://attacker.example/m")
    assert refused.value.kind == "spec_refused"


def test_a_fork_of_a_running_parent_leaves_it_running(client, store, worker, model_server, holds):
    held = gate(holds)
    model = model_server.script([tools(call("add", {"a": 1, "b": 2})), {"content": "late", "hold": held}])
    parent = client.submit({"prompt": "do the task", "model": model, "tools": ["add"],
                            "model_params": {"api_base": model_server.api_base}})  # fmt: skip
    wait_for(lambda: len(model_server.calls(model)) == 2)  # turn 2 waits for the model
    assert parent.status() == Status.running
    other = model_server.script([{"content": "x"}, {"content": "early"}])
    fork = parent.fork(at=2, model=other)  # turn 2 has begun: its history is complete
    assert fork.wait(timeout=60).content == "early"
    assert parent.status() == Status.running and parent.result().iterations == 1
    with pytest.raises(ForkError, match=r"1\.\.2"):
        parent.fork(at=3)
    held.set()
    result = parent.wait(timeout=60)
    assert (result.content, result.tokens_used, result.iterations) == ("late", 60, 2)
    # a fork of the fork works, back past where the fork began
    grand = fork.fork(at=1)
    assert grand.wait(timeout=60).forked_from.run_id == fork.run_id


def test_fork_while_the_last_turns_calls_run_is_refused_at_the_next(client, worker, model_server):
    model = model_server.script([tools(call("sleepy", {"seconds": 3})), {"content": "ok"}])
    parent = client.submit({"prompt": "p", "model": model, "tools": ["sleepy"],
                            "model_params": {"api_base": model_server.api_base}})  # fmt: skip
    wait_for(lambda: parent.result().iterations == 1)
    with pytest.raises(ForkError, match="tool calls are still running"):
        parent.fork(at=2)
    parent.wait(timeout=60)


def test_fork_refused_for_another_tenant(client, store, parent, api):
    from orchestrator import Client
    from orchestrator.settings import Settings

    handle, _ = parent  # tenant "default"
    stranger = Client(settings=Settings(tenant="globex", key_prefix=store.keys.prefix), store=store)
    with pytest.raises(ForkError) as refused:
        stranger.fork(handle.run_id, at=2)
    assert refused.value.kind == "not_found"
    url = f"/api/runs/{handle.run_id}/fork"
    other = api.post(url, json={"at": 2}, headers={"Authorization": "Bearer tok-g"})
    assert other.status_code == 404
    bad = api.post(url, json={"at": 9}, headers={"Authorization": "Bearer tok-d"})
    assert bad.status_code == 400 and "1..5" in bad.json()["detail"]
    ok = api.post(url, json={"at": 2, "prompt_append": "again"}, headers={"Authorization": "Bearer tok-d"})
    assert ok.status_code == 201, ok.text
    body = ok.json()
    assert body["forked_from"] == {"run_id": handle.run_id, "iteration": 2} and body["status"] == "queued"
    assert client.get(body["run_id"]).wait(timeout=60).forked_from.iteration == 2


@pytest.fixture(scope="module")
def api():
    from fastapi.testclient import TestClient

    from orchestrator.api import create_app
    from orchestrator.settings import Settings

    with TestClient(create_app(Settings(api_tokens="tok-d=default,tok-g=globex"))) as http:
        yield http


def test_the_cli_forks_and_refuses_with_exit_2(parent, client):
    handle, _ = parent
    command = [sys.executable, "-m", "orchestrator.cli", "fork", handle.run_id]
    done = subprocess.run([*command, "--at", "4", "--json"], capture_output=True, text=True, cwd=ROOT,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert document["forked_from"] == {"run_id": handle.run_id, "iteration": 4}
    assert client.get(document["run_id"]).wait(timeout=60).content == "done"
    refused = subprocess.run([*command, "--at", "7", "--json"], capture_output=True, text=True, cwd=ROOT,
                             timeout=60)  # fmt: skip
    assert refused.returncode == 2 and json.loads(refused.stdout)["error"]["type"] == "refused"
    assert "1..5" in refused.stderr


def test_the_console_has_a_fork_button_on_each_turn(parent, client, store):
    from fastapi.testclient import TestClient

    from orchestrator.api import create_app
    from orchestrator.settings import Settings

    handle, _ = parent
    with TestClient(create_app(Settings(api_tokens="tok-d=default,tok-g=globex"))) as http:
        login = http.get("/login")
        nonce = re.search(r'name="nonce" value="([^"]+)"', login.text)[1]
        signed = http.post("/login", data={"token": "tok-d", "nonce": nonce}, follow_redirects=False)
        assert signed.status_code == 303
        page = http.get(f"/runs/{handle.run_id}").text
        assert all(f'data-testid="fork-{n}"' in page for n in range(1, 6))  # each turn, and after the last
        token = re.search(r'name="csrf-token" content="([^"]+)"', page)[1]
        as_json = {"Accept": "application/json"}
        refused = http.post(f"/runs/{handle.run_id}/fork", data={"at": "2"}, headers=as_json)
        assert refused.status_code == 403
        done = http.post(f"/runs/{handle.run_id}/fork", data={"at": "2", "csrf": token},
                         headers={"Accept": "application/json"})  # fmt: skip
        assert done.status_code == 200 and done.json()["location"] == f"/runs/{done.json()['run_id']}"
        fork = client.get(done.json()["run_id"])
        fork.wait(timeout=60)
        fork_page = http.get(f"/runs/{fork.run_id}").text
        assert 'data-testid="forked-from"' in fork_page and "were not idempotent" in fork_page
        bad = http.post(f"/runs/{handle.run_id}/fork", data={"at": "9", "csrf": token},
                        headers={"Accept": "application/json"})  # fmt: skip
        assert bad.status_code == 400 and "1..5" in bad.json()["message"]


def test_a_fork_before_a_compaction_gets_the_history_compaction_took_out(client, worker, store, model_server):
    from tests.test_compaction import counter

    model = model_server.script([counter(7, pad=800)])
    parent = client.submit({"prompt": "count", "model": model, "tools": ["count"], "context_tokens": 1000,
                            "model_params": {"api_base": model_server.api_base}})  # fmt: skip
    result = parent.wait(timeout=120)
    assert result.tokens_compaction > 0
    asked = [r["messages"] for r in model_server.turn_requests(model)]
    compacted_at = next(i for i, m in enumerate(asked, 1) if "[Summary" in json.dumps(m))
    at = compacted_at - 2  # before the compaction: the whole history, as turn `at` had it
    assert asked[at - 1][2] not in store.messages(parent.run_id)  # compacted away from the parent
    fork = parent.fork(at=at)
    assert fork.wait(timeout=120).content == "counted to 7"
    # its first request: the whole history turn `at` had, put back from the journal
    assert model_server.turn_requests(model)[len(asked)]["messages"] == asked[at - 1]


# -- without a worker: the journal's pieces, and the fork's script against CREATE --------------------
def test_history_at_puts_back_what_compaction_took_out():
    from orchestrator import journal

    system, task = {"role": "system", "content": "s"}, {"role": "user", "content": "t"}
    full = [system, task]
    for i in range(1, 6):
        full += [{"role": "assistant", "content": f"a{i}"}, {"role": "tool", "content": f"r{i}"}]
    # turn 4 compacted messages 2..5 (turns 1-2) into a summary, then turns 4 and 5 replied
    summary = {"role": "user", "content": "[Summary] turns 1-2"}
    now = [system, task, summary, *full[6:]]
    c = journal.Compaction(iteration=4, k=1, head=2, inserted=1, removed=full[2:6])
    kept = journal.Journal(compactions=[c])
    assert journal.undo(now, [c]) == full
    assert journal.history_at(now, kept, 2, last_reply=5) == full[:4]  # counted back from turn 5's reply
    assert journal.history_at(now, kept, 4, last_reply=5) == full[:8]  # turn 4's compaction put back
    assert journal.history_at(now, kept, 5, last_reply=5) == now[:7]  # compacted before turn 5 began
    assert journal.history_at(now, kept, 6, last_reply=5) == now  # after the last: all of it
    kept.turns[2] = {"start": 3}  # the entry's own word wins: where turn 2 began
    assert journal.history_at(now, kept, 2, last_reply=5) == full[:3]
    with pytest.raises(LookupError):
        journal.history_at(now, journal.Journal(), 2, last_reply=5)  # without the journal: gone


def test_request_digests_name_the_first_new_message_that_differs():
    from orchestrator import journal

    def request(calls_id: str, result: str, folder: str) -> dict:
        messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "t"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": calls_id, "function": {"name": "where", "arguments": "{}"}}]},
                    {"role": "tool", "tool_call_id": calls_id, "content": result},
                    {"role": "tool", "tool_call_id": calls_id,
                     "content": f"{folder}/run-1/x at 2024-01-02T03:04:05Z"}]
        return journal.request_info("openai/m", messages, "run-1")  # fmt: skip

    recorded = request("call_a", "5", "/tmp/root-a")
    assert journal.first_difference(recorded, request("call_b", "5", "/srv/root-b")) is None  # ids, folders
    assert [item["i"] for item in recorded["tail"]] == [2, 3, 4]  # since the last reply
    parted = journal.first_difference(recorded, request("call_a", "6", "/tmp/root-a"))
    assert parted == ({"message": 3, "role": "tool", "text": "5"},
                      {"message": 3, "role": "tool", "text": "6"})  # fmt: skip
    moved = {**recorded, "model": "openai/other", "digest": "y"}
    assert journal.first_difference(recorded, moved) == ({"model": "openai/m"}, {"model": "openai/other"})
    assert journal.first_difference(recorded, {**recorded, "digest": "x"}) is None  # the same messages
    longer = {**recorded, "n": 6, "digest": "x"}
    assert journal.first_difference(recorded, longer) == ({"messages": 5}, {"messages": 6})
    assert journal.first_difference(recorded, longer, new_only=True) is None
    steers = [{"role": "assistant", "content": "a"}, {"role": "tool", "content": "r"},
              {"role": "system", "content": "Guidance from your operator. It ...:\nbe brief\nreally"},
              {"role": "user", "content": "[supervisor] wrap up"}]  # fmt: skip
    assert journal.operator_steers(steers) == ["be brief\nreally"]


def test_a_fork_is_written_with_every_field_a_created_run_has(store):
    from orchestrator import RunSpec, fork
    from orchestrator.models import ForkedFrom

    spec = RunSpec(prompt="p", model="openai/m")
    store.create("fork-fields-created", spec, [{"role": "user", "content": "p"}])
    history = [{"role": "user", "content": "p"}]
    plan = fork.Plan(spec, history, 3, ForkedFrom(run_id="x", iteration=3), 60, 0.5)
    assert fork.write(store, "fork-fields-forked", plan)
    assert not fork.write(store, "fork-fields-forked", plan)  # an id is written once
    created = store.state("fork-fields-created")
    forked = store.state("fork-fields-forked")
    assert set(created) <= set(forked)
    assert (forked["iteration"], forked["tokens_used"], float(forked["cost_usd"])) == ("2", "60", 0.5)
    assert store.result("fork-fields-forked").forked_from == ForkedFrom(run_id="x", iteration=3)
