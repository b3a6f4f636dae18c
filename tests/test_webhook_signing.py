"""Standard Webhooks signing: the published test vector, a sign/verify round trip, and every
way a request must be refused (tampering, staleness, wrong secret, malformed headers)."""

from __future__ import annotations

import base64
from datetime import UTC, datetime, timedelta

import pytest

from alerts.signing import SignatureError, headers, secret_key, sign, verify

# The test vector published with the Standard Webhooks reference libraries.
VECTOR_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
VECTOR_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
VECTOR_TIMESTAMP = 1614265330
VECTOR_BODY = b'{"test": 2432232314}'
VECTOR_SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
VECTOR_NOW = datetime.fromtimestamp(VECTOR_TIMESTAMP, UTC)

OTHER_SECRET = "whsec_" + base64.b64encode(b"another key, 24 bytes ok").decode()


def vector_headers() -> dict[str, str]:
    return headers(VECTOR_SECRET, VECTOR_ID, VECTOR_TIMESTAMP, VECTOR_BODY)


def test_matches_the_published_test_vector() -> None:
    assert sign(VECTOR_SECRET, VECTOR_ID, VECTOR_TIMESTAMP, VECTOR_BODY) == VECTOR_SIGNATURE
    assert vector_headers() == {
        "webhook-id": VECTOR_ID,
        "webhook-timestamp": str(VECTOR_TIMESTAMP),
        "webhook-signature": VECTOR_SIGNATURE,
    }


def test_round_trip_verifies_with_any_header_case() -> None:
    signed = {name.title(): value for name, value in vector_headers().items()}
    verify(VECTOR_SECRET, signed, VECTOR_BODY, VECTOR_NOW + timedelta(seconds=299))


def test_one_matching_entry_among_several_is_enough() -> None:
    """Secret rotation: the sender signs with the old and the new secret."""
    signed = vector_headers()
    old = sign(OTHER_SECRET, VECTOR_ID, VECTOR_TIMESTAMP, VECTOR_BODY)
    signed["webhook-signature"] = f"v1,bm90IGl0 {old} {signed['webhook-signature']}"
    verify(VECTOR_SECRET, signed, VECTOR_BODY, VECTOR_NOW)


@pytest.mark.parametrize(
    ("secret", "body", "changed"),
    [
        (VECTOR_SECRET, b'{"test": 2432232315}', {}),
        (VECTOR_SECRET, VECTOR_BODY, {"webhook-timestamp": str(VECTOR_TIMESTAMP + 1)}),
        (VECTOR_SECRET, VECTOR_BODY, {"webhook-id": "msg_other"}),
        (OTHER_SECRET, VECTOR_BODY, {}),
        (VECTOR_SECRET, VECTOR_BODY, {"webhook-signature": "v1a,g0hM9SsE"}),
    ],
    ids=["body", "timestamp", "id", "secret", "version"],
)
def test_tampering_is_rejected(secret: str, body: bytes, changed: dict[str, str]) -> None:
    signed = vector_headers() | changed
    with pytest.raises(SignatureError, match="no v1 signature"):
        verify(secret, signed, body, VECTOR_NOW)


@pytest.mark.parametrize("offset_s", [-301, 301])
def test_stale_or_future_timestamp_is_rejected(offset_s: int) -> None:
    with pytest.raises(SignatureError, match="300 s from now"):
        verify(
            VECTOR_SECRET,
            vector_headers(),
            VECTOR_BODY,
            VECTOR_NOW + timedelta(seconds=offset_s),
        )


@pytest.mark.parametrize("missing", ["webhook-id", "webhook-timestamp", "webhook-signature"])
def test_missing_header_is_rejected(missing: str) -> None:
    signed = vector_headers()
    del signed[missing]
    with pytest.raises(SignatureError, match=f"missing {missing}"):
        verify(VECTOR_SECRET, signed, VECTOR_BODY, VECTOR_NOW)


@pytest.mark.parametrize("timestamp", ["1614265330.5", "-1614265330", "soon", "\uff11\uff12"])
def test_malformed_timestamp_is_rejected(timestamp: str) -> None:
    signed = vector_headers() | {"webhook-timestamp": timestamp}
    with pytest.raises(SignatureError, match="whole seconds"):
        verify(VECTOR_SECRET, signed, VECTOR_BODY, VECTOR_NOW)


@pytest.mark.parametrize(
    ("secret", "problem"),
    [
        ("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "must start with 'whsec_'"),
        ("whsec_MfKQ9r8GKYqr!wjUPD8ILPZIo2LaLaSw", "not valid base64"),
        ("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaS", "not valid base64"),
        ("whsec_", "empty key"),
    ],
    ids=["no-prefix", "bad-character", "bad-padding", "empty"],
)
def test_bad_secret_format_is_explained_without_the_secret(secret: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem) as caught:
        sign(secret, VECTOR_ID, VECTOR_TIMESTAMP, VECTOR_BODY)
    message = str(caught.value)
    assert "MfKQ9r8G" not in message
    # A chained decoder error would print the secret's characters in a traceback.
    assert caught.value.__context__ is None or caught.value.__suppress_context__


def test_secret_key_decodes_the_base64_after_the_prefix() -> None:
    assert secret_key(OTHER_SECRET) == b"another key, 24 bytes ok"


def test_naive_now_is_refused() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        verify(VECTOR_SECRET, vector_headers(), VECTOR_BODY, VECTOR_NOW.replace(tzinfo=None))
