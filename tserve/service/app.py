"""The FastAPI application: lifespan (model loading in the background), middleware (request ids, metrics,
body-size limit), error handlers and routers."""

from __future__ import annotations

import logging
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tserve.service import heap, tracing
from tserve.service.errors import APIError, InternalErrorMiddleware, error_response, install_error_handlers
from tserve.service.metrics import Metrics
from tserve.service.registry import ModelRegistry
from tserve.service.routes import (
    attention,
    classifications,
    completions,
    embeddings,
    files,
    health,
    libretranslate,
    logit_lens,
    oip,
    page,
    repository,
    translations,
    viewer,
)
from tserve.service.security import APIKeyMiddleware, KeyGate
from tserve.service.settings import Settings
from tserve.service.translation.file_jobs import FileJobs

log = logging.getLogger("tserve.access")


class BodyTooLarge(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body exceeds {limit} bytes", "invalid_request_error", "body_too_large")


class BodyLimitMiddleware:
    """Refuse bodies over the limit, by Content-Length up front or by counting a chunked body."""

    def __init__(self, app: ASGIApp, limit: int, larger: dict[str, int] | None = None) -> None:
        self.app, self.default_limit, self.larger = app, limit, larger or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.larger.get(scope.get("path", ""), self.default_limit)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            status = 413 if length.isdigit() else 400
            msg = f"request body exceeds {limit} bytes" if status == 413 else "bad Content-Length"
            await error_response(status, msg, "invalid_request_error", "body_too_large",
                                 path=scope.get("path"))(scope, receive, send)
            return
        seen = 0

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, counting_receive, send)


class RequestContextMiddleware:
    """Request id (X-Request-ID in and out), per-route request counts and latency, one access-log line.
    Plain ASGI rather than BaseHTTPMiddleware, so that streaming responses and client disconnects pass
    through untouched."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        request_id = headers.get(b"x-request-id", b"").decode("latin-1")[:128] or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        start = time.perf_counter()
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode("latin-1"))]
            await send(message)

        try:
            with tracing.request_trace(scope) as traced:
                try:
                    await self.app(scope, receive, send_with_id)
                finally:
                    if traced is not None:
                        traced.finish(status, time.time_ns())
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            elapsed = time.perf_counter() - start
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.latency.labels(route).observe(elapsed)
            log.info("request", extra={"request_id": request_id, "method": scope["method"], "route": route,
                                       "status": status, "ms": round(elapsed * 1000, 1)})


def build_app(settings: Settings | None = None, *, load_models: bool = True) -> FastAPI:
    settings = settings or Settings()
    metrics = Metrics()
    registry = ModelRegistry(settings, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        tracing.configure(settings.otlp_endpoint)
        pauses = heap.PauseObserver(metrics.gc_pause)
        if load_models:
            registry.start_loading()
        yield
        registry.ready = False  # /readyz answers 503 while in-flight work drains
        await file_jobs.close()
        registry.wait_loaded(timeout=60)
        registry.stop()
        pauses.close()
        tracing.shutdown()  # after the drain: the last requests' spans go out too

    app = FastAPI(title="tserve", version="0.1.0", lifespan=lifespan,
                  description="Transformer inference: text generation, translation, image classification.")
    app.state.settings, app.state.metrics, app.state.registry = settings, metrics, registry
    app.state.file_jobs = file_jobs = FileJobs(settings.file_dir, settings.file_retention_s, metrics)
    install_error_handlers(app)

    # Added first = innermost: a route's unhandled exception is answered inside the others (request id, CORS).
    app.add_middleware(InternalErrorMiddleware)
    # Added last = outermost: refused requests (no key, oversized body) are counted and logged too.
    file_body = settings.max_file_bytes + 64 * 1024  # the file and its form fields
    app.add_middleware(BodyLimitMiddleware, limit=settings.max_body_bytes,
                       larger={path: max(file_body, settings.max_body_bytes) for path in files.FILE_PATHS})
    app.state.key_gate = gate = KeyGate(settings.api_keys, settings.max_requests_per_key)
    app.add_middleware(APIKeyMiddleware, gate=gate, public_paths=settings.public_paths,
                       self_checked_paths=libretranslate.KEY_CHECKED_PATHS,
                       # the admin keys and a download's owner key are checked there
                       self_checked_prefixes=(repository.PREFIX + "/", libretranslate.DOWNLOAD_PREFIX))
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-Request-ID"])
    app.add_middleware(RequestContextMiddleware, metrics=metrics)
    for router in (health.router, completions.router, translations.router, classifications.router,
                   embeddings.router, attention.router, logit_lens.router, oip.router, viewer.router,
                   libretranslate.router, repository.router, page.router, files.router):
        app.include_router(router)
    return app
