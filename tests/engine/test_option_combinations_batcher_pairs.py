"""The dynamic batchers (image classification, embeddings) where requests with different options share one batch:
classifications of images of other sizes and modes (RGBA, greyscale, palette, an EXIF-turned JPEG) with other
`top_k`, several images per request; embeddings of texts of other lengths, in other languages and encodings;
an urgent request among earlier ones when the batch is smaller than what waits; a client that leaves while its
items wait; --max-queue and --batch-max-size with several items per request; an over-long input beside another
client's; a bfloat16 classifier's scores. The reference is each request alone (a batch of its own), which must
give the same numbers, and a failure or a departure must not change the others. Each batch is formed on
purpose: the batcher's first batch is held until every request's items wait behind it. Every app runs in this
process (`httpx.ASGITransport`) on tiny models, so that the tests take seconds."""

from __future__ import annotations

import asyncio
import base64
import io
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from tests.helpers import factories
from tests.helpers.in_process import InProcessApp
from tests.helpers.polling import until
from tserve.service.engine.batcher import DynamicBatcher
from tserve.service.engine.request import QueueFull
from tserve.service.metrics import Metrics

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
BATCH = 4


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    root = tmp_path_factory.mktemp("batcher-pairs")
    served = InProcessApp({"vit": factories.tiny_vit_dir(root / "vit"), "lm": FIXTURES / "tiny-lm",
                           "nllb": FIXTURES / "hf-nllb"},
                          batch_max_size=BATCH, batch_max_wait_ms=50, max_queue=3)
    yield served
    served.stop()


def png(image: Image.Image, **save) -> bytes:  # noqa: ANN003 - Pillow's save options
    buf = io.BytesIO()
    image.save(buf, format="PNG", **save)
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def noise(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, shape, dtype=np.uint8)


def images() -> list[bytes]:
    """Images of other sizes and modes: RGB, RGBA with transparency, greyscale, palette, an EXIF-turned JPEG."""
    rgba = noise(2, (20, 26, 4))
    rgba[:5, :, 3] = 0
    exif = Image.Exif()
    exif[0x0112] = 6
    jpeg = io.BytesIO()
    Image.fromarray(noise(5, (30, 18, 3))).transpose(Image.Transpose.ROTATE_90).save(jpeg, format="JPEG",
                                                                                      exif=exif.tobytes())
    return [png(Image.fromarray(noise(1, (28, 28, 3)))), png(Image.fromarray(rgba, "RGBA")),
            png(Image.fromarray(noise(3, (40, 33)), "L")), png(Image.fromarray(noise(4, (17, 21, 3))).quantize(16)),
            jpeg.getvalue()]


async def held_together(app: InProcessApp, batcher, item, bodies: list[tuple[str, dict]], waiting: int,  # noqa: ANN001
                        leave: int | None = None, leaving: int = 0) -> tuple[list[httpx.Response | None], list[list]]:
    """Send `bodies` while the batcher's first batch (of `item`) is held, so that their `waiting` items queue up
    behind it and run as the next batches; `leave`: the index of a request whose client leaves while its `leaving`
    items wait.
    The responses (None for the one that left) and the items of every batch after the held one."""
    gate, batches, run = threading.Event(), [], batcher.batch_fn

    def held(items: list) -> list:
        if not batches:
            batches.append(None)
            gate.wait(10)
        else:
            batches.append(list(items))
        return run(items)

    batcher.batch_fn = held
    try:
        transport = httpx.ASGITransport(app=app.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            first = batcher.enqueue([item])[0]
            await until(lambda: batches)
            sent = []
            for path, body in bodies:  # in this order
                sent.append(asyncio.ensure_future(client.post(path, json=body)))
                before, mine = len(batcher.waiting), sent[-1]
                await until(lambda before=before, mine=mine: len(batcher.waiting) > before or mine.done())
            await until(lambda: len(batcher.waiting) == waiting)
            if leave is not None:
                sent[leave].cancel()
                await until(lambda: sum(not r.cancelled for r in batcher.waiting) == waiting - leaving)
            gate.set()
            await batcher.result(first)
            done = await asyncio.gather(*sent, return_exceptions=True)
    finally:
        gate.set()
        batcher.batch_fn = run
    return [None if isinstance(r, BaseException) else r for r in done], batches[1:]


def together(app: InProcessApp, batcher, item, bodies, waiting, leave=None, leaving=0):  # noqa: ANN001, ANN201
    return asyncio.run(held_together(app, batcher, item, bodies, waiting, leave, leaving))


def alone(app: InProcessApp, path: str, body: dict) -> dict:
    return app.post(path, body).json()


def vectors(answer: dict) -> np.ndarray:
    return np.array([d["embedding"] if isinstance(d["embedding"], list)
                     else np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in answer["data"]])


def assert_same_rankings(data: list[dict], want: list[dict]) -> None:
    """The same labels in the same order, the scores within a float's rounding (rows of a batch may sum apart)."""
    assert len(data) == len(want)
    for mine, own in zip(data, want, strict=True):
        assert [p["label"] for p in mine["predictions"]] == [p["label"] for p in own["predictions"]]
        assert [p["score"] for p in mine["predictions"]] == pytest.approx([p["score"] for p in own["predictions"]],
                                                                          abs=1e-6)


def vit_blocker(app: InProcessApp) -> torch.Tensor:
    cfg = app.registry.get("vit", None).loaded.config
    return torch.zeros(cfg.n_channels, cfg.image_size, cfg.image_size)


# ------------------------------------------------------------------------------------------------------------
def test_classifications_of_other_images_and_top_k_sharing_a_batch_equal_each_alone(app):
    """Three requests of one, two and two images (five sizes and modes) with top_k 1, 3 and 4 share one batch:
    each gets its own images' rankings, cut at its own top_k, as it gets them alone."""
    blobs = [b64(b) for b in images()]
    bodies = [{"model": "vit", "image": blobs[0], "top_k": 1},
              {"model": "vit", "images": blobs[1:3], "top_k": 3},
              {"model": "vit", "images": blobs[3:5], "top_k": 4}]
    served = app.registry.get("vit", None)
    got, batches = together(app, served.batcher, vit_blocker(app), [("/v1/classifications", b) for b in bodies], 5)
    assert sorted(map(len, batches)) == [1, 4]  # the five images in a full batch and the rest
    for body, answer in zip(bodies, got, strict=True):
        want = alone(app, "/v1/classifications", body)["data"]
        data = answer.json()["data"]
        assert [len(d["predictions"]) for d in data] == [body["top_k"]] * len(want)
        assert_same_rankings(data, want)


@pytest.mark.parametrize("route", ["/v1/classifications", "/v1/embeddings"])
def test_an_urgent_image_request_goes_into_the_next_batch_before_earlier_ones(app, route):
    """Five images of a normal request wait, then one of an urgent request (a lower priority value): the next
    batch (of four) takes the urgent image first, and both requests get their images' numbers as alone."""
    blobs = [b64(b) for b in images()]
    served = app.registry.get("vit", None)
    batcher = served.batcher if route == "/v1/classifications" else served.embedder
    urgent = b64(png(Image.fromarray(noise(9, (28, 28)), "L")))
    bodies = [{"model": "vit", "images": blobs[:4]}, {"model": "vit", "image": urgent, "priority": -5}]
    got, batches = together(app, batcher, vit_blocker(app), [(route, b) for b in bodies], 5)
    mine = served.classifier.preprocess(base64.b64decode(urgent))
    assert [len(b) for b in batches] == [4, 1]
    assert torch.equal(batches[0][0], mine)
    for body, answer in zip(bodies, got, strict=True):
        if route == "/v1/embeddings":
            np.testing.assert_allclose(vectors(answer.json()), vectors(alone(app, route, body)), atol=1e-6)
        else:
            assert_same_rankings(answer.json()["data"], alone(app, route, body)["data"])


def test_a_request_of_several_images_counts_once_toward_max_queue(app):
    """--max-queue 3 counts client requests, not images: behind a running batch, requests of one, three and one
    image all wait; a fourth request is refused whole (429), none of its images left waiting."""
    blobs = [b64(b) for b in images()]
    served = app.registry.get("vit", None)
    bodies = [{"model": "vit", "image": blobs[0]}, {"model": "vit", "images": blobs[1:4]},
              {"model": "vit", "image": blobs[4]}, {"model": "vit", "images": blobs[3:5]}]
    got, batches = together(app, served.batcher, vit_blocker(app), [("/v1/classifications", b) for b in bodies], 5)
    assert [r.status_code for r in got] == [200, 200, 200, 429]
    assert [len(b) for b in batches] == [4, 1]
    for body, answer in zip(bodies[:3], got[:3], strict=True):
        assert_same_rankings(answer.json()["data"], alone(app, "/v1/classifications", body)["data"])


def test_a_client_that_leaves_while_its_images_wait_changes_nothing_for_the_others(app):
    """Three requests wait behind a running batch; the client of the middle one leaves: its images are never
    computed, and the others get what they get alone."""
    blobs = [b64(b) for b in images()]
    served = app.registry.get("vit", None)
    bodies = [{"model": "vit", "images": blobs[:2]}, {"model": "vit", "images": blobs[2:4]},
              {"model": "vit", "image": blobs[4]}]
    got, batches = together(app, served.embedder, vit_blocker(app), [("/v1/embeddings", b) for b in bodies], 5,
                            leave=1, leaving=2)
    assert got[1] is None and [len(b) for b in batches] == [3]
    for i in (0, 2):
        np.testing.assert_allclose(vectors(got[i].json()), vectors(alone(app, "/v1/embeddings", bodies[i])),
                                   atol=1e-6)


# ------------------------------------------------------------------------------------------------------------
def test_text_embeddings_of_other_lengths_and_formats_sharing_a_batch_equal_each_alone(app):
    """A language model's embeddings: requests of texts of other lengths, as floats and as base64, one batch of
    at most --batch-max-size items: each row is its text's vector alone (padding does not leak)."""
    bodies = [{"model": "lm", "input": ["the cat sat on the mat and the dog sat on the log", "hi"]},
              {"model": "lm", "input": "a b", "encoding_format": "base64"},
              {"model": "lm", "input": ["good morning my friend", "x y z", "where is the station"]}]
    served = app.registry.get("lm", None)
    got, batches = together(app, served.embedder, [1, 2, 3], [("/v1/embeddings", b) for b in bodies], 6)
    assert [len(b) for b in batches] == [BATCH, 6 - BATCH]
    for body, answer in zip(bodies, got, strict=True):
        np.testing.assert_allclose(vectors(answer.json()), vectors(alone(app, "/v1/embeddings", body)), atol=1e-5)


def test_translator_embeddings_in_other_languages_sharing_a_batch_equal_each_alone(app):
    """A multilingual translator's encoder embeddings: texts read in English, in German and in the default
    language share a batch, each row its text's vector alone in its language."""
    bodies = [{"model": "nllb", "input": ["the house is big", "cat"], "source_lang": "en"},
              {"model": "nllb", "input": "das Haus ist gross", "source_lang": "de"},
              {"model": "nllb", "input": "the house", "encoding_format": "base64"}]
    served = app.registry.get("nllb", None)
    got, _ = together(app, served.embedder, [4, 5, 6], [("/v1/embeddings", b) for b in bodies], 4)
    for body, answer in zip(bodies, got, strict=True):
        np.testing.assert_allclose(vectors(answer.json()), vectors(alone(app, "/v1/embeddings", body)), atol=1e-5)


def test_an_over_long_input_in_a_language_fails_alone_beside_another_clients_inputs(app):
    """An input past the translator's source length, read in a language, is refused (400, naming the limit)
    before it reaches the batch; another client's inputs waiting at the same time are embedded as alone."""
    served = app.registry.get("nllb", None)
    limit = served.loaded.config.max_source_len
    bodies = [{"model": "nllb", "input": ["the house is big", "cat"], "source_lang": "en"},
              {"model": "nllb", "input": ["cat", "house " * (limit + 5)], "source_lang": "en"}]
    got, _ = together(app, served.embedder, [4, 5, 6], [("/v1/embeddings", b) for b in bodies], 2)
    assert got[1].status_code == 400 and str(limit) in got[1].json()["error"]["message"]
    np.testing.assert_allclose(vectors(got[0].json()), vectors(alone(app, "/v1/embeddings", bodies[0])), atol=1e-5)


# ------------------------------------------------------------------------------------------------------------
def test_a_bfloat16_classifiers_scores_are_the_float32_softmax_of_its_logits(tmp_path):
    """In bfloat16 the logits are the model's, but the probabilities of a batch of images are computed in float32:
    each score is the float32 softmax of the bfloat16 logits (not a probability rounded to bfloat16)."""
    halved = InProcessApp({"vit": factories.tiny_vit_dir(tmp_path / "vit", seed=4)}, dtype="bfloat16")
    try:
        served = halved.registry.get("vit", None)
        pixels = [served.classifier.preprocess(b) for b in images()]
        ranked = served.classifier.run_batch(pixels)
        with torch.inference_mode():
            want = torch.softmax(served.loaded.model(torch.stack(pixels).to(torch.bfloat16)).float(), dim=-1)
    finally:
        halved.stop()
    for row, predictions in zip(want, ranked, strict=True):
        got = {p.index: p.score for p in predictions}
        assert [got[i] for i in range(len(served.loaded.labels))] == pytest.approx(row.tolist(), abs=1e-7)

def test_an_item_that_raises_in_a_batch_fails_alone_and_the_others_get_their_results():
    """`batch_fn` raising (an item the routes' checks let through, which breaks the model's forward) fails only
    that item: the batch's items run again one by one, and the other clients' items get their results, as the
    engines isolate a failing request."""

    seen: list[list[int]] = []

    def batch_fn(items: list[int]) -> list[int]:
        seen.append(list(items))
        if -1 in items:
            raise IndexError("index 64 is out of bounds")
        return [x * 2 for x in items]

    batcher = DynamicBatcher("b", batch_fn, max_batch_size=4, max_wait_ms=50, max_queue=10, metrics=Metrics())
    batcher.start()

    async def run() -> list:
        return await asyncio.gather(*(batcher.submit(x) for x in [1, -1, 3, 4]), return_exceptions=True)

    try:
        results = asyncio.run(run())
    finally:
        batcher.stop()
    assert results[0] == 2 and results[2:] == [6, 8], results
    assert isinstance(results[1], Exception) and "IndexError" in str(results[1])
    assert any(len(batch) > 1 and -1 in batch for batch in seen)  # they did share a batch


def test_with_max_queue_0_a_request_of_more_items_than_a_batch_runs_on_an_idle_batcher():
    """--max-queue 0 (no waiting room) and a request of more items than --batch-max-size: on an idle batcher it
    runs, its items over consecutive batches (nothing of anyone else waits); while a batch runs it is refused,
    as any request the free rows cannot take, and so is another request while its items wait."""

    gate, inside = threading.Event(), threading.Event()

    def batch_fn(items: list[int]) -> list[int]:
        inside.set()
        assert gate.wait(10)
        return [x * 2 for x in items]

    batcher = DynamicBatcher("b", batch_fn, max_batch_size=2, max_wait_ms=1, max_queue=0, metrics=Metrics())
    batcher.start()

    async def run() -> list[int]:
        big = batcher.enqueue([1, 2, 3, 4, 5])  # idle: taken, 5 items for batches of 2
        with pytest.raises(QueueFull):
            batcher.enqueue([9])  # its items wait: no room for another request
        await asyncio.to_thread(inside.wait, 10)
        with pytest.raises(QueueFull):
            batcher.enqueue([7, 8, 9])  # a batch runs: refused
        gate.set()
        return [await batcher.result(r) for r in big]

    try:
        assert asyncio.run(run()) == [2, 4, 6, 8, 10]
    finally:
        gate.set()
        batcher.stop()
