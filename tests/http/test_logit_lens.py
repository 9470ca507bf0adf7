"""`/v1/logit_lens` through a real server, on Hugging Face checkpoints: the last layer's guesses are the model's
own predictions (`transformers` is the reference), the first layers' are not; a translator's lens reads exactly
the translation `/v1/translations` returns; selections and size are bounded before the model runs."""

from __future__ import annotations

import httpx
import pytest
import torch
import transformers

from model.checkpoint import load
from tests.helpers import factories
from tests.helpers.server import ServerProcess

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


@pytest.mark.parametrize("body, fragment", [
    ({"model": "gpt2", "input": TEXT, "layers": [9]}, "layers must be distinct, from 0 to"),
    ({"model": "gpt2", "input": TEXT, "layers": [1, 1]}, "layers must be distinct"),
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
