"""What a spec's ``model_params`` may ask of the worker's credentials, and where they may go.

A spec comes from a submitter, who must never obtain what the operator put in the
worker's environment. ``check_params`` holds the rules; the producer calls it at
submit (``validation.py``) and the worker again before every model request
(``worker/llm.py``), for the run's params, its fallbacks and the judge's params:

- ``api_key_env`` names only a variable allowed by ``TOOLOOP_ALLOWED_KEY_ENVS``
  (names or globs, default ``*_API_KEY``), and never a ``TOOLOOP_*`` one.
- Unless the spec brings its own key (a literal ``api_key``, sealed at rest), the
  request authenticates with the worker's credentials (``api_key_env``, or the
  provider's own variables that litellm reads when no key is given). Then every
  parameter that decides where the request goes (``api_base``, ``base_url`` and
  the provider-specific ``*_url``/``*_endpoint``/``*_host``/... ones) must be unset
  or lie under a prefix of ``TOOLOOP_ALLOWED_API_BASES``.
- Endpoints of side channels (telemetry hosts, token exchange, STS...) may carry
  operator credentials whatever the model key is: they are checked always.
- Parts of a host name (regions, locations, projects) are plain names.
- Nothing may make the worker read its own state on the spec's behalf: litellm's
  ``os.environ/NAME`` references, parameters naming files, profiles or variables,
  and in-process hooks (callbacks, clients, credential stores) are refused.

Only names and URLs are looked at here: no litellm import (producers stay light).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

from orchestrator.settings import Settings, get_settings

DEFAULT_KEY_ENVS = "*_API_KEY"
KEY_ENV = "api_key_env"
OWN_KEY = "api_key"  # a literal key: the spec's own credential
MODEL_ENDPOINTS = frozenset({"api_base", "base_url"})  # where the model request itself goes
ENV_REFERENCE = "os.environ/"  # litellm resolves such strings from the worker's environment

# Parameters deciding where a request (or a side channel carrying credentials) goes.
ENDPOINT_NAMES = frozenset({"api_base", "base_url", "api_host", "azure_endpoint", "proxy"})
ENDPOINT_SUFFIXES = ("_url", "_uri", "_endpoint", "_host", "_base", "_site", "_proxy", "_server")
# Parameters interpolated into a provider's host name or path: plain names only.
NAME_PARTS = frozenset({"region_name", "vertex_location", "vertex_project", "location", "project"})
NAME_PART_SUFFIXES = ("_region", "_region_name", "_location", "_project", "_project_id")
URL_IN_MODEL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s,]*")
PLAIN_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")
# Parameters that make the worker read a file, profile or variable of its own.
LOCAL_NAMES = frozenset({
    "aws_profile_name", "aws_web_identity_token", "litellm_credential_name",
    "gcs_path_service_account", "chatgpt_auth_file",
})  # fmt: skip
LOCAL_SUFFIXES = ("_file", "_path", "_dir", "_env", "_profile")
# In-process hooks: code, clients, credential stores, routers, logging objects.
HOOK_NAMES = frozenset({
    "callbacks", "success_callback", "failure_callback", "logger_fn", "client", "shared_session",
    "model_list", "litellm_logging_obj", "litellm_trusted_callback_vars", "secret_fields",
    "configurable_clientside_auth_params", "azure_ad_token_provider", "use_litellm_proxy",
})  # fmt: skip
NESTED = ("metadata", "litellm_metadata")  # litellm reads callback settings from these too


def key_env_patterns(setting: str) -> list[str]:
    return [p.strip() for p in (setting or "").split(",") if p.strip()]


def key_env_allowed(name: str, patterns: list[str]) -> bool:
    """True if the operator allows ``name``; ``TOOLOOP_*`` never, whatever the patterns."""
    if not isinstance(name, str) or not name or name.upper().startswith("TOOLOOP_"):
        return False
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def api_bases(setting: str) -> list[str]:
    return [b.strip() for b in (setting or "").split(",") if b.strip()]


def base_allowed(url: Any, bases: list[str]) -> bool:
    """True if ``url`` lies under one of ``bases``: same scheme, host and port, and the
    base's path followed by nothing or ``/...`` (``https://api.x.com`` never admits
    ``https://api.x.com.evil.net``, ``https://api.x.com@evil.net`` or ``/v10`` for ``/v1``)."""
    target = _parts(url)
    return target is not None and any(_under(target, base) for base in map(_parts, bases) if base)


def _parts(url: Any) -> tuple[str, str, int, str] | None:
    """(scheme, host, port, path) of a plain http(s) URL; None for anything else."""
    if not isinstance(url, str) or any(c.isspace() or ord(c) < 32 or c == "\\" for c in url):
        return None
    try:
        split = urlsplit(url)
        port = split.port
    except ValueError:
        return None
    scheme = split.scheme.lower()
    if scheme not in ("http", "https") or not split.hostname or split.username is not None:
        return None
    if split.password is not None or split.query or split.fragment or "%" in split.path:
        return None
    path = split.path.rstrip("/")
    if any(seg in (".", "..") for seg in path.split("/")):
        return None
    return scheme, split.hostname.lower(), port or (443 if scheme == "https" else 80), path


def _under(target: tuple[str, str, int, str], base: tuple[str, str, int, str]) -> bool:
    if target[:3] != base[:3]:
        return False
    return target[3] == base[3] or target[3].startswith(base[3] + "/")


def is_endpoint(name: str) -> bool:
    return name in ENDPOINT_NAMES or name.endswith(ENDPOINT_SUFFIXES)


def is_name_part(name: str) -> bool:
    return name in NAME_PARTS or name.endswith(NAME_PART_SUFFIXES)


def is_local(name: str) -> bool:
    return name != KEY_ENV and (name in LOCAL_NAMES or name.endswith(LOCAL_SUFFIXES))


def own_key(params: dict[str, Any]) -> bool:
    """The spec brings its own key (literal, sealed at rest): the worker's are not used."""
    return params.get(OWN_KEY) not in (None, "")


def check_call(model: str, params: Any, settings: Settings | None = None, where: str = "model_params",
               model_field: str = "model") -> list[str]:  # fmt: skip
    """``check_params``, plus URLs in the model string (``huggingface/https://...``)."""
    settings = settings or get_settings()
    errors = check_params(params, settings, where)
    own = isinstance(params, dict) and own_key(params)
    allowed = api_bases(settings.allowed_api_bases)
    if not own and any(not base_allowed(url, allowed) for url in URL_IN_MODEL.findall(model or "")):
        errors.append(f"{model_field}: {model!r} names an endpoint outside TOOLOOP_ALLOWED_API_BASES; "
                      "the request would carry the worker's credentials")  # fmt: skip
    return errors


def check_params(params: Any, settings: Settings | None = None, where: str = "model_params") -> list[str]:
    """Every reason these params may not run on a worker; [] if they may.

    ``settings`` are those of the process checking (producer or worker): the
    operator's TOOLOOP_ALLOWED_KEY_ENVS and TOOLOOP_ALLOWED_API_BASES.
    """
    if not isinstance(params, dict):
        return [f"{where}: must be a mapping"]
    settings = settings or get_settings()
    errors = _check_key_env(params, key_env_patterns(settings.allowed_key_envs), where)
    errors += [
        f"{where}.{path}: 'os.environ/' references are refused (the worker would read its own "
        "environment); name an allowed variable with api_key_env"
        for path, value in _strings(params)
        if ENV_REFERENCE in value
    ]
    allowed = api_bases(settings.allowed_api_bases)
    for scope, name, value in _named(params, where):
        errors += _check_one(scope, name, value, own_key(params), allowed)
    errors += _check_tls(params.get("ssl_verify", True), own_key(params), where)
    return errors


def _check_tls(verify: Any, own: bool, where: str) -> list[str]:
    if not isinstance(verify, bool):  # litellm takes a CA bundle path here: a file of the worker
        return [f"{where}.ssl_verify: true or false only (a path would name a file of the worker)"]
    if not verify and not own:
        return [f"{where}.ssl_verify: false only with the spec's own api_key; the worker's keys "
                "travel over verified TLS"]  # fmt: skip
    return []


def _check_key_env(params: dict[str, Any], patterns: list[str], where: str) -> list[str]:
    if KEY_ENV not in params:
        return []
    name = params[KEY_ENV]
    if own_key(params):
        return [f"{where}: give api_key or api_key_env, not both"]
    if not key_env_allowed(name, patterns):
        shown = ", ".join(patterns) or "none"
        return [
            f"{where}.{KEY_ENV}: {name!r} is not a variable the operator allows "
            f"(TOOLOOP_ALLOWED_KEY_ENVS: {shown}; TOOLOOP_* never)"
        ]
    return []


def _check_one(where: str, name: str, value: Any, own: bool, allowed: list[str]) -> list[str]:
    field = f"{where}.{name}"
    if name in HOOK_NAMES:
        return [f"{field}: in-process hooks and clients are the operator's to configure, not a spec's"]
    if is_local(name) or (name.endswith("credentials") and _not_json_object(value)):
        return [f"{field}: names a file, profile or variable of the worker; refused"]
    if is_endpoint(name):
        if value is None or (own and name in MODEL_ENDPOINTS) or base_allowed(value, allowed):
            return []
        shown = ", ".join(allowed) or "none"
        why = "the request would carry the worker's credentials" if name in MODEL_ENDPOINTS else (
            "it may carry the operator's credentials")  # fmt: skip
        return [f"{field}: {_redacted(value)!r} is not under an allowed API base (TOOLOOP_ALLOWED_API_BASES: "
                f"{shown}); {why}"]  # fmt: skip
    if is_name_part(name) and value is not None and not (
        isinstance(value, str) and PLAIN_NAME.fullmatch(value)
    ):
        return [f"{field}: must be a plain name (letters, digits, '.', '_', '-'): it becomes part of a host"]
    return []


def _not_json_object(value: Any) -> bool:
    """A string credential that is not inline JSON is a path litellm would read."""
    return isinstance(value, str) and not value.lstrip().startswith("{")


def _redacted(value: Any) -> Any:
    """A URL as shown in an error: without its user:password part."""
    return re.sub(r"//[^/@\s]*@", "//***@", value) if isinstance(value, str) else value


def _named(params: dict[str, Any], where: str) -> Iterator[tuple[str, str, Any]]:
    """(scope, name, value) of every top-level param, and of those nested where litellm looks."""
    for name, value in params.items():
        yield where, str(name), value
        if name in NESTED and isinstance(value, dict):
            for inner, inner_value in value.items():
                yield f"{where}.{name}", str(inner), inner_value


def _strings(value: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """(dotted path, text) of every string anywhere in a JSON value, keys included."""
    if isinstance(value, str):
        yield path or "value", value
    elif isinstance(value, dict):
        for key, inner in value.items():
            here = f"{path}.{key}" if path else str(key)
            yield here, str(key)
            yield from _strings(inner, here)
    elif isinstance(value, list):
        for i, inner in enumerate(value):
            yield from _strings(inner, f"{path}.{i}" if path else str(i))
