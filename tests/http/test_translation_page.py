"""`GET /`: the translation page is self-contained (nothing fetched from other origins) and, driven by a
headless Chromium through Playwright, translates as one types (what `POST /v1/translations` answers, with its
alternatives and their scores; debounced, the latest text winning over late answers), detects the language
with Auto detect, swaps the languages and the texts, asks for the API key when the server wants one, shows the
API's errors, and translates a file through the file jobs (`POST /v1/translations/files`, the job's event
stream, its download).

The browser tests need Playwright (the dev extra) and a Chromium at /usr/bin/chromium (or $TSERVE_CHROMIUM);
without them they are skipped, unless $TSERVE_REQUIRE_BROWSER or $CI is set, where they fail instead. They are marked
slow (Chromium's start and the page's waits): CI runs them, `make test` leaves them out.
TSERVE_UPDATE_SCREENSHOTS=1 writes the page's picture in the README to docs/translation-page.png."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import httpx
import pytest

from tests.helpers import factories
from tests.helpers.browser import PageRefs, chromium
from tests.helpers.server import ROOT, ServerProcess

KEY = "page-key-0123456789"
ENGLISH = "the quick brown fox jumps"
GERMAN = "der schnelle braune Fuchs springt"
SCREENSHOT = ROOT / "docs" / "translation-page.png"
ACCEPTED = ".txt .md .html .htm .docx .pptx .odt .odp .srt .vtt .epub"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The committed tiny translators, English→German and German→English, each naming its pair."""
    root = tmp_path_factory.mktemp("page-models")
    return {"en-de": factories.tiny_mt_dir(root / "en-de", languages=("en", "de")),
            "de-en": factories.tiny_mt_dir(root / "de-en", reverse=True, languages=("de", "en"))}


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    srv = ServerProcess(factories.model_flags(checkpoints),
                        tmp_path_factory.mktemp("page-logs") / "server.log").wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def keyed_server(checkpoints, tmp_path_factory):
    """API keys on; the page and what it reads before the key is typed are public."""
    srv = ServerProcess(factories.model_flags(checkpoints) + [
        "--public-paths", "/,/frontend/settings,/languages,/healthz,/readyz"],
        tmp_path_factory.mktemp("page-key-logs") / "server.log", env={"TSERVE_API_KEYS": KEY}).wait_ready()
    yield srv
    srv.stop()


def translation(server, text: str, source: str, target: str, key: str | None = None, **options) -> dict:
    resp = httpx.post(server.url + "/v1/translations", timeout=120,
                      json={"input": text, "source_lang": source, "target_lang": target} | options,
                      headers={"Authorization": f"Bearer {key}"} if key else {})
    assert resp.status_code == 200, resp.text
    return resp.json()["data"][0]


# --------------------------------------------------------------------------------------------------
# Plain HTTP
# --------------------------------------------------------------------------------------------------
def test_page_is_self_contained(server):
    resp = httpx.get(server.url + "/", timeout=10)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/html")
    csp = resp.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "script-src 'unsafe-inline'" in csp
    html = resp.text
    assert "<script src" not in html.lower() and "<link" not in html.lower()
    for attr in ("src", "href", "action"):
        assert not re.search(rf"""{attr}\s*=\s*["']?\s*(https?:)?//""", html, re.I), attr
    assert not re.search(r"@import|url\(\s*[\"']?\s*(https?:)?//", html, re.I)
    assert re.findall(r"https?://", html) == []
    parser = PageRefs()
    parser.feed(html)
    assert parser.refs == ["viewer"]  # the one link: the attention viewer, beside the page
    assert {"source-lang", "target-lang", "swap", "source-text", "target-text", "alternatives", "copy", "api-key",
            "key-message", "error", "drop-zone", "file", "choose-file", "job-progress", "job-cancel",
            "job-download"} <= parser.ids
    # Both scripts are inlined, and the API routes they call are there.
    assert "/* translate.js */" not in html and "/* files.js */" not in html
    assert "window.tservePage" in html and "v1/translations/files" in html and "/events" in html
    assert ACCEPTED in html


def test_page_is_public_where_the_keys_say(keyed_server):
    assert httpx.get(keyed_server.url + "/", timeout=10).status_code == 200
    assert httpx.get(keyed_server.url + "/languages", timeout=10).status_code == 200
    assert httpx.post(keyed_server.url + "/v1/translations", json={"input": ENGLISH}, timeout=10).status_code == 401


# --------------------------------------------------------------------------------------------------
# Headless Chromium
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def browser():
    with chromium() as b:
        yield b


class Opened:
    """Opens the page in fresh browser contexts; when the test ends, fails it if a page asked for anything
    from another origin or logged a JavaScript error."""

    def __init__(self, browser) -> None:
        self.browser = browser
        self.contexts = []
        self.foreign: list[str] = []
        self.js_errors: list[str] = []

    def __call__(self, srv, width: int = 1280, height: int = 900, init_script: str | None = None, ready=True):
        context = self.browser.new_context(viewport={"width": width, "height": height}, accept_downloads=True)
        context.grant_permissions(["clipboard-read", "clipboard-write"], origin=srv.url)
        self.contexts.append(context)
        if init_script:
            context.add_init_script(init_script)
        pg = context.new_page()
        pg.set_default_timeout(30_000)

        def route(r):
            if r.request.url.startswith(srv.url + "/"):
                r.fallback()
            else:
                self.foreign.append(r.request.url)
                r.abort()

        pg.route("**/*", route)
        pg.on("pageerror", lambda exc: self.js_errors.append(str(exc)))
        # Chromium logs every 4xx answer as "Failed to load resource"; the error tests ask for those.
        pg.on("console", lambda msg: self.js_errors.append(msg.text)
              if msg.type == "error" and not msg.text.startswith("Failed to load resource") else None)
        pg.goto(srv.url + "/")
        if ready:
            pg.wait_for_selector("body[data-ready='true']", state="attached")
        return pg

    def close(self) -> None:
        for context in self.contexts:
            context.close()


@pytest.fixture
def open_page(browser):
    opened = Opened(browser)
    yield opened
    opened.close()
    assert opened.foreign == [], f"the page asked for other origins: {opened.foreign}"
    assert opened.js_errors == [], f"JavaScript errors: {opened.js_errors}"


def _options(pg, select: str) -> list[str]:
    return pg.eval_on_selector_all(f"{select} option", "os => os.map(o => o.value)")


def _wait_translation_of(pg, text: str) -> str:
    """The target box once it holds the translation of `text`."""
    pg.wait_for_function("t => document.getElementById('target-text').dataset.source === t", arg=text)
    return pg.input_value("#target-text")


def _alternatives(pg) -> list[tuple[str, str]]:
    return pg.eval_on_selector_all("#alternatives button", "bs => bs.map(b => [b.querySelector('.alt-text')"
                                   ".textContent, b.querySelector('.alt-score').textContent])")


def _screenshot(pg, tmp_path: Path, name: str, docs: bool = False) -> None:
    """To the test's directory; with `docs` and $TSERVE_UPDATE_SCREENSHOTS, also the README's picture."""
    pg.screenshot(path=str(tmp_path / name), full_page=True)
    if docs and os.environ.get("TSERVE_UPDATE_SCREENSHOTS"):
        pg.screenshot(path=str(SCREENSHOT), full_page=True)
        from PIL import Image  # a page's flat colours in a palette: the picture at about a third of its size

        Image.open(SCREENSHOT).convert("RGB").quantize(colors=256).save(SCREENSHOT, optimize=True)


# Holds the answer to the text in window.slowInput back for 1.5 s, whatever the page aborts, so that it
# comes back after the answer to a newer text.
LATE_ANSWER = """
(() => {
  const original = window.fetch.bind(window);
  window.slowInput = null;
  window.lateAnswered = false;
  window.fetch = async (url, init) => {
    const body = init && typeof init.body === "string" ? JSON.parse(init.body) : null;
    if (String(url).endsWith("v1/translations") && body && body.input === window.slowInput) {
      const { signal, ...rest } = init;
      const resp = await original(url, rest);
      await new Promise((resolve) => setTimeout(resolve, 1500));
      setTimeout(() => { window.lateAnswered = true; }, 200);
      return resp;
    }
    return original(url, init);
  };
})();
"""


@pytest.mark.slow
@pytest.mark.browser
def test_browser_translates_as_one_types(open_page, server, tmp_path):
    pg = open_page(server, init_script=LATE_ANSWER)
    asked: list[dict] = []
    pg.on("request", lambda r: asked.append(json.loads(r.post_data))
          if r.method == "POST" and r.url.endswith("/v1/translations") else None)
    pg.select_option("#source-lang", "en")
    assert _options(pg, "#target-lang") == ["de"]

    # Typed key by key: one request once the typing stops (not one per key), with 3 alternatives from 4 beams.
    text = "the quick brown fox jumps over the lazy dog"
    pg.click("#source-text")
    pg.keyboard.type(text, delay=25)
    expected = translation(server, text, "en", "de", n=3, num_beams=4)
    assert _wait_translation_of(pg, text) == expected["translation"]
    assert asked[-1] == {"input": text, "source_lang": "en", "target_lang": "de", "n": 3, "num_beams": 4}
    assert 1 <= len(asked) < len(text) // 3, [a["input"] for a in asked]
    assert pg.is_hidden("#error")
    assert pg.inner_text("#model-used") == "model: en-de"
    alternatives = expected["alternatives"]
    assert len(alternatives) == 3
    assert _alternatives(pg) == [[a["translation"], f"score {a['score']:.3f}"] for a in alternatives]
    assert pg.get_attribute("#alternatives li:nth-child(1) button", "aria-pressed") == "true"

    # An alternative, clicked, goes into the target box; Copy puts the box's text on the clipboard.
    pg.click("#alternatives li:nth-child(2) button")
    assert pg.input_value("#target-text") == alternatives[1]["translation"]
    assert pg.get_attribute("#alternatives li:nth-child(2) button", "aria-pressed") == "true"
    assert pg.get_attribute("#alternatives li:nth-child(1) button", "aria-pressed") == "false"
    pg.click("#copy")
    pg.wait_for_selector("#copy[data-copied='true']", state="attached")
    assert pg.evaluate("navigator.clipboard.readText()") == alternatives[1]["translation"]

    # Another text replaces it.
    again = "hello world"
    pg.fill("#source-text", again)
    assert _wait_translation_of(pg, again) == translation(server, again, "en", "de", n=3, num_beams=4)["translation"]
    assert len(_alternatives(pg)) == 3

    # The latest text wins: the answer to an older text that comes back after a newer one's is dropped.
    older, newer = "good morning", "the lazy dog"
    pg.evaluate("t => { window.slowInput = t; }", older)
    with pg.expect_request(lambda r: r.url.endswith("/v1/translations") and older in (r.post_data or "")):
        pg.fill("#source-text", older)
    pg.fill("#source-text", newer)
    want = translation(server, newer, "en", "de", n=3, num_beams=4)["translation"]
    assert _wait_translation_of(pg, newer) == want
    pg.wait_for_function("() => window.lateAnswered")
    assert pg.input_value("#target-text") == want
    assert pg.get_attribute("#target-text", "data-source") == newer

    # Emptied: nothing to show, nothing asked.
    count = len(asked)
    pg.click("#clear")
    pg.wait_for_function("() => document.getElementById('target-text').value === ''")
    assert pg.is_hidden("#alternatives-box") and len(asked) == count and pg.is_disabled("#copy")
    _screenshot(pg, tmp_path, "typed.png")


@pytest.mark.slow
@pytest.mark.browser
def test_browser_auto_detect_and_swap(open_page, server, tmp_path):
    pg = open_page(server)
    # Two pairs served: Auto detect first and chosen, every target offered, nothing to swap.
    assert _options(pg, "#source-lang") == ["auto", "en", "de"]
    assert pg.eval_on_selector("#source-lang option", "o => o.textContent") == "Auto detect"
    assert pg.input_value("#source-lang") == "auto"
    assert sorted(_options(pg, "#target-lang")) == ["de", "en"]
    assert pg.is_disabled("#swap")

    # Auto detect: /detect names the language, the translation is that language's.
    pg.select_option("#target-lang", "en")
    pg.fill("#source-text", GERMAN)
    assert _wait_translation_of(pg, GERMAN) == translation(server, GERMAN, "de", "en", n=3, num_beams=4)["translation"]
    assert pg.inner_text("#detected").startswith("Detected: German")
    assert pg.get_attribute("#detected", "data-language") == "de"
    # A text already in the target language comes back as it is.
    english = "Where is the station? The train leaves at noon."
    pg.fill("#source-text", english)
    assert _wait_translation_of(pg, english) == english
    assert "already in English" in pg.inner_text("#status")

    # A language picked: its targets only; swap exchanges the languages and the texts, and translates back.
    pg.select_option("#source-lang", "en")
    assert _options(pg, "#target-lang") == ["de"] and pg.inner_text("#detected") == ""
    pg.fill("#source-text", ENGLISH)
    german = _wait_translation_of(pg, ENGLISH)
    assert german == translation(server, ENGLISH, "en", "de", n=3, num_beams=4)["translation"]
    assert pg.is_enabled("#swap")
    swapped = pg.evaluate("""() => {
        document.getElementById('swap').click();
        return ['source-lang', 'target-lang', 'source-text', 'target-text'].map(id => document.getElementById(id).value);
    }""")
    assert swapped == ["de", "en", german, ENGLISH]
    assert _wait_translation_of(pg, german) == translation(server, german, "de", "en", n=3, num_beams=4)["translation"]
    pg.select_option("#source-lang", "auto")
    assert pg.is_disabled("#swap")

    # Auto detect into German.
    pg.select_option("#target-lang", "de")
    pg.fill("#source-text", "the quick brown fox jumps over the lazy dog")
    _wait_translation_of(pg, "the quick brown fox jumps over the lazy dog")
    assert pg.inner_text("#detected").startswith("Detected: English")
    _screenshot(pg, tmp_path, "auto.png")

    # A narrow window: one column, the target below the source, nothing wider than the window.
    pg.set_viewport_size({"width": 380, "height": 800})
    source_box, target_box = pg.locator("#source-text").bounding_box(), pg.locator("#target-text").bounding_box()
    assert target_box["y"] >= source_box["y"] + source_box["height"]
    assert pg.evaluate("document.documentElement.scrollWidth") <= 380
    assert pg.is_visible("#swap") and pg.is_visible("#choose-file")


@pytest.mark.slow
@pytest.mark.browser
def test_browser_asks_for_the_api_key(open_page, keyed_server):
    pg = open_page(keyed_server)
    assert pg.is_visible("#api-key")  # /frontend/settings says keyRequired
    pg.select_option("#source-lang", "en")
    pg.fill("#source-text", ENGLISH)
    pg.wait_for_selector("#key-message:not(.hidden)")
    assert "needs an API key" in pg.inner_text("#key-message") and "HTTP 401" in pg.inner_text("#key-message")
    assert "(HTTP 401)" in pg.inner_text("#error")
    assert pg.input_value("#target-text") == ""

    pg.fill("#api-key", "not-the-key")
    pg.wait_for_function("() => document.getElementById('key-message').textContent.includes('refused this API key')")
    pg.fill("#api-key", KEY)
    expected = translation(keyed_server, ENGLISH, "en", "de", key=KEY, n=3, num_beams=4)["translation"]
    assert _wait_translation_of(pg, ENGLISH) == expected
    assert pg.is_hidden("#key-message") and pg.is_hidden("#error")
    assert len(_alternatives(pg)) == 3

    # The key stays in this browser: a reload translates with it, Auto detect (/detect) included.
    pg.reload()
    pg.wait_for_selector("body[data-ready='true']", state="attached")
    assert pg.input_value("#api-key") == KEY
    pg.select_option("#target-lang", "en")
    pg.fill("#source-text", GERMAN)
    assert _wait_translation_of(pg, GERMAN) == translation(keyed_server, GERMAN, "de", "en", key=KEY)["translation"]
    assert pg.get_attribute("#detected", "data-language") == "de"

    # /detect without the key answers 403 in LibreTranslate's shape: shown too.
    pg.fill("#api-key", "")
    pg.fill("#source-text", ENGLISH + " over")
    pg.wait_for_function("() => document.getElementById('error').textContent.includes('HTTP 403')")
    assert pg.is_visible("#key-message")


@pytest.mark.slow
@pytest.mark.browser
def test_browser_shows_errors_and_retries_without_beams(open_page, server):
    pg = open_page(server)
    pg.select_option("#source-lang", "en")

    # A server whose limits refuse num_beams: asked once more without n and num_beams, no alternatives then.
    def refuse_beams(route):
        body = json.loads(route.request.post_data)
        if "n" in body or "num_beams" in body:
            route.fulfill(status=400, content_type="application/json", body=json.dumps({"error": {
                "message": "num_beams 4 exceeds the 2 decoder rows this server runs (--max-running-requests)",
                "type": "invalid_request_error", "code": "request_too_large", "param": "num_beams"}}))
        else:
            route.fallback()

    pg.route("**/v1/translations", refuse_beams)
    pg.fill("#source-text", ENGLISH)
    assert _wait_translation_of(pg, ENGLISH) == translation(server, ENGLISH, "en", "de")["translation"]
    assert pg.is_hidden("#alternatives-box") and pg.is_hidden("#error")
    pg.unroute("**/v1/translations", refuse_beams)

    # The API's own error message, with the status.
    pg.route("**/v1/translations", lambda route: route.fulfill(status=503, content_type="application/json", body=json.dumps(
        {"error": {"message": "the model is loading", "type": "server_overloaded", "code": "unavailable"}})))
    pg.fill("#source-text", "hello world")
    pg.wait_for_selector("#error:not(.hidden)")
    assert pg.inner_text("#error") == "the model is loading (HTTP 503)"
    assert pg.is_hidden("#key-message")
    pg.unroute("**/v1/translations")

    # A pair nobody serves (the server's 400), and LibreTranslate's {"error": "..."} from /detect.
    pg.route("**/detect", lambda route: route.fulfill(status=400, content_type="application/json",
                                                      body=json.dumps({"error": "Invalid request: missing q"})))
    pg.select_option("#source-lang", "auto")
    pg.wait_for_function("() => document.getElementById('error').textContent.includes('missing q (HTTP 400)')")


# --------------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------------
def _file_endpoints_present(server) -> bool:
    """Whether this server has the file jobs: a request without a file is refused by the route (4xx), an
    absent route answers 404 Not Found."""
    resp = httpx.post(server.url + "/v1/translations/files", data={"target_lang": "de"}, timeout=30)
    return not (resp.status_code == 404 and resp.json().get("error", {}).get("message") == "Not Found")


@pytest.mark.slow
@pytest.mark.browser
def test_browser_translates_a_file(open_page, server, tmp_path):
    if not _file_endpoints_present(server):
        pytest.skip("file endpoints not present")
    pg = open_page(server, height=860)
    text = "the quick brown fox jumps over the lazy dog"
    # Typed text and a file side by side (the picture in the README).
    pg.fill("#source-text", text)
    _wait_translation_of(pg, text)
    pg.select_option("#source-lang", "en")
    pg.set_input_files("#file", files=[{"name": "report.txt", "mimeType": "text/plain", "buffer": text.encode()}])
    pg.wait_for_selector("#job[data-status='succeeded']", state="attached", timeout=120_000)
    bar = pg.eval_on_selector("#job-progress", "b => [b.value, b.max, +b.dataset.done, +b.dataset.total]")
    assert bar[0] == bar[1] and bar[2] == bar[3] >= 1
    assert pg.inner_text("#job-status") == "Done" and pg.is_hidden("#job-cancel") and pg.is_hidden("#file-error")
    pg.wait_for_selector("#job-download:not(.hidden)")
    assert pg.get_attribute("#job-download", "download") == "de-report.txt"
    with pg.expect_download() as caught:
        pg.click("#job-download")
    download = caught.value
    assert download.suggested_filename == "de-report.txt"
    got = Path(download.path()).read_text(encoding="utf-8")
    assert got.strip() == translation(server, text, "en", "de")["translation"].strip()
    pg.locator("#job-download").blur()
    _screenshot(pg, tmp_path, "file.png", docs=True)


def _job(job_id: str, status: str, done: int, total: int, error: dict | None = None) -> dict:
    return {"id": job_id, "object": "translation.job", "status": status, "filename": "report.txt",
            "done_segments": done, "total_segments": total,
            "download_url": f"/v1/translations/jobs/{job_id}/file", "error": error}


def _events(*jobs: dict) -> str:
    return "".join(f"data: {json.dumps(j)}\n\n" for j in jobs)


@pytest.mark.slow
@pytest.mark.browser
def test_browser_follows_file_jobs_as_the_api_describes_them(open_page, server):
    """The file API as the page reads it, answered by stubs: the form it sends (with the key), the event
    stream, polling where the stream breaks, the download's name, cancelling, a failed job, and what it
    refuses before sending."""
    pg = open_page(server, init_script=f"localStorage.setItem('tserve.apiKey', '{KEY}')")
    seen: list[tuple[str, str, str | None]] = []
    forms: list[bytes] = []
    polls = {"job-2": 0}
    cancelled: set[str] = set()

    def files_api(route):
        req = route.request
        path = req.url.removeprefix(server.url)
        seen.append((req.method, path, req.headers.get("authorization")))
        if path == "/v1/translations/files":
            body = req.post_data_buffer
            forms.append(body)
            job_id = "job-1" if b"job one" in body else "job-2" if b"job two" in body else "job-3"
            route.fulfill(status=202, content_type="application/json", body=json.dumps(_job(job_id, "queued", 0, 0)))
        elif path == "/v1/translations/jobs/job-1/events":
            route.fulfill(content_type="text/event-stream", body=_events(
                _job("job-1", "running", 0, 3), _job("job-1", "running", 2, 3), _job("job-1", "succeeded", 3, 3)))
        elif path == "/v1/translations/jobs/job-1/file":
            route.fulfill(content_type="text/plain", body="der schnelle braune Fuchs")
        elif path == "/v1/translations/jobs/job-2/events":  # the stream breaks: the page polls
            route.fulfill(status=500, content_type="application/json", body=json.dumps({"error": {"message": "x"}}))
        elif path == "/v1/translations/jobs/job-2" and req.method == "GET":
            polls["job-2"] += 1
            job = _job("job-2", "cancelled", 1, 4) if "job-2" in cancelled else _job("job-2", "running", 1, 4)
            route.fulfill(content_type="application/json", body=json.dumps(job))
        elif path == "/v1/translations/jobs/job-2" and req.method == "DELETE":
            cancelled.add("job-2")
            route.fulfill(content_type="application/json", body=json.dumps(_job("job-2", "cancelled", 1, 4)))
        elif path == "/v1/translations/jobs/job-3/events":  # ends without a terminal status: the page polls
            route.fulfill(content_type="text/event-stream", body=_events(_job("job-3", "running", 0, 2)))
        elif path == "/v1/translations/jobs/job-3":
            route.fulfill(content_type="application/json", body=json.dumps(
                _job("job-3", "failed", 1, 2, {"message": "segment 2 could not be translated"})))
        else:
            route.fulfill(status=404, content_type="application/json", body=json.dumps({"error": {"message": path}}))

    pg.route(re.compile(r".*/v1/translations/(files|jobs/.*)$"), files_api)

    # Auto detect with two pairs served: the page asks for the file's language instead of sending it.
    pg.set_input_files("#file", files=[{"name": "report.txt", "mimeType": "text/plain", "buffer": b"job one"}])
    pg.wait_for_selector("#file-error:not(.hidden)")
    assert "Choose the file's language" in pg.inner_text("#file-error") and seen == []
    # A type the API does not take.
    pg.select_option("#source-lang", "en")
    pg.set_input_files("#file", files=[{"name": "photo.png", "mimeType": "image/png", "buffer": b"\x89PNG"}])
    pg.wait_for_function("() => document.getElementById('file-error').textContent.includes('photo.png')")
    assert seen == []

    # The event stream to the end; the download is named after the target language.
    pg.set_input_files("#file", files=[{"name": "report.txt", "mimeType": "text/plain", "buffer": b"job one"}])
    pg.wait_for_selector("#job-download:not(.hidden)")
    assert pg.is_hidden("#file-error")
    assert pg.eval_on_selector("#job-progress", "b => [b.value, b.max]") == [3, 3]
    assert pg.inner_text("#job-count") == "3 / 3 segments" and pg.inner_text("#job-status") == "Done"
    assert pg.get_attribute("#job-download", "download") == "de-report.txt"
    with pg.expect_download() as caught:
        pg.click("#job-download")
    assert caught.value.suggested_filename == "de-report.txt"
    assert Path(caught.value.path()).read_text() == "der schnelle braune Fuchs"
    assert [(m, p) for m, p, _ in seen] == [("POST", "/v1/translations/files"),
                                           ("GET", "/v1/translations/jobs/job-1/events"),
                                           ("GET", "/v1/translations/jobs/job-1/file")]

    # The stream fails: polling; Cancel sends DELETE and the job ends cancelled.
    pg.set_input_files("#file", files=[{"name": "report.txt", "mimeType": "text/plain", "buffer": b"job two"}])
    pg.wait_for_function("() => document.getElementById('job-count').textContent === '1 / 4 segments'")
    assert pg.is_hidden("#job-download") and pg.is_visible("#job-cancel")
    assert pg.eval_on_selector("#job-progress", "b => [b.value, b.max]") == [1, 4]
    pg.click("#job-cancel")
    pg.wait_for_selector("#job[data-status='cancelled']", state="attached")
    assert pg.inner_text("#job-status") == "Cancelled" and pg.is_hidden("#job-cancel") and pg.is_hidden("#job-download")
    assert ("DELETE", "/v1/translations/jobs/job-2") in [(m, p) for m, p, _ in seen] and polls["job-2"] >= 1

    # The stream ends early: polling finds the job failed, and its error is shown.
    pg.set_input_files("#file", files=[{"name": "report.txt", "mimeType": "text/plain", "buffer": b"job three"}])
    pg.wait_for_selector("#job[data-status='failed']", state="attached")
    assert pg.inner_text("#file-error") == "segment 2 could not be translated"
    assert pg.is_hidden("#job-download")

    assert {auth for _, _, auth in seen} == {f"Bearer {KEY}"}
    assert len(forms) == 3
    for body in forms:  # the multipart form: the file under its name, the languages picked
        assert b'name="file"; filename="report.txt"' in body
        assert b'name="source_lang"\r\n\r\nen\r\n' in body and b'name="target_lang"\r\n\r\nde\r\n' in body


@pytest.mark.slow
@pytest.mark.browser
def test_browser_file_drop_zone_takes_a_dropped_file(open_page, server):
    """Dropping a file starts the same job as choosing one."""
    pg = open_page(server)
    pg.select_option("#source-lang", "en")
    sent: list[bytes] = []

    def files_api(route):
        sent.append(route.request.post_data_buffer)
        route.fulfill(status=400, content_type="application/json",
                      body=json.dumps({"error": {"message": "the file is empty", "type": "invalid_request_error"}}))

    pg.route("**/v1/translations/files", files_api)
    handle = pg.evaluate_handle("""() => {
        const data = new DataTransfer();
        data.items.add(new File(['hello world'], 'notes.md', { type: 'text/markdown' }));
        return data;
    }""")
    pg.dispatch_event("#drop-zone", "dragenter", {"dataTransfer": handle})
    assert "dragging" in pg.get_attribute("#drop-zone", "class")
    pg.dispatch_event("#drop-zone", "drop", {"dataTransfer": handle})
    pg.wait_for_selector("#file-error:not(.hidden)")
    assert pg.inner_text("#file-error") == "the file is empty (HTTP 400)"
    assert "dragging" not in pg.get_attribute("#drop-zone", "class")
    assert len(sent) == 1 and b'filename="notes.md"' in sent[0] and b"hello world" in sent[0]
    assert pg.is_hidden("#job")
