"""Llama, Mistral, Qwen2 and Qwen3 served by one real `tserve serve` process, every path against
`transformers` or the one-request path on the same weights: 20 concurrent greedy completions, streaming text,
chat, seeds, n, penalties, logit_bias, stop strings, logprobs, /v1/attention, /v1/logit_lens, /v1/embeddings,
and int8 and int4 weights, and the Open Inference Protocol (/v2)."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from tests.helpers import factories
from tests.helpers.fixture_training import assert_varied, cycle_prompts
from tests.helpers.llama_family import FAMILIES
from tests.helpers.one_request import lm_tokens
from tests.helpers.server import ServerProcess, concurrently
from tserve.model import checkpoint
from tserve.model.decoding import SamplingParams

transformers = pytest.importorskip("transformers")
# Gemma 2 and Granite over HTTP are the long tail (CI runs them, on AVX2 kernels): their maths is held to transformers
# by tests/model/test_llama_family.py, and what they add to serving (the `math` path of soft-capped attention, scaled
# logits) by its batched-prefill and paged-cache tests.
LONG_TAIL = ("gemma2", "granite")
pytestmark = [pytest.mark.kernels, pytest.mark.parametrize(
    "family", [pytest.param(f, marks=pytest.mark.slow) if f in LONG_TAIL else f for f in FAMILIES])]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f: factories.hf_family_dir(f, root / f) for f in FAMILIES}


def _serve(checkpoints, tmp_path_factory, *extra: str):
    srv = ServerProcess([*factories.model_flags(checkpoints), "--max-running-requests", "20", *extra],
                        tmp_path_factory.mktemp("family-logs") / "server.log").wait_ready()
    return srv


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    srv = _serve(checkpoints, tmp_path_factory)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def int8_server(checkpoints, tmp_path_factory):
    srv = _serve(checkpoints, tmp_path_factory, "--quantize", "int8")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def int4_server(checkpoints, tmp_path_factory):
    srv = _serve(checkpoints, tmp_path_factory, "--quantize", "int4")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def models(checkpoints):
    return {f: checkpoint.load(d) for f, d in checkpoints.items()}


@pytest.fixture(scope="module")
def references(checkpoints):
    return {f: transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32,
                                                                 attn_implementation="eager").eval()
            for f, d in checkpoints.items()}


def post(server, path: str, body: dict) -> dict:
    resp = httpx.post(server.url + path, json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          do_sample=False, max_new_tokens=n, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_twenty_concurrent_greedy_completions_equal_transformers(server, models, references, family):
    loaded, hf = models[family], references[family]
    card = next(m for m in httpx.get(server.url + "/v1/models").json()["data"] if m["id"] == family)
    assert card["max_model_len"] == 128  # the fixtures' context
    assert card["kv_cache_bytes_per_token"] == 2 * loaded.config.n_layers * 2 * loaded.config.d_head * 4
    texts = cycle_prompts(20, seed=21)
    answers = concurrently(server, "/v1/completions", [
        {"model": family, "prompt": t, "max_tokens": 12, "temperature": 0, "logprobs": 0} for t in texts])
    got = [a["choices"][0]["logprobs"]["tokens"] for a in answers]
    expected = []
    for t in texts:
        ids = hf_greedy(hf, loaded.tokenizer.encode(t), 12)
        expected.append(loaded.tokenizer.tokens(ids))
    assert got == expected
    assert_varied(got, min_distinct=0.9)


def test_streaming_text_equals_the_whole_text(server, models, family):
    """Multi-byte characters (byte-level pieces, SentencePiece byte fallback) and `▁` spaces come out whole."""
    prompt = "Es war einmal ein König, der hatte drei"
    body = {"model": family, "prompt": prompt, "max_tokens": 24, "temperature": 0}
    whole = post(server, "/v1/completions", body)["choices"][0]["text"]
    with httpx.stream("POST", server.url + "/v1/completions", json=body | {"stream": True}, timeout=120) as resp:
        assert resp.status_code == 200
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    streamed = "".join(e["choices"][0]["text"] for e in events)
    assert streamed == whole and "\ufffd" not in whole
    loaded = models[family]
    ids = loaded.tokenizer.encode(prompt)
    generated = lm_tokens(loaded, ids, SamplingParams(max_tokens=24, temperature=0.0), with_eos=False)
    assert whole == loaded.tokenizer.decode(ids + generated)[len(loaded.tokenizer.decode(ids)):]
    assert any(ord(c) > 127 for c in whole)  # the cycle's umlauts: multi-byte pieces


def test_chat_equals_transformers_on_its_rendered_template(server, checkpoints, models, references, family):
    loaded, hf = models[family], references[family]
    theirs = transformers.AutoTokenizer.from_pretrained(checkpoints[family])
    messages = [{"role": "user", "content": "Good morning. Where is the station?"}]
    ids = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    expected = hf_greedy(hf, ids, 10)
    answer = post(server, "/v1/chat/completions", {"model": family, "messages": messages, "max_tokens": 10,
                                                   "temperature": 0, "logprobs": True})
    choice = answer["choices"][0]
    eos = set(loaded.generation.eos_token_ids or [loaded.tokenizer.eos_id])
    kept = expected[: next((i for i, t in enumerate(expected) if t in eos), len(expected))]
    assert [c["token"] for c in choice["logprobs"]["content"]] == loaded.tokenizer.tokens(kept)
    assert answer["usage"]["prompt_tokens"] == len(ids)
    if family == "mistral":
        bad = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "model": family, "messages": [{"role": "assistant", "content": "x"}], "max_tokens": 2})
        assert bad.status_code == 400 and "Conversation roles must alternate" in bad.json()["error"]["message"]
        system = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "model": family, "max_tokens": 2, "messages": [{"role": "system", "content": "Be brief."}, *messages]})
        assert system.status_code == 400 and system.json()["error"]["code"] == "invalid_messages"
    else:  # a template with a system role renders it, as transformers does
        with_system = [{"role": "system", "content": "Be brief."}, *messages]
        ids = theirs.apply_chat_template(with_system, add_generation_prompt=True, tokenize=True, return_dict=False)
        answer = post(server, "/v1/chat/completions", {"model": family, "messages": with_system, "max_tokens": 1})
        assert answer["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.slow
def test_sampling_settings_equal_the_one_request_path(server, models, family):
    """seed, n, penalties and logit_bias over HTTP give what `generate` gives alone for the same settings."""
    loaded = models[family]
    prompt = "The weather is nice today,"
    ids = loaded.tokenizer.encode(prompt)
    greedy = lm_tokens(loaded, ids, SamplingParams(max_tokens=8, temperature=0.0), with_eos=False)
    cases = [
        ({"temperature": 1.3, "seed": 11}, SamplingParams(max_tokens=8, temperature=1.3, seed=11)),
        ({"temperature": 0, "frequency_penalty": 1.5, "presence_penalty": 0.5},
         SamplingParams(max_tokens=8, temperature=0.0, frequency_penalty=1.5, presence_penalty=0.5)),
        ({"temperature": 0, "logit_bias": {str(greedy[0]): -100}},
         SamplingParams(max_tokens=8, temperature=0.0, logit_bias={greedy[0]: -100.0})),
    ]
    bodies = [{"model": family, "prompt": prompt, "max_tokens": 8, "ignore_eos": True, "logprobs": 0} | b
              for b, _ in cases]
    answers = concurrently(server, "/v1/completions", bodies)
    for answer, (_, params) in zip(answers, cases, strict=True):
        params.ignore_eos = True
        assert answer["choices"][0]["logprobs"]["tokens"] == loaded.tokenizer.tokens(lm_tokens(loaded, ids, params))
    assert answers[2]["choices"][0]["logprobs"]["tokens"][0] != loaded.tokenizer.tokens(greedy[:1])[0]
    two = post(server, "/v1/completions", {"model": family, "prompt": prompt, "max_tokens": 8, "n": 2, "seed": 3,
                                           "temperature": 1.5, "ignore_eos": True})
    again = post(server, "/v1/completions", {"model": family, "prompt": prompt, "max_tokens": 8, "n": 2, "seed": 3,
                                             "temperature": 1.5, "ignore_eos": True})
    assert [c["text"] for c in two["choices"]] == [c["text"] for c in again["choices"]]
    for j, choice in enumerate(two["choices"]):  # choice j is seeded with seed + j
        alone = lm_tokens(loaded, ids, SamplingParams(max_tokens=8, temperature=1.5, seed=3 + j, ignore_eos=True))
        assert choice["text"] == loaded.tokenizer.decode(ids + alone)[len(loaded.tokenizer.decode(ids)):]


def test_stop_strings_and_logprobs(server, models, references, family):
    loaded, hf = models[family], references[family]
    prompt = "Once upon a time there was a"
    ids = loaded.tokenizer.encode(prompt)
    answer = post(server, "/v1/completions", {"model": family, "prompt": prompt, "max_tokens": 16, "temperature": 0,
                                              "logprobs": 3})
    text = answer["choices"][0]["text"]
    lp = answer["choices"][0]["logprobs"]
    with torch.no_grad():
        first = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].float(), -1)
    top = first.topk(3)
    assert lp["token_logprobs"][0] == pytest.approx(top.values[0].item(), abs=1e-4)
    assert sorted(lp["top_logprobs"][0].values(), reverse=True) == pytest.approx(top.values.tolist(), abs=1e-4)
    word = text.split()[1]
    stopped = post(server, "/v1/completions", {"model": family, "prompt": prompt, "max_tokens": 16, "temperature": 0,
                                               "stop": [word]})["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["text"] == text[: text.index(word)]


def test_attention_lens_and_embeddings_equal_transformers(server, models, references, family):
    """/v1/attention gives one map per query head (a kv head's maps are those of its group's query heads)."""
    loaded, hf = models[family], references[family]
    text = "Hello world, good morning"
    ids = loaded.tokenizer.encode(text)
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_attentions=True, output_hidden_states=True)
    maps = post(server, "/v1/attention", {"model": family, "input": text, "layers": [1], "heads": [0, 3]})["maps"]
    weights = torch.tensor([m["weights"] for m in maps]).reshape(2, len(ids), len(ids))
    torch.testing.assert_close(weights, out.attentions[1][0, [0, 3]], atol=1e-5, rtol=0)

    lens = post(server, "/v1/logit_lens", {"model": family, "input": text, "top_k": 1})
    last = [p["top"][0]["token"] for p in lens["layers"][-1]["positions"]]
    assert last == loaded.tokenizer.tokens(out.logits[0].argmax(-1).tolist())

    embedded = post(server, "/v1/embeddings", {"model": family, "input": [text]})["data"][0]["embedding"]
    expected = torch.nn.functional.normalize(out.hidden_states[-1][0].mean(0), dim=-1)
    torch.testing.assert_close(torch.tensor(embedded), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_quantized_weights_serve_what_they_compute_alone(quantize, request, checkpoints, models, family):
    """`--quantize int8` / `int4`: among concurrent requests each answer equals the quantized model's alone,
    and keeps to the float32 model's greedy choice on most steps."""
    server = request.getfixturevalue(f"{quantize}_server")
    quantized = checkpoint.load(checkpoints[family], quantize=quantize)
    texts = cycle_prompts(8, seed=31)
    answers = concurrently(server, "/v1/completions", [
        {"model": family, "prompt": t, "max_tokens": 10, "temperature": 0, "logprobs": 0, "ignore_eos": True}
        for t in texts])
    agree = total = 0
    for t, answer in zip(texts, answers, strict=True):
        ids = quantized.tokenizer.encode(t)
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        alone = lm_tokens(quantized, ids, params)
        assert answer["choices"][0]["logprobs"]["tokens"] == quantized.tokenizer.tokens(alone)
        fp32 = lm_tokens(models[family], ids, params)
        agree += sum(a == b for a, b in zip(alone, fp32, strict=True))
        total += len(alone)
    assert agree / total >= 0.8, agree / total


def test_the_openai_client_chats_and_streams(server, family):
    """docs/MODELS.md's example, with the official client."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    messages = [{"role": "user", "content": "Where is the station?"}]
    reply = client.chat.completions.create(model=family, messages=messages, max_tokens=12, temperature=0)
    text = reply.choices[0].message.content
    assert text and reply.choices[0].finish_reason in ("stop", "length")
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model=family, messages=messages, max_tokens=12, temperature=0, stream=True))
    assert streamed == text


def test_open_inference_protocol_completes_as_v1_does(server, family):
    meta = httpx.get(server.url + f"/v2/models/{family}").json()
    assert [t["name"] for t in meta["inputs"]] == ["text_input"]
    assert [t["name"] for t in meta["outputs"]] == ["text_output", "finish_reason"]
    texts = ["The quick brown fox", "Guten Morgen. Wo ist"]
    body = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [2], "data": texts}],
            "parameters": {"max_tokens": 8, "temperature": 0}}
    outputs = {o["name"]: o for o in post(server, f"/v2/models/{family}/infer", body)["outputs"]}
    v1 = post(server, "/v1/completions", {"model": family, "prompt": texts, "max_tokens": 8, "temperature": 0})
    assert outputs["text_output"]["data"] == [c["text"] for c in v1["choices"]]
    assert outputs["finish_reason"]["data"] == [c["finish_reason"] for c in v1["choices"]]
    for parameters, words in (({"max_tokens": 0}, "max_tokens must be an integer from 1"),
                              ({"temperature": "hot"}, "temperature must be a number"),
                              ({"beams": 2}, "unknown parameter 'beams'")):
        resp = httpx.post(server.url + f"/v2/models/{family}/infer", json=body | {"parameters": parameters})
        assert resp.status_code == 400 and words in resp.json()["error"], resp.text
    too_long = body | {"parameters": {"max_tokens": 200}}
    resp = httpx.post(server.url + f"/v2/models/{family}/infer", json=too_long)
    assert resp.status_code == 400 and "context" in resp.json()["error"], resp.text
