"""API-key authentication. Keys are stored only as sha256 hex digests; a presented key is
hashed and compared in constant time. No message, log line or repr ever holds a key.

Authentication is off when no key hashes are configured at all: every caller is then an
anonymous admin (meant for local development).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

MISSING_KEY = "missing API key: send Authorization: Bearer <key> or x-api-key"
INVALID_KEY = "invalid API key"
NOT_ADMIN = "this endpoint needs an admin API key"
_BEARER = "bearer"


class AuthError(Exception):
    """Authentication (401) or authorisation (403) failure, with a message safe to return."""

    def __init__(self, status: Literal[401, 403], message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Principal:
    """An authenticated caller: a holder of a valid key, which may be an admin key."""

    is_admin: bool


def hash_key(key: str) -> str:
    """The sha256 hex digest under which a key is stored."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def authenticate(
    authorization: str | None,
    x_api_key: str | None,
    key_hashes: Sequence[str],
    admin_hashes: Sequence[str],
) -> Principal:
    """The caller presenting `Authorization: Bearer KEY` or `x-api-key: KEY`. A Bearer token
    takes precedence when both headers are sent. Admin keys are valid normal keys too."""
    if not key_hashes and not admin_hashes:
        return Principal(is_admin=True)
    key = bearer_token(authorization) or _stripped(x_api_key)
    if key is None:
        raise AuthError(401, MISSING_KEY)
    digest = hash_key(key)
    is_admin = _matches_any(digest, admin_hashes)
    if not (is_admin or _matches_any(digest, key_hashes)):
        raise AuthError(401, INVALID_KEY)
    return Principal(is_admin=is_admin)


def require_admin(p: Principal) -> None:
    """Raise 403 unless the principal holds an admin key."""
    if not p.is_admin:
        raise AuthError(403, NOT_ADMIN)


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header (scheme case-insensitive), or
    None when the header is absent, empty or uses another scheme."""
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != _BEARER:
        return None
    return _stripped(token)


def _stripped(value: str | None) -> str | None:
    text = value.strip() if value is not None else ""
    return text or None


def _matches_any(digest: str, stored: Sequence[str]) -> bool:
    """Compare against every stored hash (no early exit), each in constant time."""
    presented = digest.encode("ascii")
    found = False
    for candidate in stored:
        normalised = candidate.strip().lower().encode("utf-8", "surrogatepass")
        found |= hmac.compare_digest(presented, normalised)
    return found
