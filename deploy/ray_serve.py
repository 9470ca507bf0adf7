"""tserve as a Ray Serve application: the same FastAPI app (`tserve.service.app.build_app`) in every replica,
behind Serve's HTTP proxy, with Serve's replica health checks, restarts and autoscaling.

Run it from the repository root:

    serve run deploy/ray/serve_config.yaml                  # the config file
    serve run deploy.ray_serve:app_builder num_replicas=2   # or the builder, arguments as key=value

or from Python:

    from ray import serve
    from deploy.ray_serve import app_builder
    serve.run(app_builder({"num_replicas": 2}), name="tserve", route_prefix="/")

Server settings are the usual `TSERVE_*` variables (in `runtime_env.env_vars`, so every replica sees them) or
keys of the builder's arguments named like the settings (`models`, `max_running_requests`, ...). The
deployment's own options are `TSERVE_RAY_*` variables or builder arguments (arguments win):

    TSERVE_RAY_NUM_REPLICAS            fixed replica count, or "auto" for autoscaling (default 1)
    TSERVE_RAY_MIN_REPLICAS            autoscaling: fewest replicas (default 1)
    TSERVE_RAY_MAX_REPLICAS            autoscaling: most replicas (default 4)
    TSERVE_RAY_TARGET_ONGOING_REQUESTS autoscaling: requests in flight per replica to aim for
                                       (default TSERVE_MAX_RUNNING_REQUESTS)
    TSERVE_RAY_MAX_ONGOING_REQUESTS    requests Serve sends to one replica at a time; more wait in the proxy
                                       (default 2 x TSERVE_MAX_RUNNING_REQUESTS)
    TSERVE_RAY_NUM_CPUS                CPUs reserved per replica (default 1)
    TSERVE_RAY_NUM_GPUS                GPUs per replica (default 1 when TSERVE_DEVICE is cuda[:N], else 0;
                                       a replica without a GPU runs TSERVE_DEVICE=auto on the CPU)
    TSERVE_RAY_GRACEFUL_SHUTDOWN_TIMEOUT_S   how long a stopping replica may drain (default 60)
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

import ray
from fastapi import FastAPI
from pydantic import Field, PositiveFloat, PositiveInt, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from ray import serve
from ray.serve import Application

from tserve.service.app import build_app
from tserve.service.settings import Settings


class RayServeOptions(BaseSettings):
    """Deployment options: builder arguments first, then `TSERVE_RAY_*` variables, then the defaults."""

    model_config = SettingsConfigDict(env_prefix="TSERVE_RAY_", extra="forbid")

    num_replicas: PositiveInt | Literal["auto"] = 1
    min_replicas: int = Field(1, ge=0)
    max_replicas: PositiveInt = 4
    target_ongoing_requests: PositiveFloat | None = None
    max_ongoing_requests: PositiveInt | None = None
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float | None = Field(None, ge=0)
    graceful_shutdown_timeout_s: float = Field(60.0, gt=0)

    @model_validator(mode="after")
    def _check_range(self) -> RayServeOptions:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) > max_replicas ({self.max_replicas})")
        return self

    def deployment_options(self, settings: Settings) -> dict[str, Any]:
        """Keyword arguments for `Deployment.options()`; `settings` gives the defaults that depend on the
        server (batch size, device)."""
        slots = settings.max_running_requests
        opts: dict[str, Any] = {
            "max_ongoing_requests": self.max_ongoing_requests or 2 * slots,
            "graceful_shutdown_timeout_s": self.graceful_shutdown_timeout_s,
        }
        if self.num_replicas == "auto":
            opts["autoscaling_config"] = {
                "min_replicas": self.min_replicas,
                "max_replicas": self.max_replicas,
                "target_ongoing_requests": self.target_ongoing_requests or slots,
            }
        else:
            opts["num_replicas"] = self.num_replicas
        num_gpus = self.num_gpus
        if num_gpus is None:
            num_gpus = 1.0 if settings.device.startswith("cuda") else 0.0
        opts["ray_actor_options"] = {"num_cpus": self.num_cpus, "num_gpus": num_gpus}
        return opts


@serve.deployment(name="tserve", health_check_period_s=10, health_check_timeout_s=30)
@serve.ingress()  # the app is built per replica, in __init__, and handed over by __serve_build_asgi_app__
class TServeDeployment:
    async def __init__(self, settings: dict[str, Any] | None = None) -> None:
        # Settings() in the replica: TSERVE_* from the replica's environment (runtime_env), then overrides.
        server_settings = Settings(**(settings or {}))
        if server_settings.device == "auto" and not ray.get_runtime_context().get_accelerator_ids().get("GPU"):
            # Ray reserved no GPU for this replica (num_gpus 0) but may leave the node's GPUs visible.
            server_settings = server_settings.model_copy(update={"device": "cpu"})
        self.tserve_app = build_app(server_settings, load_models=False)
        self.registry = self.tserve_app.state.registry
        # Load here, not in the app's lifespan (load_models=False), which not every Serve version runs; return
        # only when every model is loaded and warmed up, so the replica takes no traffic before /readyz is 200.
        self.registry.start_loading()
        await asyncio.to_thread(self.registry.wait_loaded)
        if not self.registry.ready:
            self.registry.stop()
            raise RuntimeError(f"models failed to load: {self.registry.error or 'loader stopped'}")

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self.tserve_app

    def check_health(self) -> None:
        """Serve's replica health check: a replica whose models are not ready is replaced."""
        if not self.registry.ready:
            raise RuntimeError(f"models not ready: {self.registry.error or 'loading or stopping'}")

    def __del__(self) -> None:
        # Runs after the app's lifespan shutdown (when Serve ran it); stopping twice is harmless.
        registry = getattr(self, "registry", None)
        if registry is not None:
            registry.ready = False
            registry.stop()


def app_builder(args: dict[str, Any] | None = None) -> Application:
    """The Serve application. `args` (from a config file's `args:` or `serve run ... key=value`) may hold
    deployment options (the fields of RayServeOptions) and server settings (fields of Settings); a key
    that is neither is an error."""
    args = dict(args or {})
    settings_args = {k: args.pop(k) for k in list(args) if k in Settings.model_fields}
    options = RayServeOptions(**args)
    # Settings here (where the builder runs) only choose defaults (device -> GPUs, batch size -> request caps);
    # each replica reads its own.
    settings = Settings(**settings_args)
    return TServeDeployment.options(**options.deployment_options(settings)).bind(settings_args)
