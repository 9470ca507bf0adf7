"""The HTTP API through a real `tserve serve` process: OpenAI client, streaming, concurrency, cancellation,
seeds, translation, classification, metrics, and a table of bad inputs that must all get a 4xx."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import httpx
import openai
import pytest
import torch
from PIL import Image

from tests.helpers import factories
from tests.helpers.fixture_training import assert_varied, cycle_prompts, lexicon_sentences
from tests.helpers.one_request import lm_tokens
from tests.helpers.server import ServerProcess
from tserve.model import attention_maps, checkpoint
from tserve.model.decoding import SamplingParams, translate

PROMPTS = cycle_prompts(31)
MAX_IMAGE_PIXELS = 250_000


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    return {
        "lm": factories.tiny_lm_dir(root / "lm"),
        "gpt2": factories.hf_gpt2_dir(root / "gpt2"),
        "mt": factories.tiny_mt_dir(root / "mt"),
        "vit": factories.tiny_vit_dir(root / "vit"),
    }


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    args = factories.model_flags(checkpoints)
    args += ["--max-running-requests", "8", "--max-body-bytes", "200000", "--max-image-bytes", "100000",
             "--max-n", "4", "--max-prompts", "8", "--max-attention-floats", "5000", "--max-input-chars", "20000",
             "--max-image-pixels", str(MAX_IMAGE_PIXELS)]
    srv = ServerProcess(args, tmp_path_factory.mktemp("logs") / "server.log").wait_ready()
    yield srv
    code = srv.stop()
    # uvicorn re-raises SIGTERM after a clean shutdown.
    assert code in (0, -15) and "Application shutdown complete" in srv.log(), f"exit code {code}\n{srv.log()}"


@pytest.fixture(scope="module")
def lm(checkpoints):
    return checkpoint.load(checkpoints["lm"], device="cpu")


def reference_greedy(lm, prompt: str, max_tokens: int) -> str:
    ids = lm.tokenizer.encode(prompt)
    out = lm_tokens(lm, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0), with_eos=False)
    return lm.tokenizer.decode(ids + out)[len(lm.tokenizer.decode(ids)):]


def post(server, path: str, **kwargs) -> httpx.Response:
    return httpx.post(server.url + path, timeout=60, **kwargs)


def png_bytes(size=(40, 30), color=(200, 30, 30), mode="RGB", fmt="PNG") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, color).save(buf, format=fmt)
    return buf.getvalue()


# --------------------------------------------------------------------------------------------------
# Health, models, metrics
# --------------------------------------------------------------------------------------------------
def test_health_readiness_and_model_list(server):
    assert httpx.get(server.url + "/healthz").json() == {"status": "ok"}
    assert httpx.get(server.url + "/readyz").status_code == 200
    models = httpx.get(server.url + "/v1/models").json()
    assert models["object"] == "list"
    tasks = {m["id"]: m["task"] for m in models["data"]}
    assert tasks == {"lm": "text-generation", "gpt2": "text-generation", "mt": "translation",
                     "vit": "image-classification"}
    assert all(m["object"] == "model" and isinstance(m["created"], int) and m["owned_by"] for m in models["data"])


def test_metrics_names(server):
    post(server, "/v1/completions", json={"model": "lm", "prompt": "Hi", "max_tokens": 3})
    text = httpx.get(server.url + "/metrics").text
    for name in ("tserve_requests_total", "tserve_time_to_first_token_seconds_bucket",
                 "tserve_inter_token_latency_seconds_bucket", "tserve_request_latency_seconds_bucket",
                 "tserve_queue_depth", "tserve_running_requests", "tserve_kv_slots_in_use",
                 "tserve_kv_slots_total", "tserve_generated_tokens_total", "tserve_images_classified_total"):
        assert name in text, name
    assert 'tserve_requests_total{route="/v1/completions",status="200"}' in text
    assert server.metric("tserve_kv_slots_total", "lm") == 8


# --------------------------------------------------------------------------------------------------
# Completions
# --------------------------------------------------------------------------------------------------
def test_openai_client_completion_matches_reference(server, lm):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    resp = client.completions.create(model="lm", prompt="Hello world", max_tokens=12, temperature=0)
    assert resp.object == "text_completion" and resp.model == "lm"
    assert resp.choices[0].text == reference_greedy(lm, "Hello world", 12)
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage.prompt_tokens == len(lm.tokenizer.encode("Hello world"))
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens

    stream = client.completions.create(model="lm", prompt="Hello world", max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == resp.choices[0].text
    assert chunks[-1].usage.completion_tokens == resp.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == resp.choices[0].finish_reason


def _sse_chunks(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + path, json=body | {"stream": True}, timeout=60) as resp:
        lines = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_continuous_usage_stats_put_each_choices_usage_so_far_in_every_chunk(server, lm):
    """vLLM's `stream_options.continuous_usage_stats` (with `include_usage`): every chunk carries its choice's
    prompt, completion (so far) and total tokens, whatever number of tokens the chunk holds; the last of each
    choice is its whole count, and the usage chunk at the end the request's. Alone it adds nothing."""
    prompt = len(lm.tokenizer.encode("Hello world"))
    body = {"model": "lm", "prompt": "Hello world", "max_tokens": 9, "temperature": 0, "ignore_eos": True, "n": 2,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chat = {"model": "lm", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 7, "temperature": 0,
            "ignore_eos": True, "stream_options": body["stream_options"]}
    for path, req, tokens in (("/v1/completions", body, 9), ("/v1/chat/completions", chat, 7)):
        chunks = _sse_chunks(server, path, req)
        *with_choices, last = chunks
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == tokens * req.get("n", 1)
        seen: dict[int, list[int]] = {}
        for chunk in with_choices:
            (choice,) = chunk["choices"]
            usage = chunk["usage"]
            assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
            if path == "/v1/completions":
                assert usage["prompt_tokens"] == prompt
            seen.setdefault(choice["index"], []).append(usage["completion_tokens"])
        for counts in seen.values():  # (all of a choice's tokens may come in one chunk, where its stream fell behind)
            assert counts == sorted(counts) and counts[-1] == tokens
            assert path == "/v1/completions" or counts[0] == 0  # chat's first chunk: the role, no token yet
        assert sorted(seen) == list(range(req.get("n", 1)))
    alone = _sse_chunks(server, "/v1/completions", body | {"stream_options": {"continuous_usage_stats": True}})
    assert all("usage" not in chunk for chunk in alone)


def test_openai_client_chat(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    resp = client.chat.completions.create(model="lm", messages=messages, max_tokens=10, temperature=0)
    assert resp.object == "chat.completion" and resp.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model="lm", messages=messages, max_tokens=10, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == resp.choices[0].message.content
    # gpt2 (Hugging Face directory) has no chat template: a clear 400.
    with pytest.raises(openai.BadRequestError, match="chat template"):
        client.chat.completions.create(model="gpt2", messages=messages, max_tokens=4)


def test_prompt_list_n_and_echo_logprobs(server, lm):
    body = {"model": "lm", "prompt": ["Hello world", "Good morning"], "max_tokens": 5, "temperature": 0, "n": 2,
            "logprobs": 2, "echo": True}
    resp = post(server, "/v1/completions", json=body).json()
    assert [c["index"] for c in resp["choices"]] == [0, 1, 2, 3]
    for c, prompt in zip(resp["choices"], ["Hello world", "Hello world", "Good morning", "Good morning"], strict=True):
        assert c["text"] == prompt + reference_greedy(lm, prompt, 5)
        lp = c["logprobs"]
        n_prompt = len(lm.tokenizer.encode(prompt))
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])
        assert lp["token_logprobs"][0] is None and all(v <= 0 for v in lp["token_logprobs"][1:])
        assert all(len(t) <= 2 for t in lp["top_logprobs"][1:])
        assert len(lp["tokens"]) == n_prompt + 5 or c["finish_reason"] == "stop"
        assert lp["text_offset"] == sorted(lp["text_offset"])
    assert resp["usage"]["prompt_tokens"] == 2 * sum(len(lm.tokenizer.encode(p)) for p in ["Hello world",
                                                                                        "Good morning"])


def test_stop_strings_are_cut(server, lm):
    full = reference_greedy(lm, "Hello world", 20)
    stop = full.split()[3]  # a word well inside the text: what comes before it is sent, the rest is not
    assert full.index(stop) > 5
    resp = post(server, "/v1/completions", json={"model": "lm", "prompt": "Hello world", "max_tokens": 20,
                                                  "temperature": 0, "stop": [stop]}).json()
    choice = resp["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == full[: full.index(stop)]


def test_same_seed_same_sample(server, checkpoints):
    lm = checkpoint.load(checkpoints["gpt2"], device="cpu")
    # Far from the sentences the model learnt, and hot: a spread-out distribution to sample from.
    body = {"model": "gpt2", "prompt": "Seven zebras", "max_tokens": 16, "temperature": 1.5, "seed": 1234,
            "ignore_eos": True}
    a = post(server, "/v1/completions", json=body).json()["choices"][0]["text"]
    b = post(server, "/v1/completions", json=body).json()["choices"][0]["text"]
    assert a == b
    ids = lm.tokenizer.encode("Seven zebras")
    ref = lm_tokens(lm, ids, SamplingParams(max_tokens=16, temperature=1.5, seed=1234, ignore_eos=True))
    assert a == lm.tokenizer.decode(ids + ref)[len(lm.tokenizer.decode(ids)):]
    others = {post(server, "/v1/completions", json=body | {"seed": s}).json()["choices"][0]["text"]
              for s in range(4)}
    assert len(others) > 1


async def _stream_text(client: httpx.AsyncClient, url: str, body: dict) -> str:
    text = ""
    async with client.stream("POST", url, json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                text += "".join(c["text"] for c in chunk["choices"])
    return text


def test_concurrent_streams_equal_sequential(server):
    bodies = [{"model": "lm", "prompt": p, "max_tokens": 24, "temperature": 0, "stream": True} for p in PROMPTS]
    assert len(bodies) >= 30
    sequential = [post(server, "/v1/completions", json=b | {"stream": False}).json()["choices"][0]["text"]
                  for b in bodies]

    async def run_all() -> list[str]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(_stream_text(client, server.url + "/v1/completions", b) for b in bodies))

    concurrent = asyncio.run(run_all())
    assert_varied(sequential)
    assert concurrent == sequential


# --------------------------------------------------------------------------------------------------
# Translation
# --------------------------------------------------------------------------------------------------
def test_translation_batch_and_stream(server, checkpoints):
    mt = checkpoint.load(checkpoints["mt"], device="cpu")
    inputs = lexicon_sentences(3, seed=4)
    resp = post(server, "/v1/translations", json={"input": inputs, "num_beams": 1, "max_tokens": 10}).json()
    assert resp["object"] == "translation" and resp["model"] == "mt"
    ref = [s.output_ids for s in translate(mt, [mt.tokenizer.encode(t) for t in inputs], 1, 10)]
    assert_varied(ref, min_distinct=1.0)
    assert [d["translation"] for d in resp["data"]] == [mt.tokenizer.decode(r) for r in ref]
    assert [d["index"] for d in resp["data"]] == [0, 1, 2]
    assert resp["usage"]["prompt_tokens"] == sum(len(mt.tokenizer.encode(t)) for t in inputs)

    beams = post(server, "/v1/translations", json={"input": "Good morning."}).json()  # checkpoint default: 2 beams
    assert isinstance(beams["data"][0]["translation"], str)

    last = None
    with httpx.stream("POST", server.url + "/v1/translations",
                      json={"input": inputs[0], "num_beams": 1, "max_tokens": 10, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        chunk = json.loads(line[6:])
        text = chunk["data"][0]["translation"]
        assert last is None or text.startswith(last)
        last = text
    assert last == resp["data"][0]["translation"]


# --------------------------------------------------------------------------------------------------
# Classification
# --------------------------------------------------------------------------------------------------
def test_classification_json_and_multipart(server, checkpoints):
    vit = checkpoint.load(checkpoints["vit"], device="cpu")
    images = [png_bytes(), png_bytes((300, 200), (255, 255, 255)), png_bytes((28, 28), 80, mode="L", fmt="JPEG")]
    with torch.no_grad():
        probs = [torch.softmax(vit.model(vit.preprocessing(Image.open(io.BytesIO(b)))[None]), -1)[0]
                 for b in images]
    resp = post(server, "/v1/classifications",
                json={"images": [base64.b64encode(b).decode() for b in images], "top_k": 2}).json()
    assert resp["object"] == "classification" and resp["model"] == "vit"
    for item, p in zip(resp["data"], probs, strict=True):
        assert len(item["predictions"]) == 2
        top = item["predictions"][0]
        assert top["label"] == vit.labels[int(p.argmax())]
        assert top["score"] == pytest.approx(float(p.max()), abs=1e-5)
    multipart = post(server, "/v1/classifications", files=[("file", ("a.png", images[0])),
                                                           ("file", ("b.png", images[1]))],
                     data={"model": "vit", "top_k": "10"}).json()
    assert len(multipart["data"]) == 2
    assert len(multipart["data"][0]["predictions"]) == len(vit.labels)  # top_k clamps to the label count
    assert multipart["data"][0]["predictions"][0] == resp["data"][0]["predictions"][0]
    single = post(server, "/v1/classifications", json={"image": base64.b64encode(images[0]).decode()}).json()
    assert single["data"][0]["predictions"][0] == resp["data"][0]["predictions"][0]
    assert server.metric("tserve_images_classified_total", "vit") >= 6


# --------------------------------------------------------------------------------------------------
# Attention maps
# --------------------------------------------------------------------------------------------------
def test_attention_json_equals_math_path_while_serving(server, checkpoints):
    """The server runs sdpa and is busy with other requests; its maps equal the math path's in-process."""
    ref_lm = checkpoint.load(checkpoints["lm"], device="cpu", backend="math")
    ref = attention_maps.lm_attention(ref_lm, "Hello world, good morning", layers=[1], heads=[0, 2])
    body = {"model": "lm", "input": "Hello world, good morning", "layers": [1], "heads": [0, 2]}
    busy = {"model": "lm", "prompt": "Once upon a time", "max_tokens": 60, "ignore_eos": True}

    async def together() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(client.post(server.url + "/v1/completions", json=busy) for _ in range(6)),
                                        *(client.post(server.url + "/v1/attention", json=body) for _ in range(3)))

    for resp in asyncio.run(together())[6:]:
        maps = resp.json()["maps"]
        assert len(maps) == 1 and maps[0]["module"] == "decoder.self" and maps[0]["layer"] == 1
        assert maps[0]["query_tokens"] == ref[0].query_tokens
        torch.testing.assert_close(torch.tensor(maps[0]["weights"]), ref[0].weights, atol=1e-5, rtol=0)


def test_attention_translation_bertviz_and_png(server, checkpoints):
    mt = checkpoint.load(checkpoints["mt"], device="cpu")
    resp = post(server, "/v1/attention", json={"model": "mt", "input": "Good morning.", "target": "Guten Morgen.",
                                               "format": "bertviz"}).json()
    n_dec = mt.config.n_decoder_layers
    assert len(resp["cross_attention"]) == n_dec and len(resp["encoder_attention"]) == mt.config.n_encoder_layers
    cross = torch.tensor(resp["cross_attention"][0])
    assert cross.shape == (1, mt.config.n_heads, len(resp["decoder_tokens"]), len(resp["encoder_tokens"]))
    torch.testing.assert_close(cross.sum(-1), torch.ones(cross.shape[:3]))
    own = post(server, "/v1/attention", json={"model": "mt", "input": "Good morning.", "layers": [0],
                                              "heads": [0]}).json()
    assert isinstance(own["target"], str) and {m["module"] for m in own["maps"]} >= {"decoder.cross"}

    png = post(server, "/v1/attention", json={"model": "mt", "input": "Good morning.", "layers": [0],
                                              "heads": [0, 1], "format": "png"})
    assert png.headers["content-type"] == "image/png"
    image = Image.open(io.BytesIO(png.content))
    assert image.format == "PNG" and image.width > 100 and image.height > 100


def test_return_attention_extension(server, checkpoints):
    lm = checkpoint.load(checkpoints["lm"], device="cpu")
    body = {"model": "lm", "prompt": "Hello world", "max_tokens": 5, "temperature": 0,
            "return_attention": {"layers": [1], "heads": [2]}}
    choice = post(server, "/v1/completions", json=body).json()["choices"][0]
    (m,) = choice["attention"]["maps"]
    prompt = lm.tokenizer.encode("Hello world")
    generated = len(m["query_tokens"])
    assert 1 <= generated <= 5 and len(m["key_tokens"]) == len(prompt) + generated
    weights = torch.tensor(m["weights"])
    assert weights.shape == (1, generated, len(prompt) + generated)
    torch.testing.assert_close(weights.sum(-1), torch.ones(1, generated))
    assert torch.all(weights[0, :, len(prompt) + 1:].triu() == 0)  # no token looks at later ones

    tr = post(server, "/v1/translations", json={"model": "mt", "input": ["Good morning."], "num_beams": 1,
                                                 "max_tokens": 6, "return_attention": {"layers": [0],
                                                                                      "heads": [0]}}).json()
    maps = tr["data"][0]["attention"]["maps"]
    assert {m["module"] for m in maps} == {"decoder.self", "decoder.cross"}
    cross = next(m for m in maps if m["module"] == "decoder.cross")
    torch.testing.assert_close(torch.tensor(cross["weights"]).sum(-1), torch.ones(1, len(cross["query_tokens"])))


def test_attention_vit_png_and_json(server):
    image = base64.b64encode(png_bytes((64, 64), (250, 250, 250))).decode()
    resp = post(server, "/v1/attention", json={"model": "vit", "image": image, "layers": [1]}).json()
    assert resp["maps"][0]["query_tokens"][0] == "[CLS]"
    for rollout in (False, True):
        png = post(server, "/v1/attention", json={"image": image, "format": "png", "rollout": rollout})
        assert Image.open(io.BytesIO(png.content)).format == "PNG"


# --------------------------------------------------------------------------------------------------
# Bad input: every case a 4xx with an OpenAI-style error body; the server stays ready
# --------------------------------------------------------------------------------------------------
_PNG = base64.b64encode(png_bytes()).decode()
def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height: only the header, no pixel data (a decompression bomb's
    first bytes)."""
    import struct
    import zlib

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", len(ihdr)) + chunk + struct.pack(">I", zlib.crc32(chunk))


def _zip_bomb_png() -> bytes:
    """A small file that decompresses to 10000 x 10000 pixels."""
    buf = io.BytesIO()
    Image.new("L", (10000, 10000), 0).save(buf, format="PNG", optimize=True)
    return buf.getvalue()


BAD_INPUTS = [
    ("completions: malformed JSON", "/v1/completions", {"content": b"{not json", "headers": {
        "content-type": "application/json"}}, 400),
    ("completions: prompt wrong type", "/v1/completions", {"json": {"model": "lm", "prompt": 42}}, 400),
    ("completions: prompt missing", "/v1/completions", {"json": {"model": "lm"}}, 400),
    ("completions: empty prompt", "/v1/completions", {"json": {"model": "lm", "prompt": ""}}, 400),
    ("completions: empty prompt list", "/v1/completions", {"json": {"model": "lm", "prompt": []}}, 400),
    ("completions: negative max_tokens", "/v1/completions", {"json": {"model": "lm", "prompt": "a",
                                                                       "max_tokens": -5}}, 400),
    ("completions: huge max_tokens", "/v1/completions", {"json": {"model": "lm", "prompt": "a",
                                                                   "max_tokens": 10**12}}, 400),
    ("completions: over the context", "/v1/completions", {"json": {"model": "lm", "prompt": "a",
                                                                    "max_tokens": 500}}, 400),
    ("completions: temperature string", "/v1/completions", {"json": {"model": "lm", "prompt": "a",
                                                                      "temperature": "hot"}}, 400),
    ("completions: negative temperature", "/v1/completions", {"json": {"model": "lm", "prompt": "a",
                                                                        "temperature": -1}}, 400),
    ("completions: top_p zero", "/v1/completions", {"json": {"model": "lm", "prompt": "a", "top_p": 0}}, 400),
    ("completions: n too large", "/v1/completions", {"json": {"model": "lm", "prompt": "a", "n": 1000}}, 400),
    ("completions: logprobs 6", "/v1/completions", {"json": {"model": "lm", "prompt": "a", "logprobs": 6}}, 400),
    ("completions: 5 stop strings", "/v1/completions", {"json": {"model": "lm", "prompt": "a",
                                                                  "stop": list("abcde")}}, 400),
    ("completions: seed too big", "/v1/completions", {"json": {"model": "lm", "prompt": "a", "seed": 2**70}}, 400),
    ("completions: unknown model", "/v1/completions", {"json": {"model": "nope", "prompt": "a"}}, 404),
    ("completions: model omitted, two LMs", "/v1/completions", {"json": {"prompt": "a"}}, 400),
    ("completions: wrong task", "/v1/completions", {"json": {"model": "mt", "prompt": "a"}}, 400),
    ("completions: too many prompts", "/v1/completions", {"json": {"model": "lm", "prompt": ["a"] * 9}}, 400),
    ("completions: body too large", "/v1/completions", {"json": {"model": "lm", "prompt": "a" * 300_000}}, 413),
    ("chat: no messages", "/v1/chat/completions", {"json": {"model": "lm", "messages": []}}, 400),
    ("chat: bad role", "/v1/chat/completions", {"json": {"model": "lm", "messages": [
        {"role": "wizard", "content": "hi"}]}}, 400),
    ("translations: empty input", "/v1/translations", {"json": {"input": ""}}, 400),
    ("translations: empty list", "/v1/translations", {"json": {"input": []}}, 400),
    ("translations: input wrong type", "/v1/translations", {"json": {"input": {"a": 1}}}, 400),
    ("translations: zero beams", "/v1/translations", {"json": {"input": "hi", "num_beams": 0}}, 400),
    ("translations: stream of two inputs", "/v1/translations", {"json": {"input": ["hi", "yo"], "stream": True}},
     400),
    ("translations: n above num_beams", "/v1/translations", {"json": {"input": "hi", "num_beams": 2, "n": 3}}, 400),
    ("translations: n with greedy", "/v1/translations", {"json": {"input": "hi", "num_beams": 1, "n": 2}}, 400),
    ("translations: n zero", "/v1/translations", {"json": {"input": "hi", "n": 0}}, 400),
    ("translations: attention of a document", "/v1/translations", {"json": {
        "input": "One sentence here. Another one there.", "return_attention": {}}}, 400),
    ("translations: beyond --max-input-chars", "/v1/translations", {"json": {"input": "word " * 4100}}, 400),
    ("classifications: no image", "/v1/classifications", {"json": {"model": "vit"}}, 400),
    ("classifications: bad base64", "/v1/classifications", {"json": {"image": "%%%notbase64"}}, 400),
    ("classifications: not an image", "/v1/classifications", {"json": {"image": base64.b64encode(
        b"hello, world").decode()}}, 400),
    ("classifications: truncated PNG", "/v1/classifications", {"json": {"image": base64.b64encode(
        png_bytes()[:60]).decode()}}, 400),
    ("classifications: image too big", "/v1/classifications", {"json": {"image": base64.b64encode(
        png_bytes((1500, 1500), (1, 2, 3), fmt="BMP")[:120_000]).decode()}}, 400),
    ("classifications: top_k 0", "/v1/classifications", {"json": {"image": _PNG, "top_k": 0}}, 400),
    ("classifications: JSON array body", "/v1/classifications", {"json": [1, 2]}, 400),
    ("classifications: malformed JSON", "/v1/classifications", {"content": b"{", "headers": {
        "content-type": "application/json"}}, 400),
    ("classifications: corrupt upload", "/v1/classifications", {"files": [("file", ("x.png", b"\x89PNG\r\n"))]},
     400),
    ("classifications: upload without file", "/v1/classifications", {"data": {"model": "vit"}, "files": [
        ("other", ("x.txt", b"abc"))]}, 400),
    ("attention: layer that does not exist", "/v1/attention", {"json": {"model": "lm", "input": "hi",
                                                                         "layers": [7]}}, 400),
    ("attention: head that does not exist", "/v1/attention", {"json": {"model": "lm", "input": "hi",
                                                                        "heads": [4]}}, 400),
    ("attention: empty head list", "/v1/attention", {"json": {"model": "mt", "input": "0", "target": "",
                                                              "heads": [], "format": "png"}}, 400),
    ("attention: empty layer list", "/v1/attention", {"json": {"model": "lm", "input": "hi", "layers": []}}, 400),
    ("return_attention: empty head list", "/v1/completions", {"json": {"model": "lm", "prompt": "a",
                                                                        "return_attention": {"heads": []}}}, 400),
    ("attention: too many weights", "/v1/attention", {"json": {"model": "lm", "input": "word " * 60}}, 400),
    ("attention: no input", "/v1/attention", {"json": {"model": "lm"}}, 400),
    ("attention: image model without image", "/v1/attention", {"json": {"model": "vit", "input": "hi"}}, 400),
    ("attention: model not said", "/v1/attention", {"json": {"input": "hi"}}, 400),
    ("attention: unknown model", "/v1/attention", {"json": {"model": "nope", "input": "hi"}}, 404),
    ("attention: bad format", "/v1/attention", {"json": {"model": "lm", "input": "hi", "format": "gif"}}, 400),
    ("return_attention with stream", "/v1/completions", {"json": {"model": "lm", "prompt": "a", "stream": True,
                                                                   "return_attention": {}}}, 400),
    ("return_attention: bad layer", "/v1/completions", {"json": {"model": "lm", "prompt": "a",
                                                                  "return_attention": {"layers": [5]}}}, 400),
    ("return_attention: too many weights", "/v1/translations", {"json": {"input": "hello", "max_tokens": 60,
                                                                          "return_attention": {}}}, 400),
    ("hostile: deep nesting", "/v1/completions", {"content": b'{"prompt": ' + b"[" * 60_000 + b"]" * 60_000 + b"}",
                                                   "headers": {"content-type": "application/json"}}, 400),
    ("hostile: invalid UTF-8", "/v1/completions", {"content": b'{"prompt": "\xff\xfe\xfa"}',
                                                   "headers": {"content-type": "application/json"}}, 400),
    ("hostile: NaN temperature", "/v1/completions", {"content": b'{"prompt": "a", "temperature": NaN}',
                                                     "headers": {"content-type": "application/json"}}, 400),
    ("hostile: infinite penalty", "/v1/completions", {"content": b'{"prompt": "a", "presence_penalty": Infinity}',
                                                      "headers": {"content-type": "application/json"}}, 400),
    ("hostile: text/plain body", "/v1/completions", {"content": b"prompt=hello",
                                                     "headers": {"content-type": "text/plain"}}, 400),
    ("hostile: form body to JSON route", "/v1/translations", {"data": {"input": "hello"}}, 400),
    ("hostile: huge JSON string", "/v1/completions", {"json": {"model": "lm", "prompt": "x" * 150_000}}, 400),
    ("hostile: 50k x 50k PNG header", "/v1/classifications", {"files": [("file", ("big.png",
                                                                                  _png_header(50_000, 50_000)))]}, 400),
    ("hostile: zip-bomb PNG", "/v1/classifications", {"files": [("file", ("bomb.png", _zip_bomb_png()))]}, 400),
    ("hostile: over --max-image-pixels, under Pillow's limit", "/v1/classifications", {"files": [("file", (
        "wide.png", png_bytes((MAX_IMAGE_PIXELS // 100 + 1, 100), (9, 9, 9))))]}, 400),
    ("hostile: XML to classifications", "/v1/classifications", {"content": b"<image/>",
                                                                "headers": {"content-type": "application/xml"}}, 400),
    ("classifications: unknown model", "/v1/classifications", {"json": {"model": "nope", "image": _PNG}}, 404),
]


@pytest.mark.parametrize(("path", "kwargs", "status"), [case[1:] for case in BAD_INPUTS],
                         ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_gets_4xx(server, path, kwargs, status):
    resp = post(server, path, **kwargs)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["message"] and error["type"] and "code" in error
    assert "Traceback" not in resp.text
    assert httpx.get(server.url + "/readyz").status_code == 200


def test_max_image_pixels_is_the_limit(server):
    at_limit = png_bytes((MAX_IMAGE_PIXELS // 100, 100), (9, 9, 9))
    assert post(server, "/v1/classifications", files=[("file", ("ok.png", at_limit))]).status_code == 200
    over = png_bytes((MAX_IMAGE_PIXELS // 100 + 1, 100), (9, 9, 9))
    resp = post(server, "/v1/classifications", files=[("file", ("wide.png", over))])
    assert resp.status_code == 400 and f"the limit is {MAX_IMAGE_PIXELS} pixels" in resp.json()["error"]["message"]


def test_user_text_stays_out_of_the_logs(server):
    marker = "zebra-marker-4711"
    post(server, "/v1/completions", json={"model": "lm", "prompt": marker, "max_tokens": 2})
    post(server, "/v1/translations", json={"input": marker, "max_tokens": 2})
    assert marker not in server.log()


def test_unknown_route_is_json_404(server):
    resp = httpx.get(server.url + "/v1/nothing")
    assert resp.status_code == 404 and resp.json()["error"]["message"]


# --------------------------------------------------------------------------------------------------
# Overload
# --------------------------------------------------------------------------------------------------
def test_queue_full_gets_429_with_retry_after(checkpoints, tmp_path):
    srv = ServerProcess(["--model", f"lm={checkpoints['lm']}", "--max-running-requests", "1", "--max-queue", "1"],
                        tmp_path / "server.log").wait_ready()
    try:
        body = {"prompt": "Hello", "max_tokens": 100, "ignore_eos": True, "temperature": 0}

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=120) as client:
                return await asyncio.gather(*(client.post(srv.url + "/v1/completions", json=body)
                                              for _ in range(8)))

        responses = asyncio.run(burst())
        statuses = sorted(r.status_code for r in responses)
        assert 200 in statuses and 429 in statuses, statuses
        refused = next(r for r in responses if r.status_code == 429)
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["type"] == "server_overloaded"
    finally:
        srv.stop()
