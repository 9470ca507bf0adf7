"""docker compose, Prometheus and Grafana stay in step with the server: the compose file builds it with the
Dockerfile's settings, Prometheus scrapes it, Grafana's dashboard queries metrics it exports, and DEPLOY.md
names files that exist."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

from tests.helpers.deploy_files import (  # noqa: E402
    DEPLOY,
    DOCKERFILE,
    OPTIONAL_COMPONENTS,
    ROOT,
    check_settings,
    metric_catalog,
)


# --------------------------------------------------------------------------------------------------------
# compose, Prometheus, Grafana
# --------------------------------------------------------------------------------------------------------
def _compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def _mounts(service: dict) -> dict[str, Path]:
    """container path -> host path of the bind mounts (relative to the compose file)."""
    out = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            out[target] = (DEPLOY / source).resolve()
    return out


def _duration_s(text: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", text))


def test_compose_builds_the_server_and_prometheus_scrapes_it():
    services = _compose()["services"]
    assert set(services) >= {"tserve", "prometheus", "grafana"}
    server = services["tserve"]
    assert (DEPLOY / server["build"]["context"]).resolve() == ROOT
    assert (ROOT / server["build"].get("dockerfile", "Dockerfile")).resolve() == DOCKERFILE
    settings = check_settings(server["environment"], "compose")
    assert f"{settings.port}:{settings.port}" in server["ports"]
    assert _duration_s(server["stop_grace_period"]) > settings.request_timeout_s

    mounts = _mounts(services["prometheus"])
    config_file = mounts["/etc/prometheus/prometheus.yml"]
    assert config_file == DEPLOY / "prometheus" / "prometheus.yml"
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]
    prometheus = yaml.safe_load(config_file.read_text())
    job = next(j for j in prometheus["scrape_configs"] if j["job_name"] == "tserve")
    assert job.get("metrics_path", "/metrics") == "/metrics"
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == [f"tserve:{settings.port}"]


def test_grafana_is_provisioned_with_the_datasource_and_dashboard():
    grafana = _compose()["services"]["grafana"]
    mounts = _mounts(grafana)
    provisioning = mounts["/etc/grafana/provisioning"]
    datasources = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    prometheus = next(d for d in datasources if d["type"] == "prometheus")
    port = _compose()["services"]["prometheus"]["ports"][0].split(":")[-1]
    assert prometheus["url"] == f"http://prometheus:{port}"
    providers = yaml.safe_load((provisioning / "dashboards" / "tserve.yml").read_text())["providers"]
    dashboards_dir = providers[0]["options"]["path"]
    assert mounts[dashboards_dir] == DEPLOY / "grafana" / "dashboards"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (mounts[dashboards_dir] / Path(home).relative_to(dashboards_dir)).is_file()


def _dashboard_exprs() -> list[str]:
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "tserve.json").read_text())
    exprs = []
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        exprs += [t["expr"] for t in panel["targets"]]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            exprs.append(variable["definition"])
    return exprs


def test_dashboard_queries_use_metrics_the_server_exports():
    catalog = metric_catalog()
    used = set()
    for expr in _dashboard_exprs():
        names = set(re.findall(r"\btserve_\w+", expr))
        assert names, expr
        for name in names:
            assert name in catalog, f"{name} (in {expr!r}) is not exported by service.metrics.Metrics"
        used |= names
        labels = set().union(*(catalog[n][1] for n in names))
        for group in re.findall(r"\bby\s*\(([^)]*)\)", expr):
            grouped = {g.strip() for g in group.split(",") if g.strip()}
            assert grouped <= labels, f"{expr!r} groups by {grouped - labels}, not labels of {names}"
        for label in re.findall(r"(\w+)\s*=~?\s*\"", expr):
            assert label in labels, f"{expr!r} filters on {label}, not a label of {names}"
        for name in names:
            if catalog[name][0] == "counter" or name.endswith("_bucket"):
                assert re.search(rf"(rate|increase)\({name}\b", expr), f"{name} is a counter: use rate() in {expr!r}"
    for required in ("tserve_time_to_first_token_seconds_bucket", "tserve_inter_token_latency_seconds_bucket",
                     "tserve_generated_tokens_total", "tserve_queue_depth", "tserve_running_requests",
                     "tserve_kv_slots_in_use"):
        assert required in used, f"no panel shows {required}"


# --------------------------------------------------------------------------------------------------------
# docs
# --------------------------------------------------------------------------------------------------------
def test_deploy_doc_names_files_that_exist():
    doc = (ROOT / "docs" / "DEPLOY.md").read_text()
    for command in ("kubectl apply -k deploy/k8s/overlays/cpu", "kubectl apply -k deploy/k8s/overlays/gpu",
                    "docker compose -f deploy/compose.yaml up", "deploy/kserve/inferenceservice.yaml",
                    "TORCH_INDEX_URL=https://download.pytorch.org/whl/"):
        assert command in doc, command
    for path in set(re.findall(r"(?<![\w/.])((?:deploy|docs)/[\w./-]*\w)", doc)):
        assert (ROOT / path).exists(), f"docs/DEPLOY.md names {path}, which does not exist"
    for component in OPTIONAL_COMPONENTS:
        assert f"../../components/{component}" in doc
