"""FastAPI dependencies as Annotated aliases."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request

from services.gateway.auth import AuthError, Principal, authenticate, require_admin
from services.gateway.errors import ApiError
from services.gateway.runtime import Runtime


def get_runtime(request: Request) -> Runtime:
    runtime: Runtime | None = getattr(request.app.state, "runtime", None)
    if runtime is None:
        raise ApiError(503, "the gateway is starting; retry shortly", {"Retry-After": "2"})
    return runtime


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]


def get_principal(
    rt: RuntimeDep,
    authorization: Annotated[str | None, Header()] = None,
    x_api_key: Annotated[str | None, Header()] = None,
) -> Principal:
    cfg = rt.settings.gateway
    try:
        return authenticate(authorization, x_api_key, cfg.api_key_hashes, cfg.admin_key_hashes)
    except AuthError as exc:
        raise ApiError(exc.status, str(exc)) from None


PrincipalDep = Annotated[Principal, Depends(get_principal)]


def get_admin(principal: PrincipalDep) -> Principal:
    try:
        require_admin(principal)
    except AuthError as exc:
        raise ApiError(exc.status, str(exc)) from None
    return principal


AdminDep = Annotated[Principal, Depends(get_admin)]
