"""CPU per model call: litellm (as a turn makes it) against the same request by hand.

The scripted model runs in another process (its CPU is not counted) and answers at once;
six tools declared, a two-message history. In this process, on one event loop, rounds
interleaved, medians:

  direct       ``worker.llm.acomplete`` as a turn makes it: litellm's OpenAI provider config
               builds the request, one shared aiohttp session sends it (worker/openai_route.py);
  litellm      the same with ``TOOLOOP_MODEL_ROUTE=litellm``: litellm.acompletion with
               tooloop's settings (its pricing and success logging skipped, see
               worker/llm.py), the OpenAI SDK, httpx over litellm's aiohttp transport;
  raw aiohttp  the same JSON POST with one aiohttp session, the reply parsed: the floor.

    python bench/llm_call_cpu.py [--rounds 5] [--calls 200]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SERVER = """
import sys, time
sys.path.insert(0, sys.argv[1])
from orchestrator.scripted_model import ScriptedModel
model = ScriptedModel().start()
model.script([{"tool_calls": [{"name": "t0", "arguments": {"a": 2}}]}] * 10**6, name="bench")
print(model.api_base, flush=True)
time.sleep(10**6)
"""
TOOLS = [{"type": "function", "function": {"name": f"t{i}", "description": "A tool.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}}}} for i in range(6)]  # fmt: skip
MESSAGES = [{"role": "system", "content": "You add."}, {"role": "user", "content": "2 + 3?"}]


async def measure(api_base: str, rounds: int, calls: int) -> dict[str, list[float]]:
    import aiohttp

    from worker import llm

    llm.preload()
    params = {"api_base": api_base, "api_key": "scripted"}
    session = aiohttp.ClientSession()

    async def via_llm() -> None:
        reply = await llm.acomplete("openai/bench", MESSAGES, TOOLS, params, "bench")
        assert reply.message["tool_calls"]

    async def direct() -> None:
        os.environ["TOOLOOP_MODEL_ROUTE"] = "direct"
        await via_llm()

    async def via_litellm() -> None:
        os.environ["TOOLOOP_MODEL_ROUTE"] = "litellm"
        await via_llm()

    async def raw() -> None:
        body = {"model": "bench", "messages": MESSAGES, "tools": TOOLS}
        async with session.post(f"{api_base}/chat/completions", json=body) as response:
            assert json.loads(await response.read())["choices"][0]["message"]["tool_calls"]

    async def cpu_ms(call) -> float:
        before = os.times()
        for _ in range(calls):
            await call()
        after = os.times()
        return (after.user - before.user + after.system - before.system) / calls * 1000

    routes = {"direct": direct, "litellm": via_litellm, "raw aiohttp": raw}
    samples: dict[str, list[float]] = {name: [] for name in routes}
    for call in routes.values():
        for _ in range(20):  # warm: imports, connection pools, caches
            await call()
    for _ in range(rounds):
        for name, call in routes.items():
            samples[name].append(await cpu_ms(call))
    await session.close()
    return samples


def main() -> None:
    from bench.common import median, write_result

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    root = str(Path(__file__).resolve().parent.parent)
    server = subprocess.Popen([sys.executable, "-c", SERVER, root], stdout=subprocess.PIPE, text=True)
    try:
        api_base = server.stdout.readline().strip()
        samples = asyncio.run(measure(api_base, args.rounds, args.calls))
    finally:
        server.kill()
    from importlib.metadata import version

    got = {name: median(values) for name, values in samples.items()}
    lines = [
        f"# python bench/llm_call_cpu.py --rounds {args.rounds} --calls {args.calls}",
        f"# {os.cpu_count()} cpus, load {os.getloadavg()[0]:.2f}, litellm {version('litellm')}; "
        "CPU of this process per call, medians of rounds",
        *(f"{name:<12} {ms:6.2f} ms   rounds: {', '.join(f'{v:.2f}' for v in samples[name])}"
          for name, ms in got.items()),
        f"litellm / raw: x{got['litellm'] / got['raw aiohttp']:.1f}; direct / raw: "
        f"x{got['direct'] / got['raw aiohttp']:.1f}; direct / litellm: x{got['direct'] / got['litellm']:.2f}",
    ]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    print(f"written to {write_result('llm_call_cpu', text)}", file=sys.stderr)


if __name__ == "__main__":
    main()
