"""The translation memory and LibreTranslate's API where they meet another feature: the memory's key beside the
source's characters (full-width letters are another sentence for a tokenizer without NFKC), the served dtype,
a generation config replaced under the same name, and a pivoted HTML page with `cache=false`; language detection
beside a multilingual model (`/v1/translations` and `/translate_file` with no source) and `/detect` beside a
language that is only translated into. A memory hit must be what the model computes for those options; a
request with other options must not get another request's remembered answer. Every app runs in this process
(`httpx.ASGITransport`) on the committed fixtures, so that the tests take seconds."""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import pytest

from tests.engine.test_option_combinations_translation import mt, pivot  # noqa: F401 - module fixtures
from tests.files.test_option_combinations_files import FileApp
from tests.helpers import factories
from tests.helpers.in_process import InProcessApp

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels

SENTENCE = "three daughters know the king"
GERMAN = "Guten Morgen, wo ist der Bahnhof?"


def one(app, **body) -> dict:  # noqa: ANN001 - an InProcessApp
    (item,) = app.post("/v1/translations", body).json()["data"]
    return item


def counts(memory) -> tuple[int, int, int]:  # noqa: ANN001 - a TranslationMemory
    return memory.hits, memory.misses, len(memory)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """A one-pair English → German translator beside a multilingual one (NLLB-style codes), with a memory and a
    file directory: German → English goes to the multilingual model."""
    root = tmp_path_factory.mktemp("memory-pairs-mixed")
    app = FileApp(root, {"mt": factories.tiny_mt_dir(root / "mt"), "nllb": factories.hf_nllb_dir(root / "nllb")})
    yield app
    app.stop()


# ------------------------------------------------------------------------------------------------------------
# The memory's key beside the source's characters, the dtype and the generation config
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("plain, other", [
    (SENTENCE, "three daughters know the \uff4b\uff49\uff4e\uff47"),  # "king" in full-width letters
    ("the king is nice today", "the king is\u00a0nice today"),  # a no-break space
    ("the king is nice today", "the king is  nice today"),  # two spaces
    ("the café is nice today", "the cafe\u0301 is nice today"),  # é as e and a combining accent
], ids=["full-width", "no-break-space", "two-spaces", "decomposed"])
def test_a_sentence_spelled_otherwise_is_not_answered_with_the_stored_spellings_translation(mt, plain, other):  # noqa: F811
    """The key is the sentence as the model reads it: this byte-level tokenizer normalises nothing, so each
    spelling is other ids, translates otherwise (its score at least) and is its own entry, never the stored
    spelling's answer."""
    fresh = one(mt, input=other, cache=False)
    assert fresh != one(mt, input=plain, cache=False), "the two must translate differently for this test"
    one(mt, input=plain)  # kept
    assert one(mt, input=other) == fresh  # translated, not answered with the other spelling's entry
    assert one(mt, input=other) == fresh  # now from its own entry


def test_a_memory_file_shared_with_a_bfloat16_server_keeps_each_dtypes_own_answers(mt, tmp_path):  # noqa: F811
    """Two servers of the same weights share one memory file: the one that holds them in bfloat16 computes other
    numbers, so it misses what the float32 one stored; a server of a copy of the same weights and dtype (another
    directory) hits it, since it would compute the same."""
    served = mt.registry.models["mt"]
    memory_file = mt.app.state.settings.translation_memory
    body = {"input": "the king is nice today", "num_beams": 2, "n": 2}
    kept = one(mt, **body)  # stored by the float32 server
    half = InProcessApp({"mt": served.loaded.path}, dtype="bfloat16", translation_memory=memory_file)
    try:
        memory = half.registry.models["mt"].memory
        assert memory is served.memory  # one memory per file in a process
        hits, misses, _ = counts(memory)
        got = one(half, **body)
        assert (memory.hits, memory.misses) == (hits, misses + 1)
        assert got == one(half, **body, cache=False)
    finally:
        half.stop()
    copy = shutil.copytree(served.loaded.path, tmp_path / "copy")
    same = InProcessApp({"mt": copy}, translation_memory=memory_file)
    try:
        hits, misses, _ = counts(memory)
        assert one(same, **body) == kept
        assert (memory.hits, memory.misses) == (hits + 1, misses)
    finally:
        same.stop()


@pytest.mark.parametrize(("quantize", "first", "second"), [
    ("int8", {"int8_activations": "full"}, {"int8_activations": "7bit"}),
    ("int4", {"int4_group_size": 32}, {"int4_group_size": 64}),
], ids=["int8-activations", "int4-group-size"])
def test_servers_of_one_format_computed_otherwise_keep_their_own_answers_in_a_shared_memory(
        mt, tmp_path, quantize, first, second):  # noqa: F811
    """The same weights quantized the same way but computed otherwise (int8's activation scheme, int4's group
    size) give other numbers: a server that shares the memory file misses what the other stored, and one set up
    the same way hits it."""
    path = mt.registry.models["mt"].loaded.path
    memory_file = str(tmp_path / "memory.sqlite")
    body = {"input": "the king is nice today", "num_beams": 2, "n": 2}
    apps = []
    try:
        for options in (first, second, first):
            apps.append(InProcessApp({"mt": path}, quantize=quantize, translation_memory=memory_file, **options))
        memory = apps[0].registry.models["mt"].memory
        one(apps[0], **body)  # stored
        hits, misses, _ = counts(memory)
        assert one(apps[1], **body) == one(apps[1], **body, cache=False)
        assert (memory.hits, memory.misses) == (hits, misses + 1)  # computed otherwise: not answered from it
        hits, misses, _ = counts(memory)
        one(apps[2], **body)
        assert (memory.hits, memory.misses) == (hits + 1, misses)
    finally:
        for app in apps:
            app.stop()


def test_a_translator_reloaded_with_another_generation_config_is_not_answered_from_the_old_ones_memory(
        mt, tmp_path):  # noqa: F811
    """The weights are the same bytes but generation.json's length_penalty changes every score: a translator
    replaced under its name by that checkpoint answers as it computes, not with what the old one stored."""
    source = mt.registry.models["mt"].loaded.path
    old = shutil.copytree(source, tmp_path / "old")
    new = shutil.copytree(source, tmp_path / "new")
    generation = json.loads((new / "generation.json").read_text())
    generation["length_penalty"] = 2.0
    (new / "generation.json").write_text(json.dumps(generation))
    app = InProcessApp({"lp": old}, translation_memory=str(tmp_path / "memory.sqlite"))
    try:
        body = {"input": SENTENCE, "num_beams": 2, "n": 2}
        before = one(app, **body)
        assert one(app, **body) == before  # kept, then answered from the memory
        app.registry.load_model("lp", new)
        after = one(app, **body)
        assert after == one(app, **body, cache=False)
        assert after["score"] != before["score"]
    finally:
        app.stop()


# ------------------------------------------------------------------------------------------------------------
# cache=false beside a pivoted HTML page
# ------------------------------------------------------------------------------------------------------------
def test_a_pivoted_html_page_with_cache_false_neither_reads_nor_fills_either_hops_memory(pivot):  # noqa: F811
    """An HTML page goes through each hop of a pivot whole: cache=false must reach both hops there too, as it
    does for a text's sentences."""
    memories = [pivot.registry.models[name].memory for name in ("de-en", "en-fr")]
    page = "<p>der <b>König</b> ist heute schön</p>"
    body = {"input": page, "format": "html", "source_lang": "de", "target_lang": "fr"}
    kept = pivot.v1(**body)["data"][0]["translation"]  # both hops keep their sentence
    before = [counts(m) for m in memories]
    assert pivot.v1(**body, cache=False)["data"][0]["translation"] == kept
    other = pivot.v1(**body | {"input": "<p>drei <i>Töchter</i></p>"}, cache=False)
    assert other["models"] == ["de-en", "en-fr"]
    assert [counts(m) for m in memories] == before


# ------------------------------------------------------------------------------------------------------------
# Language detection beside a multilingual model, and /detect beside /languages and /translate
# ------------------------------------------------------------------------------------------------------------
def test_v1_translations_without_a_model_or_source_detect_the_source_for_a_multilingual_model(mixed):
    """No model and no source_lang: the source is detected (German) and German → English is the multilingual
    model's, which must be told the detected source, as a request naming it is."""
    want = one(mixed, model="nllb", input=GERMAN, source_lang="de", target_lang="en", cache=False)
    got = mixed.post("/v1/translations", {"input": GERMAN, "target_lang": "en", "cache": False}).json()
    assert got["model"] == "nllb"
    assert got["data"][0]["translation"] == want["translation"]


def test_libretranslate_translates_a_file_of_a_detected_source_with_a_multilingual_model(mixed):
    """`/translate_file` with source=auto: the file's language (German) is detected and handed to the
    multilingual model, whose file comes back as a job naming the model and both languages makes it."""
    data = f"{GERMAN}\n".encode()

    async def go() -> bytes:
        transport = httpx.ASGITransport(app=mixed.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as c:
            resp = await c.post("/translate_file", files={"file": ("a.txt", data)},
                                data={"source": "auto", "target": "en"})
            assert resp.status_code == 200, resp.text
            return (await c.get(resp.json()["translatedFileUrl"])).content

    _, asked = mixed.job("a.txt", data, model="nllb", source_lang="de", target_lang="en")
    assert asyncio.run(go()) == asked


def test_detect_offers_a_language_that_is_only_translated_into(pivot):  # noqa: F811
    """de → en and en → fr are served: French is no translator's source, but /languages lists it and
    /translate with source=auto recognises a French text (and answers it as it is); /detect, over the languages
    the translators read or write, must name it too."""
    french = "Bonjour, où est la gare ? Je voudrais un café, s'il vous plaît."
    codes = {lang["code"] for lang in pivot.request("GET", "/languages").json()}
    assert "fr" in codes
    detected = pivot.post("/detect", {"q": french}).json()
    assert detected[0]["language"] == "fr"
    assert {d["language"] for d in detected} <= codes
    got = pivot.lt(q=french, source="auto", target="fr")
    assert got["detectedLanguage"]["language"] == "fr" and got["translatedText"] == french


def test_an_html_pages_language_is_detected_on_the_text_it_shows(pivot):  # noqa: F811
    """source=auto with format=html, on LibreTranslate's /translate and on /v1/translations: the page's language
    is that of its text, not of its tags and attributes (English words whatever the page's language). A German
    page into English is translated by the German → English model, as the same page with source de is."""
    page = '<div class="greeting"><span>Guten</span> <a href="/x">Morgen</a></div>'
    asked = pivot.lt(q=page, source="de", target="en", format="html")["translatedText"]
    got = pivot.lt(q=page, source="auto", target="en", format="html")
    assert got["detectedLanguage"]["language"] == "de" and got["translatedText"] == asked != page
    v1 = pivot.post("/v1/translations", {"input": page, "target_lang": "en", "format": "html"}).json()
    assert v1["model"] == "de-en" and v1["data"][0]["translation"] == asked
