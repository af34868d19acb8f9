"""The agent as a DBOS workflow: one step per model call, one per tool call. Module-level,
so that a restarted process registers the same functions and recovers the workflow."""

from __future__ import annotations

from dbos import DBOS

from bench.peers.loop import SCHEMA, litellm_message, run_loop, tool_output
from bench.peers.systems import quiet_litellm

litellm = quiet_litellm()


@DBOS.step()
def model_step(model: str, api_base: str, messages: list[dict]) -> dict:
    reply = litellm.completion(model=model, messages=messages, tools=SCHEMA, api_base=api_base,
                               api_key="scripted")  # fmt: skip
    return litellm_message(reply)


@DBOS.step()
def tool_step(arguments: str, folder: str) -> str:
    return tool_output(arguments, folder)


@DBOS.workflow()
def agent(model: str, api_base: str, folder: str) -> str:
    return run_loop(lambda messages: model_step(model, api_base, messages),
                    lambda arguments: tool_step(arguments, folder))  # fmt: skip
