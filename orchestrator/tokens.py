"""Operator tokens (``TOOLOOP_API_TOKENS``): kept as SHA-256 digests, matched in constant time.

Shared by the operator API's bearer check and the console's sign-in.
"""

from __future__ import annotations

import hashlib
import hmac


def token_digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def match_token(digests: dict[bytes, str], given: str) -> str | None:
    """The tenant of ``given``, or None."""
    # SHA-256 digests, compared with compare_digest against every one: the answer time
    # says nothing about near misses, nor about a token's length (every digest is 32 bytes)
    wanted, found = token_digest(given), None
    for digest, tenant in digests.items():
        if hmac.compare_digest(digest, wanted):
            found = tenant
    return found
