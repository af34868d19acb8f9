"""The direct route for OpenAI-compatible chat completions: litellm's provider config
around one shared aiohttp session per process, without the rest of litellm's per-call path.

``litellm.acompletion`` costs ~10 ms of CPU per call against ~1 ms for the same POST
by hand (``bench/llm_call_cpu.py``): it builds its parameters and a logging object, the
OpenAI SDK builds an httpx request and parses the reply into its types. For the calls
this route covers, the request is built by litellm's own ``OpenAIGPTConfig`` (the body,
the URL, the headers: what litellm would send), sent on this process's session, and
the reply read into plain attributes (``choices[0].message``, ``usage``, ``model``:
what worker/llm.py reads). An error status is mapped by litellm's own mapping
(``exception_type``), so a 429 is a ``RateLimitError`` with its ``Retry-After``, a
refused connection what litellm reports, a context-window refusal a
``ContextWindowExceededError``, as before (``tests/test_model_route.py`` compares both
routes on the wire, reply and errors).

Covered: a non-streaming call of an ``openai/`` model with an explicit ``api_base`` and
``api_key``, whose other params are plain chat-completion params, while no litellm
callback is set. Everything else (other providers, streaming, custom headers, litellm
callbacks) goes through ``litellm.acompletion`` unchanged. ``TOOLOOP_MODEL_ROUTE=litellm``
sends every call there.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import logging
import os
from types import SimpleNamespace
from typing import Any

# plain chat-completion params: the body carries them as they are
PLAIN_PARAMS = frozenset({
    "tools", "tool_choice", "parallel_tool_calls", "temperature", "top_p", "max_tokens",
    "max_completion_tokens", "seed", "stop", "presence_penalty", "frequency_penalty", "user",
    "response_format", "logit_bias", "n", "reasoning_effort",
})  # fmt: skip
PROVIDER = "openai"
log = logging.getLogger(__name__)
USAGE = ("prompt_tokens", "completion_tokens", "total_tokens")

_config: list[Any] = []
_sessions: dict[tuple[int, int], Any] = {}  # (pid, id of the loop) -> its aiohttp session


def enabled() -> bool:
    return os.environ.get("TOOLOOP_MODEL_ROUTE", "direct") != "litellm"


def covers(model: str, kwargs: dict[str, Any], stream: bool) -> bool:
    """Whether this route sends the call (else ``litellm.acompletion`` does)."""
    if stream or not enabled() or not model.startswith(f"{PROVIDER}/"):
        return False
    if not isinstance(kwargs.get("api_base"), str) or not isinstance(kwargs.get("api_key"), str):
        return False
    if any(name not in PLAIN_PARAMS for name in kwargs if name not in ("api_base", "api_key")):
        return False
    import litellm

    return not (litellm.callbacks or litellm.success_callback or litellm.failure_callback
                or litellm._async_success_callback or litellm._async_failure_callback)  # fmt: skip


def config() -> Any:
    if not _config:
        from litellm.llms.openai.chat.gpt_transformation import OpenAIGPTConfig

        _config.append(OpenAIGPTConfig())
    return _config[0]


def session() -> Any:
    """This process's session on the running loop: one connection pool, kept alive."""
    import aiohttp

    loop = asyncio.get_running_loop()
    key = (os.getpid(), id(loop))
    current = _sessions.get(key)
    if current is None or current.closed:
        # no cap on connections: every model call of the process may be in flight at once
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, loop=loop)
        current = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))
        _sessions[key] = current
    return current


@atexit.register
def _forget_sessions() -> None:
    """At exit, close the pools' sockets without their loop (it may be gone already):
    aiohttp would otherwise warn of an unclosed session from its finalizers."""
    for current in _sessions.values():
        with contextlib.suppress(Exception):
            if current.connector is not None:
                current.connector._close()  # sync: closes the transports it holds
            current._connector = None  # ``closed`` from now on
    _sessions.clear()


async def acomplete(model: str, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> Any:
    """One request; the reply as attributes, or litellm's exception for what went wrong."""
    import aiohttp

    bare = model.split("/", 1)[1]
    api_base, api_key = kwargs["api_base"], kwargs["api_key"]
    optional = {k: v for k, v in kwargs.items() if k not in ("api_base", "api_key")}
    litellm_params = {"custom_llm_provider": PROVIDER, "api_base": api_base}
    cfg = config()
    body = cfg.transform_request(bare, messages, optional, litellm_params, {})
    headers = cfg.validate_environment({}, bare, messages, optional, litellm_params, api_key, api_base)
    url = cfg.get_complete_url(api_base, api_key, bare, optional, litellm_params)
    try:
        async with session().post(url, data=json.dumps(body), headers=headers) as response:
            raw = await response.read()
            status, response_headers = response.status, dict(response.headers)
    except aiohttp.ClientError as exc:
        raise _connection_error(bare, api_base, exc) from None
    if status >= 400:
        raise _status_error(bare, api_base, status, raw.decode(errors="replace"), response_headers)
    try:
        return _reply(json.loads(raw))
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
        text = f"unreadable reply ({type(exc).__name__}: {exc}): {raw[:200].decode(errors='replace')}"
        raise _status_error(bare, api_base, 500, text, response_headers) from None


def _reply(data: dict[str, Any]) -> SimpleNamespace:
    """The attributes worker/llm.py reads of a reply, nothing more."""
    choice = data["choices"][0]["message"]
    calls = [
        SimpleNamespace(id=c.get("id"), type=c.get("type", "function"), function=SimpleNamespace(
            name=c["function"].get("name"), arguments=_arguments(c["function"].get("arguments"))))
        for c in choice.get("tool_calls") or []
    ]  # fmt: skip
    message = SimpleNamespace(content=choice.get("content"), tool_calls=calls or None)
    usage = data.get("usage") or {}
    return SimpleNamespace(
        choices=[SimpleNamespace(message=message, finish_reason=data["choices"][0].get("finish_reason"))],
        usage=SimpleNamespace(**{k: usage.get(k, 0) for k in USAGE}),
        model=data.get("model", ""),
    )


def _arguments(value: Any) -> str:
    return value if isinstance(value, str) or value is None else json.dumps(value)


def _mapped(bare: str, original: Exception, api_base: str) -> Exception:
    """litellm's own mapping of a provider error (what ``litellm.acompletion`` raises)."""
    from litellm.litellm_core_utils.exception_mapping_utils import exception_type

    try:
        return exception_type(model=bare, original_exception=original, custom_llm_provider=PROVIDER,
                              extra_kwargs={"api_base": api_base})  # fmt: skip
    except Exception as mapped:  # exception_type raises what it maps
        return mapped


def _status_error(bare: str, api_base: str, status: int, text: str, headers: dict[str, str]) -> Exception:
    import httpx

    original = config().get_error_class(text, status, httpx.Headers(headers))
    return _mapped(bare, original, api_base)


def _connection_error(bare: str, api_base: str, exc: Exception) -> Exception:
    """What litellm's OpenAI handler raises for a request that got no answer: the SDK's
    "Connection error." as a 500 (``InternalServerError``, retryable)."""
    log.debug("model %s: no connection (%s)", bare, exc)
    return _status_error(bare, api_base, 500, "Connection error.", {})
