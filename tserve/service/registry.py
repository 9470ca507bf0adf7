"""The served models: loading (with progress), warm-up, each as its task's `ServedModel`, lookup by name/task,
and changes at run time (the model repository API: load, replace and unload beside serving)."""

from __future__ import annotations

import ctypes
import gc
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tserve.model import checkpoint, hub
from tserve.model.attention import resolve_backend
from tserve.model.quantize import held_bytes
from tserve.service import heap, tasks
from tserve.service.errors import APIError, bad_request, not_found, overloaded
from tserve.service.metrics import Metrics
from tserve.service.settings import Settings
from tserve.service.tasks import ServedModel

log = logging.getLogger("tserve.registry")


@dataclass
class ModelState:
    """A model's state as the Open Inference Protocol's repository index shows it."""

    state: str  # READY | LOADING | UNLOADING | UNAVAILABLE
    reason: str = ""


def _give_memory_back(refreeze: bool) -> None:
    """Free what the models dropped (reference cycles included, the frozen heap's too) and return the freed pages
    to the system; `refreeze`: freeze what is left again (`heap.freeze`)."""
    heap.thaw()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    try:  # glibc keeps freed heap pages otherwise
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    if refreeze:
        heap.freeze()


class ModelRegistry:
    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings, self.metrics = settings, metrics
        self.models: dict[str, ServedModel] = {}
        self.states: dict[str, ModelState] = {}
        self.version = 0  # changes whenever the set of served models does (`derived` values are worked out again)
        self._derived: dict[str, Any] = {}
        self._changes = threading.Lock()  # guards models, states and the retiring list against the loaders
        self._retiring: list[ServedModel] = []  # no longer served, still draining (their memory is still held)
        self._retired_ids: set[int] = set()  # those a `retire` call is draining
        self.ready = False
        self.draining = False
        self._drain_deadline = 0.0  # time.monotonic() by which a drain ends (`begin_drain`)
        self.error: str | None = None
        # Called (from the loader thread) when the models given at start fail to load: `tserve serve` then stops
        # the server and exits 1, so that a supervisor sees the failure instead of a process answering 503.
        self.on_load_failure: Callable[[], None] | None = None
        self._thread: threading.Thread | None = None
        # --draft-model, loaded once for every language model; weakly held, so that its memory goes with the last
        # model that drafts with it (an unload) and a later one loads it again
        self._draft: weakref.ref[checkpoint.LoadedModel] | None = None

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
            if not specs and self.settings.model_repository is None:
                raise RuntimeError("no models to serve: pass --model NAME=PATH (the bundled models are missing)")
            tasks.import_task_modules(self.settings.task_modules)
            device = checkpoint.resolve_device(self.settings.device)
            backend = resolve_backend(self.settings.attention_backend, device)
            for name, spec in tqdm(specs.items(), desc="loading models", unit="model"):
                self.models[name] = self._load_one(name, spec, device, backend)
                self.states[name] = ModelState("READY")
            if self.settings.warmup:
                for served in self.models.values():
                    self._warmup(served)
            for served in self.models.values():
                for worker in served.workers:
                    worker.start()
            if self.settings.gc_freeze:  # what is alive now lives as long as the process
                heap.freeze()
            self.ready = True
            self._changed()
            log.info("ready", extra={"models": sorted(self.models)})
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            log.exception("model loading failed")
            if self.on_load_failure is not None:
                self.on_load_failure()

    def _load_one(self, name: str, spec: Path, device: torch.device, backend: str) -> ServedModel:
        """`spec`: a checkpoint directory or, where no such directory exists, a Hugging Face repo id, downloaded
        here (in the loader thread, so that the server answers /healthz meanwhile)."""
        s = self.settings
        path = hub.checkpoint_dir(spec)
        self._check_memory(name, path, device)
        loaded = checkpoint.load(path, device=device, dtype=s.dtype, backend=backend, quantize=s.quantize,
                                 int8_activations=s.int8_activations, int4_group_size=s.int4_group_size,
                                 pack_weights=True, fused_layers=s.fused_layers)
        served_class = tasks.served_class(loaded.task)
        extra = {}
        if served_class.drafts and s.draft_model:
            extra["draft"] = self._load_draft(served_class.task, device, backend, beside=loaded)
        served = served_class(name, loaded, s, self.metrics, **extra)
        log.info("serving model", extra={"model": name, "task": loaded.task, "path": str(path),
                                         "device": str(loaded.device), "dtype": str(loaded.dtype),
                                         "quantization": loaded.quantization,
                                         "attention_backend": backend, "parameters": loaded.num_parameters()})
        return served

    def _load_draft(self, task: str, device: torch.device, backend: str,
                    beside: checkpoint.LoadedModel) -> checkpoint.LoadedModel:
        """--draft-model, loaded as the models it drafts for are (device, dtype, quantization), once: its weights
        are only read, so every language model's engine drafts with the same copy (each with its own cache).
        `beside`: the model it is loaded for, in memory and not served yet (--max-model-memory counts it)."""
        if (held := self._held_draft()) is not None:
            return held
        s = self.settings
        path = hub.checkpoint_dir(s.draft_model)
        self._check_memory(f"--draft-model {s.draft_model}", path, device, beside=(beside,))
        draft = checkpoint.load(path, device=device, dtype=s.dtype, backend=backend, quantize=s.quantize,
                                int8_activations=s.int8_activations, int4_group_size=s.int4_group_size,
                                pack_weights=True, fused_layers=s.fused_layers)
        if draft.task != task:
            raise ValueError(f"--draft-model {s.draft_model}: a {draft.task} model, not a {task} model")
        log.info("draft model loaded", extra={"path": str(path), "parameters": draft.num_parameters()})
        self._draft = weakref.ref(draft, lambda _: log.info("draft model unloaded: no model drafts with it"))
        return draft

    def _held_draft(self) -> checkpoint.LoadedModel | None:
        return self._draft() if self._draft is not None else None

    def _check_memory(self, name: str, path: Path, device: torch.device,
                      beside: tuple[checkpoint.LoadedModel, ...] = ()) -> None:
        """--max-model-memory: the weights of `path` (as --quantize will hold them) and of every model held (served,
        one being replaced, as both are in memory until the swap, the draft model, and `beside`: loaded, not served
        yet) together, from the checkpoint's headers before any weight is read."""
        s = self.settings
        limit = s.max_model_memory_bytes
        if limit is None or not path.exists():  # a directory, or a GGUF file
            return
        dtype = checkpoint.resolve_dtype(s.dtype, device)
        needed = checkpoint.weight_bytes(path, dtype, s.quantize, s.int8_activations, s.int4_group_size)
        with self._changes:
            holding = [m.loaded for m in (*self.models.values(), *self._retiring)]
        holding += [*beside, *([draft] if (draft := self._held_draft()) is not None else [])]
        held = sum(held_bytes(m.model) for m in holding)
        if held + needed > limit:
            raise ValueError(f"loading {name!r} needs {needed / 1e6:,.1f} MB for its weights; with the "
                             f"{held / 1e6:,.1f} MB served that passes --max-model-memory "
                             f"({self.settings.max_model_memory})")

    def _warmup(self, served: ServedModel) -> None:
        start = time.perf_counter()
        served.warm_up()
        log.info("warmed up", extra={"model": served.name, "seconds": round(time.perf_counter() - start, 3)})

    def begin_drain(self) -> None:
        """Shutdown, first part: not ready any more, and every model refuses new requests while the ones it
        holds finish."""
        if not self.draining:
            self._drain_deadline = time.monotonic() + self.settings.request_timeout_s
        self.ready, self.draining = False, True
        for served in self.models.values():
            for worker in served.workers:
                worker.refuse_new()

    def idle(self) -> bool:
        """No model holds a request (queued or running)."""
        return all(w.idle for served in self.models.values() for w in served.workers)

    def stop(self) -> None:
        """Stop every model's workers. What they hold may finish until one deadline shared by all of them,
        --request-timeout-s after the drain began (a SIGTERM's drain, or this call), not a wait per worker."""
        self.begin_drain()
        for served in self.models.values():
            for worker in served.workers:
                worker.stop(max(0.0, self._drain_deadline - time.monotonic()))
        heap.thaw()  # the process may go on (an application that embeds this one): its cycles are collectable again

    # ----------------------------------------------------------------------------------------------
    # Changes at run time (tserve/service/routes/repository.py)
    # ----------------------------------------------------------------------------------------------
    def derived(self, key: str, compute: Callable[[], Any]) -> Any:
        """A value worked out from the served models (e.g. the translators' language pairs), kept until the set
        of models changes (a value computed while it changed is stored under the version it was computed from)."""
        version = self.version
        stored, cached = self._derived.get(key, (None, None))
        if stored != version:
            cached = compute()
            self._derived[key] = (version, cached)
        return cached

    def _changed(self) -> None:
        self.version += 1
        self._derived = {}

    def claim(self, name: str, state: str) -> ServedModel | None:
        """Start loading (`LOADING`) or unloading (`UNLOADING`) `name`: 409 while another change of it runs, 404
        when unloading what is not loaded. Returns the model served under that name, if any."""
        with self._changes:
            current = self.states.get(name)
            if current is not None and current.state in ("LOADING", "UNLOADING"):
                raise APIError(409, f"model {name!r} is {current.state.lower()}", "invalid_request_error", "busy")
            served = self.models.get(name)
            if state == "UNLOADING" and served is None:
                raise not_found(f"model {name!r} is not loaded; loaded: {sorted(self.models)}")
            reason = "replacing the served model" if state == "LOADING" and served is not None else ""
            self.states[name] = ModelState(state, reason)
            return served

    def prepare(self, name: str, path: Path) -> ServedModel:
        """Load and warm up `path` as model `name`, not yet serving (blocking: run it beside serving, in a thread
        of its own). A failure leaves the name UNAVAILABLE with the error, or the model it would replace READY."""
        try:
            device = checkpoint.resolve_device(self.settings.device)
            served = self._load_one(name, path, device, resolve_backend(self.settings.attention_backend, device))
            if self.settings.warmup:
                self._warmup(served)
            return served
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            log.exception("model loading failed", extra={"model": name})
            with self._changes:  # as `claim` and `install` change the states
                self.states[name] = ModelState("READY", f"a replacement failed to load: {reason}") \
                    if name in self.models else ModelState("UNAVAILABLE", reason)
            exc.__traceback__ = None  # its frames hold what was loaded so far
        _give_memory_back(self.settings.gc_freeze)
        raise bad_request(f"model {name!r} failed to load: {reason}", "load_failed")

    def install(self, name: str, served: ServedModel) -> bool:
        """Start `served`'s workers (from the caller's thread: they keep its CPU priority) and serve it as `name`,
        at once: requests see the old model or the new one, never neither. True when it replaced one, which
        `retire` then drains."""
        for worker in served.workers:
            worker.start()
        with self._changes:
            old = self.models.get(name)
            self.models[name] = served
            self.states[name] = ModelState("READY")
            if old is not None:
                self._retiring.append(old)
                for worker in old.workers:
                    worker.replaced()
            self._changed()
        if self.settings.gc_freeze and old is None:  # a replacement is frozen by `retire`, after the old one goes
            heap.freeze()
        return old is not None

    def remove(self, name: str) -> None:
        """Stop routing to `name` (its new requests get 503 while it is UNLOADING); `retire` then drains it."""
        with self._changes:
            self._retiring.append(self.models.pop(name))
            self._changed()

    def retire(self, unloaded: str | None = None) -> None:
        """Let the models no longer served finish what they hold (up to the request timeout), stop their workers
        and give their memory back (blocking). The registry holds the only references to them, so that they are
        freed here; with `unloaded`, that name is then UNAVAILABLE ("unloaded")."""
        with self._changes:
            mine = [m for m in self._retiring if id(m) not in self._retired_ids]
            self._retired_ids |= {id(m) for m in mine}
        self._stop_workers(mine)
        with self._changes:  # until here they count toward --max-model-memory
            self._retiring = [m for m in self._retiring if not any(m is x for x in mine)]
            self._retired_ids -= {id(m) for m in mine}
        del mine  # the last reference: what is freed now is given back below
        _give_memory_back(self.settings.gc_freeze)
        if unloaded is not None:
            self.states[unloaded] = ModelState("UNAVAILABLE", "unloaded")
            self.metrics.forget_model(unloaded)

    def _stop_workers(self, models: list[ServedModel]) -> None:
        for served in models:
            for worker in served.workers:
                worker.stop(self.settings.request_timeout_s)

    def load_model(self, name: str, path: Path) -> None:
        """claim, prepare, install and retire in one blocking call (what the repository route does in steps)."""
        self.claim(name, "LOADING")
        if self.install(name, self.prepare(name, path)):
            self.retire()

    def unload_model(self, name: str) -> None:
        """claim, remove and retire in one blocking call."""
        self.claim(name, "UNLOADING")
        self.remove(name)
        self.retire(name)

    # ----------------------------------------------------------------------------------------------
    def get(self, name: str | None, task: str | None) -> ServedModel:
        """The model `name` (must do `task`, unless None), or the only model with that task when `name` is
        omitted."""
        if name is None:
            candidates = [m for m in self.models.values() if m.task == task]
            if len(candidates) == 1:
                return candidates[0]
            if not candidates:
                raise not_found(f"no {task} model is served")
            raise bad_request(f"several {task} models are served ({', '.join(m.name for m in candidates)}); "
                              "say which with 'model'", "model_required")
        served = self.models.get(name)
        if served is None and name in self.states and self.states[name].state in ("LOADING", "UNLOADING"):
            raise overloaded(f"model {name!r} is {self.states[name].state.lower()}", status=503)
        if served is None:
            raise not_found(f"model {name!r} does not exist; served models: {sorted(self.models)}")
        if task is not None and served.task != task:
            raise bad_request(f"model {name!r} does {served.task}, not {task}", "wrong_task")
        return served
