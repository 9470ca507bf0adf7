"""What docs/API.md promises about the HTTP API, through one real `tserve serve` process: request ids, the
sampling fields and extensions of `/v1/completions` (top_k, top_p, penalties, min_tokens, ignore_eos, stop
as a string, n with seed + j, seeded output whatever runs beside it), chat's max_completion_tokens and
logprobs, translation streaming and the checkpoint's num_beams, and classification batching
(--batch-max-size, --batch-max-wait-ms). Limits, API keys and injected faults: tests/http/test_http_limits.py.

Sampled outputs are compared as token lists (the `tokens` of `logprobs`) with the same request run in-process
by `model.decoding.generate` alone; before two outputs are compared, the test shows that they differ
across the inputs it uses."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import random
import time
import uuid

import httpx
import pytest
import torch
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import factories, fixture_training
from tests.helpers.one_request import lm_tokens, mt_tokens
from tests.helpers.server import ServerProcess
from tserve.model import checkpoint
from tserve.model.decoding import SamplingParams

BATCH_MAX_SIZE = 2
BATCH_MAX_WAIT_MS = 1000
LOADED = ("lm", "lm-eos", "lm-rand", "mt")
OFF_CYCLE = "Zebra"  # not in the sentence cycle: the trained LM is unsure what follows, samples vary


def eos_at_sentence_end(d):
    """The trained LM, changed so that it ends its text where it would write '.': the eos row of the output
    layer is 1.1 x the row of '.', so eos outscores '.' wherever '.' is the likely next token."""
    loaded = checkpoint.load(d, device="cpu")
    (dot,) = loaded.tokenizer.encode(".", add_special_tokens=False)
    with torch.no_grad():
        loaded.model.lm_head.weight[loaded.tokenizer.eos_id] = 1.1 * loaded.model.lm_head.weight[dot]
    checkpoint.save_checkpoint(d, loaded.model)
    return d


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("contract")
    models = factories.tiny_model_set(root)
    models["lm-eos"] = eos_at_sentence_end(factories.tiny_lm_dir(root / "lm-eos"))
    models["lm-rand"] = factories.tiny_lm_dir(root / "lm-rand", trained=False)  # flat distributions
    return models


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    args = factories.model_flags(checkpoints) + ["--batch-max-size", str(BATCH_MAX_SIZE),
                                                 "--batch-max-wait-ms", str(BATCH_MAX_WAIT_MS)]
    srv = ServerProcess(args, tmp_path_factory.mktemp("contract-logs") / "server.log").wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def loaded(checkpoints):
    return {name: checkpoint.load(checkpoints[name], device="cpu") for name in LOADED}


def post(server, path: str, **kwargs) -> httpx.Response:
    return httpx.post(server.url + path, timeout=120, **kwargs)


def complete(server, **body) -> dict:
    resp = post(server, "/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def reference(lm, prompt: str, **params) -> list[int]:
    """The generated ids of one request run alone in-process (eos, which ends a text, left out)."""
    return lm_tokens(lm, lm.tokenizer.encode(prompt), SamplingParams(**params), with_eos=False)


def text_of(lm, prompt: str, ids: list[int]) -> str:
    prompt_ids = lm.tokenizer.encode(prompt)
    return lm.tokenizer.decode(prompt_ids + ids)[len(lm.tokenizer.decode(prompt_ids)):]


def served_tokens(server, model: str, prompt: str, **params) -> list[list[str]]:
    """The generated tokens of each choice, as `logprobs` lists them."""
    body = {"model": model, "prompt": prompt, "logprobs": 0} | params
    return [c["logprobs"]["tokens"] for c in complete(server, **body)["choices"]]


# --------------------------------------------------------------------------------------------------
# X-Request-ID
# --------------------------------------------------------------------------------------------------
def test_request_id_is_echoed_or_generated(server):
    sent = f"client-{uuid.uuid4().hex[:12]}"
    echoed = [
        httpx.get(server.url + "/healthz", headers={"X-Request-ID": sent + "-a"}),
        post(server, "/v1/completions", json={"model": "lm", "prompt": "Hello", "max_tokens": 2},
             headers={"X-Request-ID": sent + "-b"}),
        post(server, "/v1/completions", json={"model": "nope", "prompt": "Hello"},
             headers={"X-Request-ID": sent + "-c"}),
    ]
    assert [r.status_code for r in echoed] == [200, 200, 404]
    assert [r.headers["x-request-id"] for r in echoed] == [sent + "-a", sent + "-b", sent + "-c"]
    with httpx.stream("POST", server.url + "/v1/completions", headers={"X-Request-ID": sent + "-d"},
                      json={"model": "lm", "prompt": "Hello", "max_tokens": 2, "stream": True}, timeout=60) as resp:
        assert resp.headers["x-request-id"] == sent + "-d"
        assert [line for line in resp.iter_lines() if line][-1] == "data: [DONE]"
    # One JSON object a line; the access log names each request by its id, with its route, method and status.
    def access_lines() -> tuple[list[dict], dict[str, dict]]:
        server.log()  # flushed
        entries = [json.loads(line) for line in server.log_file.read_text().splitlines() if line.startswith("{")]
        return entries, {e["request_id"]: e for e in entries if e.get("logger") == "tserve.access"}

    for _ in range(200):  # a stream's line is written once its response has ended, after the client read [DONE]
        entries, access = access_lines()
        if sent + "-d" in access:
            break
        time.sleep(0.02)
    for suffix, route, status in (("-a", "/healthz", 200), ("-b", "/v1/completions", 200),
                                  ("-c", "/v1/completions", 404), ("-d", "/v1/completions", 200)):
        entry = access[sent + suffix]
        assert (entry["message"], entry["level"], entry["route"], entry["status"]) == ("request", "INFO", route, status)
        assert entry["method"] == ("GET" if suffix == "-a" else "POST")
        assert isinstance(entry["ms"], int | float) and entry["ms"] >= 0 and entry["time"][:2] == "20"
    serving = [e for e in entries if e["message"] == "serving model"]
    assert {e["model"] for e in serving} >= {"lm"} and all(e["task"] and e["path"] for e in serving)

    generated = [
        httpx.get(server.url + "/healthz"),
        httpx.get(server.url + "/healthz"),
        post(server, "/v1/completions", json={"model": "lm", "prompt": "Hello", "max_tokens": 2}),
        post(server, "/v1/completions", json={"model": "nope", "prompt": "Hello"}),
        httpx.get(server.url + "/v1/nothing"),
    ]
    ids = [r.headers.get("x-request-id", "") for r in generated]
    assert all(i.strip() for i in ids), ids
    assert len(set(ids)) == len(ids), ids


# --------------------------------------------------------------------------------------------------
# Sampling fields of /v1/completions
# --------------------------------------------------------------------------------------------------
SEEDS = range(4)


def sampled(server, prompt: str, seed: int, **params) -> list[str]:
    """8 tokens of the untrained LM sampled at temperature 1."""
    return served_tokens(server, "lm-rand", prompt, max_tokens=8, temperature=1.0, seed=seed, **params)[0]


def test_top_k(server, loaded):
    """top_k 1 at temperature 1 is greedy; top_k 3 draws only among the 3 likeliest tokens, exactly as
    the same sampler in-process, which gives other samples than no top_k."""
    lm, prompt = loaded["lm-rand"], "Hello world"
    tokens = lm.tokenizer.tokens
    greedy = served_tokens(server, "lm-rand", prompt, max_tokens=8, temperature=0)[0]
    assert greedy == tokens(reference(lm, prompt, max_tokens=8, temperature=0))
    plain = [sampled(server, prompt, s) for s in SEEDS]
    assert all(p != greedy for p in plain), "sampling at temperature 1 should leave the greedy path"

    for s in SEEDS:
        assert sampled(server, prompt, s, top_k=1) == greedy

    for s in SEEDS:
        body = {"model": "lm-rand", "prompt": prompt, "max_tokens": 8, "temperature": 1.0, "seed": s, "top_k": 3,
                "logprobs": 3}
        lp = complete(server, **body)["choices"][0]["logprobs"]
        ref = reference(lm, prompt, max_tokens=8, temperature=1.0, seed=s, top_k=3)
        assert lp["tokens"] == tokens(ref)
        assert all(t in top for t, top in zip(lp["tokens"], lp["top_logprobs"], strict=True))
    assert any(tokens(reference(lm, prompt, max_tokens=8, temperature=1.0, seed=s, top_k=3)) != plain[s]
               for s in SEEDS)


def test_top_p(server, loaded):
    """A tiny top_p keeps only the likeliest token (greedy); top_p 0.5 samples as the same sampler
    in-process, which gives other samples than top_p 1."""
    lm, prompt = loaded["lm-rand"], "Good morning"
    tokens = lm.tokenizer.tokens
    greedy = served_tokens(server, "lm-rand", prompt, max_tokens=8, temperature=0)[0]
    plain = [sampled(server, prompt, s) for s in SEEDS]
    assert all(p != greedy for p in plain)
    for s in SEEDS:
        assert sampled(server, prompt, s, top_p=1e-9) == greedy
    nucleus = [tokens(reference(lm, prompt, max_tokens=8, temperature=1.0, seed=s, top_p=0.5)) for s in SEEDS]
    assert nucleus != plain
    for s in SEEDS:
        assert sampled(server, prompt, s, top_p=0.5) == nucleus[s]


def test_presence_and_frequency_penalties(server, loaded):
    """Each penalty changes the greedy output (the untrained LM repeats itself without one), as the same
    penalty applied in-process does."""
    lm, prompt = loaded["lm-rand"], "Hello world"
    tokens = lm.tokenizer.tokens
    variants = [{}, {"presence_penalty": 0.5}, {"frequency_penalty": 0.5}, {"presence_penalty": 1.5,
                                                                         "frequency_penalty": -0.5}]
    refs = [tokens(reference(lm, prompt, max_tokens=24, temperature=0, **v)) for v in variants]
    assert len({tuple(r) for r in refs}) == len(variants), refs
    for v, ref in zip(variants, refs, strict=True):
        assert served_tokens(server, "lm-rand", prompt, max_tokens=24, temperature=0, **v)[0] == ref, v


def test_min_tokens_and_ignore_eos(server, loaded):
    """lm-eos ends its text where a sentence ends. min_tokens holds eos back for that many tokens (the
    text then ends at a later sentence end), ignore_eos for the whole of max_tokens; as `model.decoding.generate` alone."""
    lm = loaded["lm-eos"]

    def ref(prompt: str, **params) -> list[int]:
        return reference(lm, prompt, max_tokens=40, temperature=0, **params)

    # A sentence of the cycle without its '.': eos comes at once, and again within 40 tokens after it.
    prompt = next((p for p in (s[:-1] for s in fixture_training.CYCLE if s.endswith("."))
                   if not ref(p) and len(ref(p, min_tokens=1)) < 40), None)
    assert prompt is not None, "no sentence of the cycle where lm-eos writes eos at once and again later"
    plain = complete(server, model="lm-eos", prompt=prompt, max_tokens=40, temperature=0)
    assert plain["choices"][0]["text"] == "" and plain["choices"][0]["finish_reason"] == "stop"
    assert plain["usage"]["completion_tokens"] == 0

    first_stop = len(ref(prompt, min_tokens=1))
    texts = []
    for params in ({"min_tokens": 1}, {"min_tokens": first_stop + 1}, {"ignore_eos": True}):
        resp = complete(server, model="lm-eos", prompt=prompt, max_tokens=40, temperature=0, **params)
        choice, expected = resp["choices"][0], ref(prompt, **params)
        assert resp["usage"]["completion_tokens"] == len(expected) >= params.get("min_tokens", 40), params
        assert choice["text"] == text_of(lm, prompt, expected), params
        assert choice["finish_reason"] == ("length" if len(expected) == 40 else "stop"), params
        texts.append(choice["text"])
    assert len(set(texts)) == 3 and texts[0], texts

    # min_tokens above max_tokens: max_tokens wins.
    capped = complete(server, model="lm-eos", prompt=prompt, max_tokens=5, temperature=0, min_tokens=50)
    assert capped["usage"]["completion_tokens"] == 5 and capped["choices"][0]["finish_reason"] == "length"


def test_stop_as_a_string(server, loaded):
    lm, prompt = loaded["lm"], "Hello world"
    full = text_of(lm, prompt, reference(lm, prompt, max_tokens=24, temperature=0))
    stop = full.split()[4]
    assert full.index(stop) > 5
    as_string = complete(server, model="lm", prompt=prompt, max_tokens=24, temperature=0, stop=stop)["choices"][0]
    as_list = complete(server, model="lm", prompt=prompt, max_tokens=24, temperature=0, stop=[stop])["choices"][0]
    assert as_string["text"] == full[: full.index(stop)]
    assert as_string["finish_reason"] == "stop"
    assert as_string == as_list


def test_choice_j_of_n_uses_seed_plus_j(server):
    body = {"model": "lm", "prompt": OFF_CYCLE, "max_tokens": 12, "temperature": 1.5, "seed": 40}
    choices = complete(server, **body, n=4)["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    texts = [c["text"] for c in choices]
    assert len(set(texts)) >= 3, texts
    alone = [complete(server, **body | {"seed": 40 + j})["choices"][0]["text"] for j in range(4)]
    assert texts == alone


async def _completion_text(client: httpx.AsyncClient, url: str, body: dict) -> str:
    if not body.get("stream"):
        resp = await client.post(url, json=body)
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["text"]
    text = ""
    async with client.stream("POST", url, json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
    return text


def histogram(server, name: str, model: str) -> dict[str, float]:
    """`count`, `sum` and each bucket (by its upper bound) of one model's histogram in /metrics."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(server.url + "/metrics", timeout=10).text):
        if family.name != name:
            continue
        for s in family.samples:
            if s.labels.get("model") != model:
                continue
            if s.name.endswith("_bucket"):
                out[f"le={float(s.labels['le']):g}"] = s.value
            elif s.name.endswith(("_count", "_sum")):
                out[s.name.rsplit("_", 1)[1]] = s.value
    return out


def test_seeded_output_is_the_same_with_concurrent_neighbours(server):
    """A seeded sample alone, then the same request three times among ten different ones running at once
    (greedy and sampled, other prompts, lengths and seeds, streamed or not): the same text every time."""
    target = {"model": "lm", "prompt": OFF_CYCLE, "max_tokens": 16, "temperature": 1.5, "seed": 11}
    alone = complete(server, **target)["choices"][0]["text"]
    others = {complete(server, **target | {"seed": s})["choices"][0]["text"] for s in (12, 13)}
    assert alone not in others  # the seed decides the text

    prompts = [fixture_training.CYCLE_TEXT[i:i + 30] for i in range(0, 300, 30)]
    neighbours = [{"model": "lm", "prompt": p, "max_tokens": 8 + 3 * i, "temperature": (0, 0.9, 1.5)[i % 3],
                   "seed": 100 + i, "stream": i % 2 == 0} for i, p in enumerate(prompts)]
    before = histogram(server, "tserve_batch_size", "lm")

    async def together() -> list[str]:
        async with httpx.AsyncClient(timeout=120) as client:
            url = server.url + "/v1/completions"
            bodies = [target, *neighbours[:5], target | {"stream": True}, *neighbours[5:], target]
            return await asyncio.gather(*(_completion_text(client, url, b) for b in bodies))

    texts = asyncio.run(together())
    assert [texts[0], texts[6], texts[-1]] == [alone] * 3
    after = histogram(server, "tserve_batch_size", "lm")
    batches, rows = after["count"] - before["count"], after["sum"] - before["sum"]
    assert rows > batches, "the requests never ran in one batch"


# --------------------------------------------------------------------------------------------------
# Chat
# --------------------------------------------------------------------------------------------------
MESSAGES = [{"role": "user", "content": "Where is the station?"}]


def chat(server, **body) -> dict:
    resp = post(server, "/v1/chat/completions", json={"model": "lm", "messages": MESSAGES, "temperature": 0} | body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def chat_prompt(lm) -> list[int]:
    return lm.tokenizer.encode(lm.tokenizer.apply_chat_template(MESSAGES), add_special_tokens=False)


def test_chat_max_completion_tokens(server, loaded):
    lm = loaded["lm"]
    long = chat(server, max_tokens=20)
    assert long["usage"]["completion_tokens"] == 20
    short = chat(server, max_tokens=20, max_completion_tokens=5)  # max_completion_tokens wins
    assert short["usage"]["completion_tokens"] == 5 and short["choices"][0]["finish_reason"] == "length"
    content = short["choices"][0]["message"]["content"]
    assert long["choices"][0]["message"]["content"].startswith(content) and content
    prompt = chat_prompt(lm)
    ref = lm_tokens(lm, prompt, SamplingParams(max_tokens=5, temperature=0))
    assert content == lm.tokenizer.decode(prompt + ref)[len(lm.tokenizer.decode(prompt)):]
    assert chat(server, max_completion_tokens=5)["choices"][0]["message"]["content"] == content


def test_chat_logprobs_and_top_logprobs(server, loaded):
    """Each generated token with its log-probability and the `top_logprobs` likeliest alternatives, equal to
    a forward pass in-process; streamed the same; absent without `logprobs`."""
    lm = loaded["lm"]
    resp = chat(server, max_completion_tokens=6, logprobs=True, top_logprobs=3)
    content = resp["choices"][0]["logprobs"]["content"]
    prompt = chat_prompt(lm)
    ref = lm_tokens(lm, prompt, SamplingParams(max_tokens=6, temperature=0))
    assert len(content) == len(ref) == 6
    with torch.no_grad():
        logits = lm.model(torch.tensor([prompt + ref]))[0, len(prompt) - 1: -1].float()
    logp = torch.log_softmax(logits, dim=-1)
    assert len({round(float(v), 3) for v in logp.max(-1).values}) > 1  # not one number throughout
    for entry, tok, row in zip(content, ref, logp, strict=True):
        assert entry["token"] == lm.tokenizer.tokens([tok])[0]
        assert entry["bytes"] == list(entry["token"].encode("utf-8"))
        assert entry["logprob"] == pytest.approx(float(row[tok]), abs=1e-4)
        top_v, top_i = row.topk(3)
        assert [t["token"] for t in entry["top_logprobs"]] == lm.tokenizer.tokens(top_i.tolist())
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(top_v.tolist(), abs=1e-4)
        assert entry["top_logprobs"][0]["token"] == entry["token"]  # greedy: the likeliest one

    streamed = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60, json={
            "model": "lm", "messages": MESSAGES, "temperature": 0, "max_completion_tokens": 6, "logprobs": True,
            "top_logprobs": 3, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    streamed += (c.get("logprobs") or {}).get("content") or []
    assert streamed == content

    assert chat(server, max_completion_tokens=3, top_logprobs=3)["choices"][0]["logprobs"] is None
    bare = chat(server, max_completion_tokens=3, logprobs=True)["choices"][0]["logprobs"]["content"]
    assert [e["top_logprobs"] for e in bare] == [[], [], []]


# --------------------------------------------------------------------------------------------------
# Translation
# --------------------------------------------------------------------------------------------------
def test_translation_stream_deltas_finish_reason_and_usage(server, loaded):
    """The deltas of a streamed translation add up to the translation (each chunk's `translation` being the
    text so far); only the last chunk has `finish_reason` (stop: eos reached; length: max_tokens) and
    `usage`, as the non-streamed answer counts it."""
    mt = loaded["mt"]
    finishes = []
    cases = [("good morning where is the station", 24), ("the quick brown fox jumps over the lazy dog", 24),
             ("hello world", 3)]
    for source, max_tokens in cases:
        body = {"model": "mt", "input": source, "num_beams": 1, "max_tokens": max_tokens}
        whole = post(server, "/v1/translations", json=body).json()
        ref = mt_tokens(mt, mt.tokenizer.encode(source), 1, max_tokens)
        assert whole["data"][0]["translation"] == mt.tokenizer.decode(ref)
        # cache off: translated token by token (the translation memory would answer it in one chunk)
        stream = body | {"stream": True, "cache": False}
        with httpx.stream("POST", server.url + "/v1/translations", json=stream, timeout=60) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in lines[:-1]]
        assert len(chunks) >= 2, chunks
        so_far = ""
        for chunk in chunks:
            assert chunk["object"] == "translation.chunk" and chunk["model"] == "mt"
            (item,) = chunk["data"]
            so_far += item["delta"]
            assert item["translation"] == so_far and item["index"] == 0
        assert so_far == whole["data"][0]["translation"]
        assert all("finish_reason" not in c and "usage" not in c for c in chunks[:-1])
        assert chunks[-1]["usage"] == whole["usage"] and whole["usage"]["completion_tokens"] == len(ref)
        finishes.append(chunks[-1]["finish_reason"])
        assert finishes[-1] == ("stop" if ref[-1] == mt.config.eos_token_id else "length")
    assert set(finishes) == {"stop", "length"}, finishes


def test_num_beams_defaults_to_the_checkpoints(server, loaded):
    """The tiny translator's checkpoint says num_beams 2: a request without num_beams decodes as one with
    num_beams 2, which for some of these long inputs finds another translation than greedy decoding."""
    assert loaded["mt"].generation.num_beams == 2
    rng = random.Random(5)
    inputs = [" ".join(rng.choices(list(fixture_training.LEXICON), k=rng.randint(8, 14))) for _ in range(16)]

    def translations(**extra) -> list[str]:
        resp = post(server, "/v1/translations", json={"model": "mt", "input": inputs} | extra)
        assert resp.status_code == 200, resp.text
        return [d["translation"] for d in resp.json()["data"]]

    default, two, greedy = translations(), translations(num_beams=2), translations(num_beams=1)
    assert len(set(default)) == len(inputs)
    assert default == two
    assert sum(d != g for d, g in zip(default, greedy, strict=True)) >= 1, "beam search never differs from greedy"


# --------------------------------------------------------------------------------------------------
# Classification batching
# --------------------------------------------------------------------------------------------------
def _png(seed: int) -> bytes:
    rng = random.Random(seed)
    image = Image.new("L", (28, 28), rng.randrange(256))
    for _ in range(30):
        x, y = rng.randrange(28), rng.randrange(28)
        image.putpixel((x, y), rng.randrange(256))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_classification_batches_never_exceed_batch_max_size(server, checkpoints):
    vit = checkpoint.load(checkpoints["vit"], device="cpu")
    images = [_png(i) for i in range(5)]
    with torch.no_grad():
        probs = [torch.softmax(vit.model(vit.preprocessing(Image.open(io.BytesIO(b)))[None]), -1)[0] for b in images]
    assert len({round(float(p.max()), 4) for p in probs}) > 1

    before = histogram(server, "tserve_batch_size", "vit")
    resp = post(server, "/v1/classifications", json={"model": "vit", "images": [_b64(b) for b in images],
                                                      "top_k": 1}).json()
    after = histogram(server, "tserve_batch_size", "vit")
    for item, p in zip(resp["data"], probs, strict=True):
        assert item["predictions"][0]["score"] == pytest.approx(float(p.max()), abs=1e-5)
    delta = {k: after[k] - before.get(k, 0) for k in after}
    # Five images queued at once run as 2 + 2 + 1.
    assert (delta["count"], delta["sum"]) == (3, 5), delta
    assert delta["le=2"] == delta["count"] and delta["le=1"] == 1

    async def concurrent() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(client.post(server.url + "/v1/classifications", json={
                "model": "vit", "image": _b64(b)}) for b in images[:4]))

    before = histogram(server, "tserve_batch_size", "vit")
    assert [r.status_code for r in asyncio.run(concurrent())] == [200] * 4
    after = histogram(server, "tserve_batch_size", "vit")
    delta = {k: after[k] - before.get(k, 0) for k in after}
    assert delta["sum"] == 4 and delta["le=2"] == delta["count"], delta


def test_an_image_on_an_idle_server_is_not_held_for_a_batch(server):
    """--batch-max-wait-ms is a wait for more images while they keep arriving: a lone image on an idle
    classifier runs at once, in a batch of its own, and so does a second one sent 150 ms later (within the
    wait). That images under load wait for company is tested in-process
    (test_an_item_on_an_idle_batcher_does_not_wait_for_a_batch_but_items_under_load_do)."""
    async def staggered() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            async def later(delay: float, data: bytes) -> httpx.Response:
                await asyncio.sleep(delay)
                return await client.post(server.url + "/v1/classifications", json={"image": _b64(data)})

            return await asyncio.gather(later(0, _png(1)), later(0.15, _png(2)))

    before = histogram(server, "tserve_batch_size", "vit")
    assert [r.status_code for r in asyncio.run(staggered())] == [200, 200]
    after = histogram(server, "tserve_batch_size", "vit")
    delta = {k: after[k] - before.get(k, 0) for k in after}
    assert (delta["count"], delta["sum"]) == (2, 2), delta
