"""Chaos: runs while workers are killed -9, partitioned (SIGSTOP past their lease) and
restarted, Redis restarts once, some runs are poisoned or unreadable; then the tool
pool is stopped for two minutes while turns keep sweeping.

Phase 1 (faults). Each normal run has 4 turns: a non-idempotent effect (a line in its
folder), an idempotent read, another effect, an answer; model latency 0.2-1.5 s per
turn. Every --kill-every seconds a random worker is either killed -9 and replaced, or
frozen (SIGSTOP of its whole process group) for a lease and a bit, then thawed
(SIGCONT): it wakes up believing it still holds what it took. Halfway, Redis (AOF on)
is restarted. Among the runs:
  poison call   the model asks for a tool call whose function.name is null
  poison turn   the model's reply cannot be stored (a lone surrogate): the turn raises
  unreadable    the stored spec is rewritten with a field the spec no longer has
Counted at the end:
  completed      normal runs that ended `completed`
  lost           runs not ended when the system went quiet
  duplicated     effect lines written twice (a non-idempotent call run again)
  double-billed  runs whose tokens_used counts more replies than the model served them
  poison         poisoned runs ended on `error` within the attempts cap (and model
                 calls of a poison turn <= the cap)
  unreadable     unreadable runs ended on `error`
and the stalls: for each step the sweeper re-sent, how long its run stalled (last
progress before the loss -> first progress after the re-send); and the largest queue
length seen: the turn and tool queues are sampled every second from the first submit
until the system went quiet (as Redis lists, as in phase 2; with --broker, the broker's
count of ready messages).

Phase 2 (tool-pool outage). Turn and tool workers apart; the tool pool is stopped, runs
whose first step is an effect are submitted, and for --outage seconds the turn workers
keep sweeping. The tool queues are sampled every second: their length, and the most
messages any one waiting step has there (the bound is 1). Then the pool comes back:
every run completes, each effect once.

    python bench/chaos.py [--runs 100] [--workers 3] [--kill-every 4] [--recovery 60]
                          [--outage 120] [--outage-runs 50]
                          [--broker amqp://guest:guest@127.0.0.1:5672/]

With --broker the messages go through that broker (e.g. RabbitMQ) and the restarted
Redis is the run store only; the bench's queues are deleted from the broker at the end.
The outage phase samples the queues as Redis lists: it runs only with the Redis broker.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import environment, publish, scripted_model, scripted_spec
from bench.stalls import Action, Stall, read_deliveries, stalls_of_run, summary, workers_up
from tests.servers import drop_queues

TOKENS = 30
# from tests/tools.py: a non-idempotent effect (a line in the run's folder) and an idempotent read
EFFECT, READ = "append_then_sleep", "slow_lookup"


def latency(step: dict) -> object:
    return lambda _request: {**step, "delay": random.uniform(0.2, 1.5), "tokens": TOKENS}


def steps() -> list:
    return [
        latency({"tool_calls": [{"name": EFFECT, "arguments": {"text": "effect-1", "seconds": 1}}]}),
        latency({"tool_calls": [{"name": READ, "arguments": {"key": "k", "seconds": 0.5}}]}),
        latency({"tool_calls": [{"name": EFFECT, "arguments": {"text": "effect-3", "seconds": 1}}]}),
        latency({"content": "done"}),
    ]  # fmt: skip


def poison_call_steps() -> list:
    return [latency({"tool_calls": [{"name": None, "arguments": {}}]}), latency({"content": "never"})]


def poison_turn_steps() -> list:
    return [latency({"content": "bad \ud800 text"})]


class AofRedis:
    """A redis-server of our own with AOF, so it can be restarted mid-run."""

    def __init__(self, port: int) -> None:
        self.port, self.dir = port, tempfile.mkdtemp(prefix="tooloop-chaos-redis-")
        self.url = f"redis://127.0.0.1:{port}/0"
        self.start()

    def start(self) -> None:
        from orchestrator.local import redis_answers

        self.proc = subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", "--port", str(self.port), "--bind",
             "127.0.0.1", "--dir", self.dir, "--appendonly", "yes", "--appendfsync", "everysec",
             "--save", "", "--maxmemory-policy", "noeviction"], stdout=subprocess.DEVNULL)  # fmt: skip
        while not redis_answers(self.url):
            time.sleep(0.05)

    def restart(self) -> float:
        started = time.monotonic()
        self.proc.terminate()  # SIGTERM: the AOF is flushed
        self.proc.wait()
        self.start()
        return time.monotonic() - started

    def stop(self) -> None:
        self.proc.kill()


@dataclass
class Run:
    kind: str  # normal | poison_call | poison_turn | unreadable
    model: str
    handle: object = None


@dataclass
class Fleet:
    """The workers of one phase, started and replaced with the same arguments; what the
    bench did to each is kept (``actions``, wall-clock time) to explain the stalls."""

    stack: ExitStack
    env: dict[str, str]
    args: tuple[str, ...]
    tag: str
    workers: list = field(default_factory=list)
    actions: list[Action] = field(default_factory=list)

    def start(self) -> object:
        from orchestrator.local import WorkerProcess

        worker = WorkerProcess(f"chaos-{self.tag}-{len(self.workers)}", *self.args, env=self.env)
        self.workers.append(worker)
        self.stack.callback(worker.stop)
        self.note("start", worker)
        return worker

    def note(self, what: str, worker) -> None:
        self.actions.append(Action(time.time(), what, worker.name))

    def live(self) -> list:
        return [w for w in self.workers if w.proc.poll() is None]

    def watch_ready(self, store) -> threading.Event:
        """Note when each worker's pools have all published themselves (on a thread of its
        own, every 0.2 s, until the returned event is set)."""
        stop = threading.Event()

        def loop() -> None:
            ready: set[str] = set()
            while not stop.wait(0.2):
                try:
                    live = set(store.live_workers())
                except Exception:  # Redis restarting
                    continue
                for worker in list(self.workers):
                    if worker.name not in ready and {f"turns@{worker.name}", f"tools@{worker.name}"} <= live:
                        ready.add(worker.name)
                        self.note("ready", worker)

        threading.Thread(target=loop, name="ready-watch", daemon=True).start()
        return stop


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--kill-every", type=float, default=4.0)
    parser.add_argument("--chaos-for", type=float, default=40.0, help="seconds of kills and partitions")
    parser.add_argument("--recovery", type=float, default=60.0, help="TOOLOOP_RECOVERY_S")
    parser.add_argument("--poison", type=float, default=0.1, help="share of poisoned runs")
    parser.add_argument("--unreadable", type=float, default=0.05, help="share of unparseable specs")
    parser.add_argument("--outage", type=float, default=120.0, help="seconds the tool pool is down; 0: skip")
    parser.add_argument("--outage-runs", type=int, default=50)
    parser.add_argument("--broker", help="TOOLOOP_BROKER_URL (default: the restarted Redis)")
    parser.add_argument("--details", type=Path, help="write each stall, its parts, the actions here (JSON)")
    args = parser.parse_args()
    with ExitStack() as stack:
        from orchestrator.local import free_port

        redis_server = AofRedis(free_port())
        stack.callback(redis_server.stop)
        os.environ["TOOLOOP_REDIS_URL"] = redis_server.url
        os.environ["TOOLOOP_BENCH_SHARED_REDIS"] = "1"  # the store is this Redis, the one restarted
        env = environment(stack, "tests.tools")
        env["TOOLOOP_RECOVERY_S"] = os.environ["TOOLOOP_RECOVERY_S"] = str(args.recovery)
        if args.broker:
            env["TOOLOOP_BROKER_URL"] = os.environ["TOOLOOP_BROKER_URL"] = args.broker
        from orchestrator import Client

        model_server = scripted_model()
        stack.callback(model_server.stop)
        client = Client()
        if args.broker:
            # the bench's queues and exchanges, gone from a broker that outlives it: each
            # RabbitMQ quorum queue keeps file descriptors open (four runs left 96 queues)
            stack.callback(drop_queues, args.broker, client.store.keys)
        lines = faults_phase(stack, env, client, model_server, redis_server, args)
        if args.outage > 0 and not args.broker:
            lines += outage_phase(stack, env, client, model_server, args)
        publish("chaos" if not args.broker else f"chaos_{broker_name(args.broker)}", lines)


def broker_name(url: str | None) -> str:
    return url.split(":", 1)[0] if url else "redis (the store)"


# -- phase 1: kills, partitions, a Redis restart, poison and unreadable runs ----------------
def faults_phase(stack, env, client, model_server, redis_server, args) -> list[str]:
    fleet = Fleet(stack, env, ("-c", "16"), "mixed")
    stop_watch = fleet.watch_ready(client.store)
    for _ in range(args.workers):
        fleet.start()
    for worker in fleet.workers:
        worker.wait_ready(client.store, timeout=300)  # three workers starting at once on a loaded box
    runs = plan_runs(model_server, args)
    sampler = QueuePeak(client, args.broker).start()
    started = time.monotonic()
    for run in runs:
        spec = scripted_spec(model_server, run.model, tools=[EFFECT, READ])
        run.handle = client.submit(spec)
        if run.kind == "unreadable":
            make_unreadable(client.store, run.handle.run_id)
    events = chaos(fleet, redis_server, client.store.settings.lease_s, args)
    quiet_deadline = time.monotonic() + 6 * args.recovery
    while time.monotonic() < quiet_deadline and not all(r.handle.status().ended for r in runs):
        time.sleep(0.5)
    elapsed = time.monotonic() - started
    sampler.stop()
    stop_watch.set()
    for worker in fleet.live():
        worker.stop()
    cap = client.store.settings.step_attempts
    return report(args, runs, events, elapsed, model_server, cap, sampler, fleet)


def plan_runs(model_server, args) -> list[Run]:
    """Each run its own script (so the model's requests can be counted per run)."""
    n_poison = round(args.runs * args.poison)
    n_unreadable = round(args.runs * args.unreadable)
    kinds = (["poison_call"] * (n_poison - n_poison // 2) + ["poison_turn"] * (n_poison // 2)
             + ["unreadable"] * n_unreadable)  # fmt: skip
    kinds += ["normal"] * (args.runs - len(kinds))
    random.shuffle(kinds)
    makers = {"normal": steps, "unreadable": steps, "poison_call": poison_call_steps,
              "poison_turn": poison_turn_steps}  # fmt: skip
    return [Run(kind, model_server.script(makers[kind]())) for kind in kinds]


def make_unreadable(store, run_id: str) -> None:
    """A rollback: the stored spec holds a field this version does not know."""
    key = store.keys.run(run_id)
    raw = json.loads(store.redis.hget(key, "spec"))
    store.redis.hset(key, "spec", json.dumps({**raw, "retired_field": True}))


@dataclass
class ChaosEvents:
    kills: int = 0
    partitions: int = 0
    redis_down_s: float = 0.0
    redis_restarted_at: float = 0.0  # epoch seconds


def chaos(fleet: Fleet, redis_server: AofRedis, lease_s: float, args) -> ChaosEvents:
    """Every few seconds a random live worker is killed -9 (and replaced) or frozen past
    its lease, then thawed; Redis restarts once, halfway."""
    seen = ChaosEvents()
    frozen: list[tuple[float, object]] = []
    end = time.monotonic() + args.chaos_for
    halfway = time.monotonic() + args.chaos_for / 2
    while time.monotonic() < end or frozen:
        time.sleep(min(args.kill_every, 1.0) if time.monotonic() >= end else args.kill_every)
        for thaw_at, worker in list(frozen):
            if time.monotonic() >= thaw_at:
                worker.thaw()
                fleet.note("thaw", worker)
                frozen.remove((thaw_at, worker))
                print(f"SIGCONT {worker.name}", file=sys.stderr)
        if time.monotonic() >= end:
            continue
        candidates = [w for w in fleet.live() if all(w is not f for _, f in frozen)]
        victim = random.choice(candidates)
        if random.random() < 0.5 or len(candidates) < 2:
            victim.kill()
            fleet.note("kill", victim)
            seen.kills += 1
            print(f"kill -9 {victim.name}", file=sys.stderr)
            fleet.start()
        else:
            victim.freeze()
            fleet.note("freeze", victim)
            seen.partitions += 1
            frozen.append((time.monotonic() + lease_s + 5, victim))
            print(f"SIGSTOP {victim.name} for {lease_s + 5:.0f}s", file=sys.stderr)
        if not seen.redis_down_s and time.monotonic() >= halfway:
            seen.redis_restarted_at = time.time()
            seen.redis_down_s = redis_server.restart()
            print(f"restarted Redis in {seen.redis_down_s:.2f}s", file=sys.stderr)
    return seen


def run_folder(run_id: str) -> Path:
    return Path(os.environ["TOOLOOP_SANDBOX_ROOT"], run_id)


def effects_duplicated(run_id: str) -> int:
    effects_file = run_folder(run_id) / "effects.txt"
    lines = effects_file.read_text().splitlines() if effects_file.exists() else []
    return len(lines) - len(set(lines))


def report(args, runs: list[Run], seen: ChaosEvents, elapsed: float, model_server, cap: int,
           queues: QueuePeak, fleet: Fleet) -> list[str]:  # fmt: skip
    count: Counter = Counter()
    stalls: list[Stall] = []
    deliveries = read_deliveries({w.name: w.log for w in fleet.workers})
    misses: list[str] = []
    for run in runs:
        result = run.handle.result()
        served = len(model_server.calls(run.model))  # replies the model sent for this run
        count["lost"] += not result.status.ended
        count["duplicated"] += effects_duplicated(run.handle.run_id)
        count["double_billed"] += result.tokens_used > TOKENS * served
        count["unbilled"] += served - result.tokens_used // TOKENS  # replies a killed worker never got
        events = list(run.handle.events(timeout=5))
        if run.kind == "normal":
            count["completed"] += result.status == "completed"
            if result.status != "completed":  # which, and why: a normal run should not fail
                recovered = sum(e.type == "recovery" for e in events)
                misses.append(f"  not completed   run {run.handle.run_id[:12]}: {result.status} "
                              f"({result.exit}), {recovered} recoveries: {result.error}")  # fmt: skip
        elif run.kind == "unreadable":
            count["unreadable_ok"] += (result.status, result.exit) == ("failed", "error")
        if run.kind.startswith("poison"):
            why = poison_miss(run, result, served, cap, events)
            count["poison_ok"] += why is None
            count["poison_redone"] += why is None and run.kind == "poison_call" and served > 1
            misses += [f"  poison miss     run {run.handle.run_id[:12]} ({run.kind}): {why}"] if why else []
        stalls += stalls_of_run(run.handle.run_id, events, deliveries, fleet.actions)
    for stall in stalls:
        stall.queue_len = queues.at(stall.sent_at, "turns" if stall.step.startswith("turn") else "tools")
        stall.workers_up = workers_up(fleet.actions, stall.sent_at)
    recoveries = [s.total for s in stalls]
    if args.details:
        details = {"stalls": [asdict(s) for s in stalls], "actions": [asdict(a) for a in fleet.actions],
                   "queues": [(t, asdict(q)) for t, q in queues.series]}  # fmt: skip
        args.details.write_text(json.dumps(details, indent=1))
    kinds = Counter(run.kind for run in runs)
    poisoned = kinds["poison_call"] + kinds["poison_turn"]
    cuts = statistics.quantiles(recoveries, n=100, method="inclusive") if len(recoveries) > 1 else None
    redone = (f" ({count['poison_redone']} of them asked the model twice: their poison call's turn was lost "
              "with its worker and redone)") if count["poison_redone"] else ""  # fmt: skip
    lines = [
        f"chaos: {args.runs} runs ({poisoned} poisoned, {kinds['unreadable']} unreadable), {args.workers} "
        f"workers, every {args.kill_every:g}s for {args.chaos_for:g}s a kill -9 or a partition "
        f"({seen.kills} kills, {seen.partitions} SIGSTOP past the lease), Redis restarted once "
        f"({seen.redis_down_s:.2f}s down), TOOLOOP_RECOVERY_S={args.recovery:g}, attempts cap {cap}, "
        f"broker {broker_name(args.broker)}",
        f"  completed       {count['completed']}/{kinds['normal']}   (normal runs)",
        f"  lost            {count['lost']}",
        f"  duplicated      {count['duplicated']}   (non-idempotent effects executed twice)",
        f"  double-billed   {count['double_billed']}   (runs billed for more replies than the model sent)",
        f"  unbilled        {count['unbilled']}   (replies sent to a worker killed before it recorded them)",
        f"  poison          {count['poison_ok']}/{poisoned} ended on error within {cap} attempts{redone}",
        *misses,
        f"  unreadable      {count['unreadable_ok']}/{kinds['unreadable']} ended on error",
        f"  recovered steps {len(recoveries)}",
    ]
    if cuts:
        over = sum(r > args.recovery for r in recoveries)
        lines.append(f"  stall s         p50 {cuts[49]:.1f}  p90 {cuts[89]:.1f}  p99 {cuts[98]:.1f}  "
                     f"max {max(recoveries):.1f}   (bound {args.recovery:g}; {over} over it)")  # fmt: skip
    lines += summary(stalls, fleet.actions)
    peak = queues.peak
    lines.append(f"  largest queue   {peak.total} messages ({peak.turns} turns, {peak.tools} tool calls; "
                 f"{queues.samples} samples, 1/s, {queues.failed} skipped: Redis restarting)")  # fmt: skip
    lines.append(f"  all ended after {elapsed:.1f}s")
    return lines


@dataclass
class QueueLengths:
    turns: int = 0
    tools: int = 0

    @property
    def total(self) -> int:
        return self.turns + self.tools


def queue_lengths(client, broker: str | None) -> QueueLengths:
    """Messages waiting in the turn and tool queues. With the Redis broker the queues
    are Redis lists (every priority, per-tool ones too), counted as phase 2 counts them;
    with another broker, its count of ready messages in each of the bench's queues."""
    store = client.store
    if not broker:
        turns = 0
        for key in store.redis.scan_iter(f"{store.keys.broker_prefix}{store.keys.turn_queue}*", count=1000):
            if store.redis.type(key) == b"list":
                turns += store.redis.llen(key)
        return QueueLengths(turns, tool_messages(store).total)
    out = QueueLengths()
    names = [store.keys.tool_queue] + [store.keys.tool_queue_of(t) for t in (EFFECT, READ)]
    with client.celery.connection_for_read() as conn:
        for name, is_turn in [(store.keys.turn_queue, True)] + [(n, False) for n in names]:
            channel = conn.channel()  # a passive declare of a missing queue closes its channel
            try:
                count = channel.queue_declare(name, passive=True).message_count
            except conn.channel_errors:
                count = 0
            finally:
                with contextlib.suppress(Exception):
                    channel.close()
            if is_turn:
                out.turns += count
            else:
                out.tools += count
    return out


class QueuePeak:
    """Samples :func:`queue_lengths` every ``every`` seconds on a thread of its own and
    keeps the largest total seen (a sample that fails, as while Redis restarts, is skipped)."""

    def __init__(self, client, broker: str | None, every: float = 1.0) -> None:
        self.client, self.broker, self.every = client, broker, every
        self.peak = QueueLengths()
        self.series: list[tuple[float, QueueLengths]] = []  # (epoch seconds, lengths)
        self.samples = self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="queue-peak", daemon=True)

    def start(self) -> QueuePeak:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.every):
                return

    def at(self, when: float, kind: str) -> int | None:
        """The turns (or tool calls) waiting at the last sample taken before ``when``."""
        before = [lengths for t, lengths in self.series if t <= when]
        return getattr(before[-1], kind) if before else None

    def sample(self) -> QueueLengths | None:
        try:
            now = queue_lengths(self.client, self.broker)
        except Exception:  # Redis (or the broker) restarting: skip this sample
            self.failed += 1
            return None
        self.samples += 1
        self.series.append((time.time(), now))
        if now.total > self.peak.total:
            self.peak = now
        return now


def poison_miss(run: Run, result, served: int, cap: int, events: list) -> str | None:
    """Why a poisoned run did not end as it should (None: it did): on ``error``, its step
    failed at most ``cap`` attempts, and the model served no more replies than the turn's
    attempts: a poison turn at most ``cap`` (one per attempt); a poison call's turn is
    fine, so one, plus one per time that turn was lost with its worker and sent again (a
    kill -9 or a freeze during its model call: the reply never recorded is asked again)."""
    if (result.status, result.exit) != ("failed", "error"):
        return f"ended {result.status}/{result.exit}: {result.error}"
    attempts = re.search(r"failed (\d+) attempts", result.error or "")
    if attempts is None or int(attempts.group(1)) > cap:
        return f"error {result.error!r}"
    lost_turns = sum(e.type == "recovery" and e.step == "turn" for e in events)
    allowed = cap if run.kind == "poison_turn" else min(cap, 1 + lost_turns)
    if served > allowed:
        return f"{served} replies served (at most {allowed}, {lost_turns} turns lost): {result.error}"
    return None


# -- phase 2: the tool pool down for minutes while turns keep sweeping ----------------------
def outage_phase(stack, env, client, model_server, args) -> list[str]:
    turns = Fleet(stack, env, ("-Q", "turns", "-c", "8"), "turns")
    pool = Fleet(stack, env, ("-Q", "tools", "-c", "8"), "tools")
    turns.start().wait_ready(client.store, ("turns",), timeout=300)
    pool.start().wait_ready(client.store, ("tools",), timeout=300)  # publishes the tools: calls are routable
    pool.workers[0].stop()
    model = model_server.script([
        latency({"tool_calls": [{"name": EFFECT, "arguments": {"text": "outage", "seconds": 0.2}}]}),
        latency({"content": "done"}),
    ])  # fmt: skip
    spec = scripted_spec(model_server, model, tools=[EFFECT, READ])
    handles = [client.submit(spec) for _ in range(args.outage_runs)]
    store = client.store
    deadline = time.monotonic() + 60
    while tool_messages(store).total < args.outage_runs and time.monotonic() < deadline:
        time.sleep(0.5)
    before = tool_messages(store)
    peak_len, peak_per_step = before.total, before.most_per_step
    down_until = time.monotonic() + args.outage
    while time.monotonic() < down_until:
        time.sleep(1.0)
        now = tool_messages(store)
        peak_len, peak_per_step = max(peak_len, now.total), max(peak_per_step, now.most_per_step)
    after = tool_messages(store)
    pool.start().wait_ready(client.store, ("tools",), timeout=300)
    back = time.monotonic()
    results = [h.wait(timeout=6 * args.recovery) for h in handles]
    drained = time.monotonic() - back
    completed = sum(r.status == "completed" for r in results)
    duplicated = sum(effects_duplicated(h.run_id) for h in handles)
    return [
        f"tool-pool outage: {args.outage_runs} runs waiting on a tool call, the tool pool stopped for "
        f"{args.outage:g}s while a turn worker kept sweeping (TOOLOOP_RECOVERY_S={args.recovery:g})",
        f"  tool queue      {before.total} messages before, {after.total} after, largest seen {peak_len}",
        f"  per step        at most {peak_per_step} message(s) for one waiting call (bound 1)",
        f"  afterwards      {completed}/{args.outage_runs} completed {drained:.1f}s after the pool came "
        f"back, {duplicated} effects executed twice",
    ]


@dataclass
class QueueSample:
    total: int
    most_per_step: int


TASK_ID = re.compile(r'"id": ?"(tool-.+)-(\d+)"')


def tool_messages(store) -> QueueSample:
    """Messages in the tools queues (shared and per tool, every priority), and the most
    any one step has there (task ids are ``tool-<run>-<call key>-<generation>``)."""
    per_step: Counter = Counter()
    total = 0
    for key in store.redis.scan_iter(f"{store.keys.broker_prefix}{store.keys.tool_queue}*", count=1000):
        if store.redis.type(key) != b"list":
            continue
        for message in store.redis.lrange(key, 0, -1):
            total += 1
            found = TASK_ID.search(message.decode(errors="replace"))
            per_step[found.group(1) if found else f"?{total}"] += 1
    return QueueSample(total, max(per_step.values(), default=0))


if __name__ == "__main__":
    main()
