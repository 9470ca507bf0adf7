"""`/v1/logit_lens` through a real server, on Hugging Face checkpoints: the last layer's guesses are the model's
own predictions (`transformers` is the reference) with the probabilities `/v1/completions` reports, layer k is
the model cut after k blocks, the first layers' guesses are not the last's; a translator's lens reads exactly the
translation `/v1/translations` returns; selections and size are bounded before the model runs."""

from __future__ import annotations

import math

import httpx
import pytest
import torch
import transformers

from tests.helpers import factories
from tests.helpers.server import ServerProcess
from tserve.model.checkpoint import load

TEXT = "the cat sat on the mat and the dog"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return factories.hf_model_set(tmp_path_factory.mktemp("lens-models"))


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    srv = ServerProcess([*factories.model_flags(models), "--max-lens-entries", "1000"],
                        tmp_path_factory.mktemp("logs") / "server.log").wait_ready()
    yield srv
    srv.stop()


def lens(server: ServerProcess, body: dict, status: int = 200) -> dict:
    resp = httpx.post(server.url + "/v1/logit_lens", json=body, timeout=60)
    assert resp.status_code == status, resp.text
    return resp.json()


def top1(layer: dict) -> list[str]:
    return [p["top"][0]["token"] for p in layer["positions"]]


def test_language_model_lens_ends_in_the_models_own_predictions(server, models):
    answer = lens(server, {"model": "gpt2", "input": TEXT, "top_k": 3})
    ours = load(models["gpt2"])
    ids = ours.tokenizer.encode(TEXT)
    assert answer["tokens"] == ours.tokenizer.tokens(ids)
    assert [layer["layer"] for layer in answer["layers"]] == list(range(ours.config.n_layers + 1))
    for layer in answer["layers"]:
        assert [p["token"] for p in layer["positions"]] == answer["tokens"]
        for p in layer["positions"]:
            probs = [t["prob"] for t in p["top"]]
            assert len(probs) == 3 and probs == sorted(probs, reverse=True) and sum(probs) <= 1 + 1e-5
    hf = transformers.GPT2LMHeadModel.from_pretrained(models["gpt2"]).eval()
    with torch.no_grad():
        predicted = hf(torch.tensor([ids])).logits[0].argmax(-1).tolist()
    assert top1(answer["layers"][-1]) == ours.tokenizer.tokens(predicted)
    with torch.no_grad():  # layer 0: the embedding output through the final norm and the head
        x = torch.tensor([ids])
        embedded = hf.transformer.wte(x) + hf.transformer.wpe(torch.arange(len(ids))[None])
        first = hf.lm_head(hf.transformer.ln_f(embedded))[0].argmax(-1).tolist()
    assert top1(answer["layers"][0]) == ours.tokenizer.tokens(first)
    assert top1(answer["layers"][0]) != top1(answer["layers"][-1])  # the layers differ: not one distribution
    only = lens(server, {"model": "gpt2", "input": TEXT, "layers": [0, 2], "top_k": 1})
    assert [layer["layer"] for layer in only["layers"]] == [0, 2]
    assert top1(only["layers"][1]) == top1(answer["layers"][2])


def test_translator_lens_reads_the_returned_translation_by_default(server, models):
    source = "the cat sat on the mat"
    translation = httpx.post(server.url + "/v1/translations", json={"model": "marian", "input": source},
                             timeout=60).json()["data"][0]["translation"]
    answer = lens(server, {"model": "marian", "input": source, "top_k": 2})
    ours = load(models["marian"])
    eos = ours.config.eos_token_id
    target = [t for t in ours.tokenizer.encode_target(translation) if t != eos]
    assert answer["tokens"][1:] == ours.tokenizer.tokens(target)
    hf = transformers.MarianMTModel.from_pretrained(models["marian"]).eval()
    dec = torch.tensor([[ours.config.decoder_start_token_id, *target]])
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([ours.tokenizer.encode(source)]), decoder_input_ids=dec).logits[0]
    assert top1(answer["layers"][-1]) == ours.tokenizer.tokens(logits.argmax(-1).tolist())
    given = lens(server, {"model": "marian", "input": source, "target": "x y", "layers": [1]})
    assert len(given["layers"]) == 1 and given["tokens"][1:] == ours.tokenizer.tokens(
        [t for t in ours.tokenizer.encode_target("x y") if t != eos])


def top_probs(layer: dict, j: int) -> dict[str, float]:
    return {t["token"]: t["prob"] for t in layer["positions"][j]["top"]}


def test_last_layer_probabilities_are_the_completions_logprobs(server, models):
    """Every position's lens at the last layer against the echoed prompt's top logprobs, and the last
    position's against the first generated token's (1e-4)."""
    answer = lens(server, {"model": "gpt2", "input": TEXT, "top_k": 4})
    resp = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": "gpt2", "prompt": TEXT, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 4})
    assert resp.status_code == 200, resp.text
    logprobs = resp.json()["choices"][0]["logprobs"]
    tokenizer = load(models["gpt2"]).tokenizer
    text_of = {tokenizer.id_to_token(i): tokenizer.decode([i]) for i in range(tokenizer.vocab_size)}
    last = answer["layers"][-1]
    n = len(answer["tokens"])
    assert len(logprobs["top_logprobs"]) == n + 1 and logprobs["top_logprobs"][0] is None
    for j in range(n):  # entry j + 1 is the distribution the model had after reading token j
        completion = logprobs["top_logprobs"][j + 1]
        ours = {text_of[t]: p for t, p in top_probs(last, j).items()}
        assert set(ours) == set(completion), j
        for token, prob in ours.items():
            assert prob == pytest.approx(math.exp(completion[token]), abs=1e-4), (j, token)
    assert text_of[last["positions"][-1]["top"][0]["token"]] == logprobs["tokens"][-1]  # greedy next token


@pytest.mark.parametrize("kind", ["gpt2", "marian"])
def test_layer_k_is_the_model_cut_after_k_blocks(server, models, kind):
    """`transformers` loads the same weights with only the first k decoder blocks; its output distribution is
    the lens at layer k (final norm and head applied by the model itself)."""
    source = "the cat sat on the mat"
    answer = lens(server, {"model": kind, "input": TEXT if kind == "gpt2" else source, "top_k": 3})
    ours = load(models[kind])
    vocab = {ours.tokenizer.id_to_token(i): i for i in range(ours.tokenizer.vocab_size)}
    n_blocks = len(answer["layers"]) - 1
    assert n_blocks >= 2
    for k in range(1, n_blocks):
        with torch.no_grad():
            if kind == "gpt2":
                cut = transformers.GPT2LMHeadModel.from_pretrained(models[kind], n_layer=k).eval()
                ids = [vocab[t] for t in answer["tokens"]]
                logits = cut(torch.tensor([ids])).logits[0]
            else:
                cut = transformers.MarianMTModel.from_pretrained(models[kind], decoder_layers=k).eval()
                dec = [ours.config.decoder_start_token_id, *(vocab[t] for t in answer["tokens"][1:])]
                logits = cut(input_ids=torch.tensor([ours.tokenizer.encode(source)]),
                             decoder_input_ids=torch.tensor([dec])).logits[0]
        probs = torch.softmax(logits, -1)
        layer = answer["layers"][k]
        assert layer["layer"] == k
        for j in range(len(answer["tokens"])):
            for token, prob in top_probs(layer, j).items():
                assert prob == pytest.approx(probs[j, vocab[token]].item(), abs=1e-5), (k, j, token)
            assert vocab[layer["positions"][j]["top"][0]["token"]] == probs[j].argmax().item()


@pytest.mark.parametrize("body, fragment", [
    ({"model": "gpt2", "input": TEXT, "layers": [9]}, "layers [9] do not exist"),
    ({"model": "gpt2", "input": TEXT, "layers": [1, 1]}, "layers [1] named more than once"),
    ({"model": "gpt2", "input": TEXT, "top_k": 20}, "the limit is 1000"),
    ({"model": "vit", "input": TEXT}, "has no logit lens"),
    ({"input": TEXT}, "say which model"),
    ({"model": "gpt2", "input": "  "}, "give the text"),
])
def test_bad_selections_are_400(server, body, fragment):
    assert fragment in lens(server, body, 400)["error"]["message"]


def test_top_k_is_bounded_by_the_schema(server):
    lens(server, {"model": "gpt2", "input": TEXT, "top_k": 21}, 400)
    lens(server, {"model": "gpt2", "input": TEXT, "top_k": 0}, 400)
