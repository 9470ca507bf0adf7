"""A key's requests in flight (`--max-requests-per-key`) are given back however a request ends: success, a 4xx,
an exception in a route (500), a client hanging up mid-stream or mid-request, a timeout; on /v1 (the
middleware's count) and LibreTranslate's routes (the key in the body, counted by the route). With a limit of
one, the key's next request is admitted (not 429) after each."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.helpers import factories
from tests.helpers.server import ServerProcess
from tserve.service.app import build_app
from tserve.service.settings import Settings

KEY = "sk-slots-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("slots")
    return {"lm": factories.tiny_lm_dir(root / "lm"), "mt": factories.tiny_mt_dir(root / "mt", languages=("en", "de"))}


def _server(checkpoints, log, *extra: str) -> ServerProcess:
    return ServerProcess([*factories.model_flags(checkpoints), "--max-requests-per-key", "1", *extra], log,
                         env={"TSERVE_API_KEYS": KEY}).wait_ready()


def _admitted(server) -> None:
    """The key's next request is admitted within a few seconds (a hang-up is noticed at the next poll)."""
    deadline = time.monotonic() + 10
    while True:
        status = httpx.get(server.url + "/v1/models", headers=AUTH, timeout=30).status_code
        if status != 429 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert status == 200, "the key's slot was not given back"


def test_every_ending_gives_the_slot_back(checkpoints, tmp_path):
    server = _server(checkpoints, tmp_path / "server.log")
    try:
        url = server.url
        ok = httpx.post(url + "/v1/completions", json={"model": "lm", "prompt": "The", "max_tokens": 3}, headers=AUTH)
        assert ok.status_code == 200
        _admitted(server)
        bad = httpx.post(url + "/v1/completions", json={"model": "lm", "prompt": "The", "max_tokens": 0}, headers=AUTH)
        assert bad.status_code == 400
        _admitted(server)
        # A stream left after its first chunk.
        with httpx.stream("POST", url + "/v1/completions", headers=AUTH, timeout=60,
                          json={"model": "lm", "prompt": "The", "max_tokens": 100, "stream": True,
                                "ignore_eos": True}) as resp:
            assert resp.status_code == 200
            next(resp.iter_lines())
        _admitted(server)
        # LibreTranslate: the key in the body; success, an unsupported pair, a hang-up mid-request.
        body = {"q": "the quick brown fox", "source": "en", "target": "de", "api_key": KEY}
        assert httpx.post(url + "/translate", json=body, timeout=60).status_code == 200
        _admitted(server)
        assert httpx.post(url + "/translate", json=body | {"target": "fr"}, timeout=60).status_code == 400
        _admitted(server)
        long = body | {"q": [" ".join(["the quick brown fox jumps over the lazy dog"] * 3)] * 16}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(url + "/translate", json=long, timeout=0.05)
        _admitted(server)
    finally:
        server.stop()


def test_a_timeout_gives_the_slot_back(checkpoints, tmp_path):
    server = _server(checkpoints, tmp_path / "server.log", "--request-timeout-s", "0.001")
    try:
        late = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=60,
                          json={"model": "lm", "prompt": "The", "max_tokens": 100, "ignore_eos": True})
        assert late.status_code == 504
        _admitted(server)
    finally:
        server.stop()


def test_an_exception_in_a_route_gives_the_slot_back():
    app = build_app(Settings(api_keys=[KEY], max_requests_per_key=1), load_models=False)

    @app.get("/boom")
    async def boom() -> dict:
        raise RuntimeError("a bug in a route")

    async def go() -> tuple[int, int]:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            failed = await c.get("/boom", headers=AUTH)
            return failed.status_code, (await c.get("/v1/models", headers=AUTH)).status_code

    assert asyncio.run(go()) == (500, 200)
