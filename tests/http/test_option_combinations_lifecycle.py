"""Features checked after a model's or the server's lifecycle event rather than on a freshly started server: a
translator replaced under its name through the repository route (LibreTranslate's pair routing, which is worked
out once per set of served models, and the replaced model's memory given back), --gc-freeze beside a model
replaced or a load that fails at run time, and the file store when the server stops. The strong shape: after the
event, a request answers as the same request on a fresh app serving only the new models. Apps run in this process
(`httpx.ASGITransport`) on tiny fixture models, so that each test takes seconds."""

from __future__ import annotations

import asyncio
import gc
import json
import weakref
from pathlib import Path

import httpx
import pytest

from tests.helpers import factories
from tests.helpers.in_process import InProcessApp
from tests.helpers.polling import until
from tserve.service import heap
from tserve.service.app import build_app
from tserve.service.errors import APIError
from tserve.service.metrics import Metrics
from tserve.service.registry import ModelRegistry
from tserve.service.settings import Settings

TINY_LM = Path(__file__).resolve().parents[1] / "fixtures" / "tiny-lm"
ADMIN_KEY = "lifecycle-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
TEXT = "hello world good morning"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Three English → German translators: the trained fixture twice (two directories, the same answers) and a
    model of random weights (other answers)."""
    root = tmp_path_factory.mktemp("lifecycle")
    pair = ("en", "de")
    return {"trained": factories.tiny_mt_dir(root / "trained", languages=pair),
            "copy": factories.tiny_mt_dir(root / "copy", languages=pair),
            "random": factories.tiny_mt_dir(root / "random", seed=3, trained=False, languages=pair)}


@pytest.fixture
def thawed():
    """The test process's heap as the suite keeps it: never left frozen, whatever the test did."""
    heap.thaw()
    yield
    heap.thaw()


def libre(app: InProcessApp) -> str:
    resp = app.request("POST", "/translate", json={"q": TEXT, "source": "en", "target": "de"})
    assert resp.status_code == 200, resp.text
    return resp.json()["translatedText"]


def test_a_translator_replaced_by_the_route_takes_its_pairs_routes_as_a_fresh_server_would(checkpoints, tmp_path):
    """Two translators serve en→de; the first named answers LibreTranslate's /translate. Replaced under its name
    (through `POST /v2/repository/models/NAME/load`, after /translate was routed once, so the routes were
    worked out for the old set), the pair goes to the new model, still before the second one: /translate answers
    as a fresh server of the new model and the second one does. The replaced model is drained and freed."""
    fresh = InProcessApp({"first": checkpoints["random"], "second": checkpoints["copy"]}, gc_freeze=False,
                         file_dir=str(tmp_path / "fresh-files"))
    try:
        expected = libre(fresh)
    finally:
        fresh.stop()
    app = InProcessApp({"first": checkpoints["trained"], "second": checkpoints["copy"]}, gc_freeze=False,
                       file_dir=str(tmp_path / "files"), admin_keys=[ADMIN_KEY],
                       allow_load_paths=True)
    try:
        before = libre(app)
        old = weakref.ref(app.registry.models["first"])
        loaded = app.post("/v2/repository/models/first/load", {"parameters": {"path": str(checkpoints["random"])}},
                          headers=ADMIN)
        assert loaded.json() == {"name": "first", "state": "READY"}
        assert libre(app) == expected != before
        index = {m["name"]: m for m in app.post("/v2/repository/index", {}, headers=ADMIN).json()}
        assert index["first"]["state"] == "READY" and index["first"]["reason"] == ""
        gc.collect()
        assert old() is None and not app.registry._retiring  # drained, stopped and its memory given back
    finally:
        app.stop()


def test_with_gc_freeze_a_replaced_model_and_a_failed_load_leave_the_heap_frozen(thawed, tmp_path):
    """--gc-freeze beside changes at run time: a model replaced under its name is frozen once the old one is gone
    (as one loaded at start is), and a load that fails gives its memory back and freezes the heap again, instead
    of leaving every later collection to walk the whole heap."""
    reg = ModelRegistry(Settings(models=[f"lm={TINY_LM}"], device="cpu", dtype="float32", warmup=False,
                                 log_level="warning"), Metrics())
    reg.start_loading()
    reg.wait_loaded(120)
    try:
        assert reg.ready, reg.error
        assert gc.get_freeze_count() > 0
        reg.load_model("lm", TINY_LM)  # replaced under its name
        model = reg.models["lm"].loaded.model
        assert gc.get_freeze_count() > 0
        assert not any(o is model for o in gc.get_objects())  # frozen: not listed
        del model
        broken = tmp_path / "broken"
        broken.mkdir()
        (broken / "config.json").write_text(json.dumps({"architecture": "decoder", "d_model": 64}))
        with pytest.raises(APIError, match="failed to load"):
            reg.load_model("broken", broken)
        assert gc.get_freeze_count() > 0
        assert reg.states["broken"].state == "UNAVAILABLE" and reg.states["lm"].state == "READY"
    finally:
        reg.stop()


def test_a_stopped_server_leaves_no_finished_file_behind(checkpoints, tmp_path):
    """File jobs live in the process: once it stops, no later server can name a finished job's file, so the
    shutdown deletes the files it made (the running jobs cancelled, the finished ones with their files) instead
    of leaving them in --file-dir for good."""
    files = tmp_path / "files"
    app = build_app(Settings(models=[f"mt={checkpoints['trained']}"], device="cpu", gc_freeze=False, warmup=False,
                             file_dir=str(files)))

    async def go() -> None:
        async with app.router.lifespan_context(app):
            reg = app.state.registry
            await asyncio.to_thread(reg.wait_loaded, 120)
            assert reg.ready, reg.error
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                         timeout=120) as c:
                resp = await c.post("/v1/translations/files", files={"file": ("notes.txt", TEXT.encode() + b"\n")},
                                    data={"num_beams": "1"})
                assert resp.status_code == 202, resp.text
                job_id = resp.json()["id"]
                await until(lambda: app.state.file_jobs.jobs[job_id].finished, 60)
                assert (await c.get(f"/v1/translations/jobs/{job_id}")).json()["status"] == "succeeded"
            assert [p.name for p in files.iterdir()] == [job_id + ".txt"]

    asyncio.run(go())
    assert list(files.iterdir()) == []
