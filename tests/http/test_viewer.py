"""`GET /viewer`: the page is self-contained (nothing fetched from other origins), and, driven by a headless
Chromium through Playwright, draws what `/v1/attention` answers: the heatmap of a language model with its
tooltip, the alignment view of a translation, the [CLS] attention of a ViT, the logit lens grid of
`/v1/logit_lens`, a translated document's word alignments and tag placements (`/v1/translations` with
return_alignment), and the API's errors.

The browser tests need Playwright (the dev extra) and a Chromium at /usr/bin/chromium (or $TSERVE_CHROMIUM);
without them they are skipped, unless $TSERVE_REQUIRE_BROWSER or $CI is set, where they fail instead. They are marked
slow (Chromium's start and the page's waits): CI runs them, `make test` leaves them out."""

from __future__ import annotations

import base64
import io
import re

import httpx
import pytest
from PIL import Image, ImageDraw

from tests.helpers import factories
from tests.helpers.browser import PageRefs, chromium
from tests.helpers.server import ServerProcess

SVG_NS = "http://www.w3.org/2000/svg"
LM_TEXT = "The quick brown fox jumps over the lazy dog"
MT_TEXT = "Good morning, where is the station?"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("viewer-models")
    checkpoints = factories.tiny_model_set(root)
    for family in ("mistral", "qwen3"):  # grouped-query attention; SentencePiece and byte-level tokens
        checkpoints[family] = factories.hf_family_dir(family, root / family)
    args = factories.model_flags(checkpoints)
    srv = ServerProcess(args, tmp_path_factory.mktemp("viewer-logs") / "server.log").wait_ready()
    yield srv
    srv.stop()


def attention(server, **body) -> dict:
    resp = httpx.post(server.url + "/v1/attention", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def shown(token: str) -> str:
    """A token as the page labels it (whitespace made visible)."""
    return token.replace(" ", "\u2423").replace("\n", "\u21b5").replace("\t", "\u21e5")


# --------------------------------------------------------------------------------------------------
# Plain HTTP
# --------------------------------------------------------------------------------------------------
def test_viewer_page_is_self_contained(server):
    resp = httpx.get(server.url + "/viewer", timeout=10)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/html")
    html = resp.text
    assert "<script src" not in html.lower() and "<link" not in html.lower()
    for attr in ("src", "href"):
        assert not re.search(rf"""{attr}\s*=\s*["']?\s*(https?:)?//""", html, re.I), attr
    assert not re.search(r"@import|url\(\s*[\"']?\s*(https?:)?//", html, re.I)
    # The only absolute URL is the SVG namespace (a name, never fetched).
    assert set(re.findall(r"https?://[^\s\"'<>)]+", html)) <= {SVG_NS}
    parser = PageRefs()
    parser.feed(html)
    assert parser.refs == []
    assert {"model", "input", "target", "image", "submit", "module", "layer", "head", "heatmap", "alignment",
            "vit", "error", "tooltip", "tab-lens", "lens", "top-k", "tab-document", "document", "doc-format"} <= parser.ids
    assert "/* viewer.js */" not in html and "window.tserveViewer" in html and "v1/logit_lens" in html
    assert "/* document.js */" not in html and "return_alignment" in html
    csp = resp.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp


def test_viewer_html_ships_with_the_package():
    from importlib import resources

    static = resources.files("tserve.service").joinpath("static")
    assert static.joinpath("viewer.html").is_file() and 'id="heatmap"' in static.joinpath("viewer.html").read_text()
    assert all(static.joinpath(name).is_file() for name in ("viewer.js", "lens.js", "document.js"))


# --------------------------------------------------------------------------------------------------
# Headless Chromium
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def browser():
    with chromium() as b:
        yield b


@pytest.fixture
def page(browser, server):
    """The viewer in a fresh page; fails the test if the page asks for anything from another origin or logs
    a JavaScript error."""
    context = browser.new_context(viewport={"width": 1360, "height": 1000})
    pg = context.new_page()
    pg.set_default_timeout(30_000)
    foreign: list[str] = []
    js_errors: list[str] = []

    def route(r):
        if r.request.url.startswith(server.url + "/"):
            r.continue_()
        else:
            foreign.append(r.request.url)
            r.abort()

    pg.route("**/*", route)
    pg.on("pageerror", lambda exc: js_errors.append(str(exc)))
    # Chromium logs every 4xx answer as "Failed to load resource"; the error tests ask for those.
    pg.on("console", lambda msg: js_errors.append(msg.text)
          if msg.type == "error" and not msg.text.startswith("Failed to load resource") else None)
    pg.goto(server.url + "/viewer")
    pg.wait_for_selector("#model option[value='lm']", state="attached")
    yield pg
    context.close()
    assert foreign == [], f"the page asked for other origins: {foreign}"
    assert js_errors == [], f"JavaScript errors: {js_errors}"


def _submit_and_wait(pg, *views: str) -> None:
    for v in views:
        pg.eval_on_selector(f"#{v}", "e => e.dataset.rendered = 'false'")
    pg.click("#submit")
    for v in views:
        pg.wait_for_selector(f"#{v}[data-rendered='true']", state="attached")


def _tooltip(pg) -> str:
    pg.wait_for_selector("#tooltip:not(.hidden)")
    return pg.inner_text("#tooltip")


@pytest.mark.slow
@pytest.mark.browser
def test_browser_language_model_heatmap(page, server, tmp_path):
    expected = attention(server, model="lm", input=LM_TEXT)
    maps = {(m["module"], m["layer"]): m for m in expected["maps"]}
    last = max(layer for module, layer in maps)
    m = maps[("decoder.self", last)]
    n_q, n_k = len(m["query_tokens"]), len(m["key_tokens"])

    page.select_option("#model", "lm")
    page.fill("#input", LM_TEXT)
    _submit_and_wait(page, "heatmap")

    # Defaults: the LM's only module, its last layer, head 0.
    assert page.input_value("#module") == "decoder.self"
    assert page.input_value("#layer") == str(last)
    assert page.input_value("#head") == "0"
    assert page.eval_on_selector_all("#layer option", "os => os.map(o => o.value)") == \
        [str(layer) for module, layer in sorted(maps) if module == "decoder.self"]
    assert page.eval_on_selector_all("#head option", "os => os.length") == len(m["weights"]) + 1  # + mean
    assert page.locator("#heatmap rect.cell").count() == n_q * n_k
    assert page.get_attribute("#heatmap", "data-rows") == str(n_q)
    assert page.get_attribute("#heatmap", "data-cols") == str(n_k)
    assert page.eval_on_selector_all("#heatmap text.qlabel", "ts => ts.map(t => t.textContent)") == \
        [shown(t) for t in m["query_tokens"]]
    assert page.eval_on_selector_all("#heatmap text.klabel", "ts => ts.map(t => t.textContent)") == \
        [shown(t) for t in m["key_tokens"]]
    assert page.is_hidden("#alignment-panel") and page.is_hidden("#vit-panel") and page.is_hidden("#error")

    # Hover the strongest weight of the last row: the tooltip names both tokens and the weight.
    row = m["weights"][0][n_q - 1]
    j = max(range(n_k), key=row.__getitem__)
    page.hover(f"#heatmap rect.cell[data-q='{n_q - 1}'][data-k='{j}']")
    tip = _tooltip(page)
    assert f"weight {row[j]:.4f}" in tip
    assert shown(m["query_tokens"][n_q - 1]) in tip and shown(m["key_tokens"][j]) in tip
    assert "hot" in (page.get_attribute(f"#qlab-{n_q - 1}", "class") or "")
    page.screenshot(path=str(tmp_path / "lm-heatmap.png"), full_page=True)

    # Another layer and head: the cells show that map.
    page.select_option("#layer", "0")
    page.select_option("#head", "1")
    m0 = maps[("decoder.self", 0)]
    row = m0["weights"][1][n_q - 1]
    page.mouse.move(0, 0)
    page.hover(f"#heatmap rect.cell[data-q='{n_q - 1}'][data-k='0']")
    assert f"weight {row[0]:.4f}" in _tooltip(page)
    assert "layer 0 · head 1" in page.text_content("#heatmap-title")
    # Causal: nothing above the diagonal, so the first row's other cells are the ramp's lightest colour.
    fills = page.eval_on_selector_all("#heatmap rect.cell[data-q='0']", "rs => rs.map(r => r.getAttribute('fill'))")
    assert len(set(fills[1:])) == 1 and fills[0] != fills[1]

    # The mean of the heads.
    page.select_option("#head", "mean")
    page.mouse.move(0, 0)
    page.hover(f"#heatmap rect.cell[data-q='{n_q - 1}'][data-k='0']")
    mean = sum(h[n_q - 1][0] for h in m0["weights"]) / len(m0["weights"])
    assert f"weight {mean:.4f}" in _tooltip(page)

    # A long input: small cells, every token still has its cell and its label, only some labels show until
    # their row or column is hovered.
    long_text = " ".join([LM_TEXT] * 3)
    long = attention(server, model="lm", input=long_text, layers=[0])["maps"][0]
    n = len(long["query_tokens"])
    assert n > 80
    page.fill("#input", long_text)
    _submit_and_wait(page, "heatmap")
    assert page.locator("#heatmap rect.cell").count() == n * n
    assert page.locator("#heatmap text.qlabel").count() == n
    shown_labels = page.locator("#heatmap text.qlabel:not(.minor)").count()
    assert 1 < shown_labels < n
    minor = page.get_attribute("#heatmap text.qlabel.minor", "id")
    q = int(minor.removeprefix("qlab-"))
    page.hover(f"#heatmap rect.cell[data-q='{q}'][data-k='0']")
    assert shown(long["query_tokens"][q]) in _tooltip(page)
    assert page.is_visible(f"#{minor}")


@pytest.mark.slow
@pytest.mark.browser
@pytest.mark.parametrize("family", ["mistral", "qwen3"])
def test_browser_llama_family_heatmap(page, server, family):
    """A grouped-query model: one map per query head (4 over 2 kv heads), its tokens labelled as the API
    names them (SentencePiece's ▁ shown as a space)."""
    text = "Töchter über den König"
    expected = attention(server, model=family, input=text, layers=[1])["maps"][0]
    n_q, n_k = len(expected["query_tokens"]), len(expected["key_tokens"])
    assert len(expected["weights"]) == 4 and n_q == n_k
    page.select_option("#model", family)
    page.fill("#input", text)
    _submit_and_wait(page, "heatmap")
    assert page.eval_on_selector_all("#head option", "os => os.length") == 4 + 1  # + mean
    assert page.locator("#heatmap rect.cell").count() == n_q * n_k
    assert page.eval_on_selector_all("#heatmap text.qlabel", "ts => ts.map(t => t.textContent)") == \
        [shown(t) for t in expected["query_tokens"]]
    assert not any("\u2581" in t for t in expected["query_tokens"])
    page.select_option("#head", "3")
    row = expected["weights"][3][n_q - 1]
    page.hover(f"#heatmap rect.cell[data-q='{n_q - 1}'][data-k='0']")
    assert f"weight {row[0]:.4f}" in _tooltip(page)


@pytest.mark.slow
@pytest.mark.browser
def test_browser_translation_alignment(page, server, tmp_path):
    expected = attention(server, model="mt", input=MT_TEXT)
    cross = {m["layer"]: m for m in expected["maps"] if m["module"] == "decoder.cross"}
    last = max(cross)
    m = cross[last]
    src, tgt = m["key_tokens"], m["query_tokens"]

    page.select_option("#model", "mt")
    assert page.is_visible("#target") and page.is_hidden("#image")
    page.fill("#input", MT_TEXT)
    _submit_and_wait(page, "heatmap", "alignment")

    assert page.input_value("#module") == "decoder.cross"
    assert page.input_value("#layer") == str(last)
    assert page.eval_on_selector_all("#module option", "os => os.map(o => o.value)") == \
        ["encoder.self", "decoder.self", "decoder.cross"]
    assert expected["target"] in page.inner_text("#target-used")
    # Heatmap of the cross-attention: target rows, source columns.
    assert page.locator("#heatmap rect.cell").count() == len(tgt) * len(src)
    # Alignment: source tokens above, target tokens below, one line per pair.
    assert page.eval_on_selector_all("#alignment .tok.src text", "ts => ts.map(t => t.textContent)") == \
        [shown(t) for t in src]
    assert page.eval_on_selector_all("#alignment .tok.tgt text", "ts => ts.map(t => t.textContent)") == \
        [shown(t) for t in tgt]
    assert page.locator("#alignment line.link").count() == len(tgt) * len(src)
    src_y = page.eval_on_selector("#alignment .tok.src rect", "r => +r.getAttribute('y')")
    tgt_y = page.eval_on_selector("#alignment .tok.tgt rect", "r => +r.getAttribute('y')")
    assert src_y < tgt_y
    # Opacity and width follow the weight: by default relative to the largest weight of the target token's row.
    w = m["weights"][0]
    pairs = [(a, b) for a in range(len(tgt)) for b in range(len(src))]
    i, j = max(pairs, key=lambda p: w[p[0]][p[1]])
    link = f"#alignment line.link[data-q='{i}'][data-k='{j}']"
    assert float(page.get_attribute(link, "stroke-opacity")) == pytest.approx(1.0)
    weakest = min(pairs, key=lambda p: w[p[0]][p[1]] / max(w[p[0]]))
    weak_link = f"#alignment line.link[data-q='{weakest[0]}'][data-k='{weakest[1]}']"

    def opacities(weights, divisor):
        got = page.eval_on_selector_all("#alignment line.link", "ls => ls.map(l => [+l.dataset.q, +l.dataset.k, "
                                        "+l.getAttribute('stroke-opacity')])")
        assert len(got) == len(pairs)
        for a, b, o in got:
            assert o == pytest.approx(weights[a][b] / divisor(a), abs=1e-3), (a, b)

    opacities(w, lambda a: max(w[a]))
    assert float(page.get_attribute(weak_link, "stroke-width")) < float(page.get_attribute(link, "stroke-width"))
    page.select_option("#scale", "map")
    top = max(max(r) for r in w)
    opacities(w, lambda a: top)
    page.select_option("#scale", "absolute")
    opacities(w, lambda a: 1.0)
    page.select_option("#scale", "map")

    # Hovering a target token lights its lines and names its strongest source token.
    page.hover(f"#alignment .tok.tgt[data-i='{i}']")
    tip = _tooltip(page)
    assert shown(tgt[i]) in tip and f"strongest: {shown(src[j])} ({w[i][j]:.4f})" in tip
    assert page.locator("#alignment line.link.on").count() == len(src)
    page.screenshot(path=str(tmp_path / "mt-alignment.png"), full_page=True)

    # Another head changes the lines; a given target is scored instead of the model's own.
    page.select_option("#head", "2")
    w2 = m["weights"][2]
    opacities(w2, lambda a: max(max(r) for r in w2))
    page.fill("#target", "Guten Morgen")
    _submit_and_wait(page, "alignment")
    scored = attention(server, model="mt", input=MT_TEXT, target="Guten Morgen")
    m2 = next(x for x in scored["maps"] if x["module"] == "decoder.cross" and x["layer"] == last)
    assert "Guten Morgen" in page.inner_text("#target-used")
    assert page.locator("#alignment .tok.tgt").count() == len(m2["query_tokens"])
    assert page.locator("#alignment line.link").count() == len(m2["query_tokens"]) * len(m2["key_tokens"])
    page.screenshot(path=str(tmp_path / "mt-alignment-target.png"), full_page=True)


def _png() -> bytes:
    img = Image.new("RGB", (56, 56), "white")
    ImageDraw.Draw(img).ellipse((10, 10, 46, 46), outline="black", width=5)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.slow
@pytest.mark.browser
def test_browser_vit_cls_attention(page, server, tmp_path):
    png = _png()
    expected = attention(server, model="vit", image=base64.b64encode(png).decode())
    m = next(x for x in expected["maps"] if x["layer"] == max(y["layer"] for y in expected["maps"]))
    n = len(m["key_tokens"])

    page.select_option("#model", "vit")
    assert page.is_visible("#image") and page.is_hidden("#input")
    page.set_input_files("#image", files=[{"name": "circle.png", "mimeType": "image/png", "buffer": png}])
    page.wait_for_selector("#image[data-ready='true']", state="attached")  # FileReader is asynchronous
    _submit_and_wait(page, "heatmap", "vit")
    assert page.input_value("#module") == "encoder.self"
    assert page.locator("#heatmap rect.cell").count() == n * n
    assert page.get_attribute("#vit", "data-patches") == str(n - 1)
    assert page.is_visible("#vit canvas")
    # Hover the strongest patch: the tooltip names it.
    cls = m["weights"][0][0]
    p = max(range(1, n), key=cls.__getitem__)
    r, c = map(int, re.fullmatch(r"patch\((\d+),(\d+)\)", m["key_tokens"][p]).groups())
    grid = round((n - 1) ** 0.5)
    box = page.locator("#vit canvas").bounding_box()
    size = (box["width"] - 12) / 2
    page.mouse.move(box["x"] + size + 12 + (c + 0.5) * size / grid, box["y"] + (r + 0.5) * size / grid)
    tip = _tooltip(page)
    assert f"patch({r},{c})" in tip and f"weight {cls[p]:.4f}" in tip
    page.screenshot(path=str(tmp_path / "vit.png"), full_page=True)


@pytest.mark.slow
@pytest.mark.browser
def test_browser_shows_api_and_input_errors(page, server):
    page.select_option("#model", "lm")
    page.fill("#input", LM_TEXT)
    page.click("#options-summary")
    page.fill("#fetch-layers", "7")
    page.click("#submit")
    page.wait_for_selector("#error:not(.hidden)")
    assert "do not exist" in page.inner_text("#error") and "(HTTP 400)" in page.inner_text("#error")
    assert page.get_attribute("#heatmap", "data-rendered") == "false"

    page.fill("#fetch-layers", "")
    page.fill("#input", "   ")
    page.click("#submit")
    page.wait_for_function("() => document.getElementById('error').textContent.includes('type some text')")

    page.select_option("#model", "vit")
    assert page.is_hidden("#error")  # a new model clears the old error
    page.click("#submit")
    page.wait_for_function("() => document.getElementById('error').textContent.includes('choose an image')")


def lens(server, **body) -> dict:
    resp = httpx.post(server.url + "/v1/logit_lens", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.mark.slow
@pytest.mark.browser
def test_browser_logit_lens_grid(page, server, tmp_path):
    expected = lens(server, model="lm", input=LM_TEXT, top_k=3)
    tokens, layers = expected["tokens"], expected["layers"]

    page.click("#tab-lens")
    assert page.get_attribute("#tab-lens", "aria-selected") == "true"
    assert page.is_hidden("#heatmap-panel") and page.is_hidden("#selection-panel") and page.is_visible("#lens-panel")
    assert page.eval_on_selector("#model option[value='vit']", "o => o.disabled")  # a ViT has no lens
    page.select_option("#model", "lm")
    page.click("#options-summary")
    page.fill("#top-k", "3")
    page.fill("#input", LM_TEXT)
    _submit_and_wait(page, "lens")

    assert page.get_attribute("#lens", "data-rows") == str(len(layers))
    assert page.get_attribute("#lens", "data-cols") == str(len(tokens))
    assert page.locator("#lens rect.lcell").count() == len(layers) * len(tokens)
    # The last layer is the top row; every cell names its top token and is coloured by its probability.
    cells = page.eval_on_selector_all("#lens rect.lcell", "rs => rs.map(r => [+r.dataset.layer, +r.dataset.pos, "
                                      "+r.dataset.prob, r.getAttribute('fill')])")
    assert [c[0] for c in cells[:len(tokens)]] == [layers[-1]["layer"]] * len(tokens)
    by_cell = {(layer["layer"], j): p for layer in layers for j, p in enumerate(layer["positions"])}
    for layer, j, prob, _ in cells:
        assert prob == pytest.approx(by_cell[(layer, j)]["top"][0]["prob"], rel=1e-6)
    ranked = sorted(cells, key=lambda c: c[2])
    assert ranked[0][3] != ranked[-1][3]  # the colour follows the probability
    labels = page.eval_on_selector_all("#lens text.top", "ts => ts.map(t => t.dataset.token)")
    assert labels == [p["top"][0]["token"] for layer in reversed(layers) for p in layer["positions"]]
    hits = page.eval_on_selector_all("#lens text.top.hit", "ts => ts.length")
    assert hits == sum(p["top"][0]["token"] == tokens[j + 1] for layer in layers
                       for j, p in enumerate(layer["positions"][:-1]))
    assert page.eval_on_selector_all("#lens text.plabel", "ts => ts.length") == len(tokens)

    # Hover: the top-k of that layer and position, with their probabilities.
    last, j = layers[-1], 2
    page.hover(f"#lens rect.lcell[data-layer='{last['layer']}'][data-pos='{j}']")
    tip = _tooltip(page)
    assert f"layer {last['layer']} · after {shown(tokens[j])}" in tip
    for i, t in enumerate(last["positions"][j]["top"]):
        assert f"{i + 1}. {shown(t['token'])}  {t['prob']:.4f}" in tip or t["prob"] < 0.001
    page.screenshot(path=str(tmp_path / "lm-lens.png"), full_page=True)

    # A translator: the grid reads the model's own translation; a given target replaces it.
    page.select_option("#model", "mt")
    page.fill("#input", MT_TEXT)
    _submit_and_wait(page, "lens")
    own = lens(server, model="mt", input=MT_TEXT, top_k=3)
    assert page.get_attribute("#lens", "data-cols") == str(len(own["tokens"]))
    assert "".join(own["tokens"][1:]) in page.inner_text("#lens")
    page.fill("#target", "Guten Morgen")
    _submit_and_wait(page, "lens")
    given = lens(server, model="mt", input=MT_TEXT, target="Guten Morgen", top_k=3)
    assert page.get_attribute("#lens", "data-cols") == str(len(given["tokens"]))

    # Errors: a layer that does not exist, a bad top-k; back to the attention view.
    page.fill("#fetch-layers", "9")
    page.click("#submit")
    page.wait_for_selector("#error:not(.hidden)")
    assert "(HTTP 400)" in page.inner_text("#error")
    page.fill("#fetch-layers", "")
    page.fill("#top-k", "50")
    page.click("#submit")
    page.wait_for_function("() => document.getElementById('error').textContent.includes('top-k')")
    page.click("#tab-attention")
    assert page.is_hidden("#lens-panel") and page.is_visible("#heatmap-panel") and page.is_hidden("#error")
    assert page.inner_text("#submit") == "Show attention"


DOC_PAGE = ('<p>Good <b>morning</b>, where is <a href="/s?a=1&amp;b=2">the <i>station</i></a>?<br>Thank you.</p>'
            '<p>See you <em>tomorrow</em>.</p>')


def _translate(server, **body) -> dict:
    resp = httpx.post(server.url + "/v1/translations", json={"model": "mt", "return_alignment": True} | body,
                      timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()["data"][0]


def _chip_box(page, sec: str, side: str, i: int) -> tuple[float, float]:
    return tuple(page.eval_on_selector(f"{sec} .word.{side}[data-i='{i}'] rect",
                                       "r => [+r.getAttribute('x'), +r.getAttribute('x') + +r.getAttribute('width')]"))


@pytest.mark.slow
@pytest.mark.browser
def test_browser_document_view_draws_alignments_and_tag_placements(page, server, tmp_path):
    # A plain text of two sentences: one segment each, a line per aligned target word.
    text = "Good morning. Where is the station?"
    expected = _translate(server, input=text)
    page.click("#tab-document")
    assert page.is_visible("#document-panel") and page.is_hidden("#heatmap-panel") and page.is_hidden("#target-row")
    assert page.eval_on_selector_all("#model option:not([disabled])", "os => os.map(o => o.value)") == ["mt"]
    page.select_option("#model", "mt")
    page.fill("#input", text)
    _submit_and_wait(page, "document")
    assert page.get_attribute("#document", "data-segments") == str(len(expected["segments"])) == "2"
    assert page.text_content("#doc-translation") == expected["translation"]

    # An HTML page: its segments are blocks; each inline tag is a bar over its source and its target words.
    expected = _translate(server, input=DOC_PAGE, format="html")
    page.select_option("#doc-format", "html")
    page.fill("#input", DOC_PAGE)
    _submit_and_wait(page, "document")
    assert page.text_content("#doc-translation") == expected["translation"]
    assert page.locator("#doc-translation *").count() == 0  # the page's markup is shown as text, never run
    assert page.get_attribute("#document", "data-segments") == str(len(expected["segments"]))
    placed = 0
    for n, seg in enumerate(expected["segments"]):
        sec = f"#document .segment[data-segment='{n}']"
        for side, key in (("src", "source_words"), ("tgt", "target_words")):
            assert page.eval_on_selector_all(f"{sec} .word.{side} text", "ts => ts.map(t => t.textContent)") == seg[key]
        lines = page.eval_on_selector_all(f"{sec} line.aln", "ls => ls.map(l => [+l.dataset.t, +l.dataset.s])")
        assert lines == [[t, s] for t, s in enumerate(seg["alignment"]) if s >= 0]
        rows = page.eval_on_selector_all(f"{sec} table.tags tbody tr",
                                         "rs => rs.map(r => [...r.cells].map(c => c.textContent))")
        assert [r[0] for r in rows] == [t["tag"] for t in seg["tags"]]
        for k, tag in enumerate(seg["tags"]):
            if tag["kind"] != "span":
                continue
            assert rows[k][1] == " ".join(seg["source_words"][i] for i in tag["source_words"])
            assert rows[k][2] == (" ".join(seg["target_words"][i] for i in tag["target_words"]) or "(empty)")
            for side, key in (("src", "source_words"), ("tgt", "target_words")):
                bar = f"{sec} g.tagmark[data-tag='{k}'] rect.bar.{side}"
                if not tag[key]:
                    assert page.locator(bar).count() == 0
                    continue
                x0, x1 = page.eval_on_selector(bar, "r => [+r.getAttribute('x'), +r.getAttribute('x') + "
                                                    "+r.getAttribute('width')]")
                assert (x0, x1) == (_chip_box(page, sec, side, min(tag[key]))[0],
                                    _chip_box(page, sec, side, max(tag[key]))[1])
                placed += side == "tgt"
    assert placed, "no tag was placed on target words: the test would check nothing"
    assert {t["tag"] for seg in expected["segments"] for t in seg["tags"]} == {
        "<b>", '<a href="/s?a=1&amp;b=2">', "<i>", "<br>", "<em>"}

    # Hovering a target word names the source word it was read from.
    seg = expected["segments"][0]
    t = next(t for t, s in enumerate(seg["alignment"]) if s >= 0)
    page.hover(f"#document .segment[data-segment='0'] .word.tgt[data-i='{t}']")
    tip = _tooltip(page)
    assert f"target [{t}] {seg['target_words'][t]}" in tip
    assert f"read from: {seg['source_words'][seg['alignment'][t]]}" in tip
    page.screenshot(path=str(tmp_path / "document.png"), full_page=True)

    # Errors come back on the page; the other views are where they were.
    page.fill("#input", "<p><code>x</code></p>")
    page.click("#submit")
    page.wait_for_selector("#error:not(.hidden)")
    assert "(HTTP 400)" in page.inner_text("#error")
    page.click("#tab-attention")
    assert page.is_hidden("#document-panel") and page.is_visible("#heatmap-panel")
