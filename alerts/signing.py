"""Standard Webhooks signatures (https://www.standardwebhooks.com): `sign`, the three
`webhook-*` request `headers`, and `verify` for receivers (and our tests).

A secret is "whsec_" + base64 of the HMAC key. The signed content is
"{msg_id}.{timestamp}.{body}", and the signature header holds space-separated "v1,<base64>"
entries so a receiver can accept an old and a new secret while rotating. Error messages never
include the secret or any part of it."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Mapping
from datetime import datetime

SECRET_PREFIX = "whsec_"
VERSION = "v1"
ID_HEADER = "webhook-id"
TIMESTAMP_HEADER = "webhook-timestamp"
SIGNATURE_HEADER = "webhook-signature"
DEFAULT_TOLERANCE_S = 300


class SignatureError(Exception):
    """A request whose webhook headers are missing, malformed, stale or do not match."""


def secret_key(secret: str) -> bytes:
    """The HMAC key inside a "whsec_<base64>" secret; ValueError (without the secret) if bad."""
    if not secret.startswith(SECRET_PREFIX):
        raise ValueError(f"webhook secret must start with {SECRET_PREFIX!r} followed by base64")
    try:
        key = base64.b64decode(secret.removeprefix(SECRET_PREFIX), validate=True)
    except binascii.Error:
        # `from None`: the decoder's message is about the secret's characters.
        raise ValueError(f"webhook secret is not valid base64 after {SECRET_PREFIX!r}") from None
    if not key:
        raise ValueError(f"webhook secret has an empty key after {SECRET_PREFIX!r}")
    return key


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The "v1,<base64 HMAC-SHA256>" signature of one message."""
    return _signature(secret_key(secret), msg_id, timestamp, body)


def headers(secret: str, msg_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """The webhook-id, webhook-timestamp and webhook-signature headers of one message."""
    return {
        ID_HEADER: msg_id,
        TIMESTAMP_HEADER: str(timestamp),
        SIGNATURE_HEADER: sign(secret, msg_id, timestamp, body),
    }


def verify(
    secret: str,
    headers: Mapping[str, str],
    body: bytes,
    now: datetime,
    tolerance_s: int = DEFAULT_TOLERANCE_S,
) -> None:
    """Raise SignatureError unless `headers` carry a valid, fresh signature of `body`.
    Header names are matched case-insensitively; `now` must be timezone-aware."""
    if now.tzinfo is None:
        raise ValueError("verify needs a timezone-aware `now`")
    found = {name.lower(): value for name, value in headers.items()}
    msg_id = _required(found, ID_HEADER)
    timestamp = _timestamp(_required(found, TIMESTAMP_HEADER))
    if abs(now.timestamp() - timestamp) > tolerance_s:
        raise SignatureError(f"{TIMESTAMP_HEADER} is more than {tolerance_s} s from now")
    expected = _signature(secret_key(secret), msg_id, timestamp, body).encode()
    offered = _required(found, SIGNATURE_HEADER).split()
    # Check every entry (no early exit) so timing says nothing about which one matched.
    matches = [hmac.compare_digest(expected, entry.encode()) for entry in offered]
    if not any(matches):
        raise SignatureError(f"no {VERSION} signature in {SIGNATURE_HEADER} matches the body")


def _signature(key: bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    content = f"{msg_id}.{timestamp}.".encode() + body
    digest = hmac.new(key, content, hashlib.sha256).digest()
    return f"{VERSION},{base64.b64encode(digest).decode()}"


def _required(found: Mapping[str, str], name: str) -> str:
    value = found.get(name, "").strip()
    if not value:
        raise SignatureError(f"missing {name} header")
    return value


def _timestamp(text: str) -> int:
    if not text.isascii() or not text.isdigit():
        raise SignatureError(f"{TIMESTAMP_HEADER} must be whole seconds since the epoch")
    return int(text)
