"""What the deployment tests share: where the files are, and the server's own settings and metric names
that the files must use."""

from __future__ import annotations

from pathlib import Path

from tserve.service.metrics import Metrics
from tserve.service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKERFILE = ROOT / "Dockerfile"
OPTIONAL_COMPONENTS = ("queue-autoscaling", "service-monitor")


def check_settings(values: dict[str, str], where: str) -> Settings:
    """Every TSERVE_* variable is a server setting and its value is one the server accepts."""
    fields = {}
    for key, value in values.items():
        if not key.startswith("TSERVE_"):
            continue
        name = key.removeprefix("TSERVE_").lower()
        assert name in Settings.model_fields, f"{where}: {key} is not a server setting"
        fields[name] = value
    return Settings(**fields)


def metric_catalog() -> dict[str, tuple[str, set[str]]]:
    """Every series name the server exports -> (metric kind, label names), read from its own registry."""
    suffixes = {"counter": ("_total", "_created"), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count", "_created")}
    labels = {m._name: set(m._labelnames) for m in vars(Metrics()).values() if hasattr(m, "_labelnames")}
    catalog: dict[str, tuple[str, set[str]]] = {}
    for family in Metrics().registry.collect():
        for suffix in suffixes[family.type]:
            extra = {"le"} if suffix == "_bucket" else set()
            catalog[family.name + suffix] = (family.type, labels[family.name] | extra)
    assert "tserve_queue_depth" in catalog and "tserve_generated_tokens_total" in catalog
    return catalog
