"""The Open Inference Protocol's model repository extension: which models there are and in which state
(`POST /v2/repository/index`), and loading, replacing and unloading them at run time
(`POST /v2/repository/models/{name}/load` and `.../unload`). A model loads by name from --model-repository, or
from a path the body gives when --allow-load-paths is on; it loads beside the models being served, and one served
under the same name is replaced at once when the new one is ready. With keys on, these routes take the admin
keys (TSERVE_ADMIN_KEYS) only. Errors are `{"error": "..."}`, as under the rest of /v2."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request

from tserve.model.gguf import is_gguf
from tserve.service.errors import APIError, OIPError
from tserve.service.registry import ModelRegistry
from tserve.service.routes.deps import ready_registry, settings
from tserve.service.security import KeyChecker, bearer_token
from tserve.service.settings import checkpoint_dirs

PREFIX = "/v2/repository"
LOADER_NICENESS = 10
router = APIRouter(prefix=PREFIX, tags=["model repository"])


def _admin(request: Request) -> ModelRegistry:
    """The registry, once the start-up models serve (503 before), for a request with an admin key (when keys
    are on at all)."""
    s = settings(request)
    if s.admin_keys:
        if KeyChecker(s.admin_keys).match(bearer_token(request.scope)) is None:
            raise APIError(401, "the model repository API needs an admin key (TSERVE_ADMIN_KEYS)",
                           "invalid_request_error", "invalid_api_key", {"WWW-Authenticate": "Bearer"})
    elif s.api_keys:
        raise APIError(403, "the model repository API is closed: API keys are on and no admin key is set "
                            "(TSERVE_ADMIN_KEYS)", "invalid_request_error", "admin_keys_unset")
    return ready_registry(request)


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = await request.json()
    except ValueError as exc:
        raise OIPError(400, f"the body is not valid JSON ({exc})") from exc
    if not isinstance(body, dict):
        raise OIPError(400, "the body must be a JSON object")
    return body


def _repository_models(request: Request) -> dict[str, Path]:
    return checkpoint_dirs(settings(request).model_repository)


@router.post("/index")
async def index(request: Request) -> list[dict[str, str]]:
    """Every model served, loading, unloaded or in the repository, with its state (`{"ready": true}`: the
    served ones only)."""
    reg = _admin(request)
    ready_only = bool((await _body(request)).get("ready"))
    names = sorted(set(reg.models) | set(reg.states) | set(_repository_models(request)))
    out = []
    for name in names:
        state = reg.states.get(name)
        entry = {"name": name, "version": "1", "state": state.state if state else "UNAVAILABLE",
                 "reason": state.reason if state else "not loaded (in the model repository)"}
        if name in reg.models and entry["state"] == "LOADING":  # a replacement loading: the old one serves
            entry["state"] = "READY"
        if not ready_only or entry["state"] == "READY":
            out.append(entry)
    return out


@router.post("/models/{name}/load")
async def load(name: str, request: Request) -> dict[str, str]:
    """Load (or replace) `name`: from the body's `parameters.path` when --allow-load-paths is on, else from
    --model-repository."""
    reg = _admin(request)
    if not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise OIPError(400, "a model name is letters, digits, '-', '_' and '.'")
    parameters = (await _body(request)).get("parameters") or {}
    if not isinstance(parameters, dict):
        raise OIPError(400, "parameters must be a JSON object")
    path = parameters.get("path")
    if path is not None:
        if not settings(request).allow_load_paths:
            raise OIPError(403, "loading from a path of the request's is off (--allow-load-paths)")
        if not isinstance(path, str) or not ((Path(path) / "config.json").is_file() or is_gguf(Path(path))):
            raise OIPError(400, f"parameters.path {path!r} is not a checkpoint directory or a GGUF file")
        source = Path(path)
    else:
        found = _repository_models(request)
        if name not in found:
            raise OIPError(404, f"model {name!r} is not in the model repository (--model-repository); it has: "
                                f"{sorted(found)}")
        source = found[name]
    reg.claim(name, "LOADING")  # on the event loop: a second change of this name is a 409 from now on

    async def change() -> None:
        # installed on the event loop, so that its workers run at the server's priority
        if reg.install(name, await _beside_serving(reg.prepare, name, source)):
            await asyncio.to_thread(reg.retire)

    await _to_the_end(change())
    return {"name": name, "state": "READY"}


async def _to_the_end(change) -> None:  # noqa: ANN001 - a coroutine
    """A change of the served models runs to its end even when the client that asked leaves."""
    await asyncio.shield(asyncio.ensure_future(change))


async def _beside_serving(fn, *args):  # noqa: ANN001, ANN202
    """`fn(*args)` in a thread of its own at a lower CPU priority (nice 10, inherited by the thread pools it
    starts), so that the workers serving other models keep their steps while a model loads. What it returns."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def run() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOADER_NICENESS)
        except (OSError, AttributeError):  # not Linux, or not allowed: at the usual priority
            pass
        try:
            result: tuple[bool, object] = (True, fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting route
            result = (False, exc)
        loop.call_soon_threadsafe(lambda: done.done() or (
            done.set_result(result[1]) if result[0] else done.set_exception(result[1])))

    threading.Thread(target=run, name="model-loader", daemon=True).start()
    return await done


@router.post("/models/{name}/unload")
async def unload(name: str, request: Request) -> dict[str, str]:
    """Stop serving `name`: new requests get 503 at once, the ones it holds finish, then its memory is given
    back; answers when that is done."""
    reg = _admin(request)
    reg.claim(name, "UNLOADING")
    reg.remove(name)
    await _to_the_end(asyncio.to_thread(reg.retire, name))
    return {"name": name, "state": "UNAVAILABLE"}
