"""OpenTelemetry traces reach a real OTLP/HTTP receiver (in this test process): each request one trace that
continues the client's `traceparent`, with validate, queue, prefill, decode and output spans under it (one set
per sentence of a document), GenAI attributes that agree with the answer, and nothing sent when tracing is off."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import httpx
import pytest

from tests.helpers import factories
from tests.helpers.server import ServerProcess

pytest.importorskip("opentelemetry.proto")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest  # noqa: E402

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class Receiver:
    """An OTLP/HTTP trace receiver: every span it was sent, as (span, its attributes)."""

    def __init__(self) -> None:
        self.spans: list = []
        self.services: set[str] = set()  # the senders' service.name
        spans, services, lock = self.spans, self.services, threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                with lock:
                    for resource in request.resource_spans:
                        services.update(kv.value.string_value for kv in resource.resource.attributes
                                        if kv.key == "service.name")
                        for scope in resource.scope_spans:
                            spans.extend(scope.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args) -> None:  # noqa: ANN002 - quiet
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def trace(self, trace_id: str, count: int, timeout: float = 20.0) -> list:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [s for s in self.spans if s.trace_id.hex() == trace_id]
            if len(found) >= count:
                return found
            time.sleep(0.1)
        raise AssertionError(f"{len([s for s in self.spans if s.trace_id.hex() == trace_id])} spans of {trace_id}")


def attributes(span) -> dict:
    out = {}
    for kv in span.attributes:
        v = kv.value
        kind = v.WhichOneof("value")
        out[kv.key] = list(x.string_value for x in v.array_value.values) if kind == "array_value" else getattr(v, kind)
    return out


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    root = tmp_path_factory.mktemp("tracing")
    receiver = Receiver()
    models = {"lm": factories.tiny_lm_dir(root / "lm"), "mt": factories.tiny_mt_dir(root / "mt")}
    srv = ServerProcess([*factories.model_flags(models), "--otlp-endpoint", receiver.url], root / "server.log")
    yield srv.wait_ready(), receiver
    srv.stop()
    receiver.server.shutdown()


def test_a_completion_is_one_trace_under_the_clients_span(traced):
    srv, receiver = traced
    resp = httpx.post(srv.url + "/v1/completions", timeout=60,
                      headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"},
                      json={"model": "lm", "prompt": "Good morning", "max_tokens": 7, "temperature": 0,
                            "ignore_eos": True})
    assert resp.status_code == 200
    usage = resp.json()["usage"]
    spans = {s.name: s for s in receiver.trace(TRACE_ID, 6)}
    root = spans["POST /v1/completions"]
    assert root.parent_span_id.hex() == CLIENT_SPAN
    assert receiver.services == {"tserve"}  # OTEL_SERVICE_NAME unset
    for name in ("validate", "queue", "prefill", "decode", "output"):
        assert spans[name].parent_span_id == root.span_id, name
        assert root.start_time_unix_nano <= spans[name].start_time_unix_nano <= spans[name].end_time_unix_nano
    order = [spans[n] for n in ("validate", "queue", "prefill", "decode", "output")]
    assert all(a.end_time_unix_nano <= b.start_time_unix_nano + 1 for a, b in zip(order, order[1:], strict=False))
    expected = {"gen_ai.request.model": "lm", "http.response.status_code": 200,
                "gen_ai.usage.input_tokens": usage["prompt_tokens"],
                "gen_ai.usage.output_tokens": usage["completion_tokens"], "gen_ai.response.finish_reasons": ["length"]}
    got = attributes(root)
    assert {k: got.get(k) for k in expected} == expected
    decode = attributes(spans["decode"])
    assert decode["gen_ai.usage.output_tokens"] == 7 and 6 <= decode["tserve.steps"] <= 7


def test_a_document_has_spans_per_sentence(traced):
    srv, receiver = traced
    trace_id = "5bf92f3577b34da6a3ce929d0e0e4737"
    resp = httpx.post(srv.url + "/v1/translations", timeout=60,
                      headers={"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01"},
                      json={"model": "mt", "input": "Hello world. Good morning.", "num_beams": 1})
    assert resp.status_code == 200
    spans = receiver.trace(trace_id, 2 * 3 + 3)
    assert sum(s.name == "decode" for s in spans) == 2 and sum(s.name == "queue" for s in spans) == 2
    root = next(s for s in spans if s.name == "POST /v1/translations")
    assert attributes(root)["gen_ai.request.model"] == "mt"


@pytest.mark.slow  # 6 s: a server of its own; test_off_means_no_tracer_and_no_observer checks the same in-process
def test_no_traces_when_off(tmp_path):
    receiver = Receiver()
    srv = ServerProcess(["--model", f"lm={factories.tiny_lm_dir(tmp_path / 'lm')}"], tmp_path / "server.log",
                        env={"OTEL_EXPORTER_OTLP_ENDPOINT": ""}).wait_ready()
    try:
        httpx.post(srv.url + "/v1/completions", json={"model": "lm", "prompt": "Hi", "max_tokens": 2}, timeout=60)
        time.sleep(1.0)
        assert receiver.spans == []
    finally:
        srv.stop()
        receiver.server.shutdown()


def test_off_means_no_tracer_and_no_observer(monkeypatch):
    """Without an endpoint nothing is set up: no tracer, and engine requests carry no observer (no cost)."""
    import asyncio

    from tserve.service import tracing
    from tserve.service.app import build_app
    from tserve.service.engine import request_observer
    from tserve.service.settings import Settings

    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    app = build_app(Settings(), load_models=False)

    @app.get("/observed")
    async def observed() -> dict:
        return {"observer": request_observer.get() is not None, "tracer": tracing._tracer is not None}

    async def go() -> dict:
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
                return (await c.get("/observed")).json()

    assert asyncio.run(go()) == {"observer": False, "tracer": False}
