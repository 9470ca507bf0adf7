"""The served models: loading (with progress), warm-up, per-task workers, and lookup by name/task."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from model import checkpoint
from model.attention import resolve_backend
from service.engine import DynamicBatcher, GenerationEngine, Scheduler, TranslationEngine
from service.errors import bad_request, not_found
from service.metrics import Metrics
from service.runners import Classifier
from service.settings import Settings

log = logging.getLogger("tserve.registry")


@dataclass
class ServedModel:
    name: str
    loaded: checkpoint.LoadedModel
    created: int
    engine: GenerationEngine | TranslationEngine | None = None
    classifier: Classifier | None = None
    batcher: DynamicBatcher | None = None

    @property
    def task(self) -> str:
        return self.loaded.task

    @property
    def worker(self) -> Scheduler:
        """What holds this model's requests and runs its model work."""
        return self.engine or self.batcher


class ModelRegistry:
    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings, self.metrics = settings, metrics
        self.models: dict[str, ServedModel] = {}
        self.ready = False
        self.draining = False
        self.error: str | None = None
        self._thread: threading.Thread | None = None

    # ----------------------------------------------------------------------------------------------
    def start_loading(self) -> None:
        """Load and warm up every model in a background thread; `ready` turns True when done."""
        self._thread = threading.Thread(target=self._load_all, name="model-loader", daemon=True)
        self._thread.start()

    def wait_loaded(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _load_all(self) -> None:
        try:
            specs = self.settings.model_specs()
            if not specs:
                raise RuntimeError("no models to serve: pass --model NAME=PATH (the bundled models are missing)")
            device = checkpoint.resolve_device(self.settings.device)
            backend = resolve_backend(self.settings.attention_backend, device)
            for name, path in tqdm(specs.items(), desc="loading models", unit="model"):
                self.models[name] = self._load_one(name, path, device, backend)
            if self.settings.warmup:
                for served in self.models.values():
                    self._warmup(served)
            for served in self.models.values():
                (served.engine or served.batcher).start()
            self.ready = True
            log.info("ready", extra={"models": sorted(self.models)})
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            log.exception("model loading failed")

    def _load_one(self, name: str, path: Path, device: torch.device, backend: str) -> ServedModel:
        s = self.settings
        loaded = checkpoint.load(path, device=device, dtype=s.dtype, backend=backend)
        served = ServedModel(name, loaded, int(time.time()))
        if loaded.task == "text-generation":
            served.engine = GenerationEngine(name, loaded, max_slots=s.max_running_requests, max_queue=s.max_queue,
                                             max_model_len=s.max_model_len, timeout_s=s.request_timeout_s,
                                             metrics=self.metrics, cuda_graphs=s.cuda_graphs,
                                             compile=s.compile)
        elif loaded.task == "translation":
            served.engine = TranslationEngine(name, loaded, max_rows=s.max_running_requests, max_queue=s.max_queue,
                                              timeout_s=s.request_timeout_s, metrics=self.metrics,
                                              cuda_graphs=s.cuda_graphs)
        else:
            served.classifier = Classifier(loaded, s.max_image_bytes, s.max_image_pixels)
            served.batcher = DynamicBatcher(name, served.classifier.run_batch, max_batch_size=s.batch_max_size,
                                            device=loaded.device,
                                            max_wait_ms=s.batch_max_wait_ms, max_queue=s.max_queue,
                                            timeout_s=s.request_timeout_s, metrics=self.metrics)
        log.info("serving model", extra={"model": name, "task": loaded.task, "path": str(path),
                                         "device": str(loaded.device), "dtype": str(loaded.dtype),
                                         "attention_backend": backend, "parameters": loaded.num_parameters()})
        return served

    def _warmup(self, served: ServedModel) -> None:
        """One small request through each model (through the engine's own runner) so that the first real one
        does not pay for lazy init."""
        start = time.perf_counter()
        if served.engine is not None:
            served.engine.warm_up()
        else:
            cfg = served.loaded.config
            served.classifier.run_batch([torch.zeros(cfg.n_channels, cfg.image_size, cfg.image_size)])
        log.info("warmed up", extra={"model": served.name, "seconds": round(time.perf_counter() - start, 3)})

    def begin_drain(self) -> None:
        """Shutdown, first part: not ready any more, and every model refuses new requests while the ones it
        holds finish."""
        self.ready, self.draining = False, True
        for served in self.models.values():
            (served.engine or served.batcher).refuse_new()

    def idle(self) -> bool:
        """No model holds a request (queued or running)."""
        return all((served.engine or served.batcher).idle for served in self.models.values())

    def stop(self) -> None:
        for served in self.models.values():
            (served.engine or served.batcher).stop()

    # ----------------------------------------------------------------------------------------------
    def get(self, name: str | None, task: str) -> ServedModel:
        """The model `name` (must do `task`), or the only model with that task when `name` is omitted."""
        if name is None:
            candidates = [m for m in self.models.values() if m.task == task]
            if len(candidates) == 1:
                return candidates[0]
            if not candidates:
                raise not_found(f"no {task} model is served")
            raise bad_request(f"several {task} models are served ({', '.join(m.name for m in candidates)}); "
                              "say which with 'model'", "model_required")
        served = self.models.get(name)
        if served is None:
            raise not_found(f"model {name!r} does not exist; served models: {sorted(self.models)}")
        if served.task != task:
            raise bad_request(f"model {name!r} does {served.task}, not {task}", "wrong_task")
        return served
