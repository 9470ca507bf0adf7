"""API keys, per-key concurrency and CORS, in-process (the models are not needed to answer 401/429)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tserve.service.app import build_app
from tserve.service.security import APIKeyMiddleware, KeyChecker, KeyGate, bearer_token, key_priority
from tserve.service.settings import Settings

KEY = "sk-test-0123456789abcdef"


def client(**settings) -> httpx.AsyncClient:
    app = build_app(Settings(**settings), load_models=False)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize(("headers", "status"), [
    ({}, 401),
    ({"Authorization": "Bearer wrong"}, 401),
    ({"Authorization": f"Basic {KEY}"}, 401),
    ({"Authorization": f"Bearer {KEY}"}, 200),
    # RFC 7235 section 2.1: the scheme is case-insensitive, and clients spell it each their own way.
    ({"Authorization": f"bearer {KEY}"}, 200),
    ({"Authorization": f"BEARER {KEY}"}, 200),
    ({"Authorization": f"bEaReR {KEY}"}, 200),
    ({"Authorization": f"Bearer{KEY}"}, 401),  # no scheme at all
])
def test_api_key_required(headers, status):
    async def go() -> httpx.Response:
        async with client(api_keys=[KEY, "other"]) as c:
            return await c.get("/v1/models", headers=headers)

    resp = run(go())
    assert resp.status_code == status
    if status == 401:
        assert resp.json()["error"]["code"] == "invalid_api_key"
        assert resp.json()["error"]["message"] == "missing or invalid API key: send 'Authorization: Bearer <key>'"
        assert resp.json()["error"]["type"] == "invalid_request_error"
        assert resp.headers["www-authenticate"] == "Bearer"


def test_health_and_metrics_open_unless_configured():
    async def go() -> list[int]:
        async with client(api_keys=[KEY]) as c:
            open_ = [(await c.get(p)).status_code for p in ("/healthz", "/metrics")]
        async with client(api_keys=[KEY], public_paths=[]) as c:
            closed = [(await c.get(p)).status_code for p in ("/healthz", "/metrics")]
        return open_ + closed

    assert run(go()) == [200, 200, 401, 401]


def test_keys_from_the_environment(monkeypatch):
    monkeypatch.setenv("TSERVE_API_KEYS", f"{KEY},second")
    assert Settings().api_keys == [KEY, "second"]


def test_no_keys_no_authentication():
    async def go() -> int:
        async with client() as c:
            return (await c.get("/v1/models")).status_code

    assert run(go()) == 200


def test_in_flight_limit_per_key():
    """A key with one request in flight gets 429 for the next; another key is not affected."""
    app = build_app(Settings(api_keys=[KEY, "k2"], max_requests_per_key=1), load_models=False)
    gate = asyncio.Event()

    @app.get("/slow")
    async def slow() -> dict:
        await gate.wait()
        return {"ok": True}

    async def go() -> tuple[int, httpx.Response, int, int, int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            first = asyncio.create_task(c.get("/slow", headers={"Authorization": f"Bearer {KEY}"}))
            await asyncio.sleep(0.05)
            second = await c.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
            other = await c.get("/v1/models", headers={"Authorization": "Bearer k2"})
            gate.set()
            first_status = (await first).status_code
            # the first request's slot is given back when it ends, once: the key is admitted again, and again
            # up to its limit only
            again = await c.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
            gate.clear()
            held = asyncio.create_task(c.get("/slow", headers={"Authorization": f"Bearer {KEY}"}))
            await asyncio.sleep(0.05)
            over = await c.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
            gate.set()
            await held
            return first_status, second, other.status_code, again.status_code, over.status_code

    first, second, other, again, over = run(go())
    assert (first, second.status_code, other, again, over) == (200, 429, 200, 200, 429)
    assert second.headers["retry-after"] == "1"
    assert second.json()["error"]["code"] == "rate_limit_exceeded"
    assert second.json()["error"]["type"] == "server_overloaded"
    assert second.json()["error"]["message"] == "this API key has 1 requests in flight; retry later"


def test_cors_closed_by_default_and_open_when_configured():
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}

    async def go() -> tuple[httpx.Response, httpx.Response]:
        async with client() as c:
            closed = await c.options("/v1/completions", headers=preflight)
        async with client(cors_origins=["https://app.example"]) as c:
            opened = await c.options("/v1/completions", headers=preflight)
        return closed, opened

    closed, opened = run(go())
    assert "access-control-allow-origin" not in closed.headers
    assert opened.headers["access-control-allow-origin"] == "https://app.example"


def test_key_comparison_is_constant_time(monkeypatch):
    """Whatever the candidate (no common prefix, all but the last character, the key itself), the check
    makes the same calls: hmac.compare_digest on equal-length digests, once per configured key, with no
    early exit. (Proven by construction rather than by timing, which a shared CI machine cannot resolve.)"""
    import tserve.service.security as security

    calls: list[tuple[int, int]] = []
    real = security.hmac.compare_digest

    def recording(a: bytes, b: bytes) -> bool:
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(security.hmac, "compare_digest", recording)
    key = "k" * 64
    checker = KeyChecker(["first-key", key, "third"])
    traces = []
    for candidate in ("x" * 64, "k" * 63 + "x", key, ""):
        calls.clear()
        checker.match(candidate)
        traces.append(list(calls))
    assert all(trace == traces[0] for trace in traces)
    assert traces[0] == [(32, 32)] * 3
    assert checker.match(key) == 1 and checker.match("k" * 63 + "x") is None


def test_prompts_are_logged_only_when_asked(caplog):
    from types import SimpleNamespace

    from tserve.service.routes.deps import log_inputs

    def request(log_prompts: bool):
        app = SimpleNamespace(state=SimpleNamespace(settings=Settings(log_prompts=log_prompts)))
        return SimpleNamespace(app=app, state=SimpleNamespace(request_id="r1"))

    with caplog.at_level("INFO", logger="tserve.requests"):
        log_inputs(request(False), ["secret text"])
        assert not caplog.records
        log_inputs(request(True), ["secret text"])
    assert caplog.records[0].inputs == ["secret text"] and caplog.records[0].request_id == "r1"


def test_log_lines_are_one_json_object_with_the_records_fields():
    """--log-level's lines: time, level, logger, message, every `extra=` field by its own name, the
    exception's traceback under `exception`, text as it is (not \\u-escaped), none of LogRecord's own
    attributes (args, pathname, ...)."""
    import json
    import logging
    import sys

    from tserve.service.cli import JsonFormatter

    try:
        raise ValueError("bad weight")
    except ValueError:
        exc_info = sys.exc_info()
    record = logging.LogRecord("tserve.access", logging.WARNING, __file__, 1, "über %s", ("alles",), exc_info)
    record.__dict__.update(request_id="r7", status=404, ms=1.5)
    line = JsonFormatter().format(record)
    assert "\n" not in line and "über alles" in line
    entry = json.loads(line)
    assert entry.pop("exception").splitlines()[-1] == "ValueError: bad weight"
    assert entry.pop("time")[:2] == "20"
    assert entry == {"level": "WARNING", "logger": "tserve.access", "message": "über alles", "request_id": "r7",
                     "status": 404, "ms": 1.5}


def test_requests_are_admitted_as_their_key_or_address_with_the_keys_priority():
    """The middleware says whose each request is for the engines' fair admission: the key (`KEY:N` gives its
    priority N), else the client's address; a body's `priority` may ask for a later turn than its key's, not an
    earlier one, and is taken as asked for a key without a priority."""
    from tserve.service.engine import admission
    from tserve.service.routes.deps import prioritise

    def who_app(**settings):
        app = build_app(Settings(**settings), load_models=False)

        @app.get("/who")
        async def who(priority: int | None = None) -> dict:
            prioritise(priority)
            return {"client": list(admission.get().client), "priority": admission.get().priority}

        return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, client=("10.0.0.7", 5000)),
                                 base_url="http://test")

    async def go() -> list[dict]:
        async with who_app(api_keys=["ka:3", "kb", "k:c:-2"]) as c:
            keyed = [(await c.get("/who", headers={"Authorization": f"Bearer {k}"})).json() for k in ("ka", "kb", "k:c")]
            for key, asked in (("ka", -5), ("ka", 7), ("kb", -5)):
                keyed.append((await c.get("/who", params={"priority": asked},
                                          headers={"Authorization": f"Bearer {key}"})).json())
        async with who_app() as c:
            keyed.append((await c.get("/who")).json())
        return keyed

    assert run(go()) == [{"client": ["key", 0], "priority": 3}, {"client": ["key", 1], "priority": 0},
                         {"client": ["key", 2], "priority": -2}, {"client": ["key", 0], "priority": 3},
                         {"client": ["key", 0], "priority": 7}, {"client": ["key", 1], "priority": -5},
                         {"client": ["address", "10.0.0.7"], "priority": 0}]


def test_a_keys_priority_is_the_integer_after_its_last_colon():
    assert [key_priority(e) for e in ("ka:3", "k:c:-2", "kb", "k:x", ":5", "k:", "k:-", "k:+1", "k:X1")] == [
        ("ka", 3), ("k:c", -2), ("kb", None), ("k:x", None), (":5", None), ("k:", None), ("k:-", None),
        ("k:+1", None), ("k:X1", None)]


def test_a_bearer_token_is_read_from_the_authorization_header_alone():
    def scope(*headers: tuple[bytes, bytes]) -> dict:
        return {"headers": list(headers)}

    assert bearer_token(scope((b"x-other", b"Bearer no"), (b"authorization", b"Bearer  tok \t"))) == "tok"
    assert bearer_token(scope((b"authorization", b"Basic tok"))) == ""
    assert bearer_token(scope()) == ""


def test_the_middleware_lets_through_the_paths_whose_routes_check_the_key():
    seen: list[tuple[str, dict]] = []

    async def app(scope, receive, send) -> None:  # noqa: ANN001
        seen.append((scope["path"], await receive()))  # the route reads the body through the middleware

    async def body() -> dict:
        return {"type": "http.request", "body": b"{}"}

    async def sent(message) -> None:  # noqa: ANN001
        pass

    middleware = APIKeyMiddleware(app, KeyGate([KEY], 0), ["/healthz"], frozenset({"/translate"}),
                                  ("/v2/repository/",))
    for path in ("/healthz", "/translate", "/v2/repository/m/load", "/v1/models", "/translate/x", "/v2/repository"):
        run(middleware({"type": "http", "path": path, "headers": [], "client": ("1.2.3.4", 1)}, body, sent))
    keyed = [(b"authorization", f"Bearer {KEY}".encode())]
    run(middleware({"type": "http", "path": "/v1/chat", "headers": keyed, "client": ("1.2.3.4", 1)}, body, sent))
    assert [path for path, _ in seen] == ["/healthz", "/translate", "/v2/repository/m/load", "/v1/chat"]
    assert all(message["body"] == b"{}" for _, message in seen)
