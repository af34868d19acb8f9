"""Regression guard of the per-turn cost, as counts (CPU per turn is too noisy to time).

A deployment of its own on a private redis-server, watched with ``MONITOR``: every
command the workers send while a run goes by. Per tool-turn, by difference of a
run of 4 tool-turns and a run of 1 (what a run costs once cancels out):
  - the run store's scripts, by name: one claim, one reply, one call start, one record;
  - broker messages: task messages (LPUSH) and task events (PUBLISH);
  - Redis round trips of the workers: every command, a MULTI..EXEC block counted once.
Not counted: what runs on a clock rather than per step (BRPOP polls, heartbeats, the
sweeper, kombu's unacked restore), and the producer's own commands (this process's
connections). Raise a number here only with a reason in the commit.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator

import pytest
import redis

from orchestrator.local import free_port
from tests.conftest import start_redis
from tests.helpers import call, tools

# Commands sent on a clock, not per step: their number depends on how long a run took.
CLOCKED = {"BRPOP", "PING", "HELLO", "CLIENT", "SCRIPT", "INFO"}
CLOCKED_SCRIPTS = {"BEAT", "RECOVER"}
CLOCKED_KEYS = (":workers", ":leases", ":sweeper", "unacked_mutex", "unacked_index ")

# The guarded figures, per tool-turn (a model reply calling one tool, the call, the record).
STORE_SCRIPTS_PER_TOOL_TURN = {"CLAIM_TURN": 1, "RECORD_REPLY": 1, "START_CALL": 1, "RECORD_CALL": 1}
TASK_MESSAGES_PER_TOOL_TURN = 2  # turn -> tool -> next turn
EVENT_MESSAGES_PER_TOOL_TURN = 0  # task events are off until a monitor (Flower) turns them on
ROUND_TRIPS_PER_TOOL_TURN = 10  # 4 scripts + 2 publishes + 2 deliveries + 2 acks


class Watch:
    """MONITOR in a thread; a window is cut by marker commands, so a listener running
    behind (a loaded machine) still files every command in the right window."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.seen: list[dict] = []
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._listen, daemon=True)
        self.thread.start()
        self._mark(resend=True)  # MONITOR is on once a marker comes through

    def _listen(self) -> None:
        with self.client.monitor() as monitor:
            for command in monitor.listen():
                with self.lock:
                    self.seen.append(command)
                if self.done.is_set():
                    return

    def _mark(self, resend: bool = False) -> str:
        """Send a marker and wait until MONITOR shows it. ``resend``: the listener thread
        may not have sent MONITOR yet (a loaded machine), so a first marker can go unseen."""
        marker = f"mark-{uuid.uuid4().hex}"
        self.client.echo(marker)
        deadline, again = time.monotonic() + 30, time.monotonic() + 1
        while time.monotonic() < deadline:
            with self.lock:
                if any(marker in c["command"] for c in self.seen[-50:]):
                    return marker
            if resend and time.monotonic() > again:
                self.client.echo(marker)
                again = time.monotonic() + 1
            time.sleep(0.02)
        raise AssertionError("MONITOR fell behind by 30 s")

    def window(self, action) -> list[dict]:
        time.sleep(0.5)  # the acks of what ran before
        start = self._mark()
        action()
        time.sleep(0.5)  # acks follow the run's end
        end = self._mark()
        with self.lock:
            at = [i for i, c in enumerate(self.seen) if start in c["command"] or end in c["command"]]
            return self.seen[at[0] + 1 : at[-1]]

    def close(self) -> None:
        self.done.set()
        self.client.ping()  # wakes the listener
        self.thread.join(5)


def own_ports(to: int | None = None) -> set[str]:
    """Local TCP ports of this process's sockets (the producer: its store, its broker
    connections, the MONITOR), from /proc; ``to``: only those connected to that port (a
    local port may be another process's too, towards another server)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for row in list(f)[1:]:
                cols = row.split()
                if cols[9] in inodes and (to is None or int(cols[2].rsplit(":", 1)[1], 16) == to):
                    ports.add(str(int(cols[1].rsplit(":", 1)[1], 16)))
    return ports


@pytest.fixture
def private(deployment) -> Iterator:
    port = free_port()
    server = start_redis(port)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        d = deployment(TOOLOOP_REDIS_URL=url, TOOLOOP_RECOVERY_S="600")  # sweeps and beats rare
        d.start_worker("-c", "2")
        watch = Watch(url)
        yield d, watch
        watch.close()
        d.stop()
    finally:
        server.terminate()
        server.wait(10)


def counts(commands: list[dict], names: dict[str, str], producer_ports: set[str]) -> Counter:
    def clocked(words: list[str], command: str = "") -> bool:
        """Commands sent on a clock (heartbeats, sweeps, polls), not by the run."""
        verb = words[0].upper()
        if verb == "EVALSHA":  # (a script's keys may name the lease index: told apart by name)
            name = names.get(words[1]) if len(words) > 1 else None
            return name is None or name in CLOCKED_SCRIPTS  # None: kombu's binding refresh
        return verb in CLOCKED or any(k in command for k in CLOCKED_KEYS)

    """Store scripts by name, task and event messages, and round trips (MULTI..EXEC once)."""
    out: Counter = Counter()
    in_multi: dict[str, str] = {}  # port -> the block's first command
    for c in commands:
        if c["client_type"] == "lua" or c["client_port"] in producer_ports:
            continue
        port, words = c["client_port"], c["command"].split(" ", 2)
        verb = words[0].upper()
        if verb == "MULTI":
            in_multi[port] = ""
            continue
        if verb == "EXEC":
            first = in_multi.pop(port, "")
            if not clocked(first.split(" ")):  # (heartbeats go pipelined too, on a clock)
                out[f"transaction {first}"] += 1
                out["round trips"] += 1
            continue
        if port in in_multi:
            in_multi[port] = in_multi[port] or " ".join(words[:2])
            continue
        if clocked(words, c["command"]):
            continue
        if verb == "EVALSHA":
            out[f"script {names[words[1]]}"] += 1
        elif verb == "LPUSH":
            out["task messages"] += 1
        elif verb == "PUBLISH" and "/task." in words[1]:
            out["event messages"] += 1
        elif verb == "PUBLISH" and "/worker." in words[1]:
            continue  # worker heartbeats, on a clock
        else:
            out[f"other {verb} {words[1] if len(words) > 1 else ''}"] += 1  # shown on failure
        out["round trips"] += 1
    return out


def test_round_trips_and_messages_per_tool_turn(private, spec) -> None:
    d, watch = private
    names = {script.sha: name for name, script in d.store._scripts.items()}
    run = {n: spec([tools(call("add", {"a": 1, "b": i})) for i in range(n)] + [{"content": "done"}],
                   tools=["add"]) for n in (1, 4)}  # fmt: skip
    # warm-up: every pool process declares its queues and loads the scripts once
    for handle in [d.client.submit(run[4]) for _ in range(4)]:
        handle.wait(timeout=60)

    def one(n: int) -> Counter:
        commands = watch.window(lambda: d.client.submit(run[n]).wait(timeout=30))
        return counts(commands, names, own_ports())

    short, long = one(1), one(4)
    per_turn = {k: (long[k] - short[k]) / 3 for k in set(long) | set(short)}
    shown = f"per tool-turn {per_turn}; 1-turn run {dict(short)}; 4-turn run {dict(long)}"
    scripts = {k.removeprefix("script "): v for k, v in per_turn.items() if k.startswith("script ") and v}
    assert scripts == STORE_SCRIPTS_PER_TOOL_TURN, shown
    assert per_turn.get("task messages", 0) == TASK_MESSAGES_PER_TOOL_TURN, shown
    assert per_turn.get("event messages", 0) == EVENT_MESSAGES_PER_TOOL_TURN, shown
    assert per_turn.get("round trips", 0) == ROUND_TRIPS_PER_TOOL_TURN, shown


SUBMIT_ROUND_TRIPS = 3  # the live workers' catalog with Redis's clock, CREATE, the first turn's message


def test_a_submit_is_three_round_trips(private, spec) -> None:
    """A producer's submit: its tools checked against the live workers' catalog (read once,
    with Redis's clock), the run written, its first turn sent. Was 6: the catalog read twice,
    each a TIME and an HGETALL."""
    d, watch = private
    run = spec([tools(call("add", {"a": 1, "b": 2})), {"content": "done"}], tools=["add"])
    d.client.submit(run).wait(timeout=60)  # warm-up: scripts loaded, connections open
    commands = watch.window(lambda: d.client.submit(run))
    mine = own_ports(to=watch.client.connection_pool.connection_kwargs["port"])  # the private Redis
    sent = [c["command"].split(" ", 2)[:2] for c in commands
            if c["client_port"] in mine and c["client_type"] != "lua"]  # fmt: skip
    names = {s.sha: n for n, s in d.store._scripts.items()} | {d.store._workers.sha: "WORKERS"}
    shown = [names.get(w[1], " ".join(w)) if w[0].upper() == "EVALSHA" else " ".join(w) for w in sent]
    assert len(sent) == SUBMIT_ROUND_TRIPS, shown
    assert shown[:2] == ["WORKERS", "CREATE"] and sent[2][0].upper() == "LPUSH", shown
