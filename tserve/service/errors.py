"""Errors, in one place: what every failure path (validation, unknown routes, oversized bodies, overload,
engine failures, internal faults) answers, without stack traces. `engine_failure` is the one map from what
the engines and the batcher raise to a status, message and code; the shape follows the protocol of the
route: OpenAI's `{"error": {"message", "type", "code"}}` everywhere (and `param`, the request field at fault,
where one is), `{"error": "..."}` under `/v2/` (the Open Inference Protocol) and on LibreTranslate's routes.
Overload is 429 (queue full) or 503 (loading, shutting down, out of memory), always with Retry-After."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tserve.model.decoding.constrained_beam import ConstraintsUnmet
from tserve.service.engine import InvalidInput, OutOfMemory, QueueFull, RequestTimeout, ShuttingDown

# InvalidInput: what an engine or an input rule refuses (400); raised by the engines and the service alike.
__all__ = ["LIBRETRANSLATE_DOWNLOAD_PREFIX", "LIBRETRANSLATE_PATHS", "OIP_PREFIX", "APIError", "InvalidInput", "OIPError",
           "bad_request", "client_closed", "engine_failure", "error_body", "error_response", "flat_errors",
           "install_error_handlers", "not_found", "overloaded"]

log = logging.getLogger("tserve.errors")


class APIError(Exception):
    """An error with an HTTP status that is reported to the client as-is."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.headers = status, message, type_, code, headers
        self.param = param


class OIPError(APIError):
    """A request the Open Inference Protocol refuses; rendered as `{"error": message}` like every error under
    /v2/."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(status, message, "invalid_request_error" if status < 500 else "server_error")


def bad_request(message: str, code: str = "invalid_value", param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", code, param=param)


def not_found(message: str, code: str = "model_not_found") -> APIError:
    return APIError(404, message, "invalid_request_error", code)


def overloaded(message: str, retry_after: int = 1, status: int = 429) -> APIError:
    return APIError(status, message, "server_overloaded", "rate_limit_exceeded" if status == 429 else "unavailable",
                    {"Retry-After": str(retry_after)})


def engine_failure(exc: BaseException, what: str, invalid_code: str = "request_too_large") -> APIError:
    """The error a client gets for what an engine or the batcher raised, at submission or while its request
    ran (`what`: "generation", "translation", "classification"). Never internals: the kind of failure only."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ShuttingDown):
        return overloaded(str(exc), status=503)
    if isinstance(exc, QueueFull):
        return overloaded(str(exc))
    if isinstance(exc, OutOfMemory):
        return overloaded(str(exc), retry_after=1, status=503)
    if isinstance(exc, RequestTimeout):
        return APIError(504, str(exc), "server_error", "timeout")
    if isinstance(exc, ConstraintsUnmet):  # valid input the model could not satisfy
        return APIError(422, str(exc), "invalid_request_error", "glossary_unplaceable")
    if isinstance(exc, ValueError):  # the request cannot run on this server, or a call job refused its input
        return bad_request(str(exc), getattr(exc, "code", None) or invalid_code, getattr(exc, "param", None))
    return APIError(500, str(exc) or f"{what} failed", "server_error", f"{what}_failed")


def client_closed() -> APIError:
    """The client went away before the answer (nginx's 499): nobody reads it, the access log and metrics do."""
    return APIError(499, "client closed the request", "invalid_request_error", "client_closed")


def error_body(message: str, type_: str, code: str | None, param: str | None = None) -> dict:
    """OpenAI's error object; `param` only where a request field is at fault (a client may act on it)."""
    return {"error": {"message": message, "type": type_, "code": code} | ({"param": param} if param else {})}


OIP_PREFIX = "/v2/"
LIBRETRANSLATE_PATHS = frozenset({"/translate", "/languages", "/detect", "/frontend/settings", "/translate_file"})
LIBRETRANSLATE_DOWNLOAD_PREFIX = "/download_file/"


def flat_errors(path: str) -> bool:
    """Whether errors on `path` are `{"error": message}` (the Open Inference Protocol, LibreTranslate's API)."""
    return path.startswith((OIP_PREFIX, LIBRETRANSLATE_DOWNLOAD_PREFIX)) or path in LIBRETRANSLATE_PATHS


def error_response(status: int, message: str, type_: str, code: str | None = None,
                   headers: dict[str, str] | None = None, request: Request | None = None,
                   path: str | None = None, param: str | None = None) -> JSONResponse:
    """The error in the shape of the request's protocol: the request's, or `path`'s (an ASGI middleware's)."""
    path = request.url.path if request is not None else path
    if path is not None and flat_errors(path):
        return JSONResponse({"error": message}, status_code=status, headers=headers)
    return JSONResponse(error_body(message, type_, code, param), status_code=status, headers=headers)


def _describe(errors: list[dict]) -> str:
    parts = []
    for e in errors[:5]:
        if e.get("type") == "json_invalid":
            return f"the body is not valid JSON ({e.get('ctx', {}).get('error', 'decode error')})"
        where = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        parts.append(f"{where or 'body'}: {e.get('msg', 'invalid')}")
    return "; ".join(parts)


def install_error_handlers(app: FastAPI) -> None:
    def render(request: Request, err: APIError) -> JSONResponse:
        return error_response(err.status, err.message, err.type, err.code, err.headers, request, param=err.param)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return render(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return render(request, bad_request(_describe(exc.errors()), "invalid_request"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc.__cause__, APIError):  # e.g. the body limit tripped while the body was read
            return render(request, exc.__cause__)
        if isinstance(exc.__cause__, ClientDisconnect):  # FastAPI's reading of a JSON body, cut by the client
            return render(request, client_closed())
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return render(request, APIError(exc.status_code, str(exc.detail), type_, None, getattr(exc, "headers", None)))

    @app.exception_handler(ClientDisconnect)
    async def _disconnected(request: Request, __: ClientDisconnect) -> JSONResponse:  # while the body was read
        return render(request, client_closed())

    @app.exception_handler(Exception)  # what a middleware raised; a route's is `InternalErrorMiddleware`'s
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        return internal_error(request)


def internal_error(request: Request) -> JSONResponse:
    """The answer to an exception nothing else handled (logged here, with the traceback being handled)."""
    request_id = getattr(request.state, "request_id", None)
    log.exception("internal error", extra={"request_id": request_id, "path": request.url.path})
    return error_response(500, f"internal error (request id {request_id})", "server_error", "internal_error",
                          request=request)


class InternalErrorMiddleware:
    """A route's exception that no handler took becomes the 500 of `internal_error` here, inside the other
    middlewares, so that it carries the request id and the CORS headers as every other answer does (Starlette's
    own last-resort handler answers outside them). A response already started is cut as before."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception:
            if started:
                raise
            await internal_error(Request(scope))(scope, receive, send)
