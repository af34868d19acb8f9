"""Declared HTTP tools, the worker's side: render the request, check where it goes, send it.

The declaration travels in the call's payload (the tool worker never reads the spec).
Before each request, and again before following each redirect, the target must be:

- a host of the tool's ``allow_hosts`` (the submitter's own allowlist);
- not a link-local or cloud-metadata address (169.254.0.0/16, fe80::/10, ...) unless
  the operator allows the URL (``TOOLOOP_ALLOWED_API_BASES``): checked on every address
  the host resolves to, when the connection is made, and the connection goes to one of
  those addresses (``worker/sources/pinned.py``: the name is never resolved twice);
- when the tool sends ``env_headers`` (the worker's own variables): under
  ``TOOLOOP_ALLOWED_API_BASES``, with every variable allowed by ``TOOLOOP_ALLOWED_KEY_ENVS``,
  as read by this worker's settings.

The request runs in a helper thread so the call's lease is heartbeaten while it waits;
the thread is joined before the call returns (tool processes fork sandboxed calls and
must stay single-threaded between calls).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import quote, urljoin, urlsplit

import httpx
from pydantic import ValidationError

from orchestrator.http_tools import (
    ENV_REF,
    HttpTool,
    credential_problems,
    declared,
    host_allowed,
    template_parts,
)
from orchestrator.settings import Settings
from worker.sandbox import CallOutcome
from worker.sources.pinned import PinnedBackend, PinnedTransport, Refused, target

__all__ = ["Refused", "call", "check_target", "http_payload"]

TICK_S = 0.25
MAX_REDIRECTS = 5
MAX_HEADERS = 50  # response headers returned to the model


def http_payload(spec: Any, name: str) -> dict[str, Any]:
    """Fields a call's payload gets from the run's declared HTTP tools (in the turn)."""
    tools = declared(spec)
    if not tools:
        return {}
    out: dict[str, Any] = {"allowed_tools": [*spec.tools, *tools]}
    if name in tools:
        out |= {"allowed": True, "http_tool": tools[name].model_dump(mode="json")}
    return out


def call(data: dict[str, Any], arguments: Any, timeout_s: float, settings: Settings,
         on_tick: Callable[[], bool]) -> CallOutcome:  # fmt: skip
    started = time.perf_counter()
    try:  # checked at submit; again here, as the worker reads it from Redis
        tool = HttpTool.model_validate(data)
    except ValidationError as exc:
        return CallOutcome(False, error=f"Refused: the declaration is invalid: {_first_error(exc)}")
    problem = _arguments_problem(tool, arguments)
    if problem:
        return CallOutcome(False, error=f"ValidationError: {problem}")
    timeout = min(timeout_s, tool.timeout_s)
    outcome = _in_thread(lambda cancel: _perform(tool, arguments, timeout, settings, cancel),
                         timeout, on_tick)  # fmt: skip
    outcome.duration_ms = round((time.perf_counter() - started) * 1000, 3)
    return outcome


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    at = ".".join(str(p) for p in err["loc"])
    return (f"{at}: " if at else "") + str(err["msg"]).removeprefix("Value error, ")


def _arguments_problem(tool: HttpTool, arguments: Any) -> str | None:
    import jsonschema

    try:
        jsonschema.validate(arguments, tool.parameters, cls=jsonschema.Draft202012Validator)
    except jsonschema.ValidationError as exc:
        where = ".".join(str(p) for p in exc.absolute_path) or "arguments"
        return f"{where}: {exc.message}"
    return None


def _in_thread(work: Callable[[threading.Event], CallOutcome], timeout: float,
               on_tick: Callable[[], bool]) -> CallOutcome:  # fmt: skip
    cancel, box = threading.Event(), []
    thread = threading.Thread(target=lambda: box.append(_guarded(work, cancel)), daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    stopped = None
    while thread.is_alive():
        thread.join(TICK_S)
        if not thread.is_alive():
            break
        if time.monotonic() >= deadline:
            stopped = CallOutcome(False, error=f"Timeout: tool call exceeded {timeout:g}s")
        elif not _still_wanted(on_tick):
            stopped = CallOutcome(False, error="Aborted: the run ended while the tool ran")
        if stopped:
            cancel.set()
            thread.join(5.0)  # bounded by the client's own timeouts
            return stopped
    outcome = box[0] if box else CallOutcome(False, error="HttpError: the request ended without a result")
    if not outcome.ok and time.monotonic() >= deadline:  # the request's own deadline, a tick sooner
        return CallOutcome(False, error=f"Timeout: tool call exceeded {timeout:g}s")
    return outcome


def _guarded(work: Callable[[threading.Event], CallOutcome], cancel: threading.Event) -> CallOutcome:
    try:
        return work(cancel)
    except Refused as exc:
        return CallOutcome(False, error=f"Refused: {exc}")
    except Exception as exc:
        return CallOutcome(False, error=f"HttpError: {type(exc).__name__}: {exc}")


def _still_wanted(on_tick: Callable[[], bool]) -> bool:
    try:
        return on_tick()
    except Exception:  # Redis away: the call goes on, as in the sandbox
        return True


# -- one request, redirects followed by hand ----------------------------------------------
def _perform(tool: HttpTool, args: dict[str, Any], timeout: float, settings: Settings,
             cancel: threading.Event) -> CallOutcome:  # fmt: skip
    method, url = tool.method, _render_url(tool.url, args)
    headers = {k: _render(v, args) for k, v in tool.headers.items()}
    body = _render_body(tool.body, args)
    deadline = time.monotonic() + timeout
    backend = PinnedBackend()
    with httpx.Client(transport=PinnedTransport(backend), timeout=httpx.Timeout(timeout),
                      follow_redirects=False, trust_env=False) as client:  # fmt: skip
        for _ in range(MAX_REDIRECTS + 1):
            backend.target = target(url, check_target(tool, url, settings))  # each hop checked
            sent = {**headers, **_env_headers(tool)}
            kwargs = _body_kwargs(body) if method not in ("GET", "HEAD") else {}
            with client.stream(method, url, headers=sent, **kwargs) as response:
                location = response.headers.get("location")
                if response.is_redirect and location:
                    url = urljoin(url, location)
                    if response.status_code not in (307, 308):
                        method, body = ("HEAD" if method == "HEAD" else "GET"), None
                    continue
                return CallOutcome(True, output=_read(response, tool, deadline, cancel))
    raise Refused(f"more than {MAX_REDIRECTS} redirects")


def check_target(tool: HttpTool, url: str, settings: Settings) -> bool:
    """Raise ``Refused`` unless a request of ``tool`` may go to ``url`` (see the module doc);
    True when the operator lets ``url`` reach link-local and metadata addresses (the
    addresses themselves are checked where the connection is made: ``pinned.resolve``)."""
    split = urlsplit(url)
    if split.scheme not in ("http", "https") or not split.hostname or split.username or split.password:
        raise Refused(f"{url}: only plain http(s) URLs")
    host = split.hostname.lower()
    port = split.port or (443 if split.scheme == "https" else 80)
    if not host_allowed(host, port, tool.allow_hosts):
        raise Refused(f"{host} is not in allow_hosts ({', '.join(tool.allow_hosts)})")
    problems = credential_problems(tool, settings.allowed_key_envs, settings.allowed_api_bases, url)
    if problems:
        raise Refused("; ".join(problems))
    from orchestrator.credentials import api_bases, base_allowed

    return base_allowed(url, api_bases(settings.allowed_api_bases))


def _env_headers(tool: HttpTool) -> dict[str, str]:
    """Values read now from this worker's environment (never stored)."""
    import os

    out = {}
    for header, template in tool.env_headers.items():
        missing = [n for n in ENV_REF.findall(template) if n not in os.environ]
        if missing:
            raise Refused(f"env_headers: {missing} not set on this worker")
        out[header] = ENV_REF.sub(lambda m: os.environ[m.group(1)], template)
    return out


def _render_url(template: str, args: dict[str, Any]) -> str:
    return _substitute(template, args, lambda v: quote(_text(v), safe=""))


def _render(template: str, args: dict[str, Any]) -> str:
    return _substitute(template, args, _text)


def _substitute(template: str, args: dict[str, Any], fmt: Callable[[Any], str]) -> str:
    """Bare ``{name}`` placeholders only, checked again here (a declaration written into
    Redis by hand never passed submit): ``str.format`` would also obey ``{q:>400000000}``.
    An optional argument left out is empty."""
    return "".join(text + (fmt(args[name]) if name is not None and name in args else "")
                   for text, name in _parts(template))  # fmt: skip


def _parts(template: str) -> list[tuple[str, str | None]]:
    try:
        return template_parts(template)
    except ValueError as exc:
        raise Refused(str(exc)) from None


def _render_body(body: Any, args: dict[str, Any]) -> Any:
    """A JSON template: a string that is exactly ``{arg}`` becomes the argument's value
    (its JSON type kept); other strings get ``{arg}`` replaced by its text."""
    if isinstance(body, str):
        names = [name for _, name in _parts(body) if name]
        if len(names) == 1 and body == "{" + names[0] + "}":
            return args.get(names[0])
        return _render(body, args)
    if isinstance(body, dict):
        return {k: _render_body(v, args) for k, v in body.items()}
    if isinstance(body, list):
        return [_render_body(v, args) for v in body]
    return body


def _body_kwargs(body: Any) -> dict[str, Any]:
    if body is None:
        return {}
    if isinstance(body, str):
        return {"content": body.encode()}
    return {"json": body}


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _read(response: Any, tool: HttpTool, deadline: float, cancel: threading.Event) -> dict[str, Any]:
    data, truncated = bytearray(), False
    for chunk in response.iter_bytes():
        if cancel.is_set() or time.monotonic() > deadline:
            raise TimeoutError("the response did not end in time")
        data += chunk
        if len(data) > tool.max_response_bytes:
            del data[tool.max_response_bytes :]
            truncated = True
            break
    headers = dict(list(response.headers.items())[:MAX_HEADERS])
    return {"status": response.status_code, "headers": headers, "body": _decode(bytes(data), response),
            "truncated": truncated}  # fmt: skip


def _decode(data: bytes, response: Any) -> Any:
    text = data.decode(response.encoding or "utf-8", errors="replace")
    if "json" in response.headers.get("content-type", ""):
        try:
            return json.loads(text)
        except ValueError:
            pass
    return text
