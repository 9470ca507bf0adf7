"""The deployment files against what a running server really serves and exports, beside the options a deployment
sets apart from the defaults: the Grafana dashboard's queries, legends, units and model variable read against the
/metrics of an app serving a language model and an image classifier (in this process, `httpx.ASGITransport`);
every probe of the KServe predictor on the port the server listens on and a path it answers; the Ray Serve
deployment options given apart from the batch size, an explicit GPU count, a numbered CUDA device and scale to
zero; and the image's HEALTHCHECK following TSERVE_PORT."""

from __future__ import annotations

import base64
import http.server
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import factories
from tests.helpers.deploy_files import DEPLOY, DOCKERFILE, check_settings
from tests.helpers.in_process import InProcessApp
from tests.http.test_option_combinations_compat import png
from tserve.testing.server import port_nobody_else_takes

yaml = pytest.importorskip("yaml")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TINY_LM = FIXTURES / "tiny-lm"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "tserve.json"


# ------------------------------------------------------------------------------------------------------------
# A served app and what its /metrics exports
# ------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """A language model "lm" and an image classifier "vit", each asked once, so that every panel of the
    dashboard (tokens, latencies, queue, KV slots, images, batches, requests) has its series."""
    vit = factories.tiny_vit_dir(tmp_path_factory.mktemp("deploy-vit") / "vit")
    served = InProcessApp({"lm": TINY_LM, "vit": vit}, warmup=False, gc_freeze=False)
    served.post("/v1/completions", {"model": "lm", "prompt": "Hello", "max_tokens": 4})
    served.post("/v1/classifications", {"model": "vit", "image": base64.b64encode(png(0)).decode(), "top_k": 2})
    yield served
    served.stop()


@pytest.fixture(scope="module")
def exported(app) -> dict[str, list[dict[str, str]]]:
    """Series name -> the label sets of its samples, as GET /metrics renders them."""
    resp = app.request("GET", "/metrics")
    assert resp.status_code == 200
    series: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(resp.text):
        for sample in family.samples:
            series.setdefault(sample.name, []).append(dict(sample.labels))
    return series


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _targets() -> list[tuple[dict, dict]]:
    return [(panel, target) for panel in _dashboard()["panels"] for target in panel["targets"]]


def _kept_labels(expr: str) -> set[str]:
    """The labels an aggregation keeps (`sum by (a, b)`): the only ones a legend can show."""
    groups = re.findall(r"\bby\s*\(([^)]*)\)", expr)
    assert groups, f"{expr!r} aggregates without `by`: its legend has no labels"
    return {g.strip() for g in groups[-1].split(",") if g.strip()}


def test_every_quantile_panel_keeps_the_bucket_bound_and_the_labels_it_shows(exported):
    """histogram_quantile needs the `le` of every bucket: summing the buckets without it leaves one series per
    model with no bound, and the panel is empty. The labels kept beside `le` must be labels the histogram's
    live series carry."""
    quantiles = 0
    for panel, target in _targets():
        expr = target["expr"]
        if "histogram_quantile" not in expr:
            continue
        quantiles += 1
        (bucket,) = set(re.findall(r"\btserve_\w+_bucket\b", expr))
        kept = _kept_labels(expr)
        assert "le" in kept, f"{panel['title']}: {expr!r} sums the buckets of {bucket} without `le`"
        assert bucket in exported, f"{panel['title']}: {bucket} has no series"
        live = set().union(*(labels.keys() for labels in exported[bucket]))
        assert kept <= live, f"{panel['title']}: keeps {kept - live}, not labels of {bucket}"
    assert quantiles >= 6


def test_every_legend_names_a_label_its_query_keeps():
    """A legend's `{{label}}` shows a label the query keeps; one it dropped prints empty, and two series the
    title promises apart (requests by route *and status*) draw as one line."""
    for panel, target in _targets():
        shown = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
        kept = _kept_labels(target["expr"]) - {"le"}
        assert shown <= kept, f"{panel['title']}: the legend shows {shown - kept}, which {target['expr']!r} drops"
    requests = next(t["expr"] for _, t in _targets() if "tserve_requests_total" in t["expr"])
    assert _kept_labels(requests) == {"route", "status"}


def test_panels_of_a_seconds_metric_are_in_seconds():
    """The server exports its latencies in seconds (`*_seconds_bucket`): a panel drawing them in any other
    unit shows a first token of 0.2 s as 0.2 ms."""
    seen = 0
    for panel in _dashboard()["panels"]:
        exprs = [t["expr"] for t in panel["targets"]]
        if all(re.search(r"histogram_quantile\(.*_seconds_bucket", e) for e in exprs):
            seen += 1
            assert panel["fieldConfig"]["defaults"]["unit"] == "s", panel["title"]
        elif all(re.search(r"rate\(tserve_\w+_total", e) for e in exprs):
            # a rate of a counter is per second
            assert panel["fieldConfig"]["defaults"]["unit"] in ("short", "reqps", "ops", "cps"), panel["title"]
    assert seen == 3


def test_the_model_variable_lists_every_served_model(app, exported):
    """The dashboard's `$model` choices come from `label_values(metric, label)`, the query Grafana runs (not
    the `definition` it displays): that metric must carry that label, with one value per served model."""
    (variable,) = [v for v in _dashboard()["templating"]["list"] if v["type"] == "query"]
    query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
    assert query == variable["definition"]
    metric, label = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", query).groups()
    assert metric in exported, metric
    values = {labels.get(label) for labels in exported[metric]}
    assert {"lm", "vit"} <= values, f"label_values({metric}, {label}) gives {values}"
    # and every panel filtering on it filters the label that names the model
    for panel, target in _targets():
        if "$model" in target["expr"]:
            assert re.search(rf'\b{label}=~"\$model"', target["expr"]), panel["title"]


# ------------------------------------------------------------------------------------------------------------
# KServe: every probe on the server's port, on a path it answers
# ------------------------------------------------------------------------------------------------------------
def test_a_model_is_in_the_model_variable_before_its_first_request(tmp_path):
    """A model loaded but not asked yet is a choice of `$model` already: every model's queue and running gauges
    are exported from the moment it serves, an image classifier's too (its batcher takes no step until then)."""
    vit = factories.tiny_vit_dir(tmp_path / "vit")
    idle = InProcessApp({"lm": TINY_LM, "vit": vit}, warmup=False, gc_freeze=False)
    try:
        text = idle.request("GET", "/metrics").text
    finally:
        idle.stop()
    for name in ("tserve_queue_depth", "tserve_running_requests"):
        for model in ("lm", "vit"):
            assert f'{name}{{model="{model}"}}' in text, (name, model)


def test_the_latency_buckets_reach_the_longest_request_timeout_deployed():
    """The request latency histogram's buckets go up to the longest request a deployment allows (the default
    --request-timeout-s and every TSERVE_REQUEST_TIMEOUT_S of deploy/ and the Dockerfile): a p95 between two
    minutes and the timeout is then a figure, not the last bucket's bound."""
    from tserve.service.metrics import Metrics
    from tserve.service.settings import Settings

    deployed = [float(v) for path in [*DEPLOY.rglob("*.y*ml"), *DEPLOY.rglob("*.env"), DOCKERFILE]
                for v in re.findall(r"TSERVE_REQUEST_TIMEOUT_S\W+?\"?(\d+)", path.read_text())]
    longest = max([Settings().request_timeout_s, *deployed])
    assert deployed and longest >= 300
    bounds = Metrics().latency._upper_bounds
    assert max(b for b in bounds if b != float("inf")) >= longest


def test_every_kserve_probe_reaches_the_server_on_its_port_and_a_path_it_answers(app):
    """KServe's predictor names the container's port itself in each probe: one on another port than
    TSERVE_PORT fails forever, and Knative restarts a healthy replica."""
    isvc = yaml.safe_load((DEPLOY / "kserve" / "inferenceservice.yaml").read_text())
    (c,) = isvc["spec"]["predictor"]["containers"]
    settings = check_settings({e["name"]: e["value"] for e in c["env"] if "value" in e}, "InferenceService")
    probes = {k: v["httpGet"] for k, v in c.items() if k.endswith("Probe")}
    assert {"readinessProbe", "livenessProbe"} <= probes.keys()
    for kind, probe in probes.items():
        assert probe["port"] == settings.port, f"{kind} on port {probe['port']}, the server on {settings.port}"
        assert app.request("GET", probe["path"]).status_code == 200, f"{kind}: {probe['path']}"


# ------------------------------------------------------------------------------------------------------------
# Ray Serve: options apart from the defaults
# ------------------------------------------------------------------------------------------------------------
@pytest.fixture
def ray_serve(monkeypatch):
    pytest.importorskip("ray.serve")
    import deploy.ray_serve as module  # noqa: PLC0415 - needs Ray

    for key in list(os.environ):
        if key.startswith("TSERVE_"):
            monkeypatch.delenv(key)
    return module


def _options(app) -> tuple[object, dict]:  # noqa: ANN001 - a Ray Serve Application
    deployment = app._bound_deployment
    return deployment._deployment_config, deployment.ray_actor_options


def test_ray_request_targets_given_apart_from_the_batch_size_are_the_ones_used(ray_serve, monkeypatch):
    """TSERVE_RAY_TARGET_ONGOING_REQUESTS and TSERVE_RAY_MAX_ONGOING_REQUESTS default to the batch size (and
    twice it); given, from the environment or as arguments, they win over it."""
    monkeypatch.setenv("TSERVE_MAX_RUNNING_REQUESTS", "8")
    monkeypatch.setenv("TSERVE_RAY_NUM_REPLICAS", "auto")
    monkeypatch.setenv("TSERVE_RAY_TARGET_ONGOING_REQUESTS", "3")
    monkeypatch.setenv("TSERVE_RAY_MAX_ONGOING_REQUESTS", "5")
    cfg, _ = _options(ray_serve.app_builder({}))
    assert (cfg.autoscaling_config.target_ongoing_requests, cfg.max_ongoing_requests) == (3, 5)
    cfg, _ = _options(ray_serve.app_builder({"target_ongoing_requests": 6, "max_ongoing_requests": 12}))
    assert (cfg.autoscaling_config.target_ongoing_requests, cfg.max_ongoing_requests) == (6, 12)


def test_ray_autoscaling_may_scale_to_zero(ray_serve):
    """min_replicas 0 (documented `ge=0`) lets Serve stop every replica of an idle application."""
    cfg, _ = _options(ray_serve.app_builder({"num_replicas": "auto", "min_replicas": 0, "max_replicas": 2}))
    assert (cfg.autoscaling_config.min_replicas, cfg.autoscaling_config.max_replicas) == (0, 2)


@pytest.mark.parametrize(("device", "num_gpus", "reserved"), [
    ("cuda", None, 1.0), ("cuda:1", None, 1.0), ("cpu", None, 0.0), ("auto", None, 0.0),
    ("cuda", 0, 0.0), ("cuda", 0.5, 0.5), ("cpu", 2, 2.0)])
def test_ray_gpus_per_replica_follow_the_device_unless_given(ray_serve, device, num_gpus, reserved):
    """One GPU by default when TSERVE_DEVICE is cuda or cuda:N; a count given (0 included: a replica meant to
    share the node's GPUs some other way) is the count reserved."""
    args = {"device": device} | ({} if num_gpus is None else {"num_gpus": num_gpus})
    _, actor = _options(ray_serve.app_builder(args))
    assert actor["num_gpus"] == reserved


# ------------------------------------------------------------------------------------------------------------
# The image's HEALTHCHECK
# ------------------------------------------------------------------------------------------------------------
class _Healthz(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200 if self.path == "/healthz" else 404)
        self.end_headers()

    def log_message(self, *args) -> None:  # noqa: ANN002
        pass


def _healthcheck_command() -> list[str]:
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    line = next(line for line in text.splitlines() if line.startswith("HEALTHCHECK"))
    command = json.loads(line.split(" CMD ", 1)[1])
    assert command[0] == "python"
    return [sys.executable, *command[1:]]


def test_the_image_healthcheck_asks_the_port_the_server_listens_on():
    """`docker run -e TSERVE_PORT=9000` moves the server: the HEALTHCHECK must follow it, or Docker marks a
    healthy container unhealthy (and compose or Swarm restart it)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Healthz)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        env = {k: v for k, v in os.environ.items() if k != "TSERVE_PORT"}
        ok = subprocess.run(_healthcheck_command(), env=env | {"TSERVE_PORT": str(port)}, capture_output=True,
                            timeout=30)
        assert ok.returncode == 0, ok.stderr
        elsewhere = subprocess.run(_healthcheck_command(), env=env | {"TSERVE_PORT": str(port_nobody_else_takes())},
                                   capture_output=True, timeout=30)
        assert elsewhere.returncode != 0
    finally:
        server.shutdown()
        server.server_close()
