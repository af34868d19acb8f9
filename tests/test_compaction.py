"""Context compaction: thresholds, where the cut falls, the summary call, its fallback,
the context-window retry, and a 200-turn run that stays within its context budget."""

from __future__ import annotations

import json
import threading
from typing import Any

from orchestrator import RunSpec, Status
from orchestrator.events import Compaction
from tests.helpers import gate, redis_values, wait_for
from worker import compaction, llm

SYSTEM = {"role": "system", "content": "be useful"}
TASK = {"role": "user", "content": "the task"}


def turn(i: int, calls: int = 1) -> list[dict[str, Any]]:
    """One tool turn: the assistant's calls, then one result per call."""
    ids = [f"c{i}_{j}" for j in range(calls)]
    assistant = {"role": "assistant", "content": None, "tool_calls": [
        {"id": cid, "type": "function", "function": {"name": "count", "arguments": "{}"}} for cid in ids]}
    return [assistant, *({"role": "tool", "tool_call_id": cid, "content": str(i)} for cid in ids)]


def history(turns: int, calls: int = 1) -> list[dict[str, Any]]:
    out = [SYSTEM, TASK]
    for i in range(turns):
        out += turn(i, calls)
    return out


def pairs_intact(messages: list[dict[str, Any]]) -> bool:
    """Every tool result follows the assistant message that called it, and every call has its result."""
    open_ids: set[str] = set()
    for message in messages:
        if message["role"] == "tool":
            if message["tool_call_id"] not in open_ids:
                return False
            open_ids.discard(message["tool_call_id"])
        else:
            if open_ids:
                return False
            open_ids = {c["id"] for c in message.get("tool_calls") or []}
    return not open_ids


# -- pure ------------------------------------------------------------------------------------
def test_threshold_is_more_than_50_non_system_messages():
    spec = RunSpec(prompt="x", model="openai/unknown-model")
    assert not compaction.needed(history(24), spec)  # 1 + 48 non-system
    assert compaction.needed(history(25), spec)  # 51
    small = RunSpec(prompt="x", model="openai/unknown-model", context_tokens=1000)
    assert compaction.needed([SYSTEM, TASK, {"role": "user", "content": "w" * 4100}], small)


def test_split_keeps_head_recent_and_whole_tool_groups():
    messages = history(30, calls=3)  # 4 messages per turn
    steer = {"role": "system", "content": "operator says hi"}
    messages.insert(40, steer)
    cut = compaction.split(messages)
    assert cut.head == 2 and steer in cut.kept and steer not in cut.middle
    tail = messages[cut.start :]
    assert 20 <= len(tail) <= 23 and tail[0]["role"] == "assistant"
    assert pairs_intact(messages[: cut.head] + tail)
    assert compaction.split(history(5)) is None  # nothing between head and the recent 20


def test_fewer_recent_messages_kept_when_they_alone_pass_the_budget():
    spec = RunSpec(prompt="x", model="openai/unknown-model", context_tokens=1200)
    small = history(30)
    assert compaction.keep_for(small, spec) == compaction.KEEP_RECENT
    large = [SYSTEM, TASK] + [{"role": "user", "content": "w" * 400} for _ in range(30)]  # ~100 tokens each
    keep = compaction.keep_for(large, spec)
    assert keep == 5 and llm.estimate_tokens(large[-keep:]) + compaction.SUMMARY_MAX_CHARS // 4 < 1200
    assert compaction.keep_for(large, RunSpec(prompt="x", model="openai/unknown-model")) == 20  # no budget


def test_transcript_is_capped():
    text = compaction.transcript(history(400)[2:])
    assert len(text) <= compaction.SOURCE_MAX_CHARS and "characters cut" in text
    assert text.startswith("assistant:") and "-> count({})" in text


# -- whole runs ----------------------------------------------------------------------------------
def counter(goal: int, pad: int = 0):
    """A scripted step that counts with the `count` tool until `goal`, whatever the history
    looks like (compaction removes the turns a step index would be counted from)."""

    def step(request: dict[str, Any]) -> dict[str, Any]:
        last = request["messages"][-1]
        n = json.loads(last["content"])["n"] if last["role"] == "tool" else 0
        if n >= goal:
            return {"content": f"counted to {n}"}
        return {"tool_calls": [{"name": "count", "arguments": {"n": n, "pad": pad}}]}

    return step


def compactions(store, run_id: str) -> list[Compaction]:
    return [e for e in store.read_events(run_id, "0", count=10_000) if isinstance(e, Compaction)]


def test_summary_call_made_and_pairs_intact(client, worker, spec, model_server, store):
    s = spec([counter(30)], tools=["count"], max_iterations=40)
    summary = {"content": "SUMMARY-OF-EARLY-TURNS", "tokens": 11}
    model_server.summaries[s["model"].removeprefix("openai/")] = summary
    run = client.submit(s)
    result = run.wait(timeout=120)
    assert (result.status, result.content) == (Status.completed, "counted to 30")
    summaries = model_server.summary_requests(s["model"])
    assert len(summaries) == 1
    source = summaries[0]["messages"][1]["content"]
    assert len(source) <= compaction.SOURCE_MAX_CHARS and "-> count(" in source
    [event] = compactions(store, run.run_id)
    assert (event.reason, event.fallback, event.before) == ("threshold", False, 52)
    assert event.after == 23  # system, task, summary, the 20 most recent
    turns = model_server.turn_requests(s["model"])
    after = [r for r in turns if any("SUMMARY-OF-EARLY" in str(m.get("content")) for m in r["messages"])]
    assert after and all(pairs_intact(r["messages"][2:]) for r in turns)
    assert after[0]["messages"][:2] == turns[0]["messages"][:2]  # system prompt and task kept
    assert (result.tokens_compaction, result.tokens_used) == (11, 31 * 30 + 11)
    assert len(store.messages(run.run_id)) < 40


def test_failed_summary_falls_back_to_a_cut_transcript(client, worker, spec, model_server, store):
    s = spec([counter(27)], tools=["count"], max_iterations=40, model_params={"num_retries": 0})
    model_server.summaries[s["model"].removeprefix("openai/")] = {"status": 500, "error": "summariser down"}
    run = client.submit(s)
    result = run.wait(timeout=120)
    assert result.status == Status.completed and result.tokens_compaction == 0
    [event] = compactions(store, run.run_id)
    assert event.fallback is True
    summary = next(m for m in store.messages(run.run_id) if str(m.get("content")).startswith("[Summary"))
    assert "assistant:" in summary["content"] and "tool:" in summary["content"]
    assert len(summary["content"]) <= compaction.SUMMARY_MAX_CHARS + 100


def test_context_window_exceeded_trims_and_retries_once(client, worker, spec, model_server, store):
    too_long = {"status": 400, "error": "This model's maximum context length is 8192 tokens. However, "
                "your messages resulted in 9000 tokens.", "code": "context_length_exceeded"}  # fmt: skip
    counting = counter(99)

    def step(request: dict[str, Any]) -> dict[str, Any]:
        last = request["messages"][-1]
        if last["role"] == "tool" and json.loads(last["content"])["n"] == 8:
            return {"content": "fits now", "fail": [too_long]}
        return counting(request)

    s = spec([step], tools=["count"])
    run = client.submit(s)
    result = run.wait(timeout=120)
    assert (result.status, result.content) == (Status.completed, "fits now")
    [event] = compactions(store, run.run_id)
    assert event.reason == "context_window"
    refused, retried = model_server.turn_requests(s["model"])[-2:]
    assert len(retried["messages"]) < len(refused["messages"]) and pairs_intact(retried["messages"][2:])


def test_compaction_tokens_count_toward_the_token_budget(client, worker, spec, model_server, store):
    s = spec([counter(30)], tools=["count"], max_iterations=40, token_budget=2000)
    model_server.summaries[s["model"].removeprefix("openai/")] = {"content": "short", "tokens": 1500}
    run = client.submit(s)
    result = run.wait(timeout=120)
    # 25 turns cost 750 tokens; the summary's 1500 spend the budget before turn 26 calls the model
    assert (result.exit, result.error_type) == ("budget_exceeded", "BudgetExceeded")
    assert (result.tokens_compaction, result.tokens_used) == (1500, 25 * 30 + 1500)
    assert len(model_server.turn_requests(s["model"])) == 25 and len(compactions(store, run.run_id)) == 1


class HistoryWatcher(threading.Thread):
    """Reads the run's messages key in Redis while the run goes on: its largest estimate."""

    def __init__(self, store, run_id: str) -> None:
        super().__init__(daemon=True)
        self.store, self.run_id, self.largest, self.reads = store, run_id, 0, 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.01):  # runs are fast now: >100 looks over 200 turns
            kept = self.store.messages(self.run_id)
            self.largest = max(self.largest, llm.estimate_tokens(kept))
            self.reads += 1


def test_200_turn_run_stays_within_its_context_budget(client, worker, spec, model_server, store):
    budget = 2500
    s = spec([counter(200, pad=300)], tools=["count"], max_iterations=205, context_tokens=budget)
    run = client.submit(s)
    watcher = HistoryWatcher(store, run.run_id)
    watcher.start()
    result = run.wait(timeout=900)
    watcher.done.set()
    watcher.join()
    assert (result.status, result.content, result.iterations) == (Status.completed, "counted to 200", 201)
    turns = model_server.turn_requests(s["model"])
    assert len(turns) == 201
    sizes = [llm.estimate_tokens(r["messages"]) for r in turns]
    assert max(sizes) <= budget, max(sizes)  # every prompt the model got
    assert all(pairs_intact(r["messages"][2:]) for r in turns)
    events = compactions(store, run.run_id)
    assert len(events) >= 10 and result.tokens_compaction == 30 * len(events)
    assert result.tokens_used == 201 * 30 + result.tokens_compaction
    # what Redis held, read all along the run: one turn's reply and result past the budget at most
    assert watcher.reads > 100 and watcher.largest <= budget + 200, watcher.largest
    [kept] = redis_values(store.redis, store.keys.messages(run.run_id)).values()
    # JSON framing adds to the content the estimate counts; 200 turns uncompacted would be ~90 KB
    assert sum(len(m) for m in kept) <= 6 * budget


def test_compaction_of_a_history_no_longer_ours_is_refused_but_billed(client, worker, spec, store, holds):
    release = gate(holds)
    run = client.submit(spec([{"content": "done", "hold": release}]))
    wait_for(lambda: store.state(run.run_id).get("turn_claimed") == "1", timeout=30)
    n = len(store.messages(run.run_id))
    summary = [json.dumps({"role": "user", "content": "[Summary]"})]
    # another delivery changed the history meanwhile, or the turn is not the one claimed
    assert store.compact(run.run_id, 1, n + 3, 1, 1, summary, 7, 0.0, "threshold", False) == "stale"
    assert store.compact(run.run_id, 2, n, 1, 1, summary, 7, 0.0, "threshold", False) == "stale"
    assert len(store.messages(run.run_id)) == n and compactions(store, run.run_id) == []
    release.set()
    result = run.wait(timeout=30)
    assert (result.tokens_compaction, result.tokens_used) == (14, 30 + 14)  # spent all the same
    assert store.compact(run.run_id, 2, n + 1, 1, 1, summary, 7, 0.0, "threshold", False) == "ended"
    assert store.result(run.run_id).tokens_compaction == 21


# -- issue 22, item 10: every model call of a turn within its lease --------------------------
def test_slow_model_calls_around_a_compaction_keep_the_turns_lease(client, worker, spec, model_server, store):
    """A turn whose reply is refused (context window), compacted with a slow summary, then
    answered slowly makes three model calls, each near its timeout. The turn's bound counted
    one: past it the heartbeat stopped, the sweeper sent the turn again, and the model was
    asked (and billed) twice. Each model call now re-arms the bound."""
    import time

    delay, timeout = 6.5, 8.0  # each call within its timeout; together past one call's bound + lease
    too_long = {"status": 400, "error": "This model's maximum context length is 8192 tokens. However, "
                "your messages resulted in 9000 tokens.", "code": "context_length_exceeded"}  # fmt: skip

    def step(request: dict[str, Any]) -> dict[str, Any]:
        last = request["messages"][-1]
        if last["role"] != "tool":  # the task: two quick tool turns make a history to compact
            return {"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 1}}]}
        if last["content"] == "2" and sum(m["role"] == "tool" for m in request["messages"]) == 1:
            return {"tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 2}}]}
        time.sleep(delay)  # the slow turn: refused once (after the delay), then answered
        return {"content": "done", "fail": [too_long]}

    s = spec([step], tools=["add"], model_params={"timeout": timeout, "num_retries": 0})
    name = s["model"].removeprefix("openai/")
    model_server.summaries[name] = {"content": "SUMMARY", "tokens": 7, "delay": delay}
    run = client.submit(s)
    result = run.wait(timeout=120)
    assert (result.status, result.content) == (Status.completed, "done"), result.error
    [event] = compactions(store, run.run_id)
    assert event.reason == "context_window"
    slow = [r for r in model_server.turn_requests(s["model"]) if r["messages"][-1].get("content") == "4"]
    events = [e.type for e in store.read_events(run.run_id, "0", count=10_000)]
    assert len(slow) == 2 and "discarded" not in events, (len(slow), events)  # refused, then answered: once
    assert len(model_server.summary_requests(s["model"])) == 1
    assert (result.tokens_compaction, result.tokens_used) == (7, 30 * 3 + 7)  # three replies, billed once
