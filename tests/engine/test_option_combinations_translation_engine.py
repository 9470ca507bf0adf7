"""`/v1/translations` where its options meet the engine's and the server's: streaming beside a document of several
greedy sentences, an input's layout, a multilingual model's language-code token and a sentence cut by max_tokens;
the translation memory beside `cache: false` (streamed or not), max_tokens and truncated translations; the
server's --no-prefix-cache and --max-model-len reaching a translator it loads. Every app runs in this process
(`httpx.ASGITransport`) on the committed tiny fixtures, so that the tests take seconds."""

from __future__ import annotations

import json

import pytest

from tests.helpers import factories
from tests.helpers.in_process import InProcessApp

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels


class Translations(InProcessApp):
    def one(self, **body) -> dict:
        (item,) = self.post("/v1/translations", body).json()["data"]
        return item

    def chunks(self, **body) -> list[dict]:
        """A streamed translation's chunks (without the closing [DONE])."""
        text = self.post("/v1/translations", body | {"stream": True}).text
        assert text.rstrip().endswith("data: [DONE]")
        return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


@pytest.fixture(scope="module")
def mt(tmp_path_factory):
    """The tiny English → German translator with a translation memory file of its own."""
    root = tmp_path_factory.mktemp("mt-engine")
    app = Translations({"mt": factories.tiny_mt_dir(root / "mt")}, translation_memory=str(root / "memory.sqlite"))
    yield app
    app.stop()


@pytest.fixture(scope="module")
def nllb(tmp_path_factory):
    root = tmp_path_factory.mktemp("nllb-engine")
    app = Translations({"nllb": factories.hf_nllb_dir(root / "nllb")})
    yield app
    app.stop()


# ------------------------------------------------------------------------------------------------------------
# Streaming
# ------------------------------------------------------------------------------------------------------------
def test_a_greedy_document_of_several_sentences_streams_sentence_by_sentence(mt):
    """Token-by-token chunks are for one greedy sentence; a greedy document of two sentences streams a chunk per
    sentence, ending with what the non-streamed answer says, not an error."""
    body = {"input": "Good morning, where is the station? Hello world.", "num_beams": 1, "cache": False}
    whole = mt.post("/v1/translations", body).json()
    chunks = mt.chunks(**body)
    assert all("error" not in c for c in chunks), chunks
    assert [c["data"][0]["segment"] for c in chunks] == [0, 1]
    last = chunks[-1]
    assert last["data"][0]["translation"] == whole["data"][0]["translation"]
    assert "".join(c["data"][0]["delta"] for c in chunks) == whole["data"][0]["translation"]
    assert last["usage"] == whole["usage"] and last["finish_reason"] == "stop"


def test_a_streamed_greedy_sentence_keeps_the_layout_around_it(mt):
    """An input's whitespace before and after its sentence is kept: the streamed greedy translation's deltas add
    up to the non-streamed answer, trailing newlines included."""
    body = {"input": "  hello world\n\n", "num_beams": 1, "cache": False}
    whole = mt.one(**body)["translation"]
    assert whole.startswith("  ") and whole.endswith("\n\n")
    chunks = mt.chunks(**body)
    assert chunks[-1]["data"][0]["translation"] == whole
    assert "".join(c["data"][0]["delta"] for c in chunks) == whole


def test_a_streamed_document_finishes_by_length_when_an_earlier_sentence_was_cut(mt):
    """finish_reason is "length" when any sentence stopped at max_tokens, not only the last one: here the first
    sentence is cut and the second ends by eos."""
    first, second = "the quick brown fox jumps over the dog.", "Hello world."
    body = {"num_beams": 2, "max_tokens": 8, "cache": False}
    assert mt.chunks(input=first, **body)[-1]["finish_reason"] == "length"
    assert mt.chunks(input=second, **body)[-1]["finish_reason"] == "stop"
    chunks = mt.chunks(input=f"{first} {second}", **body)
    assert len(chunks) == 2 and chunks[-1]["finish_reason"] == "length"


def test_a_multilingual_greedy_stream_counts_every_token_in_usage(nllb):
    """An NLLB translation's first token is the target language's code, which has no text: a streamed greedy
    translation skips it as a chunk but still counts it, so its usage is the non-streamed answer's."""
    body = {"input": "good morning where is the station", "source_lang": "en", "target_lang": "de",
            "num_beams": 1, "cache": False}  # (the memory would answer a stream in one chunk)
    whole = nllb.post("/v1/translations", body).json()
    chunks = nllb.chunks(**body)
    assert len(chunks) > 2  # token by token
    assert chunks[-1]["data"][0]["translation"] == whole["data"][0]["translation"]
    assert chunks[-1]["usage"] == whole["usage"] and whole["usage"]["completion_tokens"] > 2


# ------------------------------------------------------------------------------------------------------------
# The translation memory
# ------------------------------------------------------------------------------------------------------------
def test_cache_false_neither_reads_nor_fills_the_memory_streamed_or_not(mt):
    """`cache: false`: the sentence is translated afresh and not kept; once another request kept it, a
    `cache: false` request, streamed or not, still does not read it."""
    memory = mt.registry.models["mt"].memory
    body = {"input": "my three daughters are nice today", "num_beams": 2}
    entries, hits = len(memory), memory.hits
    fresh = mt.one(**body, cache=False)
    assert (len(memory), memory.hits) == (entries, hits)
    assert mt.one(**body) == fresh  # translated and kept
    assert len(memory) == entries + 1
    hits = memory.hits
    assert mt.one(**body, cache=False) == fresh
    assert memory.hits == hits
    assert mt.one(**body) == fresh and memory.hits == hits + 1
    # Streamed too: a greedy sentence the memory holds is decoded token by token again with `cache: false`.
    greedy = {"input": body["input"], "num_beams": 1}
    kept = mt.one(**greedy)["translation"]
    hits = memory.hits
    chunks = mt.chunks(**greedy, cache=False)
    assert len(chunks) > 2 and chunks[-1]["data"][0]["translation"] == kept and memory.hits == hits


def test_a_kept_translation_does_not_answer_a_request_with_fewer_max_tokens(mt):
    """A sentence kept whole (it ended by eos) is not the answer to the same sentence asked with a lower
    max_tokens: that one is cut as a fresh translation would be."""
    sentence = "where is the station today my friend"
    whole = mt.one(input=sentence, num_beams=1)["translation"]  # kept
    cut = mt.one(input=sentence, num_beams=1, max_tokens=3, cache=False)["translation"]
    assert cut != whole
    assert mt.one(input=sentence, num_beams=1, max_tokens=3)["translation"] == cut
    assert mt.one(input=sentence, num_beams=1)["translation"] == whole


def test_a_translation_cut_by_max_tokens_is_not_kept(mt):
    """Only translations that ended by eos are kept: a sentence cut at max_tokens is translated again each time,
    and its stream says "length" every time, not "stop" as an answer from the memory would."""
    memory = mt.registry.models["mt"].memory
    body = {"input": "the dog knows the quick king", "num_beams": 1, "max_tokens": 3}
    entries = len(memory)
    for _ in range(2):
        chunks = mt.chunks(**body)
        assert chunks[-1]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == 3
        assert len(memory) == entries
    mt.one(**body)
    assert len(memory) == entries


# ------------------------------------------------------------------------------------------------------------
# The server's settings reach a translator it loads
# ------------------------------------------------------------------------------------------------------------
def test_no_prefix_cache_and_max_model_len_reach_a_translator(tmp_path):
    """--no-prefix-cache: a translator encodes an identical source again (no encoder output kept for reuse);
    --max-model-len: its sources and targets are held to that many tokens, so a larger max_tokens is refused."""
    app = Translations({"mt": factories.tiny_mt_dir(tmp_path / "mt")}, prefix_cache=False, max_model_len=16)
    try:
        engine = app.registry.models["mt"].engine
        assert engine.translator.max_target_len == 16 and engine.translator.max_source_len == 16
        reuses = engine.m.encoder_reuses._value.get()
        body = {"input": "hello world good morning", "num_beams": 2}
        first = app.one(**body)
        assert app.one(**body) == first
        assert engine.m.encoder_reuses._value.get() == reuses
        assert engine.runner.cross_slots_held == 0 and engine.runner.blocks.num_in_use == 0
        refused = app.post("/v1/translations", body | {"max_tokens": 17}, 400).json()
        assert "16" in json.dumps(refused)
        app.post("/v1/translations", body | {"max_tokens": 16})
    finally:
        app.stop()
