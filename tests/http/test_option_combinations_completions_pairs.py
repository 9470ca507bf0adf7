"""The legacy `/v1/completions` route where two of its options meet in one request, in-process (the app through
httpx.ASGITransport): a list of prompts with n seeded choices, echo and logprobs (each prompt answered as if it
were sent alone, choice j of a prompt with seed + j, prompt-major choice order, the echoed prompt's logprobs those
of a forward pass and its offsets where each token's text starts, usage summed over prompts and choices); a list
whose later prompt does not fit the context, with echo and logprobs; echo beside a stop string found in the
prompt. References: the same request piece by piece (each prompt alone, each choice alone with its seed), the
model's own forward pass, and OpenAI's documented rules written as plain Python."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_option_combinations_lm import chunks, post, run
from tests.helpers import factories
from tserve.model import checkpoint

PROMPTS = ["Zebra", "the quick brown"]  # off the trained cycle (varied samples), and on it; of different lengths
SEED, N = 21, 2


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {"lm": factories.tiny_lm_dir(tmp_path_factory.mktemp("completions-pairs") / "lm")}


@pytest.fixture(scope="module")
def lm(models):
    return checkpoint.load(models["lm"], device="cpu")


def sampled(**body) -> dict:
    return {"model": "lm", "max_tokens": 8, "temperature": 1.5, "seed": SEED, "ignore_eos": True, "echo": True,
            "logprobs": 2} | body


def _same_choice(got: dict, want: dict) -> None:
    """Two choices equal but for their index; logprobs to the rounding a batch of another size may bring."""
    assert (got["text"], got["finish_reason"]) == (want["text"], want["finish_reason"])
    g, w = got["logprobs"], want["logprobs"]
    assert (g["tokens"], g["text_offset"]) == (w["tokens"], w["text_offset"])
    assert g["token_logprobs"][0] is None and w["token_logprobs"][0] is None
    assert g["token_logprobs"][1:] == pytest.approx(w["token_logprobs"][1:], abs=1e-4)
    assert [sorted(t or {}) for t in g["top_logprobs"]] == [sorted(t or {}) for t in w["top_logprobs"]]


# --------------------------------------------------------------------------------------------------
# Several prompts x n choices, seeded, with echo and logprobs
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [SEED, 0], ids=["seed-21", "seed-0"])
def test_a_list_of_prompts_with_n_seeded_echoed_choices_answers_each_prompt_as_if_alone(models, seed):
    """Choices come prompt-major (index p * n + j); choice j of prompt p is exactly prompt p sent alone with
    seed + j (its echoed prompt, its sample, its logprobs and offsets), whatever the other prompt beside it;
    seed 0 is a seed like any other. `user` and `metadata` change nothing. Usage counts every choice's prompt
    and every choice's tokens."""
    together = sampled(prompt=PROMPTS, n=N, seed=seed, user="someone", metadata={"team": "x"})

    async def go(client):
        alone = [[await post(client, "/v1/completions", sampled(prompt=p, seed=seed + j)) for j in range(N)]
                 for p in PROMPTS]
        return await post(client, "/v1/completions", together), alone

    whole, alone = run(models, go)
    choices = whole["choices"]
    assert [c["index"] for c in choices] == list(range(len(PROMPTS) * N))
    for c in choices:
        p, j = divmod(c["index"], N)
        assert c["text"].startswith(PROMPTS[p])
        _same_choice(c, alone[p][j]["choices"][0])
    for p in range(len(PROMPTS)):  # the seed decides the sample: the rule above is not met by chance
        assert len({choices[p * N + j]["text"] for j in range(N)}) == N
    usage = whole["usage"]
    assert usage["prompt_tokens"] == N * sum(a[0]["usage"]["prompt_tokens"] for a in alone)
    assert usage["completion_tokens"] == sum(a[j]["usage"]["completion_tokens"] for a in alone for j in range(N))
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_echoed_prompt_logprobs_of_several_prompts_are_each_prompts_forward_pass(models, lm):
    """With echo and logprobs, each prompt token's logprob is the model's log-probability of it after the tokens
    before it (the first token has none), its top alternatives the likeliest ones; each token's text_offset is
    where its own text starts in the choice's text (OpenAI's rule), for every prompt of a list and every choice."""
    k = 3
    body = sampled(prompt=PROMPTS, n=N, logprobs=k, max_tokens=4)

    async def go(client):
        return await post(client, "/v1/completions", body)

    for c in run(models, go)["choices"]:
        prompt = PROMPTS[c["index"] // N]
        ids = lm.tokenizer.encode(prompt)
        lp = c["logprobs"]
        assert lp["tokens"][: len(ids)] == lm.tokenizer.tokens(ids)
        with torch.no_grad():
            logp = torch.log_softmax(lm.model(torch.tensor([ids]))[0, :-1].float(), dim=-1)
        want = [float(logp[i, t]) for i, t in enumerate(ids[1:])]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["token_logprobs"][1: len(ids)] == pytest.approx(want, abs=1e-4)
        for pos in range(1, len(ids)):
            top_v, top_i = logp[pos - 1].topk(k)
            got = lp["top_logprobs"][pos]
            assert sorted(got) == sorted(lm.tokenizer.tokens(top_i.tolist()))
            assert sorted(got.values()) == pytest.approx(sorted(top_v.tolist()), abs=1e-4)
        # Offsets: nondecreasing, each token's text read at its offset, the completion's first at len(prompt).
        offsets, text = lp["text_offset"], c["text"]
        assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[len(ids)] == len(prompt)
        for pos in range(1, len(lp["tokens"])):
            piece = lm.tokenizer.decode([ids[pos]]) if pos < len(ids) else lp["tokens"][pos]
            assert text[offsets[pos]: offsets[pos] + len(piece)] == piece, (prompt, pos)


def test_a_streamed_list_of_prompts_with_n_and_echo_streams_each_choice_under_its_own_index(models):
    """Streamed, the same request sends each choice's echoed prompt (with its logprobs) under that choice's
    index, then its tokens: joined per index, the chunks are the unstreamed answer; the usage chunk its usage."""
    body = sampled(prompt=PROMPTS, n=N, logprobs=1, max_tokens=5)

    async def go(client):
        return (await post(client, "/v1/completions", body),
                await chunks(client, "/v1/completions", body | {"stream_options": {"include_usage": True}}))

    whole, streamed = run(models, go)
    joined: dict[int, dict] = {}
    for chunk in streamed:
        for ch in chunk["choices"]:
            c = joined.setdefault(ch["index"], {"text": "", "finish_reason": None, "logprobs": {
                "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}})
            c["text"] += ch["text"]
            c["finish_reason"] = ch["finish_reason"] or c["finish_reason"]
            for key, column in c["logprobs"].items():
                column += ch["logprobs"][key]
    assert sorted(joined) == [c["index"] for c in whole["choices"]]
    for c in whole["choices"]:
        _same_choice(joined[c["index"]], c)
    usage = {k: streamed[-1]["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    assert usage == {k: whole["usage"][k] for k in usage}


# --------------------------------------------------------------------------------------------------
# Limits beside echo with logprobs
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("echo", [False, True], ids=["plain", "echo-logprobs"])
def test_a_later_prompt_past_the_context_is_refused_whatever_the_n_and_echo(models, echo):
    """The context limit holds for every prompt of a list, not the first only: a later prompt that with max_tokens
    does not fit is a 400 context_length_exceeded naming its length, also with n > 1 and with echo + logprobs
    (whose prompt scoring comes after the check)."""
    long = "the quick brown fox " * 10  # 133 tokens with bos; the tiny LM's context is 128
    body = {"model": "lm", "prompt": ["Hi", "Hello", long], "n": N, "max_tokens": 16, "temperature": 0,
            "echo": echo, "logprobs": 1 if echo else None}

    async def go(client):
        resp = await client.post("/v1/completions", json=body)
        return resp.status_code, resp.json()

    status, answer = run(models, go)
    assert status == 400, answer
    assert answer["error"]["code"] == "context_length_exceeded"
    assert "133 tokens" in answer["error"]["message"]


# --------------------------------------------------------------------------------------------------
# Echo beside stop strings
# --------------------------------------------------------------------------------------------------
def test_echo_keeps_the_whole_prompt_when_a_stop_string_occurs_in_it(models):
    """A stop string is looked for in the completion only: one that the prompt contains leaves the echoed
    prompt whole, and the completion is cut as the same request without echo cuts it, streamed or not."""
    prompt, stop = "the quick brown fox", "the"  # in the prompt, and in " jumps over the lazy dog" that follows
    plain = {"model": "lm", "prompt": prompt, "max_tokens": 16, "temperature": 0, "stop": [stop]}

    async def go(client):
        return (await post(client, "/v1/completions", plain), await post(client, "/v1/completions", plain | {
            "echo": True}), await chunks(client, "/v1/completions", plain | {"echo": True, "n": N}))

    cut, echoed, streamed = run(models, go)
    completion = cut["choices"][0]["text"]
    assert cut["choices"][0]["finish_reason"] == "stop" and completion == " jumps over "
    assert echoed["choices"][0]["text"] == prompt + completion
    assert echoed["choices"][0]["finish_reason"] == "stop"
    texts = {j: "" for j in range(N)}
    for chunk in streamed:
        for ch in chunk["choices"]:
            texts[ch["index"]] += ch["text"]
    assert texts == {j: prompt + completion for j in range(N)}


# --------------------------------------------------------------------------------------------------
# Prompts as token ids; OpenAI's fields that are not served
# --------------------------------------------------------------------------------------------------
def test_prompts_given_as_token_ids_answer_as_the_same_prompts_given_as_text(models, lm):
    """`prompt` as a prompt's token ids, or as several prompts' ids (OpenAI's other two forms): each choice equals
    the one the same prompt as text gets (the ids the route would encode it to, its bos too), with n, seeds and
    logprobs; echoed, the ids read as their text, special tokens written out; an id outside the vocabulary, or an
    empty prompt, is a 400."""
    ids = [lm.tokenizer.encode(p) for p in PROMPTS]
    plain = {"echo": False, "n": N}

    async def go(client):
        as_text = await post(client, "/v1/completions", sampled(prompt=PROMPTS, **plain))
        as_ids = await post(client, "/v1/completions", sampled(prompt=ids, **plain))
        one = await post(client, "/v1/completions", sampled(prompt=ids[1], **plain))
        echoed = await post(client, "/v1/completions", sampled(prompt=ids[1], n=1))
        outside = await client.post("/v1/completions", json=sampled(prompt=[3, lm.config.vocab_size]))
        empty = await client.post("/v1/completions", json=sampled(prompt=[ids[0], []]))
        return as_text, as_ids, one, echoed, outside, empty

    as_text, as_ids, one, echoed, outside, empty = run(models, go)
    assert len(as_ids["choices"]) == len(PROMPTS) * N
    for got, want in zip(as_ids["choices"], as_text["choices"], strict=True):
        assert (got["text"], got["logprobs"]["tokens"]) == (want["text"], want["logprobs"]["tokens"])
    for got, want in zip(one["choices"], as_text["choices"][N:], strict=True):
        assert (got["text"], got["logprobs"]["tokens"]) == (want["text"], want["logprobs"]["tokens"])
    assert as_ids["usage"] == as_text["usage"]
    prefix = lm.tokenizer.decode(ids[1], skip_special_tokens=False)
    assert echoed["choices"][0]["text"] == prefix + as_text["choices"][N]["text"]
    assert outside.status_code == 400 and outside.json()["error"]["code"] == "invalid_prompt"
    assert empty.status_code == 400


def test_suffix_and_a_best_of_beyond_n_are_refused_not_ignored(models):
    """`suffix` and `best_of` (more candidates than choices) would make other answers than the client asked for:
    400 naming them, as vLLM refuses what it does not serve; `best_of` equal to `n` asks for nothing more."""
    async def go(client):
        suffix = await client.post("/v1/completions", json=sampled(prompt="Hello", suffix=" world"))
        best_of = await client.post("/v1/completions", json=sampled(prompt="Hello", n=2, best_of=3))
        same = await client.post("/v1/completions", json=sampled(prompt="Hello", n=2, best_of=2))
        return suffix, best_of, same

    suffix, best_of, same = run(models, go)
    for refused, name in ((suffix, "suffix"), (best_of, "best_of")):
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "unsupported_parameter"
        assert name in refused.json()["error"]["message"]
    assert same.status_code == 200 and len(same.json()["choices"]) == 2
