"""OpenAI-style errors: `{"error": {"message", "type", "code"}}` with a 4xx/5xx status, for every failure
path (validation, unknown routes, oversized bodies, overload, internal faults — without stack traces)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

log = logging.getLogger("tserve.errors")


class APIError(Exception):
    """An error with an HTTP status that is reported to the client as-is."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.headers = status, message, type_, code, headers


def bad_request(message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, "invalid_request_error", code)


def not_found(message: str, code: str = "model_not_found") -> APIError:
    return APIError(404, message, "invalid_request_error", code)


def overloaded(message: str, retry_after: int = 1, status: int = 429) -> APIError:
    return APIError(status, message, "server_overloaded", "rate_limit_exceeded" if status == 429 else "unavailable",
                    {"Retry-After": str(retry_after)})


def client_closed() -> APIError:
    """The client went away before the answer (nginx's 499): nobody reads it, the access log and metrics do."""
    return APIError(499, "client closed the request", "invalid_request_error", "client_closed")


def error_body(message: str, type_: str, code: str | None) -> dict:
    return {"error": {"message": message, "type": type_, "code": code}}


def error_response(status: int, message: str, type_: str, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, code), status_code=status, headers=headers)


def _describe(errors: list[dict]) -> str:
    parts = []
    for e in errors[:5]:
        if e.get("type") == "json_invalid":
            return f"the body is not valid JSON ({e.get('ctx', {}).get('error', 'decode error')})"
        where = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        parts.append(f"{where or 'body'}: {e.get('msg', 'invalid')}")
    return "; ".join(parts)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.type, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, _describe(exc.errors()), "invalid_request_error", "invalid_request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc.__cause__, APIError):  # e.g. the body limit tripped while the body was read
            cause = exc.__cause__
            return error_response(cause.status, cause.message, cause.type, cause.code, cause.headers)
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(exc.status_code, str(exc.detail), type_, None, getattr(exc, "headers", None))

    @app.exception_handler(ClientDisconnect)
    async def _disconnected(_: Request, __: ClientDisconnect) -> JSONResponse:  # while the body was being read
        err = client_closed()
        return error_response(err.status, err.message, err.type, err.code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        request_id = getattr(request.state, "request_id", None)
        log.exception("internal error", extra={"request_id": request_id, "path": request.url.path})
        return error_response(500, f"internal error (request id {request_id})", "server_error", "internal_error")
