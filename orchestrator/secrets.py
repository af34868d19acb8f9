"""Literal API keys in a spec are sealed before they reach Redis.

Sealing uses Fernet (AES + HMAC) with a key derived from ``TOOLOOP_SECRET_KEY``,
which producers and turn workers share. Without that setting a literal
``api_key`` is refused at submit: use ``api_key_env`` instead, which names an
environment variable of the worker and stores nothing secret at all.
"""

from __future__ import annotations

import base64
import hashlib
from typing import Any

from orchestrator.settings import get_settings

SEALED = "sealed:v1:"


class SecretError(ValueError):
    """A secret cannot be sealed or unsealed with this deployment's key."""


def _fernet(secret: str | None = None) -> Any:
    from cryptography.fernet import Fernet  # only producers with literal keys pay the import

    secret = secret if secret is not None else get_settings().secret_key
    if not secret:
        raise SecretError(
            "model_params.api_key: a literal API key would be stored in Redis; set "
            "TOOLOOP_SECRET_KEY (shared with the workers) to seal it, or use api_key_env"
        )
    digest = hashlib.sha256(secret.encode()).digest()
    return Fernet(base64.urlsafe_b64encode(digest))


def seal(value: str, secret: str | None = None) -> str:
    if value.startswith(SEALED):
        return value
    return SEALED + _fernet(secret).encrypt(value.encode()).decode()


def unseal(value: str, secret: str | None = None) -> str:
    if not isinstance(value, str) or not value.startswith(SEALED):
        return value
    from cryptography.fernet import InvalidToken

    try:
        return _fernet(secret).decrypt(value[len(SEALED) :].encode()).decode()
    except InvalidToken as exc:
        raise SecretError("sealed api_key does not open with this TOOLOOP_SECRET_KEY") from exc


def seal_params(params: dict[str, Any]) -> dict[str, Any]:
    if "api_key" not in params:
        return params
    return {**params, "api_key": seal(str(params["api_key"]))}
