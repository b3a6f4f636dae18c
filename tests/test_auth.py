"""API-key authentication: each header form, each failure, admin checks, and no key leaks."""

from __future__ import annotations

import hashlib
import logging

import pytest

from services.gateway.auth import (
    AuthError,
    Principal,
    authenticate,
    bearer_token,
    hash_key,
    require_admin,
)

USER_KEY = "sk-user-0123456789"
ADMIN_KEY = "sk-admin-9876543210"
USERS = [hash_key(USER_KEY)]
ADMINS = [hash_key(ADMIN_KEY)]


def _auth_error(authorization: str | None, x_api_key: str | None) -> AuthError:
    with pytest.raises(AuthError) as caught:
        authenticate(authorization, x_api_key, USERS, ADMINS)
    return caught.value


def test_hash_key_is_sha256_hex() -> None:
    assert hash_key("abc") == hashlib.sha256(b"abc").hexdigest()


def test_bearer_header_authenticates() -> None:
    principal = authenticate(f"Bearer {USER_KEY}", None, USERS, ADMINS)
    assert principal == Principal(is_admin=False)
    assert _auth_error(f"Bearer {USER_KEY}x", None).message == "invalid API key"


def test_x_api_key_authenticates() -> None:
    assert authenticate(None, USER_KEY, USERS, ADMINS) == Principal(is_admin=False)
    assert _auth_error(None, f"{USER_KEY}x").message == "invalid API key"


def test_bearer_scheme_is_case_insensitive_and_whitespace_tolerant() -> None:
    assert not authenticate(f"  bearer   {USER_KEY} ", None, USERS, ADMINS).is_admin
    assert bearer_token(f"BEARER {USER_KEY}") == USER_KEY


def test_bearer_takes_precedence_over_x_api_key() -> None:
    assert authenticate(f"Bearer {ADMIN_KEY}", USER_KEY, USERS, ADMINS).is_admin
    assert _auth_error("Bearer wrong", USER_KEY).message == "invalid API key"


def test_other_authorization_schemes_fall_back_to_x_api_key() -> None:
    assert bearer_token("Basic dXNlcjpwYXNz") is None
    assert authenticate("Basic dXNlcjpwYXNz", USER_KEY, USERS, ADMINS) == Principal(is_admin=False)
    assert _auth_error("Basic dXNlcjpwYXNz", None).message.startswith("missing API key")


def test_admin_key_is_admin_and_a_valid_normal_key() -> None:
    principal = authenticate(None, ADMIN_KEY, USERS, ADMINS)
    assert principal.is_admin
    require_admin(principal)
    assert authenticate(None, ADMIN_KEY, [], ADMINS).is_admin


def test_stored_hashes_match_case_insensitively() -> None:
    assert authenticate(None, USER_KEY, [USERS[0].upper()], []) == Principal(is_admin=False)
    assert authenticate(None, ADMIN_KEY, [], [f" {ADMINS[0].upper()} "]).is_admin


@pytest.mark.parametrize(
    ("authorization", "x_api_key"),
    [(None, None), ("", ""), ("Bearer", None), ("Bearer   ", "  "), ("Basic abc", None)],
)
def test_missing_key_is_401_with_instructions(
    authorization: str | None, x_api_key: str | None
) -> None:
    error = _auth_error(authorization, x_api_key)
    assert error.status == 401
    assert str(error) == "missing API key: send Authorization: Bearer <key> or x-api-key"


def test_wrong_key_is_401_invalid() -> None:
    error = _auth_error("Bearer sk-not-a-real-key", None)
    assert (error.status, str(error)) == (401, "invalid API key")


def test_a_hash_is_not_accepted_as_a_key() -> None:
    assert _auth_error(None, USERS[0]).status == 401


def test_no_configured_keys_turns_auth_off() -> None:
    principal = authenticate(None, None, [], [])
    assert principal == Principal(is_admin=True)
    assert authenticate("Bearer anything", None, [], []).is_admin


def test_require_admin_rejects_normal_keys_with_403() -> None:
    with pytest.raises(AuthError) as caught:
        require_admin(authenticate(None, USER_KEY, USERS, ADMINS))
    assert (caught.value.status, caught.value.message) == (
        403,
        "this endpoint needs an admin API key",
    )


def test_keys_never_appear_in_errors_principals_or_logs(caplog: pytest.LogCaptureFixture) -> None:
    secret = "sk-secret-never-show-me"
    caplog.set_level(logging.DEBUG)
    errors = [_auth_error(f"Bearer {secret}", None), _auth_error(None, secret)]
    principal = authenticate(None, USER_KEY, USERS, ADMINS)
    texts = [*(f"{e!s} {e!r} {e.args}" for e in errors), repr(principal), caplog.text]
    assert not any(secret in text or USER_KEY in text for text in texts)
