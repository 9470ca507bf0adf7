"""Operating features checked where two of them meet in one request: an API key's priority (`KEY:N`) beside the
route that carries the request (the chat route's body priority, LibreTranslate's key in the body, which the route
checks itself) as the engines see it; the model repository API beside a client that leaves while its load runs.
One app runs in this process (`httpx.ASGITransport`) on the committed fixture models, so that the tests take
seconds."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import httpx
import pytest

from tests.helpers import factories
from tests.helpers.in_process import InProcessApp
from tests.helpers.polling import until
from tserve.service.engine.worker import Worker

TINY_LM = Path(__file__).resolve().parents[1] / "fixtures" / "tiny-lm"
URGENT, LATE, PLAIN, ADMIN = "ops-urgent-key", "ops-late-key", "ops-plain-key", "ops-admin-key"
# The keys as the operator writes them: an urgent key, a key whose requests wait behind others, a plain key.
KEY_ENTRIES = [f"{URGENT}:-3", f"{LATE}:4", PLAIN]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """A language model and an English-German translator, API keys with priorities, admin keys, and a model
    repository holding a second language model."""
    root = tmp_path_factory.mktemp("ops-pairs")
    repository = root / "repository"
    repository.mkdir()
    (repository / "lm2").symlink_to(TINY_LM, target_is_directory=True)
    served = InProcessApp({"lm": TINY_LM, "en-de": factories.tiny_mt_dir(root / "en-de", languages=("en", "de"))},
                          gc_freeze=False, file_dir=str(root / "files"), api_keys=KEY_ENTRIES, admin_keys=[ADMIN],
                          model_repository=str(repository))
    yield served
    served.stop()


@pytest.fixture
def queued(monkeypatch):
    """(model, client, priority) of every engine request queued while the test runs: what the engines' fair
    admission orders by."""
    seen: list[tuple[str, object, int]] = []
    enqueue = Worker._enqueue

    def recording(self, req, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        enqueue(self, req, *args, **kwargs)
        seen.append((self.name, req.client, req.priority))

    monkeypatch.setattr(Worker, "_enqueue", recording)
    return seen


def test_a_keys_priority_and_a_body_priority_reach_the_engine_from_every_route(app, queued):
    """The key's priority (`KEY:N`) is the default of each of its requests and a body's `priority` may ask for a
    later turn: on /v1/completions, on /v1/chat/completions and on a beam translation alike, and on
    LibreTranslate's /translate, whose key
    comes in the body and is checked by the route rather than the middleware. A chat request asking for a later
    turn that kept its key's, or a /translate request admitted as an anonymous address at priority 0, would
    jump the queue of everyone else."""
    chat = {"model": "lm", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    completion = {"model": "lm", "prompt": "Good", "max_tokens": 2}
    cases = [  # (path, body, headers, expected (client, priority))
        ("/v1/completions", completion | {"priority": 9}, bearer(LATE), (("key", 1), 9)),
        ("/v1/chat/completions", chat | {"priority": 9}, bearer(LATE), (("key", 1), 9)),
        ("/v1/chat/completions", chat | {"priority": -9}, bearer(LATE), (("key", 1), 4)),
        ("/v1/chat/completions", chat, bearer(URGENT), (("key", 0), -3)),
        ("/v1/chat/completions", chat | {"priority": 5}, bearer(PLAIN), (("key", 2), 5)),
        ("/v1/translations", {"model": "en-de", "input": "the small cat", "num_beams": 2, "priority": 6},
         bearer(URGENT), (("key", 0), 6)),
        ("/translate", {"q": "the quick brown fox", "source": "en", "target": "de", "api_key": URGENT}, {},
         (("key", 0), -3)),
        ("/translate", {"q": "the lazy dog jumps", "source": "en", "target": "de", "api_key": LATE}, {},
         (("key", 1), 4)),
    ]
    for path, body, headers, expected in cases:
        queued.clear()
        resp = app.request("POST", path, json=body, headers=headers)
        assert resp.status_code == 200, (path, resp.text)
        assert queued, f"{path} queued nothing"
        assert {(client, priority) for _, client, priority in queued} == {expected}, (path, body, queued)


def test_a_load_runs_to_its_end_when_the_client_that_asked_leaves(app, monkeypatch):
    """`POST /v2/repository/models/NAME/load` answers when the model serves; a client that gives up meanwhile
    (a timeout, a hang-up) must not cut the change short: the model is still installed and READY, and a later
    load of that name is not refused as busy (409) by a LOADING state nobody will ever end."""
    reg = app.registry
    release = threading.Event()
    prepare = reg.prepare

    def held_prepare(name, path):  # noqa: ANN001, ANN202 - the load is still running when the client leaves
        assert release.wait(30)
        return prepare(name, path)

    monkeypatch.setattr(reg, "prepare", held_prepare)

    async def go() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app.app), base_url="http://test",
                                     timeout=60) as client:
            asking = asyncio.create_task(client.post("/v2/repository/models/lm2/load", json={},
                                                     headers=bearer(ADMIN)))
            await until(lambda: getattr(reg.states.get("lm2"), "state", None) == "LOADING", 10)
            await asyncio.sleep(0.05)  # in the loader thread, waiting for `release`
            asking.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asking
            release.set()
            await until(lambda: "lm2" in reg.models and reg.states["lm2"].state == "READY", 15)
            served = await client.post("/v1/completions", json={"model": "lm2", "prompt": "Good", "max_tokens": 2},
                                       headers=bearer(PLAIN))
            assert served.status_code == 200, served.text
            again = await client.post("/v2/repository/models/lm2/unload", json={}, headers=bearer(ADMIN))
            assert again.status_code == 200, again.text

    try:
        asyncio.run(go())
    finally:
        release.set()
        if "lm2" in reg.models:
            reg.unload_model("lm2")

