"""The HTTP application around the routes, in process (`httpx.ASGITransport`, or the app called as ASGI): a key's
requests in flight counted one by one under a limit above one; CORS preflights for GET and for the X-Request-ID
header; bodies of exactly the limit (by Content-Length, chunked, a file with its form fields) let through; a
request id kept to its 128 characters; an internal error counted and logged as a 500 under the id its body names;
a client that leaves while its body is read counted as 499; a plain ValueError of an inspection job coded as its
route's error. Most apps run without models (`load_models=False`): the layer answers before any model would."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest

from tests.helpers import factories
from tests.helpers.in_process import InProcessApp, asgi_request
from tserve.service.app import build_app
from tserve.service.settings import Settings

KEY = "sk-app-layer-0123456789"
BEARER = {"Authorization": f"Bearer {KEY}"}
ORIGIN = "https://page.example"


def _count(app, route: str, status: int) -> float:  # noqa: ANN001 - a FastAPI app
    value = app.state.metrics.registry.get_sample_value("tserve_requests_total", {"route": route,
                                                                                  "status": str(status)})
    return value or 0.0




# --------------------------------------------------------------------------------------------------
# --max-requests-per-key above one
# --------------------------------------------------------------------------------------------------
def test_a_key_under_a_limit_of_two_is_counted_down_by_one_when_one_of_its_requests_ends():
    """With two requests allowed in flight and two held, one ending frees one slot, not all of them: the key's next
    request is held beside the other, and the one after it is a 429 again. (A limit of one cannot tell "one
    less" from "none".)"""
    app = build_app(Settings(api_keys=[KEY], max_requests_per_key=2), load_models=False)
    releases = [asyncio.Event() for _ in range(3)]

    @app.get("/held/{i}")
    async def held(i: int) -> dict:
        await releases[i].wait()
        return {"ok": i}

    async def go() -> tuple[int, int, int, list[int]]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            holders = [asyncio.create_task(c.get(f"/held/{i}", headers=BEARER)) for i in (0, 1)]
            await asyncio.sleep(0.05)
            full = (await c.get("/v1/models", headers=BEARER)).status_code
            releases[0].set()
            first = (await holders[0]).status_code
            holders.append(asyncio.create_task(c.get("/held/2", headers=BEARER)))
            await asyncio.sleep(0.05)
            again = (await c.get("/v1/models", headers=BEARER)).status_code
            for release in releases:
                release.set()
            ended = [(await h).status_code for h in holders]
            after = (await c.get("/v1/models", headers=BEARER)).status_code
            return full, first, again, [*ended, after]

    full, first, again, ended = asyncio.run(go())
    assert (full, first) == (429, 200)
    assert again == 429, "one request ending gave back more than its own slot"
    assert ended == [200, 200, 200, 200]
    assert sum(app.state.key_gate.in_flight.values()) == 0


# --------------------------------------------------------------------------------------------------
# CORS preflights beyond POST with Authorization
# --------------------------------------------------------------------------------------------------
def test_cors_preflights_allow_get_and_the_request_id_header_but_not_other_methods():
    """A page lists models with GET (/v1/models) and may send its own X-Request-ID to find its requests in the
    server's log: the preflights for both are allowed (with keys on, before the key is asked); a method the API
    does not take (DELETE) is not."""
    app = build_app(Settings(api_keys=[KEY], cors_origins=[ORIGIN]), load_models=False)

    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            return [await c.options(path, headers={"Origin": ORIGIN, "Access-Control-Request-Method": method,
                                                   "Access-Control-Request-Headers": headers})
                    for path, method, headers in (("/v1/models", "GET", "authorization"),
                                                  ("/v1/completions", "POST", "authorization,content-type,x-request-id"),
                                                  ("/v1/models", "DELETE", "authorization"))]

    get, with_id, delete = asyncio.run(go())
    for resp in (get, with_id):
        assert resp.status_code == 200, resp.text
        assert resp.headers["access-control-allow-origin"] == ORIGIN
    assert "GET" in get.headers["access-control-allow-methods"]
    assert "x-request-id" in with_id.headers["access-control-allow-headers"].lower()
    assert delete.status_code == 400


# --------------------------------------------------------------------------------------------------
# Bodies at the limit
# --------------------------------------------------------------------------------------------------
def test_a_body_of_exactly_the_limit_passes_by_length_and_chunked_and_one_byte_more_is_413():
    """--max-body-bytes is the largest body taken: a body of exactly that many bytes reaches the route whether it
    says its Content-Length or comes chunked; one byte more is refused both ways."""
    limit = 1024
    app = build_app(Settings(max_body_bytes=limit), load_models=False)
    json_type = (b"content-type", b"application/json")

    def body(size: int) -> bytes:
        head = b'{"model": "lm", "prompt": "'
        return head + b"a" * (size - len(head) - 2) + b'"}'

    async def run() -> list[int]:
        out = []
        for size in (limit, limit + 1):
            data = body(size)
            assert len(data) == size
            by_length = await asgi_request(app, "POST", "/v1/completions", [data],
                                    [json_type, (b"content-length", str(size).encode())])
            chunked = await asgi_request(app, "POST", "/v1/completions", [data[i:i + 300] for i in range(0, size, 300)],
                                  [json_type])
            out += [by_length[0], chunked[0]]
        return out

    exact_length, exact_chunked, over_length, over_chunked = asyncio.run(run())
    assert exact_length != 413 and exact_chunked != 413  # on to the route (no model loaded: its own answer)
    assert (over_length, over_chunked) == (413, 413)


def test_a_file_of_exactly_max_file_bytes_with_its_form_fields_reaches_the_file_routes():
    """The file routes take a file of up to --max-file-bytes, sent as multipart with its form fields: the body is
    larger than the file alone, so the body limit there leaves room for the fields (the route itself answers for
    the file's size); far past both, the middleware refuses it."""
    app = build_app(Settings(max_body_bytes=1024, max_file_bytes=2048), load_models=False)

    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            form = {"source": "en", "target": "de"}
            return [await c.post("/translate_file", data=form, files={"file": ("a.txt", b"a" * 2048)}),
                    await c.post("/v1/translations/files", data=form, files={"file": ("a.txt", b"a" * 2048)}),
                    await c.post("/translate_file", data=form, files={"file": ("a.txt", b"a" * 200_000)})]

    libre, v1, huge = asyncio.run(go())
    for resp in (libre, v1):
        assert resp.status_code != 413, resp.text  # on to the route (no model loaded: its own answer)
    assert huge.status_code == 413 and isinstance(huge.json()["error"], str)


# --------------------------------------------------------------------------------------------------
# Request ids, internal errors and clients that leave: what an operator sees
# --------------------------------------------------------------------------------------------------
def test_a_client_request_id_is_echoed_to_its_first_128_characters():
    """A client's X-Request-ID comes back as sent, cut at 128 characters, so that a long header cannot grow the
    access log and the traces without bound."""
    app = build_app(Settings(), load_models=False)

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            return await c.get("/healthz", headers={"X-Request-ID": "r" * 100 + "s" * 200})

    assert asyncio.run(go()).headers["x-request-id"] == "r" * 100 + "s" * 28


def test_an_internal_error_is_counted_and_logged_as_a_500_under_the_id_its_body_names(caplog):
    """An exception in a route is a 500 whose message names the request id; tserve_requests_total and the access
    log count it as a 500 (not as a success) under that same id, the one the server generated when the client
    sent none."""
    app = build_app(Settings(), load_models=False)

    @app.get("/fails")
    async def fails() -> dict:
        raise RuntimeError("something internal")

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return await c.get("/fails")

    with caplog.at_level(logging.INFO, logger="tserve.access"):
        resp = asyncio.run(go())
    assert resp.status_code == 500 and resp.json()["error"]["code"] == "internal_error"
    assert "something internal" not in resp.text
    lines = [r for r in caplog.records if r.name == "tserve.access" and getattr(r, "route", None) == "/fails"]
    assert [r.status for r in lines] == [500]
    assert len(lines[0].request_id) == 32
    assert resp.json()["error"]["message"] == f"internal error (request id {lines[0].request_id})"
    assert _count(app, "/fails", 500) == 1 and _count(app, "/fails", 200) == 0


@pytest.mark.parametrize(("path", "shape"), [("/translate", "flat"), ("/v1/completions", "openai")])
def test_a_client_that_leaves_while_its_body_is_read_is_counted_as_499(caplog, path, shape):
    """A client gone before its body arrived is nginx's 499 in the metrics and the access log: not a 4xx of the
    client's request, nor a 500 of the server's. LibreTranslate's routes read their body (JSON or a form)
    themselves; FastAPI reads an OpenAI route's JSON body, and calls a cut one "an error parsing the body"."""
    app = build_app(Settings(), load_models=False)
    headers = [(b"content-type", b"application/json"), (b"content-length", b"40")]
    with caplog.at_level(logging.INFO, logger="tserve.access"):
        status, body = asyncio.run(asgi_request(app, "POST", path, [], headers, disconnect_first=True))
    error = json.loads(body)["error"]
    assert status == 499, body
    assert error == "client closed the request" if shape == "flat" else error["code"] == "client_closed"
    assert [r.status for r in caplog.records if r.name == "tserve.access"] == [499]
    assert _count(app, path, 499) == 1


def test_an_internal_errors_answer_carries_the_request_id_and_cors_headers():
    """The 500 of an exception in a route is answered as every other response: with its X-Request-ID (the
    client's, or the one its body names) and, where CORS is on, the headers that let a page read it."""
    app = build_app(Settings(cors_origins=["https://ui.example"]), load_models=False)

    @app.get("/fails")
    async def fails() -> dict:
        raise RuntimeError("something internal")

    async def go() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            origin = {"Origin": "https://ui.example"}
            return [await c.get("/fails", headers=origin | {"X-Request-ID": "abc-123"}),
                    await c.get("/fails", headers=origin)]

    given, generated = asyncio.run(go())
    assert given.status_code == generated.status_code == 500
    assert given.headers["x-request-id"] == "abc-123" and "abc-123" in given.json()["error"]["message"]
    rid = generated.headers["x-request-id"]
    assert generated.json()["error"]["message"] == f"internal error (request id {rid})"
    for resp in (given, generated):
        assert resp.headers["access-control-allow-origin"] == "https://ui.example"


# --------------------------------------------------------------------------------------------------
# An inspection job's plain ValueError, coded as its route's error
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lm_app(tmp_path_factory):
    app = InProcessApp({"lm": factories.tiny_lm_dir(tmp_path_factory.mktemp("app-layer") / "lm")})
    yield app
    app.stop()


def test_an_input_past_the_context_is_a_400_coded_as_each_inspection_routes_error(lm_app):
    """Attention maps and the logit lens run as call jobs in the model's worker, which find the input too long
    for the model (a plain ValueError of the model code): the client's 400, under the route's own code on both
    routes, as a selection the route checks itself (a layer the model lacks) is."""
    long = "Hello world " * 200
    for path, code in (("/v1/attention", "invalid_attention_request"), ("/v1/logit_lens", "invalid_lens_request")):
        error = lm_app.post(path, {"model": "lm", "input": long}, 400).json()["error"]
        assert (error["code"], error["type"]) == (code, "invalid_request_error"), (path, error)
        assert "takes at most 128" in error["message"]
    layer = lm_app.post("/v1/attention", {"model": "lm", "input": "Hello world", "layers": [99]}, 400)
    assert layer.json()["error"]["code"] == "invalid_attention_request"
