"""The only module that imports litellm; it does so lazily (the import costs ~6 s).

One model call is a coroutine (``acomplete``) on the process's event loop
(``worker/aio.py``), so many calls can be in flight without a thread each; sync
callers use ``complete``. Per call:

- an explicit timeout (``model_params.timeout``, default 120 s) on the whole
  call, a stream included: a hung provider cannot hold a turn for hours;
- retries of rate limits, timeouts, lost connections and 5xx with exponential
  backoff and jitter (``num_retries``/``max_retries``, default 3), honouring a
  provider's ``Retry-After``. They are ours alone: litellm's and the OpenAI SDK's
  own retries are set to 0, so retries never multiply;
- ``fallbacks``: the next model, with the same params, once one is exhausted;
- the reply priced from litellm's cost map (a dict lookup, not ``completion_cost``);
- with ``stream: true``, text deltas handed to a callback as they arrive;
- a plain call to an OpenAI-compatible server sent by ``worker/openai_route.py``
  (litellm's provider config, one aiohttp session per process: ~0.7 ms of CPU a call
  against ~4 to 10 ms through ``litellm.acompletion``), everything else by litellm.

Tool workers, the CLI and the producer client never call into this module, so
they never pay for litellm.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from orchestrator.credentials import check_call
from orchestrator.secrets import SecretError, unseal_params
from worker import aio, openai_route

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 120.0
DEFAULT_RETRIES = 3
BACKOFF_BASE_S = 0.5  # first retry after ~0.5 s, then ~1, ~2 ... (x0.5-1.5 jitter)
BACKOFF_CAP_S = 30.0
# params that steer our call layer rather than the provider: never passed to litellm
CALL_PARAMS = ("timeout", "num_retries", "max_retries", "stream", "input_cost_per_token",
               "output_cost_per_token")  # fmt: skip

OnText = Callable[[str], Awaitable[None]]  # receives each streamed text delta


class Gate(Protocol):
    """Shared rate limits (worker/ratelimit.py), asked before every request."""

    async def take(self, model: str, tenant: str, tokens: int, may_defer: bool) -> None: ...

    async def settle(self, model: str, tenant: str, estimated: int, used: int) -> None: ...


@dataclass
class Reply:
    message: dict[str, Any]  # the assistant message, OpenAI chat format
    tokens: int  # usage.total_tokens of this call
    cost_usd: float = 0.0  # priced from litellm's cost map; 0 for a model it does not know
    model: str = ""  # the model that answered: the spec's, or a fallback
    usage: dict[str, int] | None = None  # the provider's usage counts (prompt, completion, total)
    served: str = ""  # the model name the provider's response gave (its prices may be looked up by it)


class ModelError(Exception):
    """A model call failed; ``error_type`` names the provider's exception."""

    def __init__(self, error_type: str, message: str, retryable: bool = False,
                 retry_after: float | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.error_type = error_type
        self.retryable = retryable  # rate limit, timeout, lost connection, 5xx
        self.retry_after = retry_after  # the provider's hint, in seconds

    @property
    def context_exceeded(self) -> bool:
        return self.error_type == "ContextWindowExceededError"


_prepared: list[bool] = []


def preload() -> None:
    """Import litellm now (worker start), not on the first model call; quiet its per-call extras."""
    if _prepared:
        return
    import litellm
    from litellm import utils
    from litellm.litellm_core_utils.litellm_logging import Logging

    litellm.telemetry = False
    litellm.suppress_debug_info = True
    for name in ("LiteLLM", "LiteLLM Router", "LiteLLM Proxy"):  # INFO per call otherwise
        logging.getLogger(name).setLevel(logging.WARNING)
    # litellm prices every response for its own hidden params and logging payload
    # (~0.3 ms of CPU a call, a model-map search, measured with py-spy); tooloop prices
    # replies itself (``price``) and reads neither, so litellm's figure is left unknown.
    Logging.response_cost_calculator = _no_cost  # type: ignore[method-assign]
    # After every call litellm schedules its success logging (a task on the loop and a
    # thread-pool job building a logging payload) even with no callback to call: ~8 % of a
    # turn process's CPU in py-spy profiles. Skipped while no litellm callback is set.
    utils.dispatch_success_logging = _success_logging(utils.dispatch_success_logging)
    _prepared.append(True)


def _no_cost(self: Any, *args: Any, **kwargs: Any) -> None:
    return None


def _success_logging(dispatch: Callable[..., None]) -> Callable[..., None]:
    import litellm

    def maybe_dispatch(*args: Any, **kwargs: Any) -> None:
        if litellm.callbacks or litellm.success_callback or litellm._async_success_callback:
            dispatch(*args, **kwargs)

    return maybe_dispatch


def resolve_params(model: str, params: dict[str, Any], tenant: str) -> dict[str, Any]:
    """The kwargs litellm gets: sealed values opened for the run's tenant, `api_key_env` ->
    the worker's environment. Checked first against this worker's own rules (the spec may
    not have gone through a producer's checks): ``ModelError`` before any request."""
    try:
        params = unseal_params(dict(params), tenant)
    except SecretError as exc:
        raise ModelError("SecretError", f"model_params: {exc}") from None
    errors = check_call(model, params)
    if errors:
        raise ModelError("RefusedParams", "; ".join(errors))
    env_name = params.pop("api_key_env", None)
    if env_name:
        key = os.environ.get(env_name)
        if key is None:
            raise ModelError("MissingApiKey", f"environment variable {env_name} is not set")
        params["api_key"] = key
    return params


def complete(
    model: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    params: dict[str, Any],
    tenant: str,
    fallbacks: Sequence[str] = (),
    on_text: OnText | None = None,
    gate: Gate | None = None,
) -> Reply:
    """``acomplete`` run on the process's event loop, for sync callers."""
    return aio.run(acomplete(model, messages, tools, params, tenant, fallbacks, on_text, gate))


async def acomplete(
    model: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    params: dict[str, Any],
    tenant: str,
    fallbacks: Sequence[str] = (),
    on_text: OnText | None = None,
    gate: Gate | None = None,
) -> Reply:
    """The model, then each fallback in turn, each with its retries; the last error if all fail.

    A context-window error is raised at once: the caller trims the history and asks again.
    With a ``gate``, every request first takes its share of the shared rate limits; the
    first one may raise ``RateLimited`` (the caller defers), later ones wait in place.
    """
    candidates = [model, *fallbacks]
    failed: list[str] = []
    for i, candidate in enumerate(candidates):
        limits = _Limits(gate, tenant, messages, tools, may_defer=i == 0) if gate else None
        try:
            return await _with_retries(candidate, messages, tools, params, tenant, on_text, limits)
        except ModelError as exc:
            if exc.context_exceeded or i == len(candidates) - 1:
                if failed:
                    exc.args = (f"{exc} (after {'; '.join(failed)})",)
                raise
            failed.append(f"{candidate} failed: {exc.error_type}")
            log.warning("model %s failed (%s): falling back to %s", candidate, exc.error_type,
                        candidates[i + 1])  # fmt: skip
    raise AssertionError("unreachable")


async def _with_retries(
    model: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    params: dict[str, Any],
    tenant: str,
    on_text: OnText | None,
    limits: _Limits | None = None,
) -> Reply:
    kwargs = resolve_params(model, params, tenant)  # checked for every model, fallbacks too
    policy = {name: kwargs.pop(name) for name in CALL_PARAMS if name in kwargs}
    timeout, retries = timeout_and_retries(policy)
    stream = bool(policy.get("stream"))
    if tools:
        kwargs["tools"] = tools
    for attempt in range(retries + 1):
        if limits is not None:
            await limits.take(model, first=attempt == 0)
        try:
            call = _call(model, messages, kwargs, timeout, stream, on_text)
            response = await asyncio.wait_for(call, timeout)
            reply = Reply(assistant_message(response), total_tokens(response), price(model, response, policy),
                          model, usage_of(response), str(getattr(response, "model", "") or ""))  # fmt: skip
            if limits is not None:
                await limits.settle(model, reply.tokens)
            return reply
        except TimeoutError:
            error = ModelError("Timeout", f"{model}: no complete answer within {timeout:g}s", retryable=True)
        except ModelError as exc:
            error = exc
        except Exception as exc:
            error = classify(exc)
        if not error.retryable or attempt == retries:
            raise error
        delay = backoff(attempt, error.retry_after)
        log.info("model %s: %s, retry %d/%d in %.1fs", model, error.error_type, attempt + 1, retries, delay)
        await asyncio.sleep(delay)
    raise AssertionError("unreachable")


@dataclass
class _Limits:
    """A gate bound to one request: its tenant and its estimated size."""

    gate: Gate
    tenant: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    may_defer: bool
    estimated: int = 0

    async def take(self, model: str, first: bool) -> None:
        if not self.estimated:
            self.estimated = estimate_tokens(self.messages, self.tools)
        await self.gate.take(model, self.tenant, self.estimated, self.may_defer and first)

    async def settle(self, model: str, used: int) -> None:
        await self.gate.settle(model, self.tenant, self.estimated, used)


def estimate_tokens(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> int:
    """A request's prompt tokens, roughly: ~4 characters per token."""
    chars = sum(len(str(m.get("content") or "")) + len(json.dumps(m.get("tool_calls") or ""))
                for m in messages)  # fmt: skip
    return (chars + (len(json.dumps(tools)) if tools else 0)) // 4 + 1


async def _call(
    model: str,
    messages: list[dict[str, Any]],
    kwargs: dict[str, Any],
    timeout: float,
    stream: bool,
    on_text: OnText | None,
) -> Any:
    import litellm

    preload()  # once per process: callers that skipped the worker's start (the judge, tests)
    # num_retries/max_retries 0: litellm's wrapper and the OpenAI SDK would retry otherwise
    if openai_route.covers(model, kwargs, stream):
        return await openai_route.acomplete(model, messages, kwargs)
    common = {"timeout": timeout, "num_retries": 0, "max_retries": 0}
    if not stream:
        return await litellm.acompletion(model=model, messages=messages, **common, **kwargs)
    kwargs.setdefault("stream_options", {"include_usage": True})
    response = await litellm.acompletion(model=model, messages=messages, stream=True, **common, **kwargs)
    chunks = []
    async for chunk in response:
        chunks.append(chunk)
        text = _delta_text(chunk)
        if text and on_text is not None:
            await on_text(text)
    if on_text is not None:
        await on_text("")  # the end: flush what is buffered
    return litellm.stream_chunk_builder(chunks, messages=messages)


def _delta_text(chunk: Any) -> str:
    choices = getattr(chunk, "choices", None) or []
    delta = getattr(choices[0], "delta", None) if choices else None
    return getattr(delta, "content", None) or ""


# -- errors -------------------------------------------------------------------------------
def classify(exc: Exception) -> ModelError:
    """A provider's exception as a ``ModelError``: which are worth a retry, and when."""
    import litellm

    retryable = isinstance(exc, litellm.RateLimitError | litellm.Timeout | litellm.APIConnectionError
                           | litellm.InternalServerError | litellm.ServiceUnavailableError
                           | litellm.BadGatewayError)  # fmt: skip
    if not retryable and not isinstance(exc, litellm.BadRequestError):
        status = getattr(exc, "status_code", None)
        retryable = isinstance(status, int) and status >= 500
    return ModelError(type(exc).__name__, str(exc), retryable, retry_after(exc))


def retry_after(exc: Exception) -> float | None:
    """The provider's ``Retry-After`` (seconds), when its response carried one."""
    headers = getattr(exc, "litellm_response_headers", None) or getattr(
        getattr(exc, "response", None), "headers", None
    )
    try:
        value = headers.get("retry-after") if headers is not None else None
        return float(value) if value is not None else None
    except (TypeError, ValueError, AttributeError):
        return None


def timeout_and_retries(params: dict[str, Any]) -> tuple[float, int]:
    """Each request's timeout and how many retries follow a retryable failure."""
    timeout = float(params.get("timeout") or DEFAULT_TIMEOUT_S)
    return timeout, int(params.get("num_retries", params.get("max_retries", DEFAULT_RETRIES)))


def backoff(attempt: int, hint: float | None = None) -> float:
    """Exponential, with jitter so that callers throttled together do not return together."""
    delay = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2**attempt) * random.uniform(0.5, 1.5)
    return min(BACKOFF_CAP_S, max(delay, hint or 0.0))


# -- the reply ----------------------------------------------------------------------------
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


def usage_of(response: Any) -> dict[str, int]:
    """The response's token counts, as the provider gave them (a replay serves them again)."""
    usage = getattr(response, "usage", None)
    names = ("prompt_tokens", "completion_tokens", "total_tokens")
    return {name: int(getattr(usage, name, 0) or 0) for name in names}


def total_tokens(response: Any) -> int:
    usage = getattr(response, "usage", None)
    return int(getattr(usage, "total_tokens", 0) or 0)


# -- cost ---------------------------------------------------------------------------------
_prices: dict[str, tuple[float, float]] = {}


def price(model: str, response: Any, policy: dict[str, Any]) -> float:
    """USD of one reply: its prompt and completion tokens at the model's per-token prices.

    ``input_cost_per_token``/``output_cost_per_token`` in model_params override (a
    private deployment, a negotiated price). A dict lookup in litellm's cost map,
    cached per model: ``litellm.completion_cost`` costs ~2 ms of CPU per call.
    """
    usage = getattr(response, "usage", None)
    prompt = int(getattr(usage, "prompt_tokens", 0) or 0)
    completion = int(getattr(usage, "completion_tokens", 0) or 0)
    per_in, per_out = unit_prices(model, getattr(response, "model", None))
    per_in = float(policy.get("input_cost_per_token", per_in))
    per_out = float(policy.get("output_cost_per_token", per_out))
    return prompt * per_in + completion * per_out


def unit_prices(model: str, served: str | None = None) -> tuple[float, float]:
    key = f"{model}|{served or ''}"
    if key not in _prices:
        _prices[key] = _lookup(model, served)
    return _prices[key]


def _lookup(model: str, served: str | None) -> tuple[float, float]:
    import litellm

    bare = model.split("/", 1)[1] if "/" in model else model
    for name in (model, bare, served, f"{model.split('/', 1)[0]}/{served}" if served else None):
        entry = litellm.model_cost.get(name) if name else None
        if entry and "input_cost_per_token" in entry:
            return float(entry["input_cost_per_token"]), float(entry.get("output_cost_per_token") or 0)
    return 0.0, 0.0


def context_window(model: str) -> int | None:
    """The model's input window in tokens, when litellm's cost map knows it."""
    import litellm

    bare = model.split("/", 1)[1] if "/" in model else model
    for name in (model, bare):
        entry = litellm.model_cost.get(name)
        if entry and entry.get("max_input_tokens"):
            return int(entry["max_input_tokens"])
    return None
