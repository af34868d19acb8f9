"""Orchestration overhead per tool turn, in raw Celery hops, measured in one run.

Four things are timed, interleaved, on the same machine and the same scripted
model (answering at once):
  hop        one-way: an empty Celery task sending the next one, turns <-> tools
             queues (the two hops of every tool turn, with the same app settings);
  call       a round trip as producers make them: apply_async -> result.get();
  in-process a plain litellm loop calling the model and running the tool inline;
  tooloop    the same turns as one tooloop run (submit -> result).
Reported: (tooloop - in-process) per turn, in one-way hops and in round-trip
calls. Target <= 2.5 raw hops.

    python bench/overhead.py [--turns 20] [--rounds 5]
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

from bench.common import environment, median, publish, scripted_spec


def add(a: int, b: int) -> int:
    return a + b


def steps(turns: int) -> list[dict]:
    call = {"tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]}
    return [call] * turns + [{"content": "done"}]


def in_process(model: str, api_base: str, turns: int, schema: list[dict]) -> float:
    import litellm

    messages: list[dict] = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    started = time.perf_counter()
    for _ in range(turns + 1):
        reply = litellm.completion(model=model, messages=messages, tools=schema, api_base=api_base,
                                   api_key="scripted")  # fmt: skip
        message = reply.choices[0].message
        if not message.tool_calls:
            break
        messages.append({"role": "assistant", "content": message.content, "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.function.name,
             "arguments": c.function.arguments}} for c in message.tool_calls]})  # fmt: skip
        for c in message.tool_calls:
            output = add(**json.loads(c.function.arguments))
            messages.append({"role": "tool", "tool_call_id": c.id, "content": json.dumps(output)})
    return time.perf_counter() - started


def distributed(client, model_server, model: str, turns: int) -> float:
    spec = scripted_spec(model_server, model, tools=["add"], max_iterations=turns + 1)
    started = time.perf_counter()
    result = client.submit(spec).wait(timeout=120)
    elapsed = time.perf_counter() - started
    assert result.status == "completed" and len(result.tool_calls) == turns, result
    return elapsed


def raw_hops(store, hops: int) -> float:
    from bench.hop_tasks import HOP_TASK
    from worker.app import app

    keys = store.keys
    done = f"{keys.prefix}:bench:{uuid.uuid4().hex}"
    started = time.perf_counter()
    app.send_task(HOP_TASK, args=(hops - 1, [keys.turn_queue, keys.tool_queue], done),
                  queue=keys.turn_queue, ignore_result=True)  # fmt: skip
    store.redis.blpop([done], timeout=60)
    return (time.perf_counter() - started) / hops


def round_trips(store, calls: int) -> float:
    from bench.hop_tasks import ECHO_TASK
    from worker.app import app

    started = time.perf_counter()
    for i in range(calls):
        assert app.send_task(ECHO_TASK, args=(i,), queue=store.keys.turn_queue).get(timeout=30) == i
    return (time.perf_counter() - started) / calls


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with ExitStack() as stack:
        env = environment(stack, "bench.hop_tasks,examples.tools")
        from orchestrator import Client
        from orchestrator.local import WorkerProcess
        from orchestrator.scripted_model import ScriptedModel
        from worker.registry import REGISTRY, load_tools

        load_tools(["examples.tools"])
        schema = [REGISTRY["add"].definition.to_openai()]
        model_server = ScriptedModel().start()
        stack.callback(model_server.stop)
        model = model_server.script(steps(args.turns))
        client = Client()
        worker = WorkerProcess("bench", env=env)
        stack.callback(worker.stop)
        worker.wait_ready(client.store)
        for _ in range(2):  # warm-up: connections, imports, caches
            in_process(model, model_server.api_base, args.turns, schema)
            distributed(client, model_server, model, args.turns)
            raw_hops(client.store, 2 * args.turns)
            round_trips(client.store, 10)
        hop, call, inproc, dist = [], [], [], []
        for _ in range(args.rounds):
            hop.append(raw_hops(client.store, 2 * args.turns + 1))
            call.append(round_trips(client.store, 20))
            inproc.append(in_process(model, model_server.api_base, args.turns, schema))
            dist.append(distributed(client, model_server, model, args.turns))
    report(args.turns, args.rounds, median(hop), median(call), median(inproc), median(dist))


def report(turns: int, rounds: int, hop: float, call: float, inproc: float, dist: float) -> None:
    turn_in, turn_dist = inproc / turns, dist / turns
    overhead = turn_dist - turn_in
    lines = [
        f"overhead per tool turn ({turns} turns x {rounds} rounds, medians, one run)",
        f"  raw Celery hop (turns<->tools)   {hop * 1000:7.2f} ms   one-way",
        f"  Celery call (apply_async + get)  {call * 1000:7.2f} ms   round trip",
        f"  in-process litellm loop / turn   {turn_in * 1000:7.2f} ms",
        f"  tooloop / turn                   {turn_dist * 1000:7.2f} ms",
        f"  overhead / turn                  {overhead * 1000:7.2f} ms",
        f"  overhead / turn in raw hops      {overhead / hop:7.2f}   (target <= 2.5)",
        f"  overhead / turn in Celery calls  {overhead / call:7.2f}",
    ]
    publish("overhead", lines)


if __name__ == "__main__":
    main()
