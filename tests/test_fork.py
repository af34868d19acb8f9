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

import httpx
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
        first_turn = [e for e in events(store, forks[at].run_id) if e.type == "iteration"][0]
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
    assert (warning.iteration, warning.calls, warning.tools) == (3, 2, "add,append_line")  # lookup: idempotent
    quiet = handle.fork(at=1)  # nothing ran before turn 1
    quiet.wait(timeout=60)
    assert not any(isinstance(e, ForkWarning) for e in events(store, quiet.run_id))
