"""Credentials in a spec are sealed before they reach Redis, each for its own tenant.

Sealing uses Fernet (AES + HMAC) with a key derived by HKDF-SHA256 from
``TOOLOOP_SECRET_KEY`` (shared by producers and turn workers), the tenant in
HKDF's ``info``: a value sealed for tenant A does not open for tenant B, so a
blob copied from another tenant's run is worth nothing. Without that setting a
credential in a spec is refused at submit: use ``api_key_env`` instead, which
names a variable of the worker and stores nothing secret at all.

What is sealed (``seal_params``), in ``model_params`` and the judge's:
- every top-level parameter whose name is credential-like: a ``_``-separated
  word among ``CREDENTIAL_WORDS`` (``api_key``, ``aws_secret_access_key``,
  ``aws_session_token``, ``azure_ad_token``, ``vertex_credentials``,
  ``client_secret``...), or a name in ``CREDENTIAL_NAMES``;
- every value of ``extra_headers`` and ``headers`` (auth hides in custom headers);
- credential-like keys inside ``extra_body`` and ``metadata``.
A sealed value keeps its JSON type: the worker gets back exactly what was given.
"""

from __future__ import annotations

import base64
import json
import re
from functools import lru_cache
from typing import Any

from orchestrator.settings import get_settings

SEALED = "sealed:"
SEALED_V2 = "sealed:v2:"  # HKDF per tenant; the value JSON-encoded
CREDENTIAL_WORDS = frozenset({
    "key", "secret", "token", "password", "passwd", "credential", "credentials", "auth",
    "authorization", "cookie", "signature", "bearer",
})  # fmt: skip
CREDENTIAL_NAMES = frozenset({"aws_access_key_id", "vertex_credentials", "azure_ad_token", "api_key"})
HEADER_PARAMS = ("extra_headers", "headers")
NESTED_PARAMS = ("extra_body", "metadata", "litellm_metadata")
_WORDS = re.compile(r"[^a-z0-9]+")


class SecretError(ValueError):
    """A secret cannot be sealed or unsealed with this deployment's key and tenant."""


def is_credential(name: str) -> bool:
    """Credential-like parameter name (``api_key_env`` names a variable: not a secret)."""
    lowered = str(name).lower()
    if lowered.endswith("_env"):
        return False
    return lowered in CREDENTIAL_NAMES or bool(set(_WORDS.split(lowered)) & CREDENTIAL_WORDS)


def _secret(secret: str | None) -> str:
    secret = secret if secret is not None else get_settings().secret_key
    if not secret:
        raise SecretError(
            "a credential would be stored in Redis in clear; set TOOLOOP_SECRET_KEY (shared with "
            "the workers) to seal it, or use api_key_env"
        )
    return secret


@lru_cache(maxsize=256)
def _fernet(secret: str, tenant: str) -> Any:
    from cryptography.fernet import Fernet  # only processes that seal or unseal pay the import
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=b"tooloop/seal/v2",
                info=b"tenant:" + tenant.encode())  # fmt: skip
    return Fernet(base64.urlsafe_b64encode(hkdf.derive(secret.encode())))


def is_sealed(value: Any) -> bool:
    return isinstance(value, str) and value.startswith(SEALED)


def seal(value: Any, tenant: str, secret: str | None = None) -> str:
    """``value`` (any JSON value) sealed for ``tenant``; a sealed value is returned as is."""
    if is_sealed(value):
        return value
    token = _fernet(_secret(secret), tenant).encrypt(json.dumps(value).encode())
    return SEALED_V2 + token.decode()


def unseal(value: Any, tenant: str, secret: str | None = None) -> Any:
    """The clear value of a sealed one (any other value is returned as is)."""
    if not is_sealed(value):
        return value
    if not value.startswith(SEALED_V2):
        raise SecretError("a sealed value of an older format, bound to no tenant, is refused: "
                          "submit the run again")  # fmt: skip
    from cryptography.fernet import InvalidToken

    try:
        clear = _fernet(_secret(secret), tenant).decrypt(value[len(SEALED_V2) :].encode())
    except InvalidToken as exc:
        raise SecretError(f"a sealed value does not open for tenant {tenant!r} with this "
                          "TOOLOOP_SECRET_KEY") from exc  # fmt: skip
    return json.loads(clear)


def seal_params(params: dict[str, Any], tenant: str, secret: str | None = None,
                where: str = "model_params") -> dict[str, Any]:  # fmt: skip
    """Params with every credential sealed for ``tenant``; ``SecretError`` names the fields
    that cannot be sealed, or that arrive sealed and do not open for this tenant."""
    errors: list[str] = []

    def sealed(path: str, value: Any) -> Any:
        if value is None or value == "":
            return value
        try:
            if is_sealed(value):
                unseal(value, tenant, secret)  # someone else's blob is refused here already
                return value
            return seal(value, tenant, secret)
        except SecretError as exc:
            errors.append(f"{path}: {exc}")
            return value

    out: dict[str, Any] = {}
    for name, value in params.items():
        path = f"{where}.{name}"
        if name in HEADER_PARAMS and isinstance(value, dict):
            out[name] = {h: sealed(f"{path}.{h}", v) for h, v in value.items()}
        elif name in NESTED_PARAMS and isinstance(value, dict):
            out[name] = {k: sealed(f"{path}.{k}", v) if is_credential(k) else v for k, v in value.items()}
        elif is_credential(name):
            out[name] = sealed(path, value)
        else:
            out[name] = value
    if errors:
        raise SecretError("\n".join(errors))
    return out


def unseal_params(params: Any, tenant: str, secret: str | None = None) -> Any:
    """Every sealed value, wherever it is, opened for ``tenant`` (``SecretError`` if one does not)."""
    if isinstance(params, dict):
        return {k: unseal_params(v, tenant, secret) for k, v in params.items()}
    if isinstance(params, list):
        return [unseal_params(v, tenant, secret) for v in params]
    return unseal(params, tenant, secret)
