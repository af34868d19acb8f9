"""Throughput per broker/store pairing: the same workload on each, in one run.

Pairings (broker/store):
  redis/redis      one Redis as broker and store (the baseline)
  amqp/redis       RabbitMQ as broker, a Redis as store
  redis/cluster    a plain Redis as broker, a Redis Cluster (3 primaries) as store
  amqp/cluster     RabbitMQ as broker, the Redis Cluster as store

The bench starts its own servers (private redis-servers on loopback, a RabbitMQ vhost
of its own, a cluster started by tests/servers.py); every round of a pairing has a key
prefix of its own and one fresh ``tooloop worker`` with its defaults. The workload:
--runs runs submitted at once, each --turns turns that call the ``add`` tool, then an
answer; the scripted model answers at once, so the figure is what the broker, the store
and tooloop's own CPU allow. A tool-turn is a model turn plus the tool call it asked
for. After a few warm-up runs, wall time runs from the first submit to the last run's
``ended_at``; --rounds repeats the four pairings, interleaved, and the median is kept.
Printed: tool-turns/s per pairing, as a ratio to redis/redis, and the CPU of the worker
and the pairing's Redis servers per tool-turn (RabbitMQ's own CPU is not counted: its
node is shared with the rest of the machine).

    python bench/scale.py [--runs 200] [--turns 3] [--rounds 2] [--replicas 0]
                          [--pairings redis/redis,amqp/redis,redis/cluster,amqp/cluster]
                          [--amqp amqp://guest:guest@127.0.0.1:5672/]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import procs
from bench.common import environment, private_redis, publish, scripted_model, scripted_spec

PAIRINGS = ("redis/redis", "amqp/redis", "redis/cluster", "amqp/cluster")
WARM_UP = 4  # runs before the clock starts: every process has imported and connected


@dataclass
class Pairing:
    name: str
    env: dict[str, str]  # TOOLOOP_* overrides for the producer and the worker
    server_pids: list[int] = field(default_factory=list)  # Redis servers whose CPU counts
    rates: list[float] = field(default_factory=list)  # tool-turns/s, one per round
    cpu_ms: list[float] = field(default_factory=list)  # CPU ms per tool-turn, one per round
    failures: list[str] = field(default_factory=list)  # rounds that did not finish, and why


def servers(stack: ExitStack, args: argparse.Namespace, store_url: str) -> dict[str, tuple[str, list[int]]]:
    """URL and server pids of each kind of server the pairings use."""
    from bench.common import REDIS_PID
    from tests.servers import RabbitVhost, RedisCluster, amqp_answers

    made = {"store": (store_url, list(REDIS_PID))}  # environment()'s private Redis
    made["broker"] = (private_redis(stack), list(REDIS_PID))  # the broker beside the cluster
    cluster = RedisCluster(masters=3, replicas=args.replicas)
    stack.callback(cluster.stop)
    made["cluster"] = (cluster.url, [p.pid for p in cluster.procs.values()])
    if any(name.startswith("amqp/") for name in args.pairings):
        if not amqp_answers(args.amqp):
            raise SystemExit(
                f"RabbitMQ does not answer at {args.amqp} (--amqp; or leave out the amqp pairings)"
            )
        vhost = RabbitVhost(args.amqp, f"tooloop-bench-{uuid.uuid4().hex[:8]}")
        stack.callback(vhost.delete)
        made["amqp"] = (vhost.url, [])
    return made


def pairings(made: dict[str, tuple[str, list[int]]], names: list[str]) -> list[Pairing]:
    out = []
    for name in names:
        broker, store = name.split("/")
        store_url, pids = made["store"] if store == "redis" else made["cluster"]
        env = {"TOOLOOP_REDIS_URL": store_url, "TOOLOOP_KEY_PREFIX": f"bench-{uuid.uuid4().hex[:8]}"}
        if broker == "amqp":
            env["TOOLOOP_BROKER_URL"] = made["amqp"][0]
        elif store == "cluster":  # kombu cannot use a cluster: a plain Redis beside it
            env["TOOLOOP_BROKER_URL"] = made["broker"][0]
            pids = pids + made["broker"][1]
        out.append(Pairing(name, env, list(pids)))
    return out


def one_round(pairing: Pairing, base_env: dict[str, str], model_server, args) -> None:
    from orchestrator import Client
    from orchestrator.local import WorkerProcess
    from orchestrator.settings import Settings
    from orchestrator.store import RunStore

    prefix = f"{pairing.env['TOOLOOP_KEY_PREFIX']}-{len(pairing.rates)}"  # a fresh one per round
    env = {**base_env, **pairing.env, "TOOLOOP_KEY_PREFIX": prefix}
    settings = Settings(redis_url=env["TOOLOOP_REDIS_URL"], broker_url=env.get("TOOLOOP_BROKER_URL"),
                        key_prefix=prefix)  # fmt: skip
    store = RunStore.from_settings(settings)
    client = Client(settings=settings, store=store)
    worker = WorkerProcess(f"scale-{pairing.name.replace('/', '-')}", env=env)
    try:
        worker.wait_ready(store, timeout=300)
        steps = [{"tool_calls": [{"name": "add", "arguments": {"a": i, "b": 1}}]} for i in range(args.turns)]
        spec = scripted_spec(model_server, model_server.script([*steps, {"content": "done"}]), tools=["add"])
        for handle in [client.submit(spec) for _ in range(WARM_UP)]:  # imports, pools, scripts loaded
            handle.wait(timeout=300)
        cpu0 = procs.cpu_of_tree(worker.proc.pid) + sum(procs.cpu_of(p) for p in pairing.server_pids)
        started = time.time()
        handles = [client.submit(spec) for _ in range(args.runs)]
        results = [h.wait(timeout=900) for h in handles]
        cpu = procs.cpu_of_tree(worker.proc.pid) + sum(procs.cpu_of(p) for p in pairing.server_pids) - cpu0
        failed = [r.status for r in results if r.status != "completed"]
        if failed:
            raise SystemExit(f"{pairing.name}: {len(failed)} runs did not complete: {failed[:3]}")
        ended = max(int(store.redis.hget(store.keys.run(h.run_id), "ended_at")) for h in handles) / 1000
        tool_turns = args.runs * args.turns
        pairing.rates.append(tool_turns / (ended - started))
        pairing.cpu_ms.append(cpu / tool_turns * 1000)
    finally:
        worker.stop()
        _cleanup(store, client, pairing)


def _cleanup(store, client, pairing: Pairing) -> None:
    """The round's keys gone from its store (a cluster: node by node), and its queues from
    a plain Redis broker (the vhost goes with the bench)."""
    import redis
    from redis.cluster import RedisCluster

    nodes = store.redis.get_primaries() if isinstance(store.redis, RedisCluster) else [None]
    for node in nodes:
        r = node.redis_connection if node is not None else store.redis
        for key in r.scan_iter(f"{store.keys.prefix}*", count=1000):
            r.delete(key)
    broker = pairing.env.get("TOOLOOP_BROKER_URL", "")
    if broker.startswith("redis"):
        plain = redis.Redis.from_url(broker)
        for key in plain.scan_iter(f"{store.keys.prefix}*", count=1000):
            plain.delete(key)


def report(done: list[Pairing], args, redis_client) -> list[str]:
    base = statistics.median(done[0].rates) if done[0].rates else float("nan")
    lines = [
        f"Throughput per broker/store pairing: {args.runs} runs x {args.turns} tool-turns each, "
        f"scripted model answering at once, one `tooloop worker` (defaults); median of {args.rounds} "
        f"round(s), pairings interleaved",
        f"  cluster: 3 primaries, {args.replicas} replica(s) each; RabbitMQ: a vhost of the bench's own",
        *procs.machine(redis_client),
        f"  {procs.load_average()}; commit {procs.git_head()}",
        "",
        f"  {'broker/store':14s} {'tool-turns/s':>13s} {'vs ' + done[0].name:>15s} {'CPU per tool-turn':>19s}"
        f"   rounds (tool-turns/s)",
    ]
    for p in done:
        if not p.rates:
            lines.append(f"  {p.name:14s} no round finished")
            continue
        rate = statistics.median(p.rates)
        rounds = ", ".join(f"{r:.1f}" for r in p.rates)
        cpu = statistics.median(p.cpu_ms)
        lines.append(f"  {p.name:14s} {rate:13.1f} {rate / base:14.2f}x {cpu:14.1f} ms   {rounds}")
    lines += [f"  {p.name}: {failure}" for p in done for failure in p.failures]
    lines += ["", "  CPU: the worker's process tree and the Redis servers of the pairing (not RabbitMQ's)."]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--replicas", type=int, default=0, help="replicas per cluster primary")
    parser.add_argument(
        "--amqp", default=os.environ.get("TOOLOOP_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
    )
    parser.add_argument("--pairings", default=",".join(PAIRINGS),
                        help="comma-separated, the first is the baseline of the ratios")  # fmt: skip
    parser.add_argument("--no-write", action="store_true", help="print only (no docs/bench/scale.txt)")
    args = parser.parse_args()
    args.pairings = [name.strip() for name in args.pairings.split(",") if name.strip()]
    unknown = set(args.pairings) - set(PAIRINGS)
    if unknown:
        parser.error(f"--pairings: unknown {sorted(unknown)}; known: {', '.join(PAIRINGS)}")
    with ExitStack() as stack:
        base_env = environment(stack, "tests.tools")
        store_url = base_env.pop("TOOLOOP_REDIS_URL")  # each pairing sets its own
        base_env.pop("TOOLOOP_KEY_PREFIX")
        model_server = scripted_model()
        stack.callback(model_server.stop)
        made = servers(stack, args, store_url)
        done = pairings(made, args.pairings)
        for round_no in range(args.rounds):
            for pairing in done:
                print(f"round {round_no + 1}: {pairing.name} ...", file=sys.stderr, flush=True)
                try:
                    one_round(pairing, base_env, model_server, args)
                    rate, cpu = pairing.rates[-1], pairing.cpu_ms[-1]
                    print(
                        f"  {rate:.1f} tool-turns/s, {cpu:.1f} ms CPU per tool-turn",
                        file=sys.stderr,
                        flush=True,
                    )
                except (TimeoutError, SystemExit) as exc:  # e.g. a broker that stopped answering
                    pairing.failures.append(f"round {round_no + 1}: {str(exc).splitlines()[0]}")
                    print(f"  failed: {pairing.failures[-1]}", file=sys.stderr, flush=True)
        import redis

        lines = report(done, args, redis.Redis.from_url(made["store"][0]))
        if args.no_write:
            print("\n".join(lines))
        else:
            publish("scale", lines)


if __name__ == "__main__":
    main()
