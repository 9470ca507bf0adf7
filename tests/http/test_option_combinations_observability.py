"""What an operator sees, checked where options meet: requests refused by the API-key middleware (401, the per-key
429) are counted, logged and answered with their request id like the others; unknown paths and templated routes keep
the metrics' route label bounded; sizes such as 2GiB read the same from a flag and from TSERVE_*; --otlp-endpoint
beside OTEL_EXPORTER_OTLP_ENDPOINT and a full /v1/traces URL; a root span marked failed for every 5xx (a 503 while
loading, not only a 500); --log-level; the inputs log line under the request id the server generated; a SIGTERM drain
bounded by its timeout and a second signal that stops at once. Apps run in this process (`httpx.ASGITransport`),
most of them without models (`load_models=False`), so that the tests take seconds."""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import httpx
import pytest
import uvicorn

from tserve.service import tracing
from tserve.service.app import build_app
from tserve.service.cli import build_parser, configure_logging, settings_from_args
from tserve.service.settings import Settings
from tserve.service.shutdown import DrainingServer


def _requests(app, *calls: tuple) -> list[httpx.Response]:  # noqa: ANN001 - a FastAPI app
    """Each (method, path, kwargs) in turn, through the app in this process."""

    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            return [await c.request(method, path, **kwargs) for method, path, *rest in calls
                    for kwargs in [rest[0] if rest else {}]]

    return asyncio.run(go())


def _count(app, route: str, status: int) -> float:  # noqa: ANN001
    value = app.state.metrics.registry.get_sample_value("tserve_requests_total", {"route": route,
                                                                                  "status": str(status)})
    return value or 0.0


def _routes(app) -> set[str]:  # noqa: ANN001
    return {s.labels["route"] for m in app.state.metrics.registry.collect() if m.name == "tserve_requests"
            for s in m.samples}


# --------------------------------------------------------------------------------------------------
# Request ids, counts and access-log lines of refused requests
# --------------------------------------------------------------------------------------------------
def test_a_request_refused_for_its_key_is_counted_logged_and_carries_its_request_id(caplog):
    """With --api-keys (and --max-requests-per-key), the middleware's own answers (401 without a key) are
    requests like any other to an operator: the X-Request-ID comes back, the access log has their line under that
    id, and tserve_requests_total counts them; a request with the key is counted beside them."""
    app = build_app(Settings(api_keys=["k1"], max_requests_per_key=1), load_models=False)
    with caplog.at_level("INFO", logger="tserve.access"):
        refused, served = _requests(app, ("GET", "/v1/models", {"headers": {"X-Request-ID": "rid-no-key"}}),
                                    ("GET", "/v1/models", {"headers": {"X-Request-ID": "rid-key",
                                                                       "Authorization": "Bearer k1"}}))
    assert refused.status_code == 401 and served.status_code == 200
    assert refused.headers.get("x-request-id") == "rid-no-key"
    assert served.headers.get("x-request-id") == "rid-key"
    logged = {r.request_id: r.status for r in caplog.records if r.name == "tserve.access"}
    assert logged == {"rid-no-key": 401, "rid-key": 200}
    assert _count(app, "unmatched", 401) == 1 and _count(app, "/v1/models", 200) == 1


def test_the_inputs_log_line_carries_the_request_id_the_server_generated(caplog):
    """--log-prompts: a client that sends no X-Request-ID gets an id made up by the server; the line that logs its
    inputs carries that same id (as the access line and the response do), so that the two can be joined."""
    app = build_app(Settings(log_prompts=True), load_models=False)
    with caplog.at_level("INFO"):
        (resp,) = _requests(app, ("POST", "/v1/translations", {"json": {"input": "hello world"}}))
    generated = resp.headers["x-request-id"]
    assert generated
    inputs = [r for r in caplog.records if r.name == "tserve.requests"]
    access = [r for r in caplog.records if r.name == "tserve.access"]
    assert [(r.request_id, r.inputs) for r in inputs] == [(generated, ["hello world"])]
    assert [r.request_id for r in access] == [generated]


# --------------------------------------------------------------------------------------------------
# The route label
# --------------------------------------------------------------------------------------------------
def test_the_route_label_stays_bounded_for_unknown_paths_and_templated_routes():
    """A scanner's paths must not each make a series: every unknown path counts under route="unmatched"; the Open
    Inference Protocol's per-model routes count under their template, whatever the model name (here while the
    models load: 503)."""
    app = build_app(Settings(), load_models=False)
    body = {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["hi"]}]}
    responses = _requests(app, ("GET", "/wp-admin/a.php"), ("GET", "/nothing/1"),
                          ("POST", "/v2/models/first/infer", {"json": body}),
                          ("POST", "/v2/models/second/infer", {"json": body}))
    assert [r.status_code for r in responses] == [404, 404, 503, 503]
    assert _count(app, "unmatched", 404) == 2
    assert _count(app, "/v2/models/{name}/infer", 503) == 2
    assert _routes(app) == {"unmatched", "/v2/models/{name}/infer"}


# --------------------------------------------------------------------------------------------------
# Sizes from flags and from the environment
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "expected"), [("2GiB", 2 * 2**30), ("512MiB", 512 * 2**20), ("8GB", 8 * 10**9),
                                                ("1.5g", 1_500_000_000), ("1000000", 1_000_000)])
def test_sizes_are_read_the_same_from_a_flag_and_from_the_environment(monkeypatch, text, expected):
    """--max-model-memory and --kv-cache-memory take binary (GiB, MiB) and decimal (GB) units; TSERVE_* reads
    them as the flags do."""
    flagged = settings_from_args(build_parser().parse_args(["serve", "--max-model-memory", text,
                                                            "--kv-cache-memory", text]))
    monkeypatch.setenv("TSERVE_MAX_MODEL_MEMORY", text)
    monkeypatch.setenv("TSERVE_KV_CACHE_MEMORY", text)
    from_env = Settings()
    for settings in (flagged, from_env):
        assert settings.max_model_memory_bytes == expected
        assert settings.kv_cache_budget == (expected, None)
    monkeypatch.setenv("TSERVE_KV_CACHE_MEMORY", "0.3")
    assert Settings().kv_cache_budget == (None, 0.3)


# --------------------------------------------------------------------------------------------------
# Tracing
# --------------------------------------------------------------------------------------------------
@pytest.fixture
def exporters(monkeypatch):
    """The endpoints OTLP exporters were made for (none is contacted); tracing is off again afterwards."""
    from opentelemetry.exporter.otlp.proto.http import trace_exporter
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    made: list[str] = []

    class Recording(SpanExporter):
        def __init__(self, endpoint: str) -> None:
            made.append(endpoint)

        def export(self, spans) -> SpanExportResult:  # noqa: ANN001
            return SpanExportResult.SUCCESS

    monkeypatch.setattr(trace_exporter, "OTLPSpanExporter", Recording)
    yield made
    tracing.shutdown()


def test_the_otlp_flag_wins_over_the_environment_and_a_full_traces_url_is_kept(monkeypatch, exporters):
    """--otlp-endpoint beside OTEL_EXPORTER_OTLP_ENDPOINT: the flag names the collector; a collector's base URL
    gets /v1/traces, a URL that already ends with it is used as given."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://from-env:4318")
    assert tracing.configure("http://from-flag:4318/")
    assert tracing.configure("http://collector:4318/v1/traces")
    assert tracing.configure(None)
    assert exporters == ["http://from-flag:4318/v1/traces", "http://collector:4318/v1/traces",
                         "http://from-env:4318/v1/traces"]


def test_every_5xx_marks_the_requests_span_failed_and_a_4xx_does_not(monkeypatch):
    """A 503 (models loading) is a server-side failure as much as a 500: its root span has status ERROR; a 404 is
    the client's, its span is not marked. Each span records its response status and its request id."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import StatusCode

    exported = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exported))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
    app = build_app(Settings(), load_models=False)
    answers = _requests(app, ("POST", "/v1/completions", {"json": {"prompt": "hi"}, "headers": {"X-Request-ID": "r1"}}),
                        ("GET", "/nothing"))
    assert [r.status_code for r in answers] == [503, 404]
    spans = {s.name: s for s in exported.get_finished_spans()}
    loading, unknown = spans["POST /v1/completions"], spans["GET /nothing"]
    # the request id the response (and the access log) carries, given or generated, joins a trace to them
    assert loading.attributes["tserve.request_id"] == "r1"
    assert unknown.attributes["tserve.request_id"] == answers[1].headers["x-request-id"] != ""
    assert loading.attributes["http.response.status_code"] == 503 and loading.status.status_code == StatusCode.ERROR
    assert unknown.attributes["http.response.status_code"] == 404 and unknown.status.status_code != StatusCode.ERROR


# --------------------------------------------------------------------------------------------------
# Logging
# --------------------------------------------------------------------------------------------------
@pytest.fixture
def root_logger():
    """The root logger's handlers and level, restored after a test that configures logging."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    access = logging.getLogger("uvicorn.access").disabled
    yield root
    root.handlers[:], root.level = handlers, level
    logging.getLogger("uvicorn.access").disabled = access


@pytest.mark.parametrize(("level", "info_logged"), [("debug", True), ("info", True), ("warning", False),
                                                    ("error", False)])
def test_log_level_decides_whether_access_lines_are_written(root_logger, level, info_logged):
    """--log-level warning keeps the per-request access lines (INFO) out of the logs, --log-level debug lets
    debug lines in; warnings reach the logs below --log-level error."""
    configure_logging(level)
    access = logging.getLogger("tserve.access")
    assert access.isEnabledFor(logging.INFO) is info_logged
    assert access.isEnabledFor(logging.DEBUG) is (level == "debug")
    assert access.isEnabledFor(logging.WARNING) is (level != "error")


# --------------------------------------------------------------------------------------------------
# Draining on SIGTERM
# --------------------------------------------------------------------------------------------------
class _BusyRegistry:
    """A registry whose models never finish what they hold."""

    def __init__(self) -> None:
        self.drains = 0

    def begin_drain(self) -> None:
        self.drains += 1

    def idle(self) -> bool:
        return False


def test_a_drain_ends_at_its_timeout_and_a_second_signal_stops_at_once():
    """A request that never ends must not keep a SIGTERM'd server up past --request-timeout-s (the drain time),
    and an operator's second signal stops the server at once instead of starting the drain again."""
    config = uvicorn.Config(build_app(Settings(), load_models=False))
    registry = _BusyRegistry()
    server = DrainingServer(config, registry, drain_timeout_s=0.3)
    started = time.monotonic()
    server.handle_exit(signal.SIGTERM, None)
    assert registry.drains == 1 and not server.should_exit  # draining: still serving
    deadline = started + 10
    while not server.should_exit and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.should_exit and 0.25 <= time.monotonic() - started < 5

    impatient = DrainingServer(config, registry := _BusyRegistry(), drain_timeout_s=5)
    impatient.handle_exit(signal.SIGTERM, None)
    assert not impatient.should_exit
    impatient.handle_exit(signal.SIGTERM, None)
    assert impatient.should_exit and registry.drains == 1


# --------------------------------------------------------------------------------------------------
# Errors in each route family's shape
# --------------------------------------------------------------------------------------------------
def test_errors_keep_each_route_familys_shape_and_headers():
    """LibreTranslate's /translate_file (a request without its file) and the Open Inference Protocol (a model asked
    while the models load) answer `{"error": message}`; the OpenAI routes answer `{"error": {...}}`, and a wrong
    method keeps the Allow header that says the right one."""
    app = build_app(Settings(), load_models=False)
    no_file, loading, bad_completion, wrong_method = _requests(
        app, ("POST", "/translate_file", {"data": {"source": "en", "target": "de"}}),
        ("POST", "/v2/models/x/infer", {"json": {"inputs": []}}),
        ("POST", "/v1/completions", {"json": {"prompt": {"not": "a prompt"}}}),
        ("GET", "/v1/completions"))
    assert no_file.status_code == 400 and no_file.json() == {"error": "send the file as the multipart field 'file'"}
    assert loading.status_code == 503 and loading.json() == {"error": "models are still loading"}
    assert bad_completion.status_code == 400 and bad_completion.json()["error"]["code"] == "invalid_request"
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["type"] == "invalid_request_error"
    assert wrong_method.headers.get("allow") == "POST"


def test_the_middlewares_refusals_keep_each_route_familys_shape():
    """A 401 for a missing key and a 413 for a body over the limit come from middleware, before any route: on the
    Open Inference Protocol's and LibreTranslate's paths they are `{"error": message}` as the routes' own errors
    there, and OpenAI's object elsewhere."""
    app = build_app(Settings(api_keys=["k1"]), load_models=False)
    too_long = {"headers": {"Content-Length": str(10**11), "Authorization": "Bearer k1"}, "content": b"{}"}
    oip, completions, oip_large, translate_large = _requests(
        app, ("POST", "/v2/models/x/infer", {"json": {}}), ("POST", "/v1/completions", {"json": {}}),
        ("POST", "/v2/models/x/infer", too_long), ("POST", "/translate_file", too_long))
    assert oip.status_code == 401 and isinstance(oip.json()["error"], str)
    assert completions.status_code == 401 and completions.json()["error"]["code"] == "invalid_api_key"
    for resp in (oip_large, translate_large):
        assert resp.status_code == 413 and isinstance(resp.json()["error"], str), resp.text
