"""Typed progress events (orchestrator/events.py): one class per type the store writes, typed
fields, the same JSON over the API, and readers that survive an event they do not know."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime

from orchestrator import Status, approvals, children, fork, scripts
from orchestrator import events as ev
from orchestrator.views import event_line
from tests.helpers import gate

TS = "1700000000123"  # ms since the epoch, as the Lua scripts write it
WHEN = datetime(2023, 11, 14, 22, 13, 20, 123000, tzinfo=UTC)

# Each type's fields as the Lua scripts write them (strings), and what the reader gets.
SAMPLES: dict[str, tuple[dict[str, str], dict[str, object]]] = {
    "queued": ({}, {}),
    "iteration": ({"iteration": "3", "tool_calls": "2", "tokens_used": "90", "corrected": "1",
                   "cost_usd": "0.0012"},
                  {"iteration": 3, "tool_calls": 2, "tokens_used": 90, "corrected": True,
                   "cost_usd": 0.0012}),
    "tool_call": ({"iteration": "3", "tool": "add", "success": "0"},
                  {"iteration": 3, "tool": "add", "success": False}),
    "control": ({"action": "steer_applied", "count": "2"},
                {"action": "steer_applied", "count": 2, "by": None}),
    "supervisor": ({"rule": "judge", "action": "none", "iteration": "4", "verdict": "error",
                    "error_type": "Timeout"},
                   {"rule": "judge", "iteration": 4, "verdict": "error", "error_type": "Timeout"}),
    "recovery": ({"step": "turn", "iteration": "2", "lost_since": TS},
                 {"step": "turn", "iteration": 2, "lost_since": WHEN, "count": None}),
    "discarded": ({"iteration": "2", "tokens": "30", "tokens_used": "60"},
                  {"iteration": 2, "tokens": 30, "tokens_used": 60}),
    "compaction": ({"iteration": "9", "before": "52", "after": "23", "reason": "threshold",
                    "fallback": "0", "tokens_used": "400"},
                   {"before": 52, "after": 23, "fallback": False, "tokens_used": 400}),
    "rate_limited": ({"iteration": "1", "wait_ms": "1500"}, {"iteration": 1, "wait_ms": 1500}),
    "text": ({"iteration": "2", "text": "12"}, {"iteration": 2, "text": "12"}),  # text stays text
    "waiting": ({"reason": "waiting_share"}, {"reason": "waiting_share"}),
    "admitted": ({"waited_ms": "2500"}, {"waited_ms": 2500}),
    "approval": ({"iteration": "1", "call_id": "c1", "tool": "deploy", "decision": "pending",
                  "arguments": '{"a": 1}', "deadline": TS},
                 {"iteration": 1, "decision": "pending", "arguments": '{"a": 1}', "deadline": WHEN}),
    "child": ({"iteration": "1", "call_id": "c1", "agent": "researcher", "child": "r1-1-0-3"},
              {"iteration": 1, "call_id": "c1", "agent": "researcher", "child": "r1-1-0-3"}),
    "forked": ({"parent": "r1", "iteration": "3", "by": "cli:me", "prompt_appended": "1",
                "model": "openai/x"},
               {"parent": "r1", "iteration": 3, "by": "cli:me", "prompt_appended": True,
                "model": "openai/x"}),
    "fork_warning": ({"iteration": "3", "calls": "2", "tools": "add,append_line"},
                     {"iteration": 3, "calls": 2, "tools": "add,append_line"}),
    "outcome": ({"iteration": "2", "exit": "default", "status": "completed"},
                {"iteration": 2, "exit": "default", "status": Status.completed}),
}  # fmt: skip


def written_kinds() -> set[str]:
    """Every event type the Lua scripts write (``event('<type>', ...)``; approvals have one;
    a child's start and a fork's script write their own)."""
    scripts_lua = [*vars(scripts).values(), children.START_CHILD, fork.WRITE]
    lua = "\n".join(v for v in scripts_lua if isinstance(v, str))
    kinds = set(re.findall(r"\bevent\('([a-z_]+)'", lua))
    assert "'type', 'approval'" in approvals._COMMON
    return kinds | {"approval"}


def test_every_written_type_has_a_class_with_typed_fields():
    assert written_kinds() == set(ev.KINDS) == set(SAMPLES)
    for kind, (fields, expected) in SAMPLES.items():
        event = ev.parse("1700000000123-0", {"type": kind, "ts": TS, **fields})
        assert type(event) is ev.KINDS[kind] and isinstance(event, ev.Event), kind
        assert (event.id, event.type, event.ts) == ("1700000000123-0", kind, WHEN)
        got = {name: getattr(event, name) for name in expected}
        assert got == expected and all(type(got[k]) is type(v) for k, v in expected.items()), kind
        # the API's JSON: numbers as numbers, booleans as booleans; it reads back the same
        data = json.loads(json.dumps(event.model_dump(mode="json")))
        assert ev.validate(data) == event, kind
        assert all(data[k] == v for k, v in expected.items() if isinstance(v, int | bool)), kind


def test_unknown_or_misfit_events_reach_readers_as_plain_events(client, worker, spec, store, holds):
    from fastapi.testclient import TestClient

    from orchestrator.api import create_app

    release = gate(holds)
    handle = client.submit(spec([{"content": "done", "hold": release}]))
    stream = store.keys.events(handle.run_id)
    # a newer worker's event type, and a known type whose fields a newer worker changed
    store.redis.xadd(stream, {"type": "from_the_future", "ts": TS, "answer": "42"})
    misfit = {"type": "tool_call", "ts": TS, "iteration": "soon", "tool": "x", "success": "1"}
    store.redis.xadd(stream, misfit)
    release.set()
    assert handle.wait(timeout=30).status == "completed"

    seen = list(handle.events(timeout=10))
    assert [e.type for e in seen] == ["queued", "from_the_future", "tool_call", "iteration", "outcome"]
    future, misfit = seen[1], seen[2]
    assert type(future) is ev.Event and future.answer == "42" and future.ts == WHEN
    assert type(misfit) is ev.Event and misfit.iteration == "soon"  # kept as it came, not dropped
    assert isinstance(seen[-1], ev.Outcome) and seen[-1].iteration == 1
    # `tooloop watch` prints them; the API streams them to the end
    assert event_line(future) == "from_the_future answer=42"
    settings = client.store.settings.model_copy(update={"api_tokens": "tok-ev=default"})
    with TestClient(create_app(settings, client=client)) as http:
        reply = http.get(f"/api/runs/{handle.run_id}/events", headers={"Authorization": "Bearer tok-ev"})
    assert reply.status_code == 200, reply.text
    data = [json.loads(line[len("data: "):]) for line in reply.text.splitlines() if line.startswith("data: ")]
    assert [d["type"] for d in data] == [e.type for e in seen]
    assert data[1] == {"id": future.id, "type": "from_the_future", "ts": "2023-11-14T22:13:20.123000Z",
                       "answer": "42"}  # fmt: skip
    assert [ev.validate(d) for d in data] == seen
