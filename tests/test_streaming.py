"""Live model text: with ``stream: true`` the reply's deltas reach watchers (RunHandle.events(),
the API's SSE, ``tooloop watch``) paced (pieces of >= 80 characters, at most one per 500 ms),
scrubbed, and kept nowhere but the capped event stream."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx

from orchestrator import Status
from orchestrator.events import Text, parse, validate
from orchestrator.scrub import continued
from tests.conftest import ROOT
from tests.helpers import redis_values
from tests.test_api import api_server, sse_events  # noqa: F401  (a fixture, shared)
from worker.streaming import MIN_CHARS, MIN_INTERVAL_S, TextStream

WORDS = " ".join(f"word{i:03d}" for i in range(240))  # 1,919 characters
PACED = {"content": WORDS, "chunk_chars": 7, "chunk_delay": 0.01}  # ~275 deltas over ~3 s


# -- pure pacing -------------------------------------------------------------------------------
def feed(deltas: list[str], gap_s: float) -> list[tuple[float, str]]:
    """Run a TextStream over ``deltas`` arriving ``gap_s`` apart: (when, piece) sent."""
    sent: list[tuple[float, str]] = []

    async def go() -> None:
        stream = TextStream(lambda text: sent.append((time.monotonic(), text)))
        for delta in deltas:
            await stream(delta)
            await asyncio.sleep(gap_s)
        await stream("")

    asyncio.run(go())
    return sent


def test_pieces_are_large_and_spaced():
    sent = feed([WORDS[i : i + 5] for i in range(0, 1000, 5)], 0.005)  # 200 deltas, ~1 s or more
    pieces = [text for _, text in sent]
    assert "".join(pieces) == WORDS[:1000]
    assert all(len(p) >= MIN_CHARS for p in pieces[:-1]) and len(pieces) >= 2
    gaps = [b - a for (a, _), (b, _) in itertools.pairwise(sent)]
    assert min(gaps) >= MIN_INTERVAL_S - 0.01
    assert all(p[-1] == " " for p in pieces[:-1])  # cut at whitespace: no token split


def test_a_pause_of_the_model_does_not_hold_back_what_is_due():
    """100 characters, then silence: the timer sends them without the next delta."""
    sent: list[str] = []

    async def go() -> None:
        stream = TextStream(sent.append)
        await stream("x" * 10 + " ")  # too short: held
        await stream("y" * 100 + " ")  # sent at once: the first piece has no wait
        await stream("z" * 90 + " ")  # due only 500 ms later
        await asyncio.sleep(0.7)
        assert len(sent) == 2, "the timer sent the second piece during the model's pause"
        await stream("")

    asyncio.run(go())
    assert sent == ["x" * 10 + " " + "y" * 100 + " ", "z" * 90 + " "]


def test_a_secret_straddling_two_pieces_is_still_masked():
    assert continued("the api_key: ", "hunter2hunter2 and more") == "hunt*[REDACTED] and more"
    sent = feed(["x" * 90 + " password: ", "hunter2hunter2 ", "y" * 90 + " sk-abcdefghijklmnop1234 end"], 0.6)
    joined = "".join(text for _, text in sent)
    assert "hunter2hunter2" not in joined and "abcdefghijklmnop1234" not in joined
    assert "hunt*[REDACTED]" in joined and "sk-a*[REDACTED]" in joined


# -- watchers of a real run -----------------------------------------------------------------------
class Watcher(threading.Thread):
    """Collects (arrival time, event) from one kind of watcher until the outcome."""

    def __init__(self, events: Any) -> None:
        super().__init__(daemon=True)
        self.source, self.seen = events, []

    def run(self) -> None:
        for event in self.source():
            self.seen.append((time.time(), event))  # wall clock: compared with events' ts

    def texts(self) -> list[Text]:
        return [e for _, e in self.seen if e.type == "text"]


def sse(base_url: str, run_id: str) -> Any:
    def events() -> Any:
        headers = {"Authorization": "Bearer tok-acme"}
        with httpx.stream("GET", f"{base_url}/api/runs/{run_id}/events", headers=headers, timeout=60) as r:
            for data in sse_events(r):  # the typed JSON reads back into the producer's models
                yield validate({k: v for k, v in data.items() if not k.startswith("_")})

    return events


@dataclass
class WatchLine:
    type: str  # the event's type, as the line shows it
    line: str


def cli_watch(run_id: str) -> Any:
    def events() -> Any:
        proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "watch", run_id],
                                stdout=subprocess.PIPE, text=True, cwd=ROOT)  # fmt: skip
        for line in proc.stdout:
            kind = line.split(" ")[2] if line.startswith("turn ") else line.split(" ")[0]
            yield WatchLine(kind, line.rstrip("\n"))
        proc.wait(10)

    return events


def assert_paced(texts: list[Text], content: str) -> None:
    assert "".join(e.text for e in texts) == content
    assert len(texts) >= 3 and all(len(e.text) >= MIN_CHARS for e in texts[:-1])
    gaps_ms = [(b.ts - a.ts).total_seconds() * 1000 for a, b in itertools.pairwise(texts)]
    assert min(gaps_ms) >= MIN_INTERVAL_S * 1000 - 2


def test_streamed_text_reaches_every_watcher_live(client, worker, spec, model_server, store, api_server):  # noqa: F811
    add = {"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]}
    s = spec([add, PACED], tools=["add"], tenant="acme", model_params={"stream": True})
    run = client.submit(s)
    watchers = [Watcher(run.events), Watcher(sse(api_server.base_url, run.run_id)),
                Watcher(cli_watch(run.run_id))]  # fmt: skip
    for w in watchers:
        w.start()
    result = run.wait(timeout=60)
    for w in watchers:
        w.join(30)
    assert (result.status, result.content) == (Status.completed, WORDS)
    handle, api, cli = watchers
    for w in (handle, api):
        assert_paced(w.texts(), WORDS)
        assert {e.iteration for e in w.texts()} == {2}  # a tool-call turn has no text
        types = [e.type for _, e in w.seen]
        # live: the text came while the model was still answering, before the reply was recorded
        reply_recorded = types.index("iteration", types.index("tool_call"))
        assert types.index("text") < reply_recorded < types.index("outcome")
        first_text = next(t for t, e in w.seen if e.type == "text")
        recorded = w.seen[reply_recorded][1].ts.timestamp()  # when the worker wrote the reply
        assert first_text < recorded - 1.0  # ~3 s of paced deltas: the first was seen long before the end
    lines = [e.line for _, e in cli.seen if e.type == "text"]
    assert lines and all(line.startswith("turn 2 text ") for line in lines)
    assert "".join(json.loads(line.removeprefix("turn 2 text ")) for line in lines) == WORDS
    assert cli.seen[-1][1].line == "outcome exit=default status=completed turn=2"


def test_streamed_text_is_kept_only_in_the_event_stream(client, worker, spec, store):
    secret_words = WORDS[:400] + " password: hunter2hunter2 token=sk-abcdefghijklmnop1234 " + WORDS[400:800]
    answer = {"content": secret_words, "chunk_chars": 3, "chunk_delay": 0.002}
    streamed = client.submit(spec([answer], model_params={"stream": True}))
    plain = client.submit(spec([answer]))
    assert streamed.wait(timeout=60).status == plain.wait(timeout=60).status == Status.completed
    texts = [e for e in store.read_events(streamed.run_id, count=1000) if isinstance(e, Text)]
    shown = "".join(e.text for e in texts)
    assert "hunt*[REDACTED]" in shown and "sk-a*[REDACTED]" in shown
    keys = {r.run_id: redis_values(store.redis, f"{store.keys.prefix}:*{r.run_id}*")
            for r in (streamed, plain)}  # fmt: skip
    # the same keys as a run without streaming: no other copy of the deltas anywhere
    names = {rid: {re.sub(r"\{s\d+\}", "{shard}", k.replace(rid, "RUN")) for k in values}
             for rid, values in keys.items()}  # fmt: skip  (each run in its own shard)
    assert names[streamed.run_id] == names[plain.run_id]
    everything = b"".join(v for vs in keys[streamed.run_id].values() for v in vs)
    assert b"hunter2hunter2" not in everything and b"abcdefghijklmnop1234" not in everything


def test_no_text_after_the_outcome(client, worker, spec, store):
    run = client.submit(spec([{"content": "done"}], model_params={"stream": True}))
    assert run.wait(timeout=30).status == Status.completed
    before = store.read_events(run.run_id, count=1000)
    assert store.text_event(run.run_id, 1, "late text") is False  # refused: watchers stopped at the outcome
    assert store.read_events(run.run_id, count=1000) == before and before[-1].type == "outcome"


def test_live_view_shows_the_current_turns_text_not_event_lines():
    from orchestrator.views import WatchState, event_line

    def text(iteration: str, text: str) -> Text:
        return parse("1-0", {"type": "text", "ts": "1", "iteration": iteration, "text": text})

    state = WatchState("r")
    state.apply(text("1", "Hello, "))
    state.apply(text("1", "world"))
    reply = {"type": "iteration", "ts": "2", "iteration": "1", "tool_calls": "1", "tokens_used": "30"}
    state.apply(parse("2-0", reply))
    assert (state.text, state.lines) == ("Hello, world", ["turn 1 tool_calls=1 tokens=30"])
    state.apply(text("2", "next turn"))
    assert (state.text, state.turn_streaming) == ("next turn", 2)
    assert event_line(text("2", 'a\n"b"')) == 'turn 2 text "a\\n\\"b\\""'


# -- a slow or unreachable Redis ---------------------------------------------------------------
def test_a_stalled_redis_never_holds_the_event_loop():
    """The pieces of a streamed reply are written off the event loop, bounded: with a Redis
    that accepts connections and never answers, the loop (every model call in flight in the
    process) goes on; before, each piece blocked it for the client's socket timeout."""
    import socket

    import redis

    from orchestrator.settings import Settings
    from orchestrator.store import RunStore
    from worker import aio
    from worker.streaming import BATCH_MAX, DRAIN_S, PENDING_MAX, live_text, writer

    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(64)  # the kernel completes each handshake; nobody ever reads or answers
    client = redis.Redis.from_url(f"redis://127.0.0.1:{hole.getsockname()[1]}/0", socket_timeout=1,
                                  socket_connect_timeout=1, retry_on_timeout=False)  # fmt: skip
    stalled = RunStore(client, Settings(key_prefix=f"{os.environ['TOOLOOP_KEY_PREFIX']}-stalled"))

    async def scenario() -> tuple[float, float]:
        loop, lags = asyncio.get_running_loop(), [0.0]

        async def tick() -> None:
            while True:
                before = loop.time()
                await asyncio.sleep(0.01)
                lags.append(loop.time() - before - 0.01)

        ticker = asyncio.ensure_future(tick())
        started = time.monotonic()
        stream = live_text(stalled, "r1", 1)
        for i in range(0, 600, 20):  # ~30 deltas over ~1.2 s: two or three pieces
            await stream(WORDS[i : i + 20])
            await asyncio.sleep(0.04)
        await stream("")
        ticker.cancel()
        return max(lags), time.monotonic() - started

    text_writer = writer(stalled)
    try:
        worst_lag, took = aio.run(asyncio.wait_for(scenario(), 60))
        # bounded: past PENDING_MAX waiting (and the batch being written) a piece is dropped
        sent, queued_s = [], 0.0  # the longest single send: one waiting on Redis would take its 1 s timeout
        for _ in range(PENDING_MAX + BATCH_MAX + 50):
            started = time.monotonic()
            sent.append(text_writer.send("r2", 1, "x"))
            queued_s = max(queued_s, time.monotonic() - started)
    finally:
        text_writer.close()
        hole.close()
    print(f"worst loop lag {worst_lag:.3f}s, reply streamed in {took:.2f}s, longest send {queued_s:.3f}s")
    assert worst_lag < 0.5, worst_lag  # a socket timeout (1 s) per piece before
    assert took < 3 * DRAIN_S + 3, took  # the end of the reply waits for its text a bounded while
    assert sent.count(None) >= 50 and text_writer.dropped >= 50 and queued_s < 0.5, queued_s
