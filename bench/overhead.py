"""Latency overhead per tool-turn against an in-process litellm loop, in ms and raw Celery hops.

One definition: per-turn time = (T(20 turns) - T(1 turn)) / 19, which drops what a
run costs once (submit, the first and last steps, the wait); overhead = tooloop's
per-turn time - the in-process loop's. Realistic spec: six tools declared, one
(``add``) called per turn; the scripted model answers at once.

  in-process  a plain litellm loop calling the model, running the tool inline;
  tooloop     the same turns as one tooloop run: Client.submit(spec).wait();
  raw hop     one-way: an empty Celery task sending the next one, turns <-> tools
              queues (the route of a tool-turn, the same app settings).

Rounds are interleaved; medians of one run. Target: <= 4 raw hops.

    python bench/overhead.py [--turns 20] [--rounds 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import procs
from bench.common import environment, json_option, median, publish, scripted_model, scripted_spec, write_json

TOOLS = ["add", "multiply", "word_count", "read_file", "write_file", "list_dir"]  # one called


def add(a: int, b: int) -> int:
    return a + b


def steps(turns: int) -> list[dict]:
    call = {"tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]}
    return [call] * turns + [{"content": "done"}]


def in_process(model: str, api_base: str, schema: list[dict]) -> float:
    import litellm

    messages: list[dict] = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    started = time.perf_counter()
    while True:
        reply = litellm.completion(model=model, messages=messages, tools=schema, api_base=api_base,
                                   api_key="scripted")  # fmt: skip
        message = reply.choices[0].message
        if not message.tool_calls:
            return time.perf_counter() - started
        messages.append({"role": "assistant", "content": message.content, "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.function.name,
             "arguments": c.function.arguments}} for c in message.tool_calls]})  # fmt: skip
        for c in message.tool_calls:
            output = add(**json.loads(c.function.arguments))
            messages.append({"role": "tool", "tool_call_id": c.id, "content": json.dumps(output)})


def distributed(client, model_server, model: str, turns: int) -> float:
    spec = scripted_spec(model_server, model, tools=TOOLS, max_iterations=turns + 1)
    started = time.perf_counter()
    result = client.submit(spec).wait(timeout=120)
    elapsed = time.perf_counter() - started
    assert result.status == "completed" and len(result.tool_calls) == turns, result
    return elapsed


def raw_hop(store, hops: int) -> float:
    from bench.hop_tasks import HOP_TASK
    from worker.app import app

    keys = store.keys
    done = f"{keys.prefix}:bench:{uuid.uuid4().hex}"
    started = time.perf_counter()
    app.send_task(HOP_TASK, args=(hops - 1, [keys.turn_queue, keys.tool_queue], done),
                  queue=keys.turn_queue, ignore_result=True)  # fmt: skip
    store.redis.blpop([done], timeout=60)
    return (time.perf_counter() - started) / hops


def worker_code(store) -> list[str]:
    """The files of ``orchestrator`` and ``worker`` as a turn process and a tool process imported them."""
    from bench.hop_tasks import WHERE_TASK
    from worker.app import app

    done = f"{store.keys.prefix}:bench:{uuid.uuid4().hex}"
    for queue in (store.keys.turn_queue, store.keys.tool_queue):
        app.send_task(WHERE_TASK, args=(done,), queue=queue, ignore_result=True)
    replies = [store.redis.blpop([done], timeout=60) for _ in range(2)]
    return sorted({path for reply in replies if reply for path in json.loads(reply[1])})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    json_option(parser)
    args = parser.parse_args()
    with ExitStack() as stack:
        env = environment(stack, "bench.hop_tasks,examples.tools")
        from orchestrator import Client
        from orchestrator.local import WorkerProcess
        from worker.registry import REGISTRY, load_tools

        load_tools(["examples.tools", "worker.builtins"])
        schema = [REGISTRY[name].definition.to_openai() for name in TOOLS]
        model_server = scripted_model()
        stack.callback(model_server.stop)
        long, short = model_server.script(steps(args.turns)), model_server.script(steps(1))
        client = Client()
        worker = WorkerProcess("bench", env=env)
        stack.callback(worker.stop)
        worker.wait_ready(client.store)
        head = [*procs.machine(client.store.redis), procs.load_average()]
        code = worker_code(client.store) if args.json else []
        api = model_server.api_base
        times: dict[str, list[float]] = {"hop": [], "in20": [], "in1": [], "tl20": [], "tl1": []}
        for round_ in range(args.rounds + 2):  # two warm-up rounds: connections, imports, caches
            sample = {
                "hop": raw_hop(client.store, 2 * args.turns + 1),
                "in20": in_process(long, api, schema), "in1": in_process(short, api, schema),
                "tl20": distributed(client, model_server, long, args.turns),
                "tl1": distributed(client, model_server, short, 1),
            }  # fmt: skip
            if round_ >= 2:
                for name, value in sample.items():
                    times[name].append(value)
    figures = report(args.turns, args.rounds, head, {k: median(v) for k, v in times.items()})
    write_json(args.json, {**figures, "worker_code": code})


def report(turns: int, rounds: int, head: list[str], t: dict[str, float]) -> dict[str, float]:
    per_in = (t["in20"] - t["in1"]) / (turns - 1)
    per_tl = (t["tl20"] - t["tl1"]) / (turns - 1)
    overhead = per_tl - per_in
    lines = [
        f"latency overhead per tool-turn: (T({turns} turns) - T(1 turn)) / {turns - 1}, six tools declared, "
        f"one called, medians of {rounds} rounds, one run",
        *head,
        f"  raw Celery hop (turns <-> tools)   {t['hop'] * 1000:7.2f} ms   one-way",
        f"  in-process litellm loop / turn     {per_in * 1000:7.2f} ms",
        f"  tooloop (submit + wait) / turn     {per_tl * 1000:7.2f} ms",
        f"  overhead / turn                    {overhead * 1000:7.2f} ms",
        f"  overhead / turn in raw hops        {overhead / t['hop']:7.2f}   (target <= 4)",
    ]
    publish("overhead", lines)
    return {"hop_ms": t["hop"] * 1000, "in_process_ms": per_in * 1000, "tooloop_ms": per_tl * 1000,
            "overhead_ms": overhead * 1000, "overhead_hops": overhead / t["hop"]}  # fmt: skip


if __name__ == "__main__":
    main()
