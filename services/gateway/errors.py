"""Errors in each API's own shape, and the handlers that make sure nothing leaks a stack
trace or a bare 500."""

from __future__ import annotations

import logging
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

KINDS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        headers: dict[str, str] | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code  # OpenAI's `error.code`, such as "model_not_found"
        self.headers = headers or {}
        self.recorded = False  # set once the request's telemetry event carries this error


def is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_body(
    anthropic: bool, status: int, message: str, code: str | None = None
) -> dict[str, object]:
    kind = KINDS.get(status, "api_error")
    if anthropic:
        return {"type": "error", "error": {"type": kind, "message": message}}
    if status == 404 and code is not None:
        kind = "invalid_request_error"  # OpenAI's kind for a missing model
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


CHAT_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/messages")
OnReject = Callable[[Request, ApiError], None]


def install_error_handlers(app: FastAPI, on_reject: OnReject | None = None) -> None:
    """Map every error to the API's shape. `on_reject` sees chat requests refused before
    they had a telemetry event of their own (bad body, bad key), so none goes unrecorded."""

    def error_response(request: Request, error: ApiError) -> JSONResponse:
        if on_reject and not error.recorded and request.url.path in CHAT_PATHS:
            on_reject(request, error)
        body = error_body(is_anthropic(request.url.path), error.status, error.message, error.code)
        return JSONResponse(body, status_code=error.status, headers=error.headers)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(request, exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(request, ApiError(400, describe_validation(exc)))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(request, ApiError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(request, ApiError(500, "internal error; see the gateway log"))


def describe_validation(exc: RequestValidationError) -> str:
    errors = exc.errors()
    if not errors:
        return "invalid request body"
    first = errors[0]
    where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
    if first.get("type") == "json_invalid":
        return "request body is not valid JSON"
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    if not where:  # a whole-body check names its field itself
        return f"{message}{more}"
    return f"{where}: {message}{more}"
