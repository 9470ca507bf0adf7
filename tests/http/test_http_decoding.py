"""Decoding over HTTP, through one real `tserve serve` process: `logit_bias` on completions and chat
(forcing, banning, validation, neighbours unchanged), and `/v1/attention` without a target scoring exactly
the translation `/v1/translations` returns."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.helpers import factories
from tests.helpers.fixture_training import assert_varied, cycle_prompts, sentences_where_beams_matter
from tests.helpers.one_request import lm_tokens, mt_tokens
from tests.helpers.server import ServerProcess
from tserve.model import checkpoint
from tserve.model.decoding import SamplingParams


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("decoding")
    return {"lm": factories.tiny_lm_dir(root / "lm"), "mt": factories.tiny_mt_dir(root / "mt")}


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    srv = ServerProcess(factories.model_flags(checkpoints) + ["--max-running-requests", "8"],
                        tmp_path_factory.mktemp("decoding-logs") / "server.log").wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def loaded(checkpoints):
    return {name: checkpoint.load(path, device="cpu") for name, path in checkpoints.items()}


def post(server, path: str, **kwargs) -> httpx.Response:
    return httpx.post(server.url + path, timeout=120, **kwargs)


async def _tokens(client: httpx.AsyncClient, url: str, body: dict) -> list[str]:
    resp = await client.post(url, json=body | {"logprobs": 0})
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["logprobs"]["tokens"]


# --------------------------------------------------------------------------------------------------
# logit_bias
# --------------------------------------------------------------------------------------------------
def test_logit_bias_over_http_forces_bans_and_leaves_neighbours_alone(server, loaded):
    """Sent at once: +100 on a token the model never writes here makes it every token (greedy and sampled);
    -100 on the first greedy token keeps it out (greedy and sampled) and gives what the one-request path
    gives; the unbiased requests beside them answer what they answer alone."""
    lm = loaded["lm"]
    texts = cycle_prompts(6, seed=8)
    prompts = [lm.tokenizer.encode(t) for t in texts]
    plain = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
             SamplingParams(max_tokens=10, temperature=1.5, seed=5, ignore_eos=True)]
    unbiased = [lm_tokens(lm, prompts[i], plain[i % 2]) for i in range(6)]
    assert_varied(unbiased)
    banned = unbiased[0][0]
    forced = next(t for t in range(lm.config.vocab_size)
                  if all(t not in u for u in unbiased) and t != lm.tokenizer.eos_id)
    biases = [{banned: -100}, {forced: 100}, {forced: 100}, {banned: -100}, {}, {}]

    def body(i: int) -> dict:
        p = plain[i % 2]
        out = {"model": "lm", "prompt": texts[i], "max_tokens": p.max_tokens, "temperature": p.temperature,
               "seed": p.seed, "ignore_eos": True}
        return out | ({"logit_bias": {str(t): b for t, b in biases[i].items()}} if biases[i] else {})

    async def together() -> list[list[str]]:
        async with httpx.AsyncClient(timeout=120) as client:
            url = server.url + "/v1/completions"
            return await asyncio.gather(*(_tokens(client, url, body(i)) for i in range(6)))

    got = asyncio.run(together())
    name = lm.tokenizer.tokens
    assert got[1] == got[2] == name([forced] * 10)
    assert name([banned])[0] not in got[0] + got[3]
    assert got[0] == name(lm_tokens(lm, prompts[0], SamplingParams(**vars(plain[0]) | {"logit_bias": {banned: -100.0}})))
    assert got[0] != name(unbiased[0])
    assert got[4:] == [name(u) for u in unbiased[4:]]


def test_logit_bias_on_chat_forces_the_token(server, loaded):
    lm = loaded["lm"]
    (forced,) = lm.tokenizer.encode(" zebra", add_special_tokens=False)[:1]
    resp = post(server, "/v1/chat/completions", json={
        "model": "lm", "messages": [{"role": "user", "content": "Where is the station?"}], "max_tokens": 4,
        "temperature": 0, "logit_bias": {str(forced): 100}, "logprobs": True})
    assert resp.status_code == 200, resp.text
    assert [c["token"] for c in resp.json()["choices"][0]["logprobs"]["content"]] == lm.tokenizer.tokens([forced] * 4)


@pytest.mark.parametrize(("bias", "words"), [
    ({"abc": 1}, "not a token id"), ({"100000": 1}, "outside this model's vocabulary"), ({"-1": 1}, "outside"),
    ({"5": 100.5}, "from -100 to 100"), ({str(i): 1 for i in range(301)}, "at most 300"),
])
def test_bad_logit_bias_is_a_400(server, bias, words):
    for path, extra in (("/v1/completions", {"prompt": "Hello"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
        resp = post(server, path, json={"model": "lm", "max_tokens": 2, "logit_bias": bias} | extra)
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["code"] == "invalid_logit_bias" and words in error["message"], error


# --------------------------------------------------------------------------------------------------
# /v1/attention without a target
# --------------------------------------------------------------------------------------------------
def test_attention_scores_what_translations_return(server, loaded):
    """For sentences where the checkpoint's beams find another translation than greedy decoding (and a few
    where they may not), `/v1/attention` without `target` reads exactly the target tokens `/v1/translations`
    returns with the same defaults."""
    mt = loaded["mt"]
    differ = sentences_where_beams_matter(mt, 3, num_beams=mt.generation.num_beams)
    texts = differ + ["Good morning.", "Where is the station?"]
    translations = post(server, "/v1/translations", json={"model": "mt", "input": texts}).json()["data"]
    start = mt.config.decoder_start_token_id
    for text, item in zip(texts, translations, strict=True):
        ids = [t for t in mt_tokens(mt, mt.tokenizer.encode(text), mt.generation.num_beams)
               if t != mt.config.eos_token_id]
        assert item["translation"] == mt.tokenizer.decode(ids)
        resp = post(server, "/v1/attention", json={"model": "mt", "input": text, "layers": [0], "heads": [0]})
        assert resp.status_code == 200, resp.text
        out = resp.json()
        assert out["target"] == item["translation"]
        decoder = next(m for m in out["maps"] if m["module"] == "decoder.self")
        assert decoder["query_tokens"] == mt.tokenizer.tokens([start, *ids])
    greedy = [mt_tokens(mt, mt.tokenizer.encode(t), 1) for t in differ]
    assert [d["translation"] for d in translations[:3]] != [mt.tokenizer.decode(g) for g in greedy]


# --------------------------------------------------------------------------------------------------
# Prefix cache
# --------------------------------------------------------------------------------------------------
def test_a_repeated_prompt_reports_its_cached_tokens_as_openai_does(server, loaded):
    """The second of two identical long prompts is read from the prefix cache: `usage.prompt_tokens_details.
    cached_tokens` says how many of its tokens (whole blocks, all but the last token at most), the first says 0,
    the answers are the same, and /metrics counts the hit and the tokens."""
    lm = loaded["lm"]
    prompt = cycle_prompts(1, seed=31, min_words=12, max_words=12)[0]
    n_ids = len(lm.tokenizer.encode(prompt))
    before = _metric(server, "tserve_prefix_cache_cached_tokens_total")
    answers = []
    for _ in range(2):
        resp = post(server, "/v1/completions", json={"model": "lm", "prompt": prompt, "max_tokens": 6,
                                                     "temperature": 0})
        assert resp.status_code == 200, resp.text
        answers.append(resp.json())
    first, second = (a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers)
    assert first == 0 and second == (n_ids - 1) // 16 * 16 > 0
    assert answers[0]["choices"][0]["text"] == answers[1]["choices"][0]["text"]
    assert _metric(server, "tserve_prefix_cache_cached_tokens_total") - before == second
    chat = post(server, "/v1/chat/completions", json={"model": "lm", "max_tokens": 2,
                                                      "messages": [{"role": "user", "content": "hi"}]})
    assert chat.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def _metric(server, name: str) -> float:  # noqa: ANN001
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))
