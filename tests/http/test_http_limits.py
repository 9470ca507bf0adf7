"""Limits, API keys and faults through real `tserve serve` processes, as docs/API.md, docs/SETTINGS.md and
docs/RELIABILITY.md describe them: --max-model-len, --max-input-chars and --max-tokens-limit each refuse exactly
above their value (a server without them takes the same requests); API keys guard /v1/attention and the viewer's
calls; and, with faults injected by tests/helpers/hooked_server.py (no public setting), /readyz while the models
load and while the server drains after SIGTERM, 504 from --request-timeout-s and 503 + Retry-After when the
device runs out of memory."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from urllib.parse import urljoin

import httpx
import pytest

from tests.helpers import factories, fixture_training
from tests.helpers.in_process import asgi_request
from tests.helpers.server import ServerProcess
from tserve.model import checkpoint
from tserve.service.app import build_app
from tserve.service.settings import Settings

KEY = "sk-limits-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN, MAX_INPUT_CHARS, MAX_TOKENS_LIMIT = 50, 60, 20
TIMEOUT_S = 3.0
OOM, SLOW = "Kaboom", "Slowly"  # prompts holding these words fail / crawl in tests/helpers/hooked_server.py
SLOW_STEP_S = 0.1


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("limits")
    return {"lm": factories.tiny_lm_dir(root / "lm"), "mt": factories.tiny_mt_dir(root / "mt")}


@pytest.fixture(scope="module")
def servers(checkpoints, tmp_path_factory):
    """Three processes, started together (their start-up overlaps): `limited` (the three limits, API keys,
    the viewer public), `faulty` (no limits; loading held until its gate file exists; OOM and SLOW prompts)
    and `draining` (SLOW prompts; stopped by its test)."""
    logs = tmp_path_factory.mktemp("limits-logs")
    flags = factories.model_flags(checkpoints)
    gate = logs / "load-gate"
    procs = {
        "limited": ServerProcess(flags + [
            "--max-model-len", str(MAX_MODEL_LEN), "--max-input-chars", str(MAX_INPUT_CHARS),
            "--max-tokens-limit", str(MAX_TOKENS_LIMIT), "--public-paths", "/healthz,/readyz,/metrics,/viewer",
        ], logs / "limited.log", env={"TSERVE_API_KEYS": KEY}),
        "faulty": ServerProcess(flags + ["--request-timeout-s", str(TIMEOUT_S)], logs / "faulty.log", hooks={
            "TSERVE_TEST_LOAD_GATE": str(gate), "TSERVE_TEST_OOM_MARKER": OOM,
            "TSERVE_TEST_SLOW_MARKER": SLOW, "TSERVE_TEST_SLOW_STEP_S": str(SLOW_STEP_S)}),
        "draining": ServerProcess(["--model", f"lm={checkpoints['lm']}"], logs / "draining.log", hooks={
            "TSERVE_TEST_SLOW_MARKER": SLOW, "TSERVE_TEST_SLOW_STEP_S": "0.04"}),
    }
    procs["faulty"].gate = gate
    yield procs
    gate.touch()  # a server still loading would wait for its models before it exits
    for srv in procs.values():
        srv.stop()


@pytest.fixture(scope="module")
def limited(servers):
    return servers["limited"].wait_ready()


@pytest.fixture(scope="module")
def loading(servers):
    """What the faulty server answered while its models were (held) loading; then it is let load."""
    srv = servers["faulty"]
    deadline = time.monotonic() + 120
    while True:
        assert srv.proc.poll() is None and time.monotonic() < deadline, srv.log()
        try:
            first = httpx.get(srv.url + "/readyz", timeout=5)
            break
        except httpx.TransportError:
            time.sleep(0.05)
    seen = {
        "readyz": [first] + [httpx.get(srv.url + "/readyz", timeout=5) for _ in range(3)],
        "healthz": httpx.get(srv.url + "/healthz", timeout=5),
        "completion": httpx.post(srv.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=5),
        "translation": httpx.post(srv.url + "/v1/translations", json={"input": "hello"}, timeout=5),
    }
    srv.gate.touch()
    srv.wait_ready()
    seen["ready"] = httpx.get(srv.url + "/readyz", timeout=5)
    return seen


@pytest.fixture(scope="module")
def faulty(servers, loading):
    return servers["faulty"]


@pytest.fixture(scope="module")
def lm(checkpoints):
    return checkpoint.load(checkpoints["lm"], device="cpu")


def post(srv, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, headers=headers, timeout=120)


def assert_error(resp: httpx.Response, status: int, *phrases: str) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "code"} and error["message"] and error["type"], error
    for phrase in phrases:
        assert phrase in error["message"], (phrase, error["message"])
    assert "Traceback" not in resp.text
    return error


# --------------------------------------------------------------------------------------------------
# --max-model-len, --max-input-chars, --max-tokens-limit
# --------------------------------------------------------------------------------------------------
def test_max_model_len_caps_prompt_plus_max_tokens(limited, faulty, lm):
    prompt = fixture_training.CYCLE_TEXT[:MAX_INPUT_CHARS]
    n_prompt = len(lm.tokenizer.encode(prompt))
    room = MAX_MODEL_LEN - n_prompt  # the largest max_tokens that fits
    assert 1 <= room < MAX_TOKENS_LIMIT and MAX_MODEL_LEN + 1 <= lm.config.max_seq_len  # only this flag binds
    body = {"model": "lm", "prompt": prompt, "temperature": 0, "ignore_eos": True}

    at = post(limited, "/v1/completions", body | {"max_tokens": room}, AUTH)
    assert at.status_code == 200, at.text
    assert at.json()["usage"]["completion_tokens"] == room and at.json()["choices"][0]["finish_reason"] == "length"
    over = post(limited, "/v1/completions", body | {"max_tokens": room + 1}, AUTH)
    assert_error(over, 400, f"{MAX_MODEL_LEN} tokens", f"({n_prompt} tokens)", f"({room + 1})")
    # Without the flag the model's own context (128) takes it.
    assert post(faulty, "/v1/completions", body | {"max_tokens": room + 1}).status_code == 200


def test_max_input_chars_is_the_longest_prompt_and_input(limited, faulty):
    text = fixture_training.CYCLE_TEXT[: MAX_INPUT_CHARS + 1]
    at, over = text[:MAX_INPUT_CHARS], text
    completion = {"model": "lm", "max_tokens": 1}
    assert post(limited, "/v1/completions", completion | {"prompt": at}, AUTH).status_code == 200
    assert_error(post(limited, "/v1/completions", completion | {"prompt": over}, AUTH), 400,
                 f"{MAX_INPUT_CHARS + 1} characters", f"the limit is {MAX_INPUT_CHARS}")
    translation = {"model": "mt", "num_beams": 1, "max_tokens": 4}
    assert post(limited, "/v1/translations", translation | {"input": at}, AUTH).status_code == 200
    assert_error(post(limited, "/v1/translations", translation | {"input": ["hello", over]}, AUTH), 400,
                 "input 1", f"{MAX_INPUT_CHARS + 1} characters", f"the limit is {MAX_INPUT_CHARS}")
    assert post(faulty, "/v1/completions", completion | {"prompt": over}).status_code == 200
    assert post(faulty, "/v1/translations", translation | {"input": over}).status_code == 200


def test_max_tokens_limit_is_the_largest_max_tokens(limited, faulty, lm):
    body = {"model": "lm", "prompt": "Hello", "temperature": 0, "ignore_eos": True}
    assert len(lm.tokenizer.encode("Hello")) + MAX_TOKENS_LIMIT + 1 <= MAX_MODEL_LEN  # only this flag binds
    at = post(limited, "/v1/completions", body | {"max_tokens": MAX_TOKENS_LIMIT}, AUTH)
    assert at.status_code == 200 and at.json()["usage"]["completion_tokens"] == MAX_TOKENS_LIMIT
    over = assert_error(post(limited, "/v1/completions", body | {"max_tokens": MAX_TOKENS_LIMIT + 1}, AUTH), 400,
                        f"max_tokens {MAX_TOKENS_LIMIT + 1}", f"limit of {MAX_TOKENS_LIMIT}")
    assert over["code"] == "max_tokens_too_large"
    chat = {"model": "lm", "messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "ignore_eos": True}
    chat_prompt = lm.tokenizer.encode(lm.tokenizer.apply_chat_template(chat["messages"]), add_special_tokens=False)
    assert len(chat_prompt) + MAX_TOKENS_LIMIT + 1 <= MAX_MODEL_LEN
    ok = post(limited, "/v1/chat/completions", chat | {"max_completion_tokens": MAX_TOKENS_LIMIT}, AUTH)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == MAX_TOKENS_LIMIT
    for field in ("max_tokens", "max_completion_tokens"):
        assert_error(post(limited, "/v1/chat/completions", chat | {field: MAX_TOKENS_LIMIT + 1}, AUTH), 400,
                     f"limit of {MAX_TOKENS_LIMIT}")
    assert post(faulty, "/v1/completions", body | {"max_tokens": MAX_TOKENS_LIMIT + 1}).status_code == 200


def test_max_tokens_limit_holds_for_translations(limited):
    body = {"model": "mt", "input": "hello world", "num_beams": 1}
    assert post(limited, "/v1/translations", body | {"max_tokens": MAX_TOKENS_LIMIT}, AUTH).status_code == 200
    assert_error(post(limited, "/v1/translations", body | {"max_tokens": MAX_TOKENS_LIMIT + 1}, AUTH), 400,
                 f"limit of {MAX_TOKENS_LIMIT}")


# --------------------------------------------------------------------------------------------------
# API keys: /v1/attention and the viewer
# --------------------------------------------------------------------------------------------------
def test_api_keys_guard_attention_and_the_viewers_calls(limited):
    for path in ("/healthz", "/readyz", "/metrics"):
        assert httpx.get(limited.url + path).status_code == 200, path
    page = httpx.get(limited.url + "/viewer")  # listed in --public-paths, as docs/API.md says to do
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    html = page.text
    assert 'id="api-key"' in html and 'h["Authorization"] = "Bearer " + key' in html
    assert "connect-src 'self'" in page.headers["content-security-policy"]

    # The page's own calls (paths relative to the page), without the key, with a wrong one, with the key.
    models_url, attention_url = urljoin(str(page.url), "v1/models"), urljoin(str(page.url), "v1/attention")
    bodies = [{"model": "lm", "format": "json", "input": "The quick brown fox"},
              {"model": "mt", "format": "json", "input": "good morning", "target": "Guten Morgen"}]
    for headers in ({}, {"Authorization": "Bearer not-the-key"}, {"Authorization": KEY}):
        refused = [httpx.get(models_url, headers=headers)] + [httpx.post(attention_url, json=b, headers=headers)
                                                              for b in bodies]
        for resp in refused:
            assert assert_error(resp, 401, "API key")["code"] == "invalid_api_key"
            assert resp.headers["www-authenticate"] == "Bearer"
    models = httpx.get(models_url, headers=AUTH)
    assert models.status_code == 200 and {m["id"] for m in models.json()["data"]} == {"lm", "mt"}
    for body in bodies:
        resp = httpx.post(attention_url, json=body, headers=AUTH, timeout=60)
        assert resp.status_code == 200, resp.text
        assert resp.json()["model"] == body["model"] and resp.json()["maps"]


def test_each_engine_failure_is_its_status_type_and_code():
    """The one map from what an engine raised to what its client gets (`errors.engine_failure`); an internal
    failure reaches it already as the kind of failure only (`engine.request_error`)."""
    from tserve.model.decoding.constrained_beam import ConstraintsUnmet
    from tserve.service.engine import InvalidInput, OutOfMemory, QueueFull, RequestTimeout
    from tserve.service.errors import engine_failure

    cases = [(QueueFull("full"), 429, "server_overloaded", "rate_limit_exceeded"),
             (OutOfMemory("oom"), 503, "server_overloaded", "unavailable"),
             (RequestTimeout("timed out"), 504, "server_error", "timeout"),
             (ConstraintsUnmet("no room"), 422, "invalid_request_error", "glossary_unplaceable"),
             (InvalidInput("bad", "empty_prompt"), 400, "invalid_request_error", "empty_prompt"),
             (ValueError("too long"), 400, "invalid_request_error", "context_length_exceeded"),
                  (RuntimeError("generation failed: KeyError"), 500, "server_error", "generation_failed")]
    for exc, status, type_, code in cases:
        err = engine_failure(exc, "generation", "context_length_exceeded")
        assert (err.status, err.type, err.code) == (status, type_, code), exc
    assert engine_failure(QueueFull("full"), "generation").headers["Retry-After"] == "1"


def test_bodies_past_the_limit_are_refused_before_a_route_reads_them():
    """--max-body-bytes: a Content-Length past it is 413 before the body is read; a Content-Length that is not a
    number is 400; a body without a length (chunked) is 413 once it has grown past the limit; the file routes'
    limit (--max-file-bytes and the form's fields) lets a larger body through to the route. Errors as JSON."""
    app = build_app(Settings(max_body_bytes=1024, max_file_bytes=4096), load_models=False)

    async def call(path: str, chunks: list[bytes], length: str | None) -> tuple[int, dict]:
        headers = [(b"content-type", b"application/json")] + ([(b"content-length", length.encode())] if length else [])
        status, body = await asgi_request(app, "POST", path, chunks, headers)
        return status, json.loads(body or b"{}")

    big = json.dumps({"model": "lm", "prompt": "a" * 2000}).encode()

    async def run() -> list:
        return [await call("/v1/completions", [big], str(len(big))),
                await call("/v1/completions", [big], "12ab"),
                await call("/v1/completions", [big[i:i + 500] for i in range(0, len(big), 500)], None),
                await call("/v1/completions", [big[:900]], "900"),
                await call("/v1/translations/files", [big], str(len(big)))]

    (too_long, bad, chunked, small, file_route) = asyncio.run(run())
    assert too_long == (413, {"error": {"message": "request body exceeds 1024 bytes", "type": "invalid_request_error",
                                        "code": "body_too_large"}})
    assert bad[0] == 400 and bad[1]["error"]["message"] == "bad Content-Length"
    assert chunked == (413, too_long[1])
    assert small[0] != 413 and file_route[0] != 413  # on to the route (no model loaded, a cut body: its own answer)


def test_viewer_needs_the_key_unless_public():
    """With the default --public-paths the page itself is behind the key (docs/API.md: add /viewer to them)."""
    async def go() -> list[int]:
        app = build_app(Settings(api_keys=[KEY]), load_models=False)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            return [(await c.get("/viewer")).status_code, (await c.get("/viewer", headers=AUTH)).status_code]

    assert asyncio.run(go()) == [401, 200]


# --------------------------------------------------------------------------------------------------
# Faults: loading, out of memory, timeout, draining
# --------------------------------------------------------------------------------------------------
def test_readyz_is_503_while_the_models_load(loading):
    for resp in loading["readyz"]:
        assert assert_error(resp, 503, "loading")["code"] == "not_ready"
        assert int(resp.headers["retry-after"]) >= 1
    assert loading["healthz"].status_code == 200  # alive, not ready
    for what in ("completion", "translation"):
        assert_error(loading[what], 503, "loading")
        assert int(loading[what].headers["retry-after"]) >= 1
    ready = loading["ready"]
    assert ready.status_code == 200 and ready.json() == {"status": "ready", "models": ["lm", "mt"]}


def test_out_of_memory_is_503_with_retry_after(faulty):
    normal = {"model": "lm", "prompt": "Hello world", "max_tokens": 12, "temperature": 0}
    alone = post(faulty, "/v1/completions", normal).json()["choices"][0]["text"]
    doomed = {"model": "lm", "prompt": f"{OOM} Hello world", "max_tokens": 12, "temperature": 0}

    async def together() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            url = faulty.url + "/v1/completions"
            return await asyncio.gather(client.post(url, json=normal), client.post(url, json=doomed),
                                        client.post(url, json=normal | {"prompt": "Good morning"}))

    ok, failed, other = asyncio.run(together())
    error = assert_error(failed, 503, "out of memory")
    assert int(failed.headers["retry-after"]) >= 1 and error["type"] == "server_overloaded"
    assert ok.status_code == other.status_code == 200
    assert ok.json()["choices"][0]["text"] == alone  # the request beside it is untouched

    with httpx.stream("POST", faulty.url + "/v1/completions", json=doomed | {"stream": True}, timeout=60) as r:
        assert r.status_code == 200  # the stream had started: the error comes as its last event
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["error"]["type"] == "server_overloaded"

    after = post(faulty, "/v1/completions", normal)
    assert after.status_code == 200 and after.json()["choices"][0]["text"] == alone
    assert faulty.metric("tserve_kv_slots_in_use", "lm") == 0


@pytest.mark.slow  # 3-4 s: two requests held past the 3-second timeout
def test_request_timeout_is_504(faulty):
    slow = {"model": "lm", "prompt": f"{SLOW} Hello", "max_tokens": 100, "temperature": 0, "ignore_eos": True}
    assert 100 * SLOW_STEP_S > 2 * TIMEOUT_S

    async def both() -> tuple[httpx.Response, list[str], float]:
        async with httpx.AsyncClient(timeout=60) as client:
            start = time.monotonic()
            plain = asyncio.create_task(client.post(faulty.url + "/v1/completions", json=slow))
            async with client.stream("POST", faulty.url + "/v1/completions", json=slow | {"stream": True}) as r:
                assert r.status_code == 200
                lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
            return await plain, lines, time.monotonic() - start

    plain, lines, elapsed = asyncio.run(both())
    error = assert_error(plain, 504, "timed out")
    assert (error["code"], error["type"]) == ("timeout", "server_error") and elapsed >= TIMEOUT_S
    assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["error"]["code"] == "timeout"
    assert len(lines) > 3  # it had been streaming tokens until then
    for _ in range(50):
        if faulty.metric("tserve_kv_slots_in_use", "lm") == 0:
            break
        time.sleep(0.05)
    assert faulty.metric("tserve_kv_slots_in_use", "lm") == 0
    assert post(faulty, "/v1/completions", {"model": "lm", "prompt": "Hello", "max_tokens": 4}).status_code == 200


@pytest.fixture(scope="module")
def drained(servers):
    """SIGTERM while a stream of 30 slow tokens runs. From the moment the server has taken the signal until
    the stream ends, /readyz and /healthz are probed over and over; then the exit code."""
    srv = servers["draining"].wait_ready()
    body = {"model": "lm", "prompt": f"{SLOW} Good morning", "max_tokens": 30, "temperature": 0, "ignore_eos": True}
    expected = post(srv, "/v1/completions", body).json()["choices"][0]["text"]
    lines: list[str] = []
    started = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", srv.url + "/v1/completions", json=body | {"stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    if len(lines) == 3:
                        started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(30)
    srv.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while not any(m in srv.log() for m in ("draining", "Shutting down")) and time.monotonic() < deadline:
        time.sleep(0.01)  # until the server has taken the signal (the signal handler logs it)
    probes: list[tuple[str, httpx.Response | str]] = []
    while reader.is_alive():
        for path in ("/readyz", "/healthz"):
            try:
                probes.append((path, httpx.get(srv.url + path, timeout=2)))
            except httpx.TransportError as exc:
                probes.append((path, type(exc).__name__))
        time.sleep(0.05)
    reader.join()
    return {"expected": expected, "lines": lines, "probes": probes, "code": srv.proc.wait(timeout=60),
            "log": srv.log()}


@pytest.mark.slow
def test_readyz_is_503_while_draining(drained):
    """After SIGTERM, while a stream still runs, /readyz answers 503 (with Retry-After) every time, and
    /healthz 200 (alive: an orchestrator must not kill the process it is draining); once the stream's last
    token is out the server stops listening, runs the stream to its end and exits 0."""
    probes = drained["probes"]
    answered = [(path, r) for path, r in probes if not isinstance(r, str)]
    assert probes[: len(answered)] == answered, probes  # listening, then closed for good: no way back
    assert sum(path == "/readyz" for path, _ in answered) >= 3, probes  # probed while the stream still ran
    for path, resp in answered:
        if path == "/readyz":
            assert_error(resp, 503, "shutting down")
            assert int(resp.headers["retry-after"]) >= 1
        else:
            assert resp.status_code == 200
    lines = drained["lines"]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1]) == drained["expected"]
    assert drained["code"] == 0, drained["log"]
