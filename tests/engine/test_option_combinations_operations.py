"""Operating options checked where they meet: list settings from the environment and from flags; the model
repository API beside API keys, a replacement that is loading or fails, --max-model-memory beside --dtype and a
replacement; the translation memory beside a replaced translator and --quantize; --reserved-rows beside a
translator's beams; priorities within one client; --max-queue 0 on a batcher; file jobs of each format with a
glossary. Apps run in this process (`httpx.ASGITransport`) on the committed fixture models, so that the tests take
seconds."""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import time
import weakref
from pathlib import Path

import httpx
import pytest
import torch

from tests.engine.test_fair_admission import _run
from tests.files.test_formats import MARKED, SENTENCES
from tests.helpers import factories
from tests.helpers.hooked_server import slow_steps
from tests.helpers.in_process import InProcessApp
from tests.helpers.office_files import build, read_back
from tests.helpers.polling import until
from tserve.model import checkpoint
from tserve.service.app import build_app
from tserve.service.cli import build_parser, settings_from_args
from tserve.service.engine import Admission, DynamicBatcher, QueueFull, admission
from tserve.service.errors import APIError
from tserve.service.metrics import Metrics
from tserve.service.registry import ModelRegistry, ModelState
from tserve.service.settings import Settings
from tserve.service.translation.served import ServedTranslator

TINY_LM = Path(__file__).resolve().parents[1] / "fixtures" / "tiny-lm"
SENTENCE = "hello world good morning"


class App(InProcessApp):
    """An app with its models loaded (the heap never frozen: this is the test process's)."""

    def __init__(self, root: Path, models: dict[str, Path], **settings) -> None:  # noqa: ANN003
        super().__init__(models, gc_freeze=False, file_dir=str(root / "files"), **settings)

    def translate(self, model: str, **body) -> str:
        return self.post("/v1/translations", {"model": model, "input": SENTENCE, "num_beams": 1, "max_tokens": 40}
                         | body).json()["data"][0]["translation"]

    def metric(self, name: str, model: str) -> float:
        return self.app.state.metrics.registry.get_sample_value(name, {"model": model}) or 0.0


@pytest.fixture(scope="module")
def aligned(tmp_path_factory):
    return factories.aligned_mt_dir(tmp_path_factory.mktemp("aligned") / "mt")


@pytest.fixture(scope="module")
def served(aligned, tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    app = App(root, {"mt": aligned, "lm": TINY_LM}, translation_memory=str(root / "memory.sqlite"))
    yield app
    app.registry.stop()


def test_list_settings_from_the_environment_and_flags_drop_the_spaces_around_commas(monkeypatch):
    """`TSERVE_API_KEYS="k1, k2:3"` as an operator writes it: the keys are k1 and k2 (priority 3), not " k2"; a
    list flag is split the same way and wins over its environment variable."""
    monkeypatch.setenv("TSERVE_API_KEYS", " k1 , k2:3 ")
    monkeypatch.setenv("TSERVE_PUBLIC_PATHS", "/healthz, /metrics")
    monkeypatch.setenv("TSERVE_ADMIN_KEYS", "from-the-environment")
    args = build_parser().parse_args(["serve", "--admin-keys", "a1, a2", "--cors-origins",
                                      "https://x.example, https://y.example"])
    settings = settings_from_args(args)
    assert settings.api_keys == ["k1", "k2:3"] and settings.public_paths == ["/healthz", "/metrics"]
    assert settings.admin_keys == ["a1", "a2"]
    assert settings.cors_origins == ["https://x.example", "https://y.example"]
    assert settings_from_args(build_parser().parse_args(["serve", "--api-keys", "k9"])).api_keys == ["k9"]

    async def go() -> list[int]:
        app = build_app(settings, load_models=False)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            return [(await c.get("/v1/models", headers={"Authorization": "Bearer k2"})).status_code,
                    (await c.get("/metrics")).status_code]

    assert asyncio.run(go()) == [200, 200]


def test_with_api_keys_and_no_admin_keys_the_repository_api_is_closed_to_every_key():
    """An API key is not an admin key: with keys on and no TSERVE_ADMIN_KEYS, /v2/repository answers 403 to any
    key (before the models are even ready), while the key still serves elsewhere."""
    app = build_app(Settings(api_keys=["user-key"]), load_models=False)
    key = {"Authorization": "Bearer user-key"}

    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            return [await c.post(p, json={}, headers=key) for p in (
                "/v2/repository/index", "/v2/repository/models/lm/load", "/v2/repository/models/lm/unload")] + [
                await c.get("/v1/models", headers=key)]

    *repository, models = asyncio.run(go())
    assert [r.status_code for r in repository] == [403, 403, 403], [r.text for r in repository]
    assert all("no admin key is set" in r.text for r in repository)
    assert models.status_code == 200


def test_a_model_being_replaced_serves_and_shows_ready_and_a_failed_replacement_keeps_it(served, tmp_path):
    """While a replacement of `lm` loads, the old model answers and the index says READY (also under
    `{"ready": true}`); a replacement that fails to load leaves `lm` READY with the failure as its reason; a
    name whose first load is running answers 503 (retry), not 404."""
    reg = served.registry
    reg.claim("lm", "LOADING")
    try:
        index = {m["name"]: m for m in served.post("/v2/repository/index", {}).json()}
        assert index["lm"]["state"] == "READY" and index["lm"]["reason"] == "replacing the served model"
        assert "lm" in {m["name"] for m in served.post("/v2/repository/index", {"ready": True}).json()}
        served.post("/v1/completions", {"model": "lm", "prompt": "Good", "max_tokens": 2})
        broken = tmp_path / "broken"
        broken.mkdir()
        (broken / "config.json").write_text(json.dumps({"architecture": "decoder", "d_model": 64}))
        with pytest.raises(APIError, match="failed to load"):
            reg.prepare("lm", broken)
        assert reg.states["lm"].state == "READY" and reg.states["lm"].reason.startswith(
            "a replacement failed to load")
        index = {m["name"]: m for m in served.post("/v2/repository/index", {"ready": True}).json()}
        assert index["lm"]["state"] == "READY"
        served.post("/v1/completions", {"model": "lm", "prompt": "Good", "max_tokens": 2})
    finally:
        reg.states["lm"] = ModelState("READY")
    reg.claim("lm-new", "LOADING")
    try:
        resp = served.post("/v1/completions", {"model": "lm-new", "prompt": "Good", "max_tokens": 2}, 503)
        assert "loading" in resp.json()["error"]["message"]
    finally:
        reg.states.pop("lm-new")


def test_max_model_memory_counts_the_served_dtype_and_the_model_being_replaced():
    """--dtype bfloat16: a model whose float32 weights pass --max-model-memory fits at half of them; replacing it
    under its name is refused, as both copies are held until the swap, and the served one stays."""
    f32 = checkpoint.weight_bytes(TINY_LM, torch.float32)
    reg = ModelRegistry(Settings(device="cpu", dtype="bfloat16", max_model_memory=f"{f32 - 1}B", warmup=False,
                                 gc_freeze=False), Metrics())
    try:
        reg.load_model("lm", TINY_LM)
        served = reg.models["lm"]
        assert served.loaded.dtype == torch.bfloat16
        with pytest.raises(APIError, match="passes --max-model-memory"):
            reg.load_model("lm", TINY_LM)
        assert reg.models["lm"] is served and reg.states["lm"].state == "READY"
    finally:
        reg.stop()


def test_max_model_memory_counts_the_draft_model():
    """--draft-model's weights are held beside every language model: a limit that the model's weights fit but not
    with its draft's refuses the start; with room for both, the draft counts toward a model loaded later."""
    f32 = checkpoint.weight_bytes(TINY_LM, torch.float32)

    def started(limit: int) -> ModelRegistry:
        reg = ModelRegistry(Settings(models=[f"lm={TINY_LM}"], device="cpu", dtype="float32", draft_model=str(TINY_LM),
                                     max_model_memory=f"{limit}B", warmup=False, gc_freeze=False), Metrics())
        reg.start_loading()
        reg.wait_loaded(120)
        return reg

    reg = started(2 * f32 - 1)
    try:
        assert not reg.ready and "--draft-model" in reg.error and "passes --max-model-memory" in reg.error
    finally:
        reg.stop()
    reg = started(3 * f32 - 1)
    try:
        assert reg.ready, reg.error
        with pytest.raises(APIError, match="passes --max-model-memory"):
            reg.load_model("second", TINY_LM)
    finally:
        reg.stop()


def test_the_draft_model_is_freed_with_the_last_model_that_drafts_with_it():
    """--draft-model is held for the language models that draft with it: once the last one is unloaded its memory
    is given back (and counts toward --max-model-memory no longer), and a model loaded later loads it again."""
    reg = ModelRegistry(Settings(models=[f"lm={TINY_LM}"], device="cpu", dtype="float32", draft_model=str(TINY_LM),
                                 warmup=False, gc_freeze=False), Metrics())
    reg.start_loading()
    reg.wait_loaded(120)
    try:
        assert reg.ready, reg.error
        draft = weakref.ref(reg.models["lm"].draft)
        reg.load_model("second", TINY_LM)
        assert reg.models["second"].draft is draft()  # one copy for every language model
        reg.unload_model("lm")
        gc.collect()
        assert draft() is not None  # "second" still drafts with it
        reg.unload_model("second")
        gc.collect()
        assert draft() is None
        reg.load_model("third", TINY_LM)
        assert reg.models["third"].draft is not None
    finally:
        reg.stop()


def test_stopping_the_registry_drains_every_worker_against_one_request_timeout(monkeypatch):
    """Stopping waits for what the workers hold until --request-timeout-s after the drain began, one deadline for
    all of them: not a fixed wait per worker, and nothing more once a SIGTERM's drain has used it up."""
    from tserve.service.engine.worker import Worker

    given: list[float] = []
    stop = Worker.stop
    monkeypatch.setattr(Worker, "stop", lambda self, drain_timeout_s=30.0: (given.append(drain_timeout_s),
                                                                              stop(self, drain_timeout_s)))
    for timeout, drained_before in ((5.0, False), (0.05, True)):
        given.clear()
        reg = ModelRegistry(Settings(models=[f"a={TINY_LM}", f"b={TINY_LM}"], device="cpu", dtype="float32",
                                     warmup=False, gc_freeze=False, request_timeout_s=timeout), Metrics())
        reg.start_loading()
        reg.wait_loaded(120)
        assert reg.ready, reg.error
        if drained_before:  # a SIGTERM's drain whose deadline has passed: the workers stop at once
            reg.begin_drain()
            time.sleep(2 * timeout)
        reg.stop()
        assert len(given) >= 2
        assert all(0.0 <= t <= timeout for t in given), given
        assert given == sorted(given, reverse=True)
        if drained_before:
            assert given == [0.0] * len(given)


def test_a_translator_replaced_under_its_name_is_not_answered_from_the_old_ones_memory(served, aligned, tmp_path):
    """The translation memory is keyed by the weights: the same sentence sent to a name now served by other
    weights is translated by them (a memory miss), as a request that skips the memory would be."""
    served.registry.load_model("swap", aligned)
    try:
        first = served.translate("swap")
        hits = served.metric("tserve_translation_memory_hits_total", "swap")
        assert served.translate("swap") == first
        assert served.metric("tserve_translation_memory_hits_total", "swap") == hits + 1  # from the memory
        hits += 1
        served.registry.load_model("swap", factories.tiny_mt_dir(tmp_path / "other", trained=False))
        again = served.translate("swap")
        assert again == served.translate("swap", cache=False) != first
        assert served.metric("tserve_translation_memory_hits_total", "swap") == hits
    finally:
        served.registry.unload_model("swap")


@pytest.mark.parametrize("quantize", ["int8", "q8_0"])
def test_a_memory_shared_by_servers_of_another_quantization_misses(served, aligned, tmp_path, quantize):
    """Two servers share one memory file, one with --quantize int8 (or q8_0, a format with no options of its own):
    the weights are held otherwise, so what the float one stored is not the quantized one's answer."""
    served.translate("mt", max_tokens=39)  # stored by the float32 model
    other = App(tmp_path, {"mt": aligned}, quantize=quantize,
                translation_memory=served.app.state.settings.translation_memory)
    try:
        other.translate("mt", max_tokens=39)
        assert other.metric("tserve_translation_memory_hits_total", "mt") == 0
        assert other.metric("tserve_translation_memory_misses_total", "mt") == 1
        other.translate("mt", max_tokens=39)
        assert other.metric("tserve_translation_memory_hits_total", "mt") == 1  # its own entry
    finally:
        other.registry.stop()


def test_a_clients_beam_request_does_not_take_a_translators_reserved_row(tmp_path):
    """--reserved-rows 1 on a translator of 4 rows: a client with one request running asks for 3 beams (3 rows),
    which would leave no row for another client; it waits, and another client's request starts at once."""
    loaded = checkpoint.load(factories.tiny_mt_dir(tmp_path / "mt", trained=False), device="cpu")
    translator = ServedTranslator("mt", loaded, Settings(device="cpu", reserved_rows=1, max_running_requests=4,
                                                         translation_memory_max_entries=0), Metrics())
    engine = slow_steps(translator.engine, 0.02)

    def submit(who: str, beams: int, tokens: int):  # noqa: ANN202 - an engine request
        token = admission.set(Admission(who))
        try:
            return engine.submit_job(engine.translator.job("hello world", beams, tokens))
        finally:
            admission.reset(token)

    async def drain(req) -> None:  # noqa: ANN001
        async for _ in engine.stream(req):
            pass

    async def go() -> tuple:
        first = submit("a", 1, 60)
        engine.start()
        await until(lambda: first in engine.running)
        beams = submit("a", 3, 4)
        seen = engine.steps
        await until(lambda: engine.steps >= seen + 3)
        assert beams not in engine.running and beams.admitted_step == -1
        other = submit("b", 1, 4)
        arrived = engine.steps
        await drain(other)
        await drain(beams)
        await drain(first)
        return first, beams, other, arrived

    try:
        first, beams, other, arrived = asyncio.run(go())
    finally:
        engine.stop()
    assert other.admitted_step <= arrived + 1
    assert beams.admitted_step >= first.finished_step  # once its client's other request gave its row back


def test_one_clients_urgent_request_goes_before_its_own_earlier_ones():
    """One API key sends six requests, then one with a lower priority value: priorities order one client's
    requests too, not only different clients'."""
    lm = checkpoint.load(TINY_LM, device="cpu")
    flood, urgent = _run(lm, [(Admission("a", 0), 6), (Admission("a", -1), 1)])
    assert urgent[0] <= min(flood)


def test_with_max_queue_0_a_batcher_takes_no_item_while_its_batch_runs():
    """--max-queue 0 on a classifier: a batch holds the whole batcher, so an item arriving while one runs has no
    free rows and no waiting room (429), however small the batch; once it ends, an item is taken again."""
    release = threading.Event()

    def batch_fn(items: list[str]) -> list[str]:
        release.wait(10)
        return items

    batcher = DynamicBatcher("b", batch_fn, max_batch_size=4, max_wait_ms=0, max_queue=0, metrics=Metrics())
    batcher.start()

    async def go() -> list[str]:
        first = batcher.enqueue(["x"])[0]
        await until(lambda: batcher.running)
        try:
            with pytest.raises(QueueFull):
                batcher.enqueue(["y"])
        finally:
            release.set()
        return [await batcher.result(first), await batcher.submit("z")]

    try:
        assert asyncio.run(go()) == ["x", "z"]
    finally:
        batcher.stop(1)


@pytest.mark.parametrize("fmt", ["txt", "md", "docx", "odt", "epub"])
def test_a_file_job_of_each_format_keeps_its_glossary(served, fmt):
    """`glossary` in a file job's form reaches every sentence of the file, in each format (beside its
    formatting runs): the target term is in the file that comes back, and not without it."""

    async def job(fields: dict) -> bytes:
        data = build(fmt, SENTENCES, MARKED)
        transport = httpx.ASGITransport(app=served.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as c:
            resp = await c.post("/v1/translations/files", files={"file": (f"doc.{fmt}", data)},
                                data={"model": "mt", "num_beams": "1"} | fields)
            assert resp.status_code == 202, resp.text
            url = f"/v1/translations/jobs/{resp.json()['id']}"
            await until(lambda: served.app.state.file_jobs.jobs[url.rsplit("/", 1)[1]].finished, 60)
            assert (await c.get(url)).json()["status"] == "succeeded"
            return (await c.get(url + "/file")).content

    glossed, _ = read_back(fmt, asyncio.run(job({"glossary": json.dumps({"fox": "Fuchsbau"})})))
    plain, _ = read_back(fmt, asyncio.run(job({})))
    assert "Fuchsbau" in glossed[0] and "Fuchsbau" not in plain[0]
    assert glossed[1] == plain[1] == "Hallo Welt Guten Morgen"


def test_an_unloaded_models_series_leave_the_metrics_and_a_replaced_ones_stay(served):
    """A model unloaded at run time no longer reports its rows and cache memory (nor any other series); one
    replaced under its name reports the new model's."""
    reg, render = served.registry, lambda: served.app.state.metrics.render().decode()
    reg.load_model("extra", TINY_LM)
    served.post("/v1/completions", {"model": "extra", "prompt": "Good", "max_tokens": 2})
    served.post("/v1/embeddings", {"model": "extra", "input": "Good morning"})
    assert served.metric("tserve_kv_slots_total", "extra") > 0 and 'model="extra"' in render()
    assert 'model="extra/embeddings"' in render()
    reg.load_model("extra", TINY_LM)  # replaced: the new model's series
    assert served.metric("tserve_kv_slots_total", "extra") > 0
    reg.unload_model("extra")
    assert 'model="extra' not in render()
    assert served.metric("tserve_kv_slots_total", "lm") > 0  # the others keep theirs
