"""OpenTelemetry traces of requests, off unless --otlp-endpoint (or OTEL_EXPORTER_OTLP_ENDPOINT) names a
collector: then each HTTP request is a trace that continues the client's W3C `traceparent`, exported over
OTLP/HTTP in batches. Its spans:

    POST /v1/completions          the request (GenAI attributes: model, token counts, finish reasons)
      validate                    from the request's start to its first engine request
      queue                       per engine request (a document's sentence is one): waiting for rows
      prefill                     admitted -> first token
      decode                      first token -> finished: one span, with its steps and tokens
      output                      the last engine request finished -> the response sent

Engine requests keep their timeline (tserve/service/engine/request.py); the spans are made from it once a request's
stream ends, on the event loop, so the workers do nothing for tracing. Attributes follow the OpenTelemetry
GenAI semantic conventions (`gen_ai.request.model`, `gen_ai.usage.input_tokens`, ...). Off, nothing is imported
and nothing is recorded."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tserve.service.engine import EngineRequest, request_observer

_tracer: Any = None  # an opentelemetry Tracer when on
_provider: Any = None


def configure(endpoint: str | None) -> bool:
    """Turn tracing on when an endpoint is given (flag, else OTEL_EXPORTER_OTLP_ENDPOINT); True when on."""
    global _tracer, _provider
    endpoint = endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not endpoint:
        _tracer = None
        return False
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # noqa: PLC0415
    from opentelemetry.sdk.resources import Resource  # noqa: PLC0415
    from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415
    from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: PLC0415

    url = endpoint.rstrip("/")
    url = url if url.endswith("/v1/traces") else url + "/v1/traces"
    _provider = TracerProvider(resource=Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME",
                                                                                         "tserve")}))
    _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url), schedule_delay_millis=200))
    _tracer = _provider.get_tracer("tserve")
    return True


def shutdown() -> None:
    """Export what is pending and stop tracing (at server stop)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


class _RequestTrace:
    """One HTTP request's root span and the engine requests it made."""

    def __init__(self, span: Any, start_ns: int) -> None:
        self.span, self.start_ns = span, start_ns
        self.engine_requests: list[EngineRequest] = []

    def observe(self, req: EngineRequest) -> None:
        from opentelemetry import trace  # noqa: PLC0415

        self.engine_requests.append(req)
        parent = trace.set_span_in_context(self.span)
        model = {"gen_ai.request.model": req.model} if req.model else {}
        phases = [("queue", req.queued_ns, req.admitted_ns or req.finished_ns, {})]
        if req.first_token_ns:
            steps = max(0, req.finished_step - req.admitted_step + 1)  # the engine steps it ran in
            phases += [("prefill", req.admitted_ns, req.first_token_ns, {"gen_ai.usage.input_tokens": req.input_tokens}),
                       ("decode", req.first_token_ns, req.finished_ns,
                        {"tserve.steps": steps, "gen_ai.usage.output_tokens": req.output_tokens})]
        elif req.admitted_ns:
            phases.append(("run", req.admitted_ns, req.finished_ns, {}))
        for name, start, end, attributes in phases:
            if start and end:
                span = _tracer.start_span(name, context=parent, start_time=start, attributes=model | attributes)
                span.end(end_time=max(start, end))

    def finish(self, status: int, end_ns: int) -> None:
        from opentelemetry import trace  # noqa: PLC0415

        reqs = self.engine_requests
        parent = trace.set_span_in_context(self.span)
        if reqs:
            first, last = min(r.queued_ns for r in reqs), max(r.finished_ns or end_ns for r in reqs)
            _tracer.start_span("validate", context=parent, start_time=self.start_ns).end(end_time=first)
            _tracer.start_span("output", context=parent, start_time=last).end(end_time=max(last, end_ns))
            models = sorted({r.model for r in reqs if r.model})
            self.span.set_attributes({
                "gen_ai.request.model": models[0] if len(models) == 1 else ",".join(models),
                "gen_ai.usage.input_tokens": sum(r.input_tokens for r in reqs),
                "gen_ai.usage.output_tokens": sum(r.output_tokens for r in reqs),
                "gen_ai.response.finish_reasons": sorted({r.finish_reason for r in reqs if r.finish_reason}),
            })
        self.span.set_attribute("http.response.status_code", status)
        if status >= 500:
            self.span.set_status(trace.StatusCode.ERROR)
        self.span.end(end_time=end_ns)


def _request_id(scope: dict[str, Any]) -> str:
    return scope.get("state", {}).get("request_id", "")


@contextmanager
def request_trace(scope: dict[str, Any]) -> Iterator[_RequestTrace | None]:
    """The root span of an HTTP request (None when tracing is off), continuing the client's traceparent; the
    engine requests made inside report to it. The caller ends it with `finish`."""
    if _tracer is None:
        yield None
        return
    from opentelemetry.trace import SpanKind  # noqa: PLC0415
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator  # noqa: PLC0415

    carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
    context = TraceContextTextMapPropagator().extract(carrier)
    start = time.time_ns()
    span = _tracer.start_span(f"{scope['method']} {scope['path']}", context=context, kind=SpanKind.SERVER,
                              start_time=start, attributes={"http.request.method": scope["method"],
                                                            "url.path": scope["path"],
                                                            # the id the response and the logs carry
                                                            "tserve.request_id": _request_id(scope)})
    traced = _RequestTrace(span, start)
    token = request_observer.set(traced.observe)
    try:
        yield traced
    finally:
        request_observer.reset(token)
