"""Tenant fair share (issue 26): a burst of one tenant against another's few runs, weights
over a window, and what an admission costs.

    python bench/fairshare.py [--quick] [--only burst,weights,admission] [--fifo]

1. burst: tenant A submits RUNS_A runs x 3 turns at once, then tenant B submits 20;
   the scripted model answers in 2 s; one `tooloop worker` with its defaults.
   - A alone, no fair share: A's throughput (turns/s), which sizes A's cap: the runs it
     needs in flight to keep the worker busy, x 1.5 (``--cap-factor``;
     TOOLOOP_TENANT_MAX_ACTIVE=A=<cap>);
   - B alone, under that setting: B's p95 (submit to end);
   - A then B, under that setting: B's p95 (target <= 1.5 x alone) and A's throughput
     (target within 10 % of alone);
   - with ``--fifo``, A then B with no fair share: what B suffers without it.
2. weights: tenants weighted 3:1 (TOOLOOP_TENANT_SHARES=heavy=3,light=1) share
   TOOLOOP_MAX_ACTIVE=24 slots, both with far more runs than they can run; light's turns
   cost 3x heavy's tokens. Tokens recorded over WINDOW_S (after a warm-up) must split
   3:1 within 10 %.
3. admission: at one tenant, the admission's round trips (ENQUEUE, then OPEN_GATE) as a
   producer sees them (p50, target < 1 ms), and Redis's CPU per admitted run (its
   admission and the PUMP at its end) and per billed reply (the tenant's token count).

``--quick``: 300 runs of A, a 30 s window, 500 admissions. Figures go to
docs/bench/fairshare.txt.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import procs
from bench.common import environment, publish, scripted_model, scripted_spec

DELAY_S = 2.0
TURNS = 3
RUNS_B = 20
WINDOW_S = 120.0
WARMUP_S = 30.0


def steps(delay: float, tokens: int = 30) -> list[dict]:
    call = {"delay": delay, "tokens": tokens, "tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]}
    return [call] * (TURNS - 1) + [{"delay": delay, "tokens": tokens, "content": "done"}]


class Deployment:
    """A key prefix of its own, its settings, one worker reading them."""

    def __init__(self, stack: ExitStack, env: dict[str, str], **fair: str) -> None:
        from orchestrator import Client
        from orchestrator.local import WorkerProcess
        from orchestrator.settings import Settings
        from orchestrator.store import RunStore

        self.env = {**env, "TOOLOOP_KEY_PREFIX": f"bench-{uuid.uuid4().hex[:8]}", **fair}
        fields = {k.removeprefix("TOOLOOP_").lower(): v for k, v in self.env.items()
                  if k.startswith("TOOLOOP_")}  # fmt: skip
        fields.pop("bench_model_port", None)
        self.settings = Settings(**fields)
        self.store = RunStore.from_settings(self.settings)
        self.client = Client(settings=self.settings, store=self.store)
        self.worker = WorkerProcess(self.env["TOOLOOP_KEY_PREFIX"], env=self.env)
        stack.callback(self.worker.stop)
        self.worker.wait_ready(self.store)

    def ended_at(self, run_id: str) -> float:
        return int(self.store.redis.hget(self.store.keys.run(run_id), "ended_at")) / 1000


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20)[-1] if len(values) > 1 else values[0]


# -- 1. burst ------------------------------------------------------------------------------
def submit(d: Deployment, spec: dict, tenant: str, n: int) -> list[tuple[str, float]]:
    """(run id, submit time) of ``n`` runs."""
    out = []
    for _ in range(n):
        at = time.time()
        out.append((d.client.submit({**spec, "tenant": tenant}).run_id, at))
    return out


FAILED_CALLS: list[int] = []  # tool calls that failed (a sick sandbox skews every figure)


def wait_all(d: Deployment, runs: list[tuple[str, float]], timeout: float = 3600) -> None:
    for run_id, _ in runs:
        result = d.client.get(run_id).wait(timeout=timeout)
        FAILED_CALLS.append(sum(not c.success for c in result.tool_calls))


def throughput(d: Deployment, runs: list[tuple[str, float]]) -> float:
    """Turns per second from the first submit to the last end."""
    return len(runs) * TURNS / (max(d.ended_at(r) for r, _ in runs) - runs[0][1])


def b_times(d: Deployment, runs: list[tuple[str, float]]) -> list[float]:
    return [d.ended_at(r) - at for r, at in runs]


def burst(stack: ExitStack, env: dict[str, str], model, runs_a: int, fifo: bool, factor: float) -> list[str]:
    spec = scripted_spec(model, model.script(steps(DELAY_S)), tools=["add"])
    alone = Deployment(stack, env)
    a_alone = submit(alone, spec, "A", runs_a)
    wait_all(alone, a_alone)
    rate = throughput(alone, a_alone)
    alone.worker.stop()
    cap = math.ceil(factor * rate * DELAY_S)
    lines = [f"  A alone (no fair share): {runs_a} runs x {TURNS} turns in "
             f"{runs_a * TURNS / rate:.1f} s: {rate:.1f} turns/s",
             f"  A's cap: {factor:g} x {rate:.1f} turns/s x {DELAY_S:g} s = {cap} runs "
             f"(TOOLOOP_TENANT_MAX_ACTIVE=A={cap})"]  # fmt: skip
    fair = Deployment(stack, env, TOOLOOP_TENANT_MAX_ACTIVE=f"A={cap}")
    b_alone = submit(fair, spec, "B", RUNS_B)
    wait_all(fair, b_alone)
    base = p95(b_times(fair, b_alone))
    median = statistics.median(b_times(fair, b_alone))
    lines.append(f"  B alone: {RUNS_B} runs, p95 {base:.2f} s (median {median:.2f} s)")
    a_runs = submit(fair, spec, "A", runs_a)
    b_runs = submit(fair, spec, "B", RUNS_B)
    wait_all(fair, b_runs + a_runs)
    b_p95, a_rate = p95(b_times(fair, b_runs)), throughput(fair, a_runs)
    fair.worker.stop()
    lines += [f"  A then B, fair share: B p95 {b_p95:.2f} s = {b_p95 / base:.2f} x alone (target <= 1.5); "
              f"A {a_rate:.1f} turns/s = {a_rate / rate:.3f} of alone (target >= 0.90)"]  # fmt: skip
    if fifo:
        plain = Deployment(stack, env)
        a_runs, b_runs = submit(plain, spec, "A", runs_a), []
        b_runs = submit(plain, spec, "B", RUNS_B)
        wait_all(plain, b_runs + a_runs)
        b_fifo = p95(b_times(plain, b_runs))
        lines.append(f"  A then B, no fair share (FIFO): B p95 {b_fifo:.2f} s = {b_fifo / base:.2f} x alone; "
                     f"A {throughput(plain, a_runs):.1f} turns/s")  # fmt: skip
        plain.worker.stop()
    return lines


# -- 2. weights ----------------------------------------------------------------------------
def weights(stack: ExitStack, env: dict[str, str], model, window_s: float) -> list[str]:
    from orchestrator import fairshare

    slots, delay = 24, 1.0
    d = Deployment(stack, env, TOOLOOP_MAX_ACTIVE=str(slots), TOOLOOP_TENANT_SHARES="heavy=3,light=1")
    specs = {t: scripted_spec(model, model.script(steps(delay, tokens=cost)), tools=["add"])
             for t, cost in (("heavy", 100), ("light", 300))}  # fmt: skip
    # more runs than the window can run: both tenants saturate throughout
    turns_per_s = slots / delay
    need = int(turns_per_s * (window_s + WARMUP_S) / TURNS) + 50
    for i in range(need):
        for tenant in ("heavy", "light"):
            if tenant == "heavy" or i % 2 == 0:
                d.client.submit({**specs[tenant], "tenant": tenant})
    fair = fairshare.of(d.store)
    assert fair is not None
    time.sleep(WARMUP_S)
    before = fair.read_tokens()[1]
    time.sleep(window_s)
    after = fair.read_tokens()[1]
    spent = {t: after.get(t, 0) - before.get(t, 0) for t in ("heavy", "light")}
    waiting = {s.tenant: s.waiting for s in fair.shares()}
    d.worker.kill()
    ratio = spent["heavy"] / max(1, spent["light"])
    return [f"  {slots} slots (TOOLOOP_MAX_ACTIVE), weights heavy=3 light=1; a turn costs heavy 100, "
            f"light 300 tokens; model {delay:g} s",
            f"  tokens over {window_s:g} s after {WARMUP_S:g} s of warm-up: heavy {spent['heavy']}, "
            f"light {spent['light']}: {ratio:.2f} : 1 (target 3 +- 10 %: 2.70 to 3.30)",
            f"  still waiting at the end: heavy {waiting.get('heavy')}, light {waiting.get('light')} "
            "(both saturated throughout)"]  # fmt: skip


# -- 3. admission --------------------------------------------------------------------------
def admission(stack: ExitStack, env: dict[str, str], n: int) -> list[str]:
    from orchestrator import fairshare
    from orchestrator.models import RunSpec
    from orchestrator.settings import Settings
    from orchestrator.store import RunStore

    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    settings = Settings(redis_url=env["TOOLOOP_REDIS_URL"], key_prefix=prefix, tenant_max_active="A=1000000")
    store = RunStore.from_settings(settings)
    fair = fairshare.of(store)
    assert fair is not None
    spec = RunSpec(prompt="u", model="openai/x", tenant="A")
    messages = [{"role": "user", "content": "u"}]
    ids = [uuid.uuid4().hex for _ in range(2 * n)]
    gated, plain = ids[:n], ids[n:]
    for run_id in gated:
        store.create(run_id, spec, messages, "gate")
    for run_id in plain:
        store.create(run_id, spec, messages, "")

    def redis_cpu() -> float:
        """Seconds Redis spent executing commands (INFO commandstats: finer than /proc's ticks)."""
        return sum(v["usec"] for k, v in store.redis.info("commandstats").items()) / 1e6

    latency: list[float] = []
    cpu0 = redis_cpu()
    for run_id in gated:
        start = time.perf_counter()
        assert fair.enqueue(run_id, "A") == "a"
        store.open_gates([run_id])
        latency.append(time.perf_counter() - start)
    for run_id in gated:
        fair.move(run_id, "end")
    admit_cpu = (redis_cpu() - cpu0) / n
    cpu0 = redis_cpu()
    for run_id in gated:
        store.add_usage(run_id, "judge", 30)
    fair_usage = (redis_cpu() - cpu0) / n
    cpu0 = redis_cpu()
    for run_id in plain:
        store.add_usage(run_id, "judge", 30)
    plain_usage = (redis_cpu() - cpu0) / n  # (each INFO call counts too: the same in both)
    latency.sort()
    return [f"  {n} runs admitted at one tenant (ENQUEUE + OPEN_GATE, each a round trip):",
            f"    latency added per run: p50 {latency[len(latency) // 2] * 1e3:.3f} ms, "
            f"p95 {latency[int(len(latency) * 0.95)] * 1e3:.3f} ms (target p50 < 1 ms)",
            f"    Redis CPU per admitted run: {admit_cpu * 1e6:.1f} us (its admission and the PUMP at its "
            f"end; a {TURNS}-turn run: {admit_cpu * 1e6 / TURNS:.1f} us per turn)",
            f"    Redis CPU per billed reply: {fair_usage * 1e6:.1f} us under fair share, "
            f"{plain_usage * 1e6:.1f} us without (the tenant's token count, in the billing script; "
            "INFO commandstats)",
            "  with no TOOLOOP_TENANT_* / TOOLOOP_MAX_ACTIVE set, a run is written ungated and no fair-share "
            "script runs: nothing is added to a turn"]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="300 runs of A, a 30 s window, 500 admissions")
    parser.add_argument("--only", default="burst,weights,admission")
    parser.add_argument("--fifo", action="store_true", help="also A then B with no fair share")
    parser.add_argument("--cap-factor", type=float, default=1.5,
                        help="A's cap: this x A's throughput alone x the model's latency")  # fmt: skip
    args = parser.parse_args()
    only = set(args.only.split(","))
    runs_a, window_s, n = (300, 30.0, 500) if args.quick else (2000, WINDOW_S, 2000)
    lines = [f"bench/fairshare.py{' --quick' if args.quick else ''} (git {procs.git_head()})",
             procs.load_average()]  # fmt: skip
    with ExitStack() as stack:
        env = environment(stack, "tests.tools")
        model = scripted_model()
        stack.callback(model.stop)
        import redis

        lines += procs.machine(redis.Redis.from_url(env["TOOLOOP_REDIS_URL"]))
        if "admission" in only:
            lines += ["admission cost", *admission(stack, env, n)]
        if "burst" in only:
            title = (f"burst: A {runs_a} runs x {TURNS} turns, then B {RUNS_B}; model {DELAY_S:g} s; "
                     "one worker")
            lines += [title, *burst(stack, env, model, runs_a, args.fifo, args.cap_factor)]
        if "weights" in only:
            lines += ["weights 3:1, both saturating", *weights(stack, env, model, window_s)]
    if sum(FAILED_CALLS):
        lines.append(f"WARNING: {sum(FAILED_CALLS)} tool calls failed: these figures do not hold")
    one, five = os.getloadavg()[:2]
    lines.append(f"load average at the end: {one:.2f} / {five:.2f} (1 / 5 min)")
    publish("fairshare" + ("_quick" if args.quick else ""), lines)


if __name__ == "__main__":
    main()
