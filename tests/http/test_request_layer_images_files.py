"""The request layer between a client and the image and file engines, beside options other than the defaults: a
classification body with both `image` and `images` (each result matched to its own picture, indexed by its place);
the Open Inference Protocol's FP32 pixels and BYTES images held to their datatypes; and file jobs: a file exactly
--max-file-bytes long, an upload named by a Windows path, the ways a form opts out of the translation memory, a job
read while it runs, a finished job deleted, a job whose engine refused it, a pivoted job's total from its start,
and the retention counted from a job's end. Every app runs in this process (`httpx.ASGITransport`) on tiny
checkpoints, so that the tests take seconds."""

from __future__ import annotations

import asyncio
import io
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from tests.files.test_option_combinations_files import GERMAN, mt, pivot  # noqa: F401 - module fixtures
from tests.helpers.hooked_server import slow_steps
from tests.helpers.in_process import InProcessApp
from tests.helpers.polling import until
from tests.model.test_option_combinations_images import b64, noise, png
from tserve.model.attention_maps import AttentionMap
from tserve.service.errors import overloaded
from tserve.service.translation.file_jobs import FileJob, FileJobs
from tserve.service.translation.served import ServedTranslator
from tserve.service.vision.attention_png import heatmap_grid

# The jobs' outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels


@pytest.fixture(scope="module")
def vit(hf_vit):
    served = InProcessApp({"vit": hf_vit})
    yield served
    served.stop()


def session(app: InProcessApp, go: Callable[[httpx.AsyncClient], Awaitable[Any]]) -> Any:
    """`go(client)` in one event loop, so that a file job started by one request runs while the next ones read it."""
    async def run() -> Any:
        transport = httpx.ASGITransport(app=app.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as client:
            return await go(client)

    return asyncio.run(run())


async def to_the_end(app: InProcessApp, client: httpx.AsyncClient, name: str, data: bytes,
                     **fields: str) -> tuple[dict, dict]:
    """A file job started and waited for: the state the 202 answered and its last state."""
    resp = await client.post("/v1/translations/files", files={"file": (name, data)}, data=fields)
    assert resp.status_code == 202, resp.text
    started = resp.json()
    await until(lambda: app.app.state.file_jobs.jobs[started["id"]].finished, 60)
    return started, (await client.get(f"/v1/translations/jobs/{started['id']}")).json()


# ------------------------------------------------------------------------------------------------------------
# /v1/classifications: `image` beside `images`
# ------------------------------------------------------------------------------------------------------------
def test_an_image_beside_a_list_of_images_is_answered_first_and_each_result_is_its_own_pictures(vit):
    """A body may give `image` and `images` together: the single image is the first result (index 0) and the
    list's follow in order, each result the one its picture gets alone."""
    blobs = [b64(png(noise(seed, (18 + seed, 15, 3)))) for seed in (21, 22, 23)]
    alone = [vit.post("/v1/classifications", {"image": b, "top_k": 100}).json()["data"][0]["predictions"]
             for b in blobs]
    assert alone[0] != alone[1] != alone[2], "the pictures must be told apart"
    both = vit.post("/v1/classifications", {"image": blobs[0], "images": blobs[1:], "top_k": 100}).json()["data"]
    assert [d["index"] for d in both] == [0, 1, 2]
    for item, want in zip(both, alone, strict=True):
        assert [p["label"] for p in item["predictions"]] == [p["label"] for p in want]
        assert [p["score"] for p in item["predictions"]] == pytest.approx([p["score"] for p in want], abs=1e-6)


def test_base64_wrapped_in_lines_is_read_as_the_same_image(vit):
    """MIME base64 (what `base64` and `openssl base64` write without -w0) breaks its text into lines: the image
    is the same, on classifications and embeddings, plain or as a data URL; a character outside base64 is still
    refused."""
    import base64 as b64lib

    blob = png(noise(31, (17, 19, 3)))
    flat, wrapped = b64(blob), b64lib.encodebytes(blob).decode()
    assert "\n" in wrapped.strip()
    want = vit.post("/v1/classifications", {"image": flat, "top_k": 3}).json()["data"][0]["predictions"]
    for image in (wrapped, "data:image/png;base64," + wrapped.replace("\n", "\r\n")):
        got = vit.post("/v1/classifications", {"image": image, "top_k": 3}).json()["data"][0]["predictions"]
        assert got == want
    vectors = [vit.post("/v1/embeddings", {"model": "vit", "image": image}).json()["data"][0]["embedding"]
               for image in (flat, wrapped)]
    assert vectors[0] == vectors[1]
    vit.post("/v1/classifications", {"image": flat[:-8] + "!" + flat[-7:]}, status=400)


# ------------------------------------------------------------------------------------------------------------
# /v2: the classifier's tensors and their datatypes
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("datatype", ["FP64", "INT32", "BYTES"])
def test_oip_pixels_of_another_datatype_than_fp32_are_a_protocol_400(vit, datatype):
    """The metadata says FP32 for `pixels`: the right shape in another datatype is refused in the protocol's
    error shape, not read as FP32; the same tensor as FP32 is classified."""
    meta = vit.request("GET", "/v2/models/vit").json()
    shape = [1, *next(i for i in meta["inputs"] if i["name"] == "pixels")["shape"][1:]]
    size = shape[1] * shape[2] * shape[3]
    tensor = {"name": "pixels", "shape": shape, "data": [0] * size}
    refused = vit.post("/v2/models/vit/infer", {"inputs": [tensor | {"datatype": datatype}]}, status=400).json()
    assert set(refused) == {"error"} and "FP32" in refused["error"]
    taken = vit.post("/v2/models/vit/infer", {"inputs": [tensor | {"datatype": "FP32"}]}).json()
    assert {o["name"] for o in taken["outputs"]} == {"label", "probabilities"}


def test_oip_images_of_another_datatype_than_bytes_are_a_protocol_400(vit):
    """`image` is BYTES (base64 strings): an image tensor declared as another datatype is refused."""
    blob = b64(png(noise(24, (16, 16, 3))))
    refused = vit.post("/v2/models/vit/infer", {"inputs": [{"name": "image", "datatype": "FP32", "shape": [1],
                                                             "data": [blob]}]}, status=400).json()
    assert set(refused) == {"error"} and "BYTES" in refused["error"]


# ------------------------------------------------------------------------------------------------------------
# /v1/attention pictures: a grid whose last row is not full
# ------------------------------------------------------------------------------------------------------------
def test_a_heatmap_grid_of_five_panels_draws_the_fifth_on_a_second_row():
    """Four panels to a row: a fifth map (a layer and head more than a row holds) is drawn on a second row,
    under the first panel, not left off the picture."""
    tokens = ["a", "b", "c"]
    maps = [AttentionMap("decoder.self", layer, tokens, tokens,
                         torch.softmax(torch.randn(1, 3, 3, generator=torch.Generator().manual_seed(layer)), -1))
            for layer in range(5)]

    def picture(chosen: list[AttentionMap]) -> np.ndarray:
        return np.asarray(Image.open(io.BytesIO(heatmap_grid(chosen, [0]))).convert("RGB"))

    row, fifth, sheet = picture(maps[:4]), picture(maps[4:]), picture(maps)
    assert sheet.shape == (2 * row.shape[0], row.shape[1], 3)
    assert np.array_equal(sheet[:row.shape[0]], row)
    assert np.array_equal(sheet[row.shape[0]:, :fifth.shape[1]], fifth)


# ------------------------------------------------------------------------------------------------------------
# File jobs: the upload
# ------------------------------------------------------------------------------------------------------------
def test_a_file_of_exactly_max_file_bytes_is_taken_and_one_byte_more_is_413(mt, monkeypatch):  # noqa: F811
    """--max-file-bytes is the largest file taken: a file of exactly that many bytes starts a job, one byte
    more is a 413 naming the limit."""
    limit = 1024  # the smallest --max-file-bytes
    monkeypatch.setattr(mt.app.state.settings, "max_file_bytes", limit)
    line = b"hello world.\n"
    at_limit = line * (limit // len(line)) + b"x" * (limit % len(line))
    assert len(at_limit) == limit

    async def go(c: httpx.AsyncClient) -> tuple[httpx.Response, httpx.Response]:
        taken = await c.post("/v1/translations/files", files={"file": ("a.txt", at_limit)}, data={"model": "mt"})
        if taken.status_code == 202:
            await c.delete(f"/v1/translations/jobs/{taken.json()['id']}")  # not needed to its end
        over = await c.post("/v1/translations/files", files={"file": ("a.txt", at_limit + b"x")},
                            data={"model": "mt"})
        return taken, over

    taken, over = session(mt, go)
    assert taken.status_code == 202, taken.text
    assert over.status_code == 413 and over.json()["error"]["code"] == "file_too_large"
    assert str(limit) in over.json()["error"]["message"]


@pytest.mark.parametrize("path", ["C:\\Users\\me\\report.txt", "docs\\2024\\report.txt", "../../notes/report.txt"])
def test_an_upload_named_by_a_path_keeps_only_its_base_name(mt, path):  # noqa: F811
    """Browsers on Windows (and hostile clients) send a path as the file name: the job, and the download's
    Content-Disposition, name the file by its base name alone, whichever separator the path used."""
    async def go(c: httpx.AsyncClient) -> tuple[dict, dict, httpx.Response]:
        started, state = await to_the_end(mt, c, path, b"hello world.\n", model="mt", num_beams="1")
        return started, state, await c.get(state["download_url"])

    started, state, download = session(mt, go)
    assert started["filename"] == state["filename"] == "report.txt"
    assert state["status"] == "succeeded", state
    assert 'filename="report.txt"' in download.headers["content-disposition"]


# ------------------------------------------------------------------------------------------------------------
# File jobs: the form's options
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cache", ["0", "no", "False"])
def test_each_way_of_saying_no_to_the_cache_translates_a_file_again(mt, cache):  # noqa: F811
    """`cache` in a job's form is off as "false", "0" or "no", in any case: a file the memory holds is translated
    again by the engine, and the memory is not read."""
    data = b"good morning where is the station.\nthe house is small.\n"

    def hits() -> float:
        return mt.metric("tserve_translation_memory_hits_total", "mt")

    async def go(c: httpx.AsyncClient) -> tuple[float, float, dict]:
        await to_the_end(mt, c, "warm.txt", data, model="mt", num_beams="1")  # the memory holds it now
        before, tokens = hits(), mt.metric("tserve_generated_tokens_total", "mt")
        _, state = await to_the_end(mt, c, "again.txt", data, model="mt", num_beams="1", cache=cache)
        assert mt.metric("tserve_generated_tokens_total", "mt") > tokens, "the engine translated nothing"
        return before, hits(), state

    before, after, state = session(mt, go)
    assert state["status"] == "succeeded", state
    assert after == before


# ------------------------------------------------------------------------------------------------------------
# File jobs: their states
# ------------------------------------------------------------------------------------------------------------
LONG = ("the quick brown fox jumps.\nhello world good morning.\n" * 150).encode()  # 300 sentences


def test_a_job_read_while_it_runs_says_running(mt, monkeypatch):  # noqa: F811
    """A job whose first sentences are done and whose last are not reads "running" (not "queued") with its
    progress; cancelled, it reads "cancelled". The translator's steps are slowed until the job has been read, so
    that no machine is fast enough to finish the job first."""
    released = threading.Event()
    for worker in mt.registry.models["mt"].workers:
        monkeypatch.setattr(worker, "step", worker.step)  # put back after the test
        slow_steps(worker, 0.05, released)

    async def go(c: httpx.AsyncClient) -> tuple[dict, dict]:
        resp = await c.post("/v1/translations/files", files={"file": ("long.txt", LONG)},
                            data={"model": "mt", "num_beams": "1", "cache": "false"})
        assert resp.status_code == 202, resp.text
        assert resp.json()["status"] == "queued"
        job = mt.app.state.file_jobs.jobs[resp.json()["id"]]
        await until(lambda: job.done_segments > 0, 30)
        state = (await c.get(f"/v1/translations/jobs/{job.id}")).json()
        return state, (await c.delete(f"/v1/translations/jobs/{job.id}")).json()

    try:
        running, cancelled = session(mt, go)
    finally:
        released.set()
    assert 0 < running["done_segments"] < running["total_segments"], "the job ended before it was read"
    assert running["status"] == "running", running
    assert cancelled["status"] == "cancelled"


def test_deleting_a_finished_job_deletes_it_and_its_file(mt):  # noqa: F811
    """DELETE on a job that has succeeded answers its last state, then the job and its file are gone: its state
    and its download are 404, and its file is no longer in --file-dir."""
    async def go(c: httpx.AsyncClient) -> tuple[dict, Path, dict, list[int]]:
        _, state = await to_the_end(mt, c, "done.txt", b"hello world.\n", model="mt", num_beams="1")
        stored = mt.app.state.file_jobs.jobs[state["id"]].path
        assert stored is not None and stored.exists()
        deleted = (await c.delete(f"/v1/translations/jobs/{state['id']}")).json()
        after = [(await c.get(f"/v1/translations/jobs/{state['id']}{tail}")).status_code for tail in ("", "/file")]
        return state, stored, deleted, after

    state, stored, deleted, after = session(mt, go)
    assert state["status"] == deleted["status"] == "succeeded"
    assert after == [404, 404]
    assert not stored.exists()


def test_a_job_the_engine_refused_fails_with_the_errors_type_and_code(mt, monkeypatch):  # noqa: F811
    """A job whose sentences the engine refuses (a queue that stayed full) ends "failed" with the error a text
    request would have got: its message, type and code, not a generic server error."""
    async def refused(*args: Any, **kwargs: Any) -> list[str]:
        raise overloaded("the queue stayed full")

    monkeypatch.setattr(ServedTranslator, "translate_blocks", refused)

    async def go(c: httpx.AsyncClient) -> tuple[dict, int]:
        _, state = await to_the_end(mt, c, "a.txt", b"hello world.\n", model="mt", num_beams="1")
        return state, (await c.get(state["download_url"])).status_code

    state, download = session(mt, go)
    assert state["status"] == "failed"
    assert state["error"] == {"message": "the queue stayed full", "type": "server_overloaded",
                              "code": "rate_limit_exceeded"}
    assert download == 409


def test_a_pivoted_job_announces_both_hops_sentences_from_its_start(pivot):  # noqa: F811
    """A de → fr job through English counts the sentences of both hops: the 202 that starts it already says
    the total it ends with (the second hop reads a line for each line the first wrote), so that a client's
    progress bar does not jump back when the second hop starts."""
    async def go(c: httpx.AsyncClient) -> tuple[dict, dict]:
        return await to_the_end(pivot, c, "a.txt", GERMAN.encode(), source_lang="de", target_lang="fr",
                                cache="false")

    started, state = session(pivot, go)
    assert state["status"] == "succeeded" and state["models"] == ["de-en", "en-fr"]
    assert started["total_segments"] == state["total_segments"] == state["done_segments"] == 4


# ------------------------------------------------------------------------------------------------------------
# File jobs: retention
# ------------------------------------------------------------------------------------------------------------
def test_the_retention_counts_from_a_jobs_end_not_its_start(tmp_path):
    """--file-retention-s is how long a finished file waits: a job that ran longer than the retention is kept
    for the whole retention after it ended, and swept once that has passed; a running job is never swept."""
    jobs = FileJobs(str(tmp_path), retention_s=10.0, metrics=None)
    now = time.time()
    long_run = FileJob("long", "a.txt", None, "en", "de", ["mt"], 1, status="succeeded", created=now - 100,
                       finished=now - 2)
    running = FileJob("running", "b.txt", None, "en", "de", ["mt"], 1, status="running", created=now - 100)
    jobs.jobs.update({"long": long_run, "running": running})
    assert jobs.sweep(now) == 0 and set(jobs.jobs) == {"long", "running"}
    assert jobs.sweep(now + 9) == 1 and set(jobs.jobs) == {"running"}
