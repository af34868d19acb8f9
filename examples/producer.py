"""A producer script: submit runs, follow one live, collect results.

Against a real model:   OPENAI_API_KEY=... python examples/producer.py
Against the scripted model (no network needed):  python examples/producer.py --scripted
A worker must be running: `tooloop worker --tools examples.tools` (for --scripted, with
OPENAI_API_KEY set to anything: the scripted server ignores it, litellm insists on one).
With --scripted, set TOOLOOP_ALLOWED_API_BASES=http://127.0.0.1:8765/v1 for the worker and for
this script: the operator allows the worker's key to go to that endpoint.
"""

from __future__ import annotations

import argparse

from orchestrator import Client, RunSpec

SCRIPTED_PORT = 8765  # the worker must allow this endpoint (TOOLOOP_ALLOWED_API_BASES)


def scripted_spec() -> RunSpec:
    from orchestrator.scripted_model import ScriptedModel

    server = ScriptedModel(port=SCRIPTED_PORT).start()
    model = server.script([
        {"tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]},
        {"content": "2 + 3 = 5"},
    ])  # fmt: skip
    params = {"api_base": server.api_base, "api_key_env": "OPENAI_API_KEY"}
    return RunSpec(prompt="What is 2 + 3?", model=model, model_params=params, tools=["add"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scripted", action="store_true", help="use a local scripted model")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    spec = scripted_spec() if args.scripted else RunSpec(
        prompt="What is 2 + 3? Use the add tool.", model="openai/gpt-4o-mini",
        model_params={"api_key_env": "OPENAI_API_KEY"}, tools=["add"], max_iterations=5,
    )  # fmt: skip
    client = Client()
    handles = [client.submit(spec) for _ in range(args.runs)]
    for event in handles[0].events(timeout=120):
        print("event:", event.type, event.model_dump(exclude={"id", "type", "ts"}, exclude_none=True))
    for handle in handles:
        result = handle.wait(timeout=300)
        print(handle.run_id, result.status.value, result.exit, repr(result.content), result.tokens_used)


if __name__ == "__main__":
    main()
