"""A tool call's three shapes, and which one is trusted.

- **stored**: what the turn writes beside the call's state (``call_args``, in the same
  script that records the model's reply, fenced by the turn's owner): the call as the
  model made it (tool, call id, arguments: sealed if they hold a secret) and routing
  hints (``allowed``, ``http``, ``approval``, ``timeout_s``) that only pick a queue, a
  time-limit backstop and the approval gate; ``agent`` marks a call of a child agent.
- **message**: the Celery task's argument (``orchestrator.calls.message``). It only
  names the call (run, iteration, index, key) and, for routing and monitors, the tool;
  the tool task reads nothing else from it. Whoever can write to the broker can name
  a call that exists, and nothing more: a stale or duplicated message is fenced by its generation.
- **view**: what the tool task runs with, derived from the run's stored spec and the
  stored call, which ``START_CALL`` returns in the same round trip that claims the call.
  Whether the tool is allowed, its sandbox folder and policy, bindings, time limit,
  declared HTTP tool and approval timeout all come from the spec.

Never imports litellm: the tool task uses this module.
"""

from __future__ import annotations

from typing import Any

from orchestrator.calls import message
from orchestrator.children import agent_of
from orchestrator.http_tools import declared
from orchestrator.keys import call_key
from orchestrator.models import RunSpec
from worker import protect
from worker.approval import gated


def stored_call(spec: RunSpec, run_id: str, iteration: int, index: int, call_id: str, name: str,
                arguments: str, catalog: dict[str, dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    """The call as the turn records it (see the module docstring)."""
    http = name in declared(spec)
    out: dict[str, Any] = {
        "run_id": run_id,
        "iteration": iteration,
        "index": index,
        "key": call_key(iteration, index),
        "call_id": call_id,
        "tool": name,
        "arguments": protect.protect_arguments(arguments, spec.tenant),  # sealed if secret
        "allowed": name in spec.tools or http,  # routing: the tool's own queue
        "timeout_s": spec.tool_timeout_s,  # the message's hard time limit, a backstop
    }
    if http:
        out["http"] = True  # routing: any tool worker sends a declared HTTP tool's request
    if gated(spec, name, catalog):
        out["approval"] = True  # parked until a person decides
    if agent := agent_of(name, spec):
        out["agent"] = agent  # starts a child run (worker/children.py)
    return out


def view(spec: RunSpec, stored: dict[str, Any]) -> dict[str, Any]:
    """What the tool task runs with: the stored call, widened only by the stored spec."""
    name, http = stored["tool"], declared(spec)
    return {
        **message(stored),
        "model_call_id": stored.get("model_call_id"),  # set when the model repeated a call id
        "arguments": protect.open_arguments(stored.get("arguments") or "{}", spec.tenant),
        "allowed": name in spec.tools or name in http,
        "allowed_tools": [*spec.tools, *http],
        "timeout_s": spec.tool_timeout_s,
        "sandbox_root": spec.context.sandbox_root,
        "bindings": spec.context.resource_bindings,
        "policy": spec.sandbox.model_dump(),
        "max_output_chars": spec.max_tool_output_chars,
        "scrub_model_input": spec.scrub_model_input,
        "tenant": spec.tenant,
        "http_tool": http[name].model_dump(mode="json") if name in http else None,
        "approval_timeout_s": spec.approval_timeout_s,
    }
