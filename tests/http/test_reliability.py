"""Load, disconnect storms and shutdown through a real server process: every request gets a complete,
correct answer or a clean 429/503, nothing is left running, memory does not grow, SIGTERM drains."""

from __future__ import annotations

import asyncio
import base64
import json
import random
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import factories
from tests.helpers.fixture_training import assert_varied
from tests.helpers.server import ServerProcess, rss_kib

PROMPTS = ["Hello world", "Good morning", "The quick brown fox", "Where is the station", "Once upon a time",
           "I don't know", "The weather is nice", "Three daughters"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return factories.tiny_model_set(tmp_path_factory.mktemp("reliability"))


def start(checkpoints: dict[str, Path], log: Path, *extra: str) -> ServerProcess:
    args = factories.model_flags(checkpoints)
    return ServerProcess([*args, "--max-running-requests", "8", "--max-queue", "24", *extra], log).wait_ready()


class Tally:
    def __init__(self) -> None:
        self.ok = self.refused = self.disconnected = 0
        self.failures: list[str] = []


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict, leave_after: int | None) -> str | None:
    """Text of a streamed completion; None when this client leaves early on purpose."""
    text, chunks = "", 0
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            raise httpx.HTTPStatusError(str(resp.status_code), request=resp.request, response=resp)
        lines = [line async for line in _lines(resp, leave_after)]
    if leave_after is not None and len(lines) >= leave_after and lines[-1] != "data: [DONE]":
        return None
    assert lines[-1] == "data: [DONE]", lines[-3:]
    for line in lines[:-1]:
        chunk = json.loads(line[6:])
        text += "".join(c["text"] for c in chunk["choices"])
        chunks += 1
    return text


async def _lines(resp: httpx.Response, leave_after: int | None):
    n = 0
    async for line in resp.aiter_lines():
        if line.startswith("data: "):
            yield line
            n += 1
            if leave_after is not None and n >= leave_after:
                return


async def one_client(rng: random.Random, client: httpx.AsyncClient, url: str, expected: dict, tally: Tally,
                     deadline: float) -> None:
    while time.monotonic() < deadline:
        kind = rng.choice(["complete", "stream", "leave", "translate", "classify", "abandon"])
        prompt = rng.choice(PROMPTS)
        try:
            if kind == "abandon":  # a non-streaming translation or classification whose client gives up
                body = ("/v1/translations", {"input": prompt, "num_beams": 2, "max_tokens": 8}) if rng.random() < 0.5 \
                    else ("/v1/classifications", {"image": expected["image"]})
                try:
                    await asyncio.wait_for(client.post(url + body[0], json=body[1]), timeout=rng.uniform(0.005, 0.05))
                except TimeoutError:
                    tally.disconnected += 1
                    continue
            elif kind in ("complete", "stream", "leave"):
                body = {"model": "lm", "prompt": prompt, "max_tokens": 16, "temperature": 0}
                if kind == "complete":
                    resp = await client.post(f"{url}/v1/completions", json=body)
                    resp.raise_for_status()
                    got = resp.json()["choices"][0]["text"]
                else:
                    got = await stream_completion(client, f"{url}/v1/completions", body | {"stream": True},
                                                  rng.randint(1, 3) if kind == "leave" else None)
                    if got is None:
                        tally.disconnected += 1
                        continue
                if got != expected[("lm", prompt)]:
                    tally.failures.append(f"{kind} {prompt!r}: {got!r} != {expected[('lm', prompt)]!r}")
            elif kind == "translate":
                resp = await client.post(f"{url}/v1/translations",
                                         json={"input": prompt, "num_beams": rng.choice([1, 2]), "max_tokens": 8})
                resp.raise_for_status()
                got = resp.json()["data"][0]["translation"]
                beams = json.loads(resp.request.content)["num_beams"]
                if got != expected[("mt", prompt, beams)]:
                    tally.failures.append(f"translate {prompt!r} beams {beams}: {got!r}")
            else:
                resp = await client.post(f"{url}/v1/classifications", json={"image": expected["image"], "top_k": 1})
                resp.raise_for_status()
                if resp.json()["data"][0]["predictions"][0]["label"] != expected["label"]:
                    tally.failures.append("classification label changed")
            tally.ok += 1
        except httpx.HTTPStatusError as exc:
            status = exc.response.status_code
            if status in (429, 503) and "retry-after" in exc.response.headers:
                tally.refused += 1
                await asyncio.sleep(0.05)
            else:
                tally.failures.append(f"{kind}: HTTP {status} {exc.response.text[:200]}")


def expectations(url: str) -> dict:
    expected: dict = {}
    with httpx.Client(timeout=60) as c:
        for p in PROMPTS:
            body = {"model": "lm", "prompt": p, "max_tokens": 16, "temperature": 0}
            expected[("lm", p)] = c.post(f"{url}/v1/completions", json=body).json()["choices"][0]["text"]
            for beams in (1, 2):
                resp = c.post(f"{url}/v1/translations", json={"input": p, "num_beams": beams, "max_tokens": 8})
                expected[("mt", p, beams)] = resp.json()["data"][0]["translation"]
        png = factories_png()
        expected["image"] = base64.b64encode(png).decode()
        resp = c.post(f"{url}/v1/classifications", json={"image": expected["image"], "top_k": 1})
        expected["label"] = resp.json()["data"][0]["predictions"][0]["label"]
    return expected


def factories_png() -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (40, 30), (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


def soak(url: str, expected: dict, clients: int, seconds: float, seed: int) -> Tally:
    tally = Tally()

    async def go() -> None:
        limits = httpx.Limits(max_connections=clients + 8)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            deadline = time.monotonic() + seconds
            await asyncio.gather(*(one_client(random.Random(seed * 1000 + i), client, url, expected, tally,
                                              deadline) for i in range(clients)))

    asyncio.run(go())
    return tally


@pytest.mark.slow  # two rounds of 12 s under 60 clients: `make test-slow`
def test_soak_mixed_load_with_disconnects(checkpoints, tmp_path):
    srv = start(checkpoints, tmp_path / "server.log")
    try:
        expected = expectations(srv.url)
        assert_varied([expected[("lm", p)] for p in PROMPTS], min_distinct=1.0)
        assert_varied([expected[("mt", p, 2)] for p in PROMPTS], min_distinct=0.7)
        rounds = []
        for seed in (1, 2):
            tally = soak(srv.url, expected, clients=60, seconds=12, seed=seed)
            assert not tally.failures, tally.failures[:5]
            assert tally.ok > 100 and tally.disconnected > 0
            gauges = [(m, model) for model in ("lm", "mt") for m in ("tserve_kv_slots_in_use", "tserve_queue_depth",
                                                                     "tserve_running_requests",
                                                                     "tserve_kv_cache_blocks_in_use")]
            gauges += [(m, "vit") for m in ("tserve_queue_depth", "tserve_running_requests")]
            for _ in range(100):  # everything settles: no row, queue or running request left
                if all(srv.metric(*g) == 0 for g in gauges):
                    break
                time.sleep(0.05)
            assert {g: srv.metric(*g) for g in gauges} == {g: 0 for g in gauges}
            # The batcher's worker is alive: a classification still gets its answer.
            resp = httpx.post(srv.url + "/v1/classifications", json={"image": expected["image"], "top_k": 1},
                              timeout=30)
            assert resp.json()["data"][0]["predictions"][0]["label"] == expected["label"]
            rounds.append((tally, rss_kib(srv.proc.pid)))
        text = httpx.get(srv.url + "/metrics").text
        assert 'status="500"' not in text and 'status="502"' not in text
        growth = rounds[1][1] - rounds[0][1]
        assert growth < 50 * 1024, f"RSS grew by {growth} KiB between two equal rounds"
        print(f"soak: {[(t.ok, t.refused, t.disconnected) for t, _ in rounds]} ok/refused/left, "
              f"RSS {rounds[0][1]} -> {rounds[1][1]} KiB")
    finally:
        srv.stop()


def test_sigterm_finishes_in_flight_requests_and_exits_0(checkpoints, tmp_path):
    # Steps of at least 50 ms: the 60-token streams run for 3 s, long enough to watch the drain.
    srv = ServerProcess([*factories.model_flags(checkpoints), "--max-running-requests", "8"],
                        tmp_path / "server.log", step_delay_s=0.05).wait_ready()
    # logprobs: every token a chunk of its own (tokens waiting for a reader are otherwise joined), so that 60
    # chunks say that all 60 tokens came.
    body = {"model": "lm", "prompt": "Hello", "max_tokens": 60, "temperature": 0, "ignore_eos": True,
            "stream": True, "logprobs": 0}
    seen: dict = {"finished": 0}

    async def go() -> list[list[str]]:
        async with httpx.AsyncClient(timeout=120) as client:
            async def one() -> list[str]:
                lines = []
                async with client.stream("POST", srv.url + "/v1/completions", json=body) as resp:
                    async for line in resp.aiter_lines():
                        if line.startswith("data: "):
                            lines.append(line)
                            if len(lines) == 2 and "sent" not in seen:
                                seen["sent"] = True
                                srv.proc.send_signal(signal.SIGTERM)
                seen["finished"] += 1
                return lines

            async def while_draining() -> None:
                while "sent" not in seen:
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.2)
                seen["readyz"] = (await client.get(srv.url + "/readyz")).status_code
                new = await client.post(srv.url + "/v1/completions", json={"model": "lm", "prompt": "Hi",
                                                                           "max_tokens": 2})
                seen["new"] = (new.status_code, new.headers.get("retry-after"), new.json()["error"]["message"])
                seen["streams_done_meanwhile"] = seen["finished"]

            *streams, _ = await asyncio.gather(*(one() for _ in range(3)), while_draining())
            return streams

    try:
        streams = asyncio.run(go())
        code = srv.proc.wait(timeout=60)
    finally:
        srv.stop()
    assert code == 0, srv.log()
    assert seen["readyz"] == 503
    status, retry_after, message = seen["new"]
    assert status == 503 and retry_after and "shutting down" in message
    assert seen["streams_done_meanwhile"] == 0  # all of the above happened while the streams ran
    for lines in streams:
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length", lines[-3:]
        assert len(lines) == 60 + 1
