"""tserve on Ray Serve (deploy/ray_serve.py): the options and the config file, then a real local Ray cluster
with two replicas behind Serve's HTTP proxy: answers equal the plain server's, and killing a replica loses
no request."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import importlib
import io
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import yaml
from PIL import Image

from tests.helpers import factories
from tests.helpers.server import ROOT, ServerProcess
from tserve.service.settings import Settings
from tserve.testing.server import port_nobody_else_takes

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from deploy.ray_serve import RayServeOptions, TServeDeployment, app_builder  # noqa: E402

CONFIG = ROOT / "deploy" / "ray" / "serve_config.yaml"
PROMPTS = ["Hello world", "Good morning", "The quick brown fox", "Where is the station", "Once upon a time",
           "I don't know", "The weather is nice", "Three daughters"]


def options_of(app) -> tuple[dict, dict]:
    """(deployment config, ray_actor_options) of a built application."""
    deployment = app._bound_deployment
    return deployment._deployment_config, deployment.ray_actor_options


# --------------------------------------------------------------------------------------------------------
# Options and the config file (no cluster)
# --------------------------------------------------------------------------------------------------------
def test_options_from_environment_and_arguments(monkeypatch):
    for key in list(os.environ):
        if key.startswith("TSERVE_"):
            monkeypatch.delenv(key)
    cfg, actor = options_of(app_builder({}))
    assert cfg.num_replicas == 1 and cfg.autoscaling_config is None
    assert actor["num_cpus"] == 1 and actor["num_gpus"] == 0
    assert cfg.max_ongoing_requests == 2 * Settings().max_running_requests

    monkeypatch.setenv("TSERVE_RAY_NUM_REPLICAS", "auto")
    monkeypatch.setenv("TSERVE_RAY_MIN_REPLICAS", "2")
    monkeypatch.setenv("TSERVE_RAY_MAX_REPLICAS", "6")
    monkeypatch.setenv("TSERVE_RAY_NUM_CPUS", "0.5")
    monkeypatch.setenv("TSERVE_MAX_RUNNING_REQUESTS", "8")
    monkeypatch.setenv("TSERVE_DEVICE", "cuda")
    cfg, actor = options_of(app_builder({}))
    auto = cfg.autoscaling_config
    assert (auto.min_replicas, auto.max_replicas, auto.target_ongoing_requests) == (2, 6, 8)
    assert cfg.max_ongoing_requests == 16
    assert actor == {"num_cpus": 0.5, "num_gpus": 1.0}

    # Arguments win over the environment; settings among them go to the replicas.
    app = app_builder({"num_replicas": "3", "num_gpus": 0, "models": "lm=/x", "device": "cpu"})
    cfg, actor = options_of(app)
    assert cfg.num_replicas == 3 and cfg.autoscaling_config is None and actor["num_gpus"] == 0
    assert app._bound_deployment.init_args == ({"models": "lm=/x", "device": "cpu"},)

    with pytest.raises(ValueError, match="no_such_option"):
        app_builder({"no_such_option": 1})
    with pytest.raises(ValueError, match="min_replicas"):
        RayServeOptions(min_replicas=5, max_replicas=2)


def test_serve_config_file(monkeypatch):
    config = yaml.safe_load(CONFIG.read_text())
    (app,) = config["applications"]
    module, _, attr = app["import_path"].partition(":")
    assert getattr(importlib.import_module(module), attr) is app_builder
    assert app["route_prefix"] == "/"
    env = app["runtime_env"]["env_vars"]
    assert all(isinstance(v, str) for v in env.values()), "runtime_env.env_vars values must be strings"
    server = {k.removeprefix("TSERVE_").lower(): v for k, v in env.items()
              if k.startswith("TSERVE_") and not k.startswith("TSERVE_RAY_")}
    assert set(server) <= set(Settings.model_fields), set(server) - set(Settings.model_fields)
    settings = Settings(**server)
    for key in list(os.environ):
        if key.startswith("TSERVE_"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    cfg, actor = options_of(app_builder(app.get("args") or {}))
    auto = cfg.autoscaling_config
    assert auto is not None and auto.target_ongoing_requests == settings.max_running_requests
    assert cfg.graceful_shutdown_timeout_s > settings.request_timeout_s
    assert actor["num_cpus"] == float(env["TSERVE_RAY_NUM_CPUS"])
    assert config["http_options"]["port"] == Settings().port


def test_replica_serves_its_app_and_reports_its_models_health(tmp_path):
    """A replica as Serve makes and ends it (the class's async __init__ and __del__, without a cluster): it
    exists only once its models are loaded, serves the app it built, and its health check follows them."""

    class Replica(TServeDeployment.func_or_class):
        def __del__(self) -> None:  # the garbage collector's call; the async one is awaited below, as Serve does
            pass

    vit = factories.tiny_vit_dir(tmp_path / "vit")
    settings = {"models": f"vit={vit}", "device": "cpu"}

    async def lifecycle() -> None:
        replica = object.__new__(Replica)
        await replica.__init__(settings)
        try:
            app = replica.__serve_build_asgi_app__()
            assert app is replica.tserve_app and app.state.registry is replica.registry
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://replica") as c:
                resp = await c.get("/readyz")
            assert resp.status_code == 200 and resp.json()["models"] == ["vit"]
            assert replica.check_health() is None
            replica.registry.ready, replica.registry.error = False, "vit: weights are corrupt"
            with pytest.raises(RuntimeError, match="weights are corrupt"):
                replica.check_health()  # Serve replaces a replica whose check fails
            replica.registry.ready, replica.registry.error = True, None
        finally:
            await TServeDeployment.func_or_class.__del__(replica)
        with pytest.raises(RuntimeError, match="models not ready"):
            replica.check_health()  # stopped

        (vit / "model.safetensors").write_bytes(b"\x00" * 64)
        with pytest.raises(RuntimeError, match="models failed to load"):
            await object.__new__(Replica).__init__(settings)

    asyncio.run(lifecycle())


# --------------------------------------------------------------------------------------------------------
# A real cluster
# --------------------------------------------------------------------------------------------------------
def png_b64() -> str:
    buf = io.BytesIO()
    Image.new("RGB", (40, 30), (200, 30, 30)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def requests_to_send() -> list[tuple[str, dict]]:
    image = png_b64()
    out: list[tuple[str, dict]] = []
    for p in PROMPTS:
        body = {"model": "lm", "prompt": p, "max_tokens": 16, "temperature": 0}
        out += [("/v1/completions", body), ("/v1/completions", body | {"stream": True})]
        for beams in (1, 2):
            out.append(("/v1/translations", {"model": "mt", "input": p, "num_beams": beams, "max_tokens": 8}))
    out.append(("/v1/classifications", {"model": "vit", "image": image, "top_k": 2}))
    return out


def answer(path: str, resp: httpx.Response) -> object:
    """The part of a response that must not depend on which server answered."""
    if resp.headers["content-type"].startswith("text/event-stream"):
        lines = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]", lines[-3:]
        return ["".join(c["text"] for line in lines[:-1] for c in json.loads(line)["choices"])]
    body = resp.json()
    if path == "/v1/completions":
        return [c["text"] for c in body["choices"]]
    if path == "/v1/translations":
        return [d["translation"] for d in body["data"]]
    return [[p["label"] for p in d["predictions"]] for d in body["data"]]


def replica_actor_names() -> set[str]:
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("SERVE_REPLICA::") and "#tserve#" in a["name"]}


def running_replicas() -> int:
    status = serve.status().applications["tserve"].deployments["tserve"]
    return status.replica_states.get("RUNNING", 0)


def print_serve_logs(ray_dir: Path) -> None:
    for log in sorted(ray_dir.glob("session_*/logs/serve/*.log")):
        lines = log.read_text(errors="replace").splitlines()
        print(f"===== {log.name} (last 40 lines)", *lines[-40:], sep="\n")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return factories.tiny_model_set(tmp_path_factory.mktemp("ray-serve"))


@pytest.mark.slow
def test_two_replicas_match_plain_server_and_survive_a_replica_kill(checkpoints, tmp_path, monkeypatch):
    work = requests_to_send()

    # Expected answers from the plain server, one request at a time; stopped before Ray starts.
    args = factories.model_flags(checkpoints)
    plain = ServerProcess([*args, "--max-running-requests", "8", "--device", "cpu"], tmp_path / "plain.log")
    try:
        plain.wait_ready()
        with httpx.Client(base_url=plain.url, timeout=60) as c:
            expected = []
            for path, body in work:
                resp = c.post(path, json=body)
                assert resp.status_code == 200, resp.text
                expected.append(answer(path, resp))
    finally:
        plain.stop()

    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # a cluster of its own, never one that is running
    env = {"TSERVE_MODELS": ",".join(f"{n}={p}" for n, p in checkpoints.items()), "TSERVE_DEVICE": "cpu",
           "TSERVE_MAX_RUNNING_REQUESTS": "8", "TSERVE_LOG_LEVEL": "warning", "OMP_NUM_THREADS": "1"}
    port = port_nobody_else_takes()  # Ray's own processes take random ephemeral ports before the proxy binds
    ray_dir = Path(tempfile.mkdtemp(prefix="ray-"))  # short: Ray puts unix sockets under it
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 1024**2, _temp_dir=str(ray_dir),
             runtime_env={"env_vars": env}, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        t0 = time.monotonic()
        serve.run(app_builder({"num_replicas": 2, "num_cpus": 0.5}), name="tserve", route_prefix="/")
        print(f"2 replicas running after {time.monotonic() - t0:.1f} s")
        url = f"http://127.0.0.1:{port}"
        assert running_replicas() == 2
        replicas = replica_actor_names()
        assert len(replicas) == 2, replicas

        ready = httpx.get(url + "/readyz", timeout=10)
        assert ready.status_code == 200 and ready.json()["models"] == ["lm", "mt", "vit"]

        # Concurrent requests through the proxy (each request three times): the plain server's answers.
        async def concurrently() -> list[tuple[int, object]]:
            async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                async def one(i: int) -> tuple[int, object]:
                    path, body = work[i % len(work)]
                    resp = await client.post(path, json=body)
                    assert resp.status_code == 200, f"{path}: {resp.status_code} {resp.text[:300]}"
                    return i, answer(path, resp)

                return await asyncio.gather(*(one(i) for i in range(3 * len(work))))

        for i, got in asyncio.run(concurrently()):
            assert got == expected[i % len(work)], (work[i % len(work)], got, expected[i % len(work)])

        # Kill one replica while clients keep sending; Serve starts a replacement. A request may fail only
        # if it was in flight on the victim when it died (each client has one request in flight at a time);
        # the client retries it once, and the retry must succeed. Every request must end with a 200 and the
        # right answer, and the surviving replica must answer while the replacement starts.
        victim = sorted(replicas)[0]
        events: dict[str, float] = {}
        clients, max_attempts = 4, 2  # one retry

        def replace_and_wait() -> None:
            events["kill"] = time.monotonic()
            ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
            events["killed"] = time.monotonic()
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                names = replica_actor_names()
                if victim not in names and len(names) == 2 and running_replicas() == 2:
                    events["replaced"] = time.monotonic()
                    return
                time.sleep(0.25)

        @dataclasses.dataclass
        class Attempt:
            client: int
            request: int  # the client's request number
            start: float
            end: float
            outcome: str  # "200", another status, or the exception's name

        async def load_during_kill() -> tuple[list[tuple[float, int, object]], list[Attempt]]:
            done: list[tuple[float, int, object]] = []  # (finish time, work index, answer)
            attempts: list[Attempt] = []
            stop = asyncio.Event()

            async def client_loop(client: httpx.AsyncClient, k: int) -> None:
                i, n = k, 0
                while not stop.is_set():
                    path, body = work[i % len(work)]
                    for _ in range(max_attempts):
                        start = time.monotonic()
                        try:
                            resp = await client.post(path, json=body)
                            outcome = str(resp.status_code)
                        except httpx.HTTPError as exc:
                            outcome = type(exc).__name__
                        attempts.append(Attempt(k, n, start, time.monotonic(), outcome))
                        if outcome == "200":
                            done.append((time.monotonic(), i % len(work), answer(path, resp)))
                            break
                        await asyncio.sleep(0.5)
                    else:
                        raise AssertionError(f"{path} failed {max_attempts} times: "
                                             f"{[a for a in attempts if (a.client, a.request) == (k, n)]}")
                    i, n = i + 7, n + 1

            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                tasks = [asyncio.create_task(client_loop(client, k)) for k in range(clients)]
                await asyncio.sleep(0.5)  # requests in flight on both replicas when one dies
                await asyncio.to_thread(replace_and_wait)
                await asyncio.sleep(2.0)  # and a little traffic on the new pair
                stop.set()
                await asyncio.gather(*tasks)
            return done, attempts

        done, attempts = asyncio.run(load_during_kill())
        assert "replaced" in events, f"no replacement replica RUNNING within 120 s: {serve.status()}"
        for _, i, got in done:
            assert got == expected[i], (work[i], got, expected[i])
        during = [t for t, _, _ in done if events["killed"] < t < events["replaced"]]
        failed = [a for a in attempts if a.outcome != "200"]
        failed_requests = {(a.client, a.request) for a in failed}
        print(f"replacement took {events['replaced'] - events['killed']:.1f} s; {len(done)} requests answered, "
              f"{len(during)} of them during the replacement; {len(failed)} failed attempts "
              f"({len(failed_requests)} requests): {failed}; kill {events['kill']:.3f}-{events['killed']:.3f}")
        assert len(during) >= 5, f"only {len(during)} requests answered while the replacement started"
        # Only what was in flight on the victim fails (ray.kill returns before the actor is gone, so a request
        # may still be routed to it just after): at most one request per client, so at most `clients`, each
        # unanswered when the kill began and sent before the replacement ran.
        assert len({c for c, _ in failed_requests}) == len(failed_requests), failed
        assert all(events["kill"] < a.end and a.start < events["replaced"] for a in failed), (events, failed)
        assert victim not in replica_actor_names()

        # The new pair answers like the old one.
        for i, got in asyncio.run(concurrently()):
            assert got == expected[i % len(work)]
    except BaseException:
        print_serve_logs(ray_dir)
        raise
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(ray_dir, ignore_errors=True)
