"""Sign-in, sessions and CSRF for the console.

A person signs in at ``/login`` with a token of ``TOOLOOP_API_TOKENS`` (checked exactly as
the API checks a bearer token: SHA-256 digests, compared in constant time). The session
is a cookie signed and timestamped by itsdangerous: ``HttpOnly`` (no script reads it),
``SameSite=Strict`` (no other site's page sends it), ``Secure`` over HTTPS, expiring after
``SESSION_MAX_AGE_S``. It holds the tenant, a CSRF token, and a keyed fingerprint of the
token it was opened with, so a token removed from ``TOOLOOP_API_TOKENS`` ends its sessions
at the next restart. No token is kept, in the cookie or anywhere else.

Every request that changes something carries the session's CSRF token (header
``X-CSRF-Token``, or form field ``csrf``): without it the answer is 403. The sign-in form
itself carries a nonce tied to a short-lived cookie, so another site cannot sign a browser
in to a tenant of its choosing.

The signing key derives from ``TOOLOOP_SECRET_KEY``; without one each process draws its
own, and sessions end when it restarts (several API replicas need the secret key set).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

from itsdangerous import BadSignature, URLSafeTimedSerializer
from starlette.requests import Request
from starlette.responses import Response

from orchestrator.tokens import match_token, token_digest

SESSION_COOKIE = "tooloop_session"
LOGIN_COOKIE = "tooloop_login"
SESSION_MAX_AGE_S = 8 * 3600
LOGIN_MAX_AGE_S = 15 * 60  # a sign-in form left open longer is refused: reload it
CSRF_HEADER = "x-csrf-token"
CSRF_FIELD = "csrf"
LOCAL_TENANT = "default"  # --insecure-local: runs submitted without a tenant
LOCAL_FINGERPRINT = "insecure-local"


@dataclass(frozen=True)
class Session:
    tenant: str
    csrf: str


class Sessions:
    """Opens and reads signed session cookies for the tokens the API knows."""

    def __init__(self, token_digests: dict[bytes, str], secret_key: str = "",
                 insecure_local: bool = False) -> None:  # fmt: skip
        key = (hashlib.sha256(b"tooloop console sessions\0" + secret_key.encode()).digest()
               if secret_key else secrets.token_bytes(32))  # fmt: skip
        self._key = key
        self._sessions = URLSafeTimedSerializer(key, salt="tooloop.console.session")
        self._logins = URLSafeTimedSerializer(key, salt="tooloop.console.login")
        self._digests = token_digests
        self._tenants = {self._fingerprint(d): tenant for d, tenant in token_digests.items()}
        self.insecure_local = insecure_local

    def _fingerprint(self, digest: bytes) -> str:
        return hmac.new(self._key, digest, hashlib.sha256).hexdigest()[:32]

    # -- sessions ---------------------------------------------------------------------------
    def open(self, token: str) -> str | None:
        """A session cookie's value for ``token``, or None when no tenant has that token."""
        tenant = match_token(self._digests, token)
        if tenant is None:
            return None
        return self._cookie(tenant, self._fingerprint(token_digest(token)))

    def open_local(self) -> str:
        """--insecure-local: a session for the local tenant, without a token."""
        return self._cookie(LOCAL_TENANT, LOCAL_FINGERPRINT)

    def _cookie(self, tenant: str, fingerprint: str) -> str:
        return self._sessions.dumps({"t": tenant, "f": fingerprint, "c": secrets.token_urlsafe(24)})

    def read(self, request: Request) -> Session | None:
        """The request's session, if its cookie is ours, unexpired, and its token still known."""
        return self.read_value(request.cookies.get(SESSION_COOKIE, ""))

    def read_value(self, raw: str) -> Session | None:
        if not raw:
            return None
        try:
            data = self._sessions.loads(raw, max_age=SESSION_MAX_AGE_S)
        except BadSignature:  # also SignatureExpired
            return None
        tenant, fingerprint = data.get("t"), data.get("f")
        known = (self.insecure_local and fingerprint == LOCAL_FINGERPRINT and tenant == LOCAL_TENANT) or (
            self._tenants.get(fingerprint) == tenant)
        return Session(tenant, data["c"]) if known and tenant else None

    # -- the sign-in form's nonce -------------------------------------------------------------
    def login_nonce(self) -> tuple[str, str]:
        """(nonce for the form, cookie value that vouches for it)."""
        nonce = secrets.token_urlsafe(16)
        return nonce, self._logins.dumps(nonce)

    def login_nonce_ok(self, request: Request, nonce: str) -> bool:
        try:
            expected = self._logins.loads(request.cookies.get(LOGIN_COOKIE, ""), max_age=LOGIN_MAX_AGE_S)
        except BadSignature:
            return False
        return isinstance(expected, str) and hmac.compare_digest(expected, nonce)


def set_cookie(response: Response, request: Request, name: str, value: str, max_age: int) -> None:
    response.set_cookie(name, value, max_age=max_age, path="/", httponly=True, samesite="strict",
                        secure=request.url.scheme == "https")  # fmt: skip


def csrf_ok(request: Request, session: Session, sent: str | None) -> bool:
    """The session's CSRF token came with the request, and no other origin sent it."""
    origin = request.headers.get("origin")
    hosts = {request.headers.get("host"), request.headers.get("x-forwarded-host")}  # (behind a proxy)
    if origin and origin.split("://", 1)[-1] not in hosts:
        return False
    token = sent or request.headers.get(CSRF_HEADER) or ""
    return bool(token) and hmac.compare_digest(token, session.csrf)
