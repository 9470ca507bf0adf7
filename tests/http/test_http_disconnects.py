"""Clients that give up, through a real server whose engine steps (50 ms) and classification batches
(200 ms) are slowed by a test-only hook, so that requests are still running when their clients leave: every
route frees what the request held at once, and nothing is computed for nobody."""

from __future__ import annotations

import asyncio
import base64
import io
import time

import httpx
import pytest
from PIL import Image

from tests.helpers import factories
from tests.helpers.fixture_training import lexicon_sentences
from tests.helpers.server import ServerProcess


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("disconnects")
    return {"lm": factories.tiny_lm_dir(root / "lm"), "mt": factories.tiny_mt_dir(root / "mt"),
            "vit": factories.tiny_vit_dir(root / "vit")}


def post(server, path: str, **kwargs) -> httpx.Response:
    return httpx.post(server.url + path, timeout=60, **kwargs)


def png_bytes() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (40, 30), (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def slow_server(checkpoints, tmp_path_factory):
    """Each engine step takes at least 50 ms, so 100 tokens take 5 s: only a cancel frees a slot sooner; each
    classification batch takes at least 200 ms."""
    args = factories.model_flags({k: checkpoints[k] for k in ("lm", "mt", "vit")}) + ["--max-running-requests", "8"]
    srv = ServerProcess(args, tmp_path_factory.mktemp("slow-logs") / "server.log", step_delay_s=0.05,
                        hooks={"TSERVE_TEST_BATCH_DELAY_S": "0.2"}).wait_ready()
    yield srv
    srv.stop()


def test_disconnect_frees_slot(slow_server):
    server = slow_server
    body = {"model": "lm", "prompt": "Hello", "max_tokens": 100, "temperature": 0, "ignore_eos": True,
            "stream": True}

    async def start_and_leave() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            async with client.stream("POST", server.url + "/v1/completions", json=body) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        break  # the first token arrived: leave while generation is running

    async def disconnect_all() -> None:
        await asyncio.gather(*(start_and_leave() for _ in range(4)))

    asyncio.run(disconnect_all())
    left = time.monotonic()
    for _ in range(50):
        if server.metric("tserve_kv_slots_in_use", "lm") == 0 and server.metric("tserve_running_requests", "lm") == 0:
            break
        time.sleep(0.05)
    assert server.metric("tserve_kv_slots_in_use", "lm") == 0
    assert server.metric("tserve_running_requests", "lm") == 0
    generated = server.metric("tserve_generated_tokens_total", "lm")
    assert time.monotonic() - left < 3.5  # freed by the hang-up, not by running to the end (5 s)
    assert generated < 4 * 50
    time.sleep(0.3)
    assert server.metric("tserve_generated_tokens_total", "lm") == generated  # nothing runs on


@pytest.mark.parametrize("route", ["/v1/translations", "/v2/models/mt/infer"])
def test_non_streaming_translations_are_freed_when_their_clients_leave(slow_server, route):
    """6 clients ask for 4-beam translations of long inputs without streaming (24 rows on 8: two run, four
    wait) and hang up after 0.5 s; at 50 ms a step the translations would hold rows for 5 s and more. Within
    2.5 s of the hang-up (a fraction of that on an idle machine) no row is in use, nothing runs or waits, and no
    token is generated any more."""
    server = slow_server
    texts = lexicon_sentences(6, seed=21, min_words=22, max_words=26)

    def body(text: str) -> dict:
        if route.startswith("/v2"):  # the checkpoint's 2 beams
            return {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [text]}]}
        return {"model": "mt", "input": text, "num_beams": 4}

    async def ask_and_leave(text: str) -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(client.post(server.url + route, json=body(text)), timeout=0.5)

    async def all_leave() -> None:
        await asyncio.gather(*(ask_and_leave(t) for t in texts))

    before = server.metric("tserve_generated_tokens_total", "mt", default=0.0)
    asyncio.run(all_leave())
    left = time.monotonic()
    gauges = ("tserve_kv_slots_in_use", "tserve_running_requests", "tserve_queue_depth")
    while time.monotonic() - left < 5 and any(server.metric(g, "mt") for g in gauges):
        time.sleep(0.05)
    assert {g: server.metric(g, "mt") for g in gauges} == {g: 0 for g in gauges}
    assert time.monotonic() - left < 2.5  # freed by the hang-up, not by running to the end (5 s and more)
    generated = server.metric("tserve_generated_tokens_total", "mt")
    assert generated > before  # they were running
    time.sleep(0.3)
    assert server.metric("tserve_generated_tokens_total", "mt") == generated


def test_abandoned_classifications_are_not_computed(slow_server):
    """4 clients send 32 images each (8 batches of 16 at 200 ms a batch) and hang up after 0.3 s; a lone image
    sent then is answered once the server has dropped their images, having classified at most the batches
    that ran before it noticed (it looks every 0.25 s), not all of theirs. Counted, not timed: a loaded
    machine may notice later, but never runs the abandoned images."""
    server = slow_server
    image = base64.b64encode(png_bytes()).decode()
    classified_before = server.metric("tserve_images_classified_total", "vit", 0)

    async def ask_and_leave() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(client.post(server.url + "/v1/classifications",
                                                   json={"model": "vit", "images": [image] * 32}), timeout=0.3)

    async def all_leave() -> None:
        await asyncio.gather(*(ask_and_leave() for _ in range(4)))

    asyncio.run(all_leave())
    resp = post(server, "/v1/classifications", json={"model": "vit", "image": image})
    assert resp.status_code == 200, resp.text
    classified = server.metric("tserve_images_classified_total", "vit") - classified_before
    assert 1 <= classified <= 64 + 1, f"{classified:.0f} of the 128 abandoned images were classified"
