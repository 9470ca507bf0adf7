"""The translation page (`GET /`) and the attention viewer (`GET /viewer`) beside the options their tests leave at
the default: the pages served behind a reverse proxy's path prefix, a server with one translation pair, a pair whose
model refuses alternatives beside one that gives them, a 400 about the text, a 429, an API key typed into the viewer,
a range of layers, the largest top-k, an alignment read at another layer than the last, maps with different numbers
of heads, an inline tag that stands between words.

The pages come from the app in-process (`build_app`, no models needed) and are driven in a headless Chromium whose
every request is answered here: the page itself from the app, the API by small stubs in the shapes the API documents,
so that each test takes seconds. Without Playwright or Chromium the browser tests are skipped (see
tests/helpers/browser.py)."""

from __future__ import annotations

import asyncio
import json
from urllib.parse import urlsplit

import httpx
import pytest

from tests.helpers.browser import chromium
from tserve.service.app import build_app
from tserve.service.settings import Settings

ORIGIN = "http://tserve.test"
PREFIX = "/proxy/tserve/"  # where a reverse proxy puts the service: the pages must ask below it
NAMES = {"en": "English", "de": "German", "fr": "French"}


@pytest.fixture(scope="module")
def pages():
    """`GET /` and `GET /viewer` as the app answers them: {path: (status, headers, body)}."""
    app = build_app(Settings(device="cpu"))

    async def fetch():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return {path: await client.get(path) for path in ("/", "/viewer")}

    return {path: (r.status_code, dict(r.headers), r.text) for path, r in asyncio.run(fetch()).items()}


def test_pages_forbid_framing_sniffing_and_stale_copies(pages):
    """The translation page holds the API key field: no other site may frame it, and neither page is kept stale."""
    for path in ("/", "/viewer"):
        status, headers, body = pages[path]
        assert status == 200 and headers["content-type"].startswith("text/html")
        csp = [d.strip() for d in headers["content-security-policy"].split(";")]
        assert {"default-src 'none'", "frame-ancestors 'none'", "connect-src 'self'", "base-uri 'none'",
                "form-action 'none'", "img-src data: blob:"} <= set(csp), csp
        assert headers["x-content-type-options"] == "nosniff" and headers["cache-control"] == "no-cache"
        assert "<script>\n/* " not in body  # every script placeholder replaced


@pytest.fixture(scope="module")
def browser():
    with chromium() as b:
        yield b


def reply(status: int = 200, body=None, content_type: str = "application/json") -> dict:
    return {"status": status, "content_type": content_type,
            "body": body if isinstance(body, (str, bytes)) else json.dumps(body)}


class Site:
    """One page in a fresh context, every request answered here: the page from the app, `api[(method, path)]`
    (path relative to the prefix) by a stub called with the request. Records what the page asked for."""

    def __init__(self, browser, pages, page: str, api: dict, init_script: str | None = None) -> None:
        self.api, self.asked, self.errors = api, [], []
        self.context = browser.new_context(viewport={"width": 1280, "height": 900}, accept_downloads=True)
        if init_script:
            self.context.add_init_script(init_script)
        self.context.route("**/*", self._answer)
        self.pg = self.context.new_page()
        self.pg.set_default_timeout(15_000)
        self.pg.on("pageerror", lambda exc: self.errors.append(str(exc)))
        status, headers, body = pages["/" if page == "" else "/" + page]
        self.page = (status, {k: v for k, v in headers.items() if k != "content-length"}, body)
        self.path = PREFIX + page
        self.pg.goto(ORIGIN + self.path)

    def _answer(self, route) -> None:
        req = route.request
        path = urlsplit(req.url).path
        if path == self.path and req.resource_type == "document":
            status, headers, body = self.page
            route.fulfill(status=status, headers=headers, body=body)
            return
        rel = path.removeprefix(PREFIX) if path.startswith(PREFIX) else path
        self.asked.append({"method": req.method, "path": rel, "auth": req.headers.get("authorization"),
                           "body": req.post_data_buffer})
        stub = self.api.get((req.method, rel))
        route.fulfill(**(stub(req) if stub else reply(404, {"error": {"message": "Not Found"}})))

    def wait_until(self, condition, what: str) -> None:
        for _ in range(100):
            if condition():
                return
            self.pg.wait_for_timeout(50)
        raise AssertionError(f"waited in vain for {what}: {self.asked}")

    def bodies(self, path: str) -> list[dict]:
        return [json.loads(a["body"]) for a in self.asked if a["path"] == path and a["method"] == "POST"]

    def close(self) -> None:
        self.context.close()
        assert self.errors == [], self.errors


@pytest.fixture
def site(pages, browser):  # `pages` first: its asyncio.run cannot start inside Playwright's running loop
    opened: list[Site] = []

    def open_(page: str, api: dict, init_script: str | None = None) -> Site:
        opened.append(Site(browser, pages, page, api, init_script))
        return opened[-1]

    yield open_
    for s in opened:
        s.close()


# --------------------------------------------------------------------------------------------------
# The translation page
# --------------------------------------------------------------------------------------------------
def languages(*pairs: tuple[str, str]) -> list[dict]:
    """/languages as the server lists it: every language read or written, with its targets."""
    codes = sorted({c for p in pairs for c in p})
    return [{"code": c, "name": NAMES[c], "targets": sorted(t for s, t in pairs if s == c)} for c in codes]


ROWS_REFUSAL = {"error": {"message": "num_beams 4 exceeds the 2 decoder rows this server runs (--max-running-requests)",
                          "type": "invalid_request_error", "code": "request_too_large", "param": "num_beams"}}


def translator(refuse_n_for: tuple[str, ...] = (), refusals: dict[str, dict] | None = None):
    """/v1/translations: "<target>:<input>", with n alternatives when asked, except where the pair's model
    refuses num_beams (as a server with fewer decoder rows does), and `refusals[input]` for that input whatever
    it asks."""
    def answer(req):
        body = json.loads(req.post_data)
        pair = f"{body.get('source_lang')}-{body.get('target_lang')}"
        if body["input"] in (refusals or {}):
            return reply(400, refusals[body["input"]])
        if "n" in body and pair in refuse_n_for:
            return reply(400, ROWS_REFUSAL)
        best = f"{body['target_lang']}:{body['input']}"
        alts = [{"translation": best + "!" * i, "score": -0.5 * i} for i in range(body.get("n", 0))]
        return reply(200, {"data": [{"translation": best, **({"alternatives": alts} if alts else {})}], "model": pair})
    return answer


def translate_api(pairs, suggested=("en", "de"), **translator_options) -> dict:
    settings = {"charLimit": 5000, "keyRequired": False, "apiKeys": False, "filesTranslation": True,
                "language": {"source": {"code": suggested[0]}, "target": {"code": suggested[1]}}}
    return {("GET", "frontend/settings"): lambda req: reply(200, settings),
            ("GET", "languages"): lambda req: reply(200, languages(*pairs)),
            ("POST", "detect"): lambda req: reply(200, [{"language": "en", "confidence": 91.6}]),
            ("POST", "v1/translations"): translator(**translator_options)}


def ready(s: Site) -> Site:
    s.pg.wait_for_selector("body[data-ready='true']", state="attached")
    return s


def wait_translation_of(s: Site, text: str) -> str:
    s.pg.wait_for_function("t => document.getElementById('target-text').dataset.source === t", arg=text)
    return s.pg.input_value("#target-text")


@pytest.mark.browser
def test_auto_detect_and_a_file_download_stay_below_the_path_prefix(site):
    """Behind a reverse proxy every call is page-relative: /detect, and the job's download_url, which the server
    names from its own root."""
    api = translate_api([("en", "de"), ("de", "en")])
    api[("POST", "v1/translations/files")] = lambda req: reply(202, {
        "id": "j1", "object": "translation.job", "status": "succeeded", "filename": "notes.txt", "done_segments": 1,
        "total_segments": 1, "download_url": "/v1/translations/jobs/j1/file", "target_lang": "de", "error": None})
    api[("GET", "v1/translations/jobs/j1/file")] = lambda req: reply(200, "de:notes", "text/plain")
    s = ready(site("", api))
    assert s.pg.input_value("#source-lang") == "auto"
    s.pg.select_option("#target-lang", "de")
    s.pg.fill("#source-text", "hello there")
    assert wait_translation_of(s, "hello there") == "de:hello there"
    assert s.pg.get_attribute("#detected", "data-language") == "en"
    assert s.pg.inner_text("#detected") == "Detected: English (92%)"

    s.pg.select_option("#source-lang", "en")
    s.pg.set_input_files("#file", files=[{"name": "notes.txt", "mimeType": "text/plain", "buffer": b"notes"}])
    s.pg.wait_for_selector("#job-download:not(.hidden)")
    assert s.pg.get_attribute("#job-download", "download") == "de-notes.txt" and s.pg.is_hidden("#file-error")
    assert [a["path"] for a in s.asked if a["path"].startswith("/")] == []  # nothing asked outside the prefix
    assert ("GET", "v1/translations/jobs/j1/file") in [(a["method"], a["path"]) for a in s.asked]


@pytest.mark.browser
def test_a_pair_that_refuses_alternatives_leaves_the_other_pairs_asking_for_them(site):
    """English into German and into French: the German model refuses n, so German is asked without it from then
    on; French, from the same source, still gets its alternatives. Under Auto detect the target offered first is
    the one /frontend/settings suggests."""
    s = ready(site("", translate_api([("en", "de"), ("en", "fr")], suggested=("en", "de"), refuse_n_for=("en-de",))))
    assert s.pg.input_value("#source-lang") == "auto" and s.pg.input_value("#target-lang") == "de"
    s.pg.select_option("#source-lang", "en")
    s.pg.select_option("#target-lang", "de")
    s.pg.fill("#source-text", "good morning")
    assert wait_translation_of(s, "good morning") == "de:good morning"
    assert s.pg.is_hidden("#alternatives-box") and s.pg.is_hidden("#error")

    s.pg.select_option("#target-lang", "fr")
    s.pg.wait_for_function("() => document.getElementById('target-text').value === 'fr:good morning'")
    assert s.bodies("v1/translations")[-1] == {"input": "good morning", "source_lang": "en", "target_lang": "fr",
                                               "n": 3, "num_beams": 4}
    assert s.pg.is_visible("#alternatives-box") and s.pg.locator("#alternatives button").count() == 3


@pytest.mark.browser
def test_a_400_about_the_text_is_shown_and_the_pair_keeps_its_alternatives(site):
    """Only a refusal that names n or num_beams as its `param` drops the options for the pair: a 400 whose
    message merely holds the word "n", or names num_beams as one way out of a size limit, is this text's error."""
    def refusal(message: str) -> dict:
        return {"error": {"message": message, "type": "invalid_request_error", "code": "request_too_large"}}

    refusals = {"rock n roll": refusal("input 0: 'rock n roll' has 300 tokens; this model takes at most 256"),
                "a long page": refusal("4 beams of 512 tokens need 40 KV-cache blocks; the cache has 30 "
                                       "(--kv-cache-memory): lower max_tokens or num_beams")}
    s = ready(site("", translate_api([("en", "de"), ("de", "en")], refusals=refusals)))
    s.pg.select_option("#source-lang", "en")
    for (text, answer), after in zip(refusals.items(), ("good morning", "good evening"), strict=True):
        s.pg.fill("#source-text", text)
        s.pg.wait_for_function("m => document.getElementById('error').textContent === m",
                               arg=answer["error"]["message"] + " (HTTP 400)")
        s.pg.fill("#source-text", after)
        assert wait_translation_of(s, after) == "de:" + after
        assert s.bodies("v1/translations")[-1] == {"input": after, "source_lang": "en", "target_lang": "de",
                                                   "n": 3, "num_beams": 4}
        assert s.pg.is_visible("#alternatives-box") and s.pg.locator("#alternatives button").count() == 3
    assert [b for b in s.bodies("v1/translations") if "n" not in b] == []  # never asked again without them


@pytest.mark.browser
def test_a_429_shows_the_servers_message_and_does_not_ask_for_a_key(site):
    """Only 401 and 403 are about the key: a full queue is said as the server says it, the key panel stays shut."""
    api = translate_api([("en", "de"), ("de", "en")])
    api[("POST", "v1/translations")] = lambda req: reply(429, {"error": {
        "message": "the queue of model en-de is full", "type": "server_overloaded", "code": "rate_limit_exceeded"}})
    s = ready(site("", api))
    s.pg.select_option("#source-lang", "en")
    s.pg.fill("#source-text", "hello")
    s.pg.wait_for_selector("#error:not(.hidden)")
    assert s.pg.inner_text("#error") == "the queue of model en-de is full (HTTP 429)"
    assert s.pg.is_hidden("#key-panel") and s.pg.is_hidden("#key-message")
    assert s.pg.input_value("#target-text") == ""


@pytest.mark.browser
def test_one_served_pair_is_picked_and_a_file_under_auto_detect_goes_without_a_source(site):
    """With one pair the page starts on it rather than on Auto detect; a file sent under Auto detect names only
    the target (the one model's language is the source)."""
    forms: list[bytes] = []

    def files(req):
        forms.append(req.post_data_buffer)
        return reply(400, {"error": {"message": "the file is empty", "type": "invalid_request_error"}})

    api = translate_api([("en", "de")])
    api[("POST", "v1/translations/files")] = files
    s = ready(site("", api))
    assert s.pg.input_value("#source-lang") == "en" and s.pg.input_value("#target-lang") == "de"
    assert s.pg.is_enabled("#swap") is False  # German → English is not served

    s.pg.select_option("#source-lang", "auto")
    s.pg.set_input_files("#file", files=[{"name": "a.md", "mimeType": "text/markdown", "buffer": b"hello"}])
    s.pg.wait_for_function("() => document.getElementById('file-error').textContent.includes('the file is empty')")
    assert len(forms) == 1
    assert b'name="target_lang"\r\n\r\nde\r\n' in forms[0] and b'name="source_lang"' not in forms[0]


# --------------------------------------------------------------------------------------------------
# The viewer
# --------------------------------------------------------------------------------------------------
MODELS = {"object": "list", "data": [{"id": "lm", "object": "model", "task": "text-generation"},
                                     {"id": "mt", "object": "model", "task": "translation"}]}


def cross_map(layer: int) -> dict:
    """A 2-head cross-attention map whose strongest source token differs with the layer."""
    strong = [[0.9, 0.1], [0.1, 0.9]] if layer == 0 else [[0.2, 0.8], [0.7, 0.3]]
    return {"module": "decoder.cross", "layer": layer, "query_tokens": ["Guten", "Tag"],
            "key_tokens": ["good", "day"], "weights": [strong, strong]}


def attention_answer(req) -> dict:
    body = json.loads(req.post_data)
    layers = body.get("layers") or [0, 1]
    if body["model"] == "lm":
        maps = [{"module": "decoder.self", "layer": n, "query_tokens": ["a", "b"], "key_tokens": ["a", "b"],
                 "weights": [[[1.0, 0.0], [0.5, 0.5]]] * 2} for n in layers]
        return reply(200, {"model": "lm", "maps": maps})
    return reply(200, {"model": "mt", "target": "Guten Tag", "maps": [cross_map(n) for n in layers]})


def lens_answer(req) -> dict:
    body = json.loads(req.post_data)
    top = [{"token": f"t{i}", "prob": 0.5 / (i + 1)} for i in range(body["top_k"])]
    return reply(200, {"model": body["model"], "tokens": ["a", "b"],
                       "layers": [{"layer": n, "positions": [{"top": top}, {"top": top}]} for n in (0, 1)]})


def viewer_api() -> dict:
    return {("GET", "v1/models"): lambda req: reply(200, MODELS),
            ("POST", "v1/attention"): attention_answer, ("POST", "v1/logit_lens"): lens_answer}


def open_viewer(site, api: dict) -> Site:
    s = site("viewer", api)
    s.pg.wait_for_selector("#model option[value='lm']", state="attached")
    return s


def submit_and_wait(s: Site, view: str) -> None:
    s.pg.eval_on_selector(f"#{view}", "e => e.dataset.rendered = 'false'")
    s.pg.click("#submit")
    s.pg.wait_for_selector(f"#{view}[data-rendered='true']", state="attached")


@pytest.mark.browser
def test_viewer_sends_the_key_a_layer_range_and_the_largest_top_k(site):
    """The key typed in Options goes with every call, the model list's GET too; "0-1" fetches layers 0 and 1;
    top-k 20, the API's largest, is sent as it is."""
    s = open_viewer(site, viewer_api())
    s.pg.click("#options-summary")
    s.pg.fill("#api-key", "viewer-key")
    s.pg.dispatch_event("#api-key", "change")
    s.wait_until(lambda: len([a for a in s.asked if a["path"] == "v1/models"]) == 2, "the models read again")
    gets = [a for a in s.asked if a["path"] == "v1/models"]
    assert gets[0]["auth"] is None and gets[-1]["auth"] == "Bearer viewer-key"

    s.pg.select_option("#model", "lm")
    s.pg.fill("#fetch-layers", "0-1")
    submit_and_wait(s, "heatmap")
    assert s.bodies("v1/attention")[-1]["layers"] == [0, 1]
    assert s.pg.eval_on_selector_all("#layer option", "os => os.map(o => o.value)") == ["0", "1"]

    s.pg.click("#tab-lens")
    s.pg.fill("#fetch-layers", "")
    s.pg.fill("#top-k", "20")
    submit_and_wait(s, "lens")
    assert s.pg.is_hidden("#error")
    sent = s.bodies("v1/logit_lens")[-1]
    assert sent["top_k"] == 20 and "layers" not in sent
    assert {a["auth"] for a in s.asked if a["path"].startswith("v1/") and a is not gets[0]} == {"Bearer viewer-key"}


@pytest.mark.browser
def test_viewer_alignment_follows_the_layer_picked(site):
    """A translator's alignment is drawn from the cross-attention of the layer picked, not always the last."""
    s = open_viewer(site, viewer_api())
    s.pg.select_option("#model", "mt")
    s.pg.fill("#input", "good day")
    submit_and_wait(s, "alignment")
    assert s.pg.input_value("#layer") == "1"
    assert "layer 1" in s.pg.text_content("#alignment-title")
    s.pg.select_option("#scale", "absolute")
    s.pg.select_option("#layer", "0")
    assert "layer 0" in s.pg.text_content("#alignment-title")
    got = s.pg.eval_on_selector_all("#alignment line.link", "ls => ls.map(l => [+l.dataset.q, +l.dataset.k, "
                                    "+l.getAttribute('stroke-opacity')])")
    assert got == [[0, 0, 0.9], [0, 1, 0.1], [1, 0, 0.1], [1, 1, 0.9]]


def uniform_map(module: str, layer: int, heads: int) -> dict:
    return {"module": module, "layer": layer, "query_tokens": ["a", "b"], "key_tokens": ["a", "b"],
            "weights": [[[0.5, 0.5], [0.5, 0.5]]] * heads}


@pytest.mark.browser
def test_each_attention_map_offers_its_own_heads(site):
    """Modules and layers may have different numbers of heads: the head picker offers those of the map shown,
    whichever map the answer holds first, and keeps the head picked where the next map has it. The alignment
    beside a map with more heads than the cross-attention draws the mean of the cross-attention's heads."""
    maps = {"mt": [uniform_map("encoder.self", 0, 4), uniform_map("decoder.self", 0, 3),
                   uniform_map("decoder.cross", 0, 2)],
            "lm": [uniform_map("decoder.self", 0, 1), uniform_map("decoder.self", 1, 3)]}
    def answer(req) -> dict:
        model = json.loads(req.post_data)["model"]
        return reply(200, {"model": model, "target": "b", "maps": maps[model]})

    api = viewer_api()
    api[("POST", "v1/attention")] = answer
    s = open_viewer(site, api)

    def heads() -> list[str]:
        return s.pg.eval_on_selector_all("#head option", "os => os.map(o => o.value)")

    s.pg.select_option("#model", "mt")
    s.pg.fill("#input", "a b")
    submit_and_wait(s, "heatmap")
    assert s.pg.input_value("#module") == "decoder.cross" and heads() == ["0", "1", "mean"]
    s.pg.select_option("#module", "encoder.self")
    assert heads() == ["0", "1", "2", "3", "mean"]
    s.pg.select_option("#head", "3")
    assert s.pg.text_content("#heatmap-title") == "· encoder.self · layer 0 · head 3"
    assert s.pg.text_content("#alignment-title") == "· decoder.cross · layer 0 · mean of heads"
    s.pg.select_option("#module", "decoder.self")
    assert heads() == ["0", "1", "2", "mean"] and s.pg.input_value("#head") == "0"

    s.pg.select_option("#model", "lm")
    submit_and_wait(s, "heatmap")
    assert s.pg.input_value("#layer") == "0" and heads() == ["0", "mean"]
    s.pg.select_option("#layer", "1")
    assert heads() == ["0", "1", "2", "mean"]
    s.pg.select_option("#head", "2")
    s.pg.select_option("#layer", "0")
    assert heads() == ["0", "mean"] and s.pg.input_value("#head") == "0"
    assert s.pg.text_content("#heatmap-title") == "· decoder.self · layer 0 · head 0"


@pytest.mark.browser
def test_document_view_names_the_words_either_side_of_a_tag_between_words(site):
    """An atom (<br>) stands at a word boundary: its row names the source word and the target word it comes
    before, each from its own side, and "(end)" past the last word."""
    segment = {"source_words": ["Good", "morning", "Thanks"], "target_words": ["Guten", "Morgen", "Danke", "sehr"],
               "alignment": [0, 1, 2, 2],
               "tags": [{"tag": "<br>", "kind": "atom", "depth": 0, "source_boundary": 2, "target_boundary": 2},
                        {"tag": "<img>", "kind": "atom", "depth": 0, "source_boundary": 3, "target_boundary": 4}]}
    api = viewer_api()
    api[("POST", "v1/translations")] = lambda req: reply(200, {"model": "mt", "data": [
        {"translation": "Guten Morgen<br>Danke sehr<img>", "segments": [segment]}]})
    s = open_viewer(site, api)
    s.pg.click("#tab-document")
    s.pg.select_option("#model", "mt")
    s.pg.select_option("#doc-format", "html")
    s.pg.fill("#input", "Good morning<br>Thanks<img>")
    submit_and_wait(s, "document")
    rows = s.pg.eval_on_selector_all("#document table.tags tbody tr",
                                     "rs => rs.map(r => [...r.cells].map(c => c.textContent))")
    assert rows == [["<br>", "before word 2 (Thanks)", "before word 2 (Danke)"],
                    ["<img>", "before word 3 (end)", "before word 4 (end)"]]
    assert s.bodies("v1/translations")[-1] == {"model": "mt", "input": "Good morning<br>Thanks<img>",
                                               "format": "html", "return_alignment": True}
