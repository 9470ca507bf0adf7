"""The inspection routes' extensions where they meet another feature in one request: `return_attention` on a
completion of several prompts of different lengths with n > 1, echo, logprobs and a stop string; on a translation
of several inputs, with beams and n > 1 or a glossary; the weight bounds (--max-attention-floats) counted over
every choice and the longest input; the logit lens's bound (--max-lens-entries) over the layers asked for; several
texts of different lengths embedded as floats and as base64; Open Inference Protocol translations of several
texts with n > 1. Each answer is compared with a reference computed another way: the model's maps of exactly the
tokens returned (`lm_attention_ids`, `translation_attention_ids`), the input alone, or `/v1/attention` with the
returned translation as its target. Every app runs in this process (`httpx.ASGITransport`) on the tiny committed
models, so that the tests take seconds."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from tests.helpers import factories
from tests.helpers.in_process import InProcessApp
from tserve.model.attention_maps import lm_attention_ids, translation_attention_ids

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels

# Bounds that the ordinary requests below stay under, with room to tell a count that is too small.
MAX_ATTENTION_FLOATS = 20_000
MAX_LENS_ENTRIES = 400
PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog. Der schnelle"]  # 1 and many tokens
SENTENCES = ["hello", "three daughters know the king", "the quick brown fox jumps over the lazy dog"]


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    root = tmp_path_factory.mktemp("inspection-pairs")
    served = InProcessApp({"lm": factories.tiny_lm_dir(root / "lm"), "mt": factories.tiny_mt_dir(root / "mt")},
                          max_attention_floats=MAX_ATTENTION_FLOATS, max_lens_entries=MAX_LENS_ENTRIES)
    yield served
    served.stop()


def loaded(app: InProcessApp, name: str):  # noqa: ANN201 - a LoadedModel
    return app.registry.models[name].loaded


def token_ids(app: InProcessApp, name: str, tokens: list[str]) -> list[int]:
    """The ids of token strings as the tokenizer names them in a map (`query_tokens`)."""
    tok = loaded(app, name).tokenizer
    ids = {t: i for i, t in reversed(list(enumerate(tok.tokens(range(tok.vocab_size)))))}
    return [ids[t] for t in tokens]


# ------------------------------------------------------------------------------------------------------------
# Completions: return_attention beside several prompts, n > 1, echo, logprobs and stop strings
# ------------------------------------------------------------------------------------------------------------
def test_each_choices_maps_are_its_own_prompt_and_tokens_when_prompts_differ_and_n_is_two(app):
    """Two prompts of different lengths, n = 2 sampled choices each, echo and logprobs: choice i's maps read
    prompt i // n followed by exactly the tokens that choice returned (its logprobs' tokens after the echoed
    prompt), one query row per returned token, with the weights the model gives that sequence."""
    lm = loaded(app, "lm")
    layers, heads = [1], [0, 2]
    body = {"model": "lm", "prompt": PROMPTS, "n": 2, "max_tokens": 6, "temperature": 1.0, "seed": 11,
            "echo": True, "logprobs": 0, "return_attention": {"layers": layers, "heads": heads}}
    choices = app.post("/v1/completions", body).json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for c in choices:
        prompt = PROMPTS[c["index"] // 2]
        prompt_ids = lm.tokenizer.encode(prompt)
        returned = len(c["logprobs"]["tokens"]) - len(prompt_ids)  # echo lists the prompt's tokens first
        assert c["text"].startswith(prompt) and 1 <= returned <= 6
        (got,) = c["attention"]["maps"]
        tokens = got["query_tokens"]
        assert len(tokens) == returned
        assert got["key_tokens"] == lm.tokenizer.tokens(prompt_ids) + tokens
        (want,) = lm_attention_ids(lm, prompt_ids + token_ids(app, "lm", tokens), layers, heads, len(prompt_ids))
        torch.testing.assert_close(torch.tensor(got["weights"]), want.weights, atol=1e-5, rtol=1e-4)


def test_a_choice_cut_by_a_stop_string_has_the_maps_of_the_tokens_it_returned(app):
    """A stop string that ends the second prompt's answer early: its maps have one row per token it returned
    (its logprobs' tokens), after its own prompt, with the weights the model gives that sequence."""
    lm = loaded(app, "lm")
    prompt = PROMPTS[1]
    base = {"model": "lm", "prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 0,
            "return_attention": {"layers": [0], "heads": [1]}}
    full = app.post("/v1/completions", base).json()["choices"][0]
    stop = full["text"][len(full["text"]) // 2:][:3]
    assert stop.strip(), full["text"]
    cut = app.post("/v1/completions", base | {"stop": [stop], "prompt": [PROMPTS[0], prompt]}).json()["choices"][1]
    assert cut["finish_reason"] == "stop" and len(cut["text"]) < len(full["text"])
    (got,) = cut["attention"]["maps"]
    tokens = got["query_tokens"]
    assert len(tokens) == len(cut["logprobs"]["tokens"])
    prompt_ids = lm.tokenizer.encode(prompt)
    (want,) = lm_attention_ids(lm, prompt_ids + token_ids(app, "lm", tokens), [0], [1], len(prompt_ids))
    torch.testing.assert_close(torch.tensor(got["weights"]), want.weights, atol=1e-5, rtol=1e-4)


def _lm_floats(prompt_tokens: int, max_tokens: int, outputs: int, heads: int = 4) -> int:
    """What return_attention may return at most: per output sequence, one layer's heads of max_tokens rows of
    the prompt and max_tokens keys."""
    return outputs * heads * max_tokens * (prompt_tokens + max_tokens)


def test_the_completion_weight_bound_counts_every_choice_and_the_longest_prompt(app):
    """--max-attention-floats before generating: all heads of one layer fit one choice of the short prompt but
    are refused for n = 2 choices of it; half the heads fit two short prompts but are refused for the short
    prompt beside the long one (the long one's rows count, whichever comes first)."""
    lm = loaded(app, "lm")
    short, long = (len(lm.tokenizer.encode(p)) for p in PROMPTS)
    max_tokens = 60
    assert lm.config.n_heads == 4
    assert _lm_floats(short, max_tokens, 1) <= MAX_ATTENTION_FLOATS < _lm_floats(short, max_tokens, 2)
    assert _lm_floats(short, max_tokens, 2, heads=2) <= MAX_ATTENTION_FLOATS < _lm_floats(long, max_tokens, 2, heads=2)
    base = {"model": "lm", "prompt": PROMPTS[0], "max_tokens": max_tokens, "temperature": 0,
            "return_attention": {"layers": [0]}}
    app.post("/v1/completions", base)
    half = {"layers": [0], "heads": [0, 1]}
    app.post("/v1/completions", base | {"prompt": [PROMPTS[0], PROMPTS[0]], "return_attention": half})
    for more in ({"n": 2}, {"prompt": [PROMPTS[0], PROMPTS[1]], "return_attention": half}):
        refused = app.post("/v1/completions", base | more, status=400).json()["error"]
        assert refused["code"] == "too_many_weights", more


# ------------------------------------------------------------------------------------------------------------
# Translations: return_attention beside several inputs, beams with n > 1, a glossary
# ------------------------------------------------------------------------------------------------------------
def _maps(item: dict) -> dict[str, dict]:
    return {m["module"]: m for m in item["attention"]["maps"]}


def test_each_inputs_translation_maps_are_those_it_has_alone(app):
    """Three inputs of different lengths in one request: each item's maps are the ones the same input has when
    translated alone, and read that input's own source tokens."""
    mt = loaded(app, "mt")
    body = {"model": "mt", "num_beams": 1, "max_tokens": 12, "cache": False,
            "return_attention": {"layers": [1], "heads": [0, 3]}}
    together = app.post("/v1/translations", body | {"input": SENTENCES}).json()["data"]
    for text, item in zip(SENTENCES, together, strict=True):
        (alone,) = app.post("/v1/translations", body | {"input": [text]}).json()["data"]
        assert item["translation"] == alone["translation"]
        got, want = _maps(item), _maps(alone)
        assert got["decoder.cross"]["key_tokens"] == mt.tokenizer.tokens(mt.tokenizer.encode(text))
        for module in ("decoder.self", "decoder.cross"):
            assert got[module]["query_tokens"] == want[module]["query_tokens"], (text, module)
            np.testing.assert_allclose(got[module]["weights"], want[module]["weights"], atol=1e-5)


@pytest.mark.parametrize("extra", [{"num_beams": 4, "n": 3}, {"num_beams": 2, "glossary": {"king": "Hund"}}],
                         ids=["beams-n3", "glossary"])
def test_a_beam_translations_maps_read_the_translation_it_returns(app, extra):
    """With beams and several alternatives, or a glossary term the search must place: the maps are the model
    reading the source and producing the translation returned first (its best), as teacher-forcing that
    translation computes them; and usage counts that translation's tokens."""
    mt = loaded(app, "mt")
    eos = mt.config.eos_token_id
    body = {"model": "mt", "input": [SENTENCES[1]], "cache": False,
            "return_attention": {"layers": [0, 1], "heads": [1]}} | extra
    answer = app.post("/v1/translations", body).json()
    (item,) = answer["data"]
    if "glossary" in extra:
        assert "Hund" in item["translation"]
    else:
        assert len({a["translation"] for a in item["alternatives"]}) == 3
    src = mt.tokenizer.encode(SENTENCES[1])
    target = [t for t in mt.tokenizer.encode_target(item["translation"]) if t != eos]
    want = {(m.module, m.layer): m for m in translation_attention_ids(mt, src, target, [0, 1], [1])}
    got = item["attention"]["maps"]
    assert {(m["module"], m["layer"]) for m in got} == {k for k in want if k[0] != "encoder.self"}
    for m in got:
        ref = want[(m["module"], m["layer"])]
        assert m["query_tokens"] == ref.query_tokens, m["module"]
        torch.testing.assert_close(torch.tensor(m["weights"]), ref.weights, atol=1e-5, rtol=1e-4)


def test_the_translation_weight_bound_counts_the_longest_input(app):
    """--max-attention-floats over several inputs: a selection that fits a short input alone is refused when a
    long input comes after it (its source length counts), before anything is translated."""
    body = {"model": "mt", "num_beams": 1, "max_tokens": 20, "cache": False,
            "return_attention": {"layers": [0, 1], "heads": [0, 1, 2, 3]}}
    app.post("/v1/translations", body | {"input": [SENTENCES[0]]})
    refused = app.post("/v1/translations", body | {"input": [SENTENCES[0], SENTENCES[2]]},
                       status=400).json()["error"]
    assert refused["code"] == "too_many_weights"


# ------------------------------------------------------------------------------------------------------------
# The logit lens's bound over the layers asked for
# ------------------------------------------------------------------------------------------------------------
def test_the_lens_bound_counts_the_layers_asked_for(app):
    """--max-lens-entries counts layers x positions x top_k of the selection: one layer of a text fits where
    every layer of it does not, and its entries are the last layer's of the whole lens."""
    lm = loaded(app, "lm")
    text = PROMPTS[1]
    positions = len(lm.tokenizer.encode(text))
    top_k = MAX_LENS_ENTRIES // (2 * positions)
    layers = lm.config.n_layers + 1
    assert top_k >= 1 and layers * positions * top_k > MAX_LENS_ENTRIES >= positions * top_k
    one = app.post("/v1/logit_lens", {"model": "lm", "input": text, "layers": [layers - 1], "top_k": top_k}).json()
    assert [entry["layer"] for entry in one["layers"]] == [layers - 1]
    assert len(one["layers"][0]["positions"]) == positions
    refused = app.post("/v1/logit_lens", {"model": "lm", "input": text, "top_k": top_k}, status=400).json()
    assert refused["error"]["code"] == "too_many_entries"


# ------------------------------------------------------------------------------------------------------------
# Embeddings of several texts of different lengths, as floats and as base64
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["lm", "mt"])
def test_several_texts_embed_as_each_alone_in_both_encodings_and_count_their_own_tokens(app, model):
    """Texts of 1 to many tokens in one request: each vector is the one the text has alone, base64 gives the
    same float32 values, and usage counts each text's own tokens (not the padded batch)."""
    texts = [SENTENCES[0], PROMPTS[1], SENTENCES[1]]
    floats = app.post("/v1/embeddings", {"model": model, "input": texts}).json()
    packed = app.post("/v1/embeddings", {"model": model, "input": texts, "encoding_format": "base64"}).json()
    tok = loaded(app, model).tokenizer
    tokens = sum(len(tok.encode(t)) for t in texts)
    assert floats["usage"] == packed["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    for i, text in enumerate(texts):
        (alone,) = app.post("/v1/embeddings", {"model": model, "input": text}).json()["data"]
        got = np.frombuffer(base64.b64decode(packed["data"][i]["embedding"]), dtype="<f4")
        np.testing.assert_allclose(floats["data"][i]["embedding"], alone["embedding"], atol=1e-5)
        np.testing.assert_array_equal(got, np.asarray(floats["data"][i]["embedding"], dtype=np.float32))


# ------------------------------------------------------------------------------------------------------------
# Open Inference Protocol: several texts with n > 1
# ------------------------------------------------------------------------------------------------------------
def test_oip_alternatives_of_several_texts_are_each_texts_own_padded_to_n(app):
    """Several texts with parameters n and num_beams: `alternatives` is [texts, n], row i the alternatives
    /v1/translations gives text i with the same options, "" where it has fewer than n distinct ones."""
    n = 4
    texts = [SENTENCES[0], SENTENCES[1]]
    out = app.post("/v2/models/mt/infer", {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2],
                                                       "data": texts}],
                                           "parameters": {"n": n, "num_beams": n}}).json()["outputs"]
    alternatives = next(o for o in out if o["name"] == "alternatives")
    assert alternatives["shape"] == [2, n] and len(alternatives["data"]) == 2 * n
    for i, text in enumerate(texts):
        (item,) = app.post("/v1/translations", {"model": "mt", "input": [text], "n": n,
                                                "num_beams": n}).json()["data"]
        want = [a["translation"] for a in item["alternatives"]]
        assert alternatives["data"][i * n:(i + 1) * n] == want + [""] * (n - len(want)), text
