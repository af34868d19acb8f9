"""The only module that imports litellm; it does so lazily (the import costs ~6 s).

Tool workers, the CLI and the producer client never call into this module, so
they never pay for litellm.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from orchestrator.secrets import unseal

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


@dataclass
class Reply:
    message: dict[str, Any]  # the assistant message, OpenAI chat format
    tokens: int  # usage.total_tokens of this call


class ModelError(Exception):
    """A model call failed; ``error_type`` names the provider's exception."""

    def __init__(self, error_type: str, message: str) -> None:
        super().__init__(message)
        self.error_type = error_type


def preload() -> None:
    """Import litellm now (worker start), not on the first model call."""
    import litellm

    litellm.telemetry = False
    litellm.suppress_debug_info = True
    for name in ("LiteLLM", "LiteLLM Router", "LiteLLM Proxy"):  # INFO per call otherwise
        logging.getLogger(name).setLevel(logging.WARNING)


def resolve_params(params: dict[str, Any]) -> dict[str, Any]:
    """`api_key_env` -> the worker's environment; a sealed `api_key` -> clear text."""
    params = dict(params)
    env_name = params.pop("api_key_env", None)
    if env_name:
        key = os.environ.get(env_name)
        if key is None:
            raise ModelError("MissingApiKey", f"environment variable {env_name} is not set")
        params["api_key"] = key
    elif "api_key" in params:
        params["api_key"] = unseal(params["api_key"])
    return params


def complete(
    model: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    params: dict[str, Any],
) -> Reply:
    """One model call through litellm; any failure becomes ``ModelError``."""
    import litellm

    try:
        kwargs = resolve_params(params)
        stream = bool(kwargs.pop("stream", False))
        if tools:
            kwargs["tools"] = tools
        response = litellm.completion(model=model, messages=messages, stream=stream, **kwargs)
        if stream:
            response = litellm.stream_chunk_builder(list(response), messages=messages)
    except ModelError:
        raise
    except Exception as exc:
        raise ModelError(type(exc).__name__, str(exc)) from exc
    return Reply(assistant_message(response), total_tokens(response))


def assistant_message(response: Any) -> dict[str, Any]:
    message = response.choices[0].message
    out: dict[str, Any] = {"role": "assistant", "content": message.content}
    calls = getattr(message, "tool_calls", None) or []
    if calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": call.function.arguments},
            }
            for call in calls
        ]
    return out


def total_tokens(response: Any) -> int:
    usage = getattr(response, "usage", None)
    return int(getattr(usage, "total_tokens", 0) or 0)
