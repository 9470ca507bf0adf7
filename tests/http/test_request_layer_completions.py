"""The request layer of `/v1/completions` and `/v1/chat/completions` (and the language model's `/v2` infer), in
process (the app through httpx.ASGITransport): request fields read the same on both routes and in both modes
(streamed or not), beside a non-default option — stream_options without include_usage on chat, continuous usage
stats beside echo, the server's --max-tokens-limit for a chat that gives no max_tokens, best_of below n,
structured_outputs with `json_object: false` beside a regex, a /v2 parameter sent as a JSON boolean — and the ids
each route gives its answers. References: OpenAI's documented rules and vLLM's, written as plain Python."""

from __future__ import annotations

import re

import pytest

from tests.engine.test_option_combinations_lm import chunks, post, run
from tests.helpers import factories
from tserve.model.tokenizer import load_tokenizer

CHAT = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {"lm": factories.tiny_lm_dir(tmp_path_factory.mktemp("request-layer") / "lm")}


def completion(**body) -> dict:
    return {"model": "lm", "prompt": "Hello world", "max_tokens": 4, "temperature": 0} | body


def chat(**body) -> dict:
    return {"model": "lm", "messages": CHAT, "max_tokens": 4, "temperature": 0} | body


# --------------------------------------------------------------------------------------------------
# stream_options: the usage chunk only when include_usage is true, on both routes
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("options", [{"include_usage": False}, {"continuous_usage_stats": True}, {}],
                         ids=["include-usage-false", "continuous-alone", "empty"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"], ids=["completions", "chat"])
def test_stream_options_without_include_usage_send_no_usage_on_either_route(models, path, options):
    """OpenAI sends the final usage chunk (`choices: []`) only with `stream_options.include_usage: true`; a
    stream_options object that leaves it out or sets it false asks for none, and vLLM's continuous_usage_stats
    alone adds nothing either. Chat reads the option as completions does: with it true the chunk does come."""
    body = (completion if path == "/v1/completions" else chat)(n=2, ignore_eos=True)

    async def go(client):
        return (await chunks(client, path, body | {"stream_options": options}),
                await chunks(client, path, body | {"stream_options": {"include_usage": True}}))

    without, asked = run(models, go)
    assert without and all(chunk["choices"] and "usage" not in chunk for chunk in without), without[-1]
    assert asked[-1]["choices"] == [] and asked[-1]["usage"]["completion_tokens"] == 2 * 4
    assert all("usage" not in chunk for chunk in asked[:-1])


# --------------------------------------------------------------------------------------------------
# Continuous usage stats beside echo
# --------------------------------------------------------------------------------------------------
def test_continuous_usage_is_in_the_echoed_prompts_chunk_too(models):
    """With `continuous_usage_stats` (and include_usage) every chunk that carries a choice carries that choice's
    usage so far, the chunk of an echoed prompt included: no completion token yet, the prompt's own length; each
    choice's later counts rise to its max_tokens. Two prompts of different lengths, two choices each."""
    prompts = ["Hello world", "the quick brown fox"]
    body = completion(prompt=prompts, n=2, echo=True, ignore_eos=True, max_tokens=5,
                      stream_options={"include_usage": True, "continuous_usage_stats": True})

    async def go(client):
        return await post(client, "/v1/completions", body | {"stream_options": None}), \
            await chunks(client, "/v1/completions", body)

    whole, streamed = run(models, go)
    prompt_len = whole["usage"]["prompt_tokens"]  # every choice's prompt counted
    *with_choices, last = streamed
    assert last["choices"] == [] and last["usage"]["prompt_tokens"] == prompt_len
    firsts: dict[int, dict] = {}
    counts: dict[int, list[int]] = {}
    for chunk in with_choices:
        (choice,) = chunk["choices"]
        assert "usage" in chunk, chunk
        usage = chunk["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        firsts.setdefault(choice["index"], chunk)
        counts.setdefault(choice["index"], []).append(usage["completion_tokens"])
    assert sorted(firsts) == [0, 1, 2, 3]
    own = {i: firsts[i]["usage"]["prompt_tokens"] for i in firsts}
    assert own[0] == own[1] < own[2] == own[3] and 2 * (own[0] + own[2]) == prompt_len
    for i, first in firsts.items():
        assert first["choices"][0]["text"] == prompts[i // 2]  # the echo comes first, before any token
        assert first["usage"]["completion_tokens"] == 0
        assert counts[i] == sorted(counts[i]) and counts[i][-1] == 5


# --------------------------------------------------------------------------------------------------
# --max-tokens-limit for a chat that gives no max_tokens
# --------------------------------------------------------------------------------------------------
def test_a_chat_without_max_tokens_stops_at_the_servers_max_tokens_limit(models):
    """Without max_tokens (or max_completion_tokens) a chat may write what the context leaves, but never more
    than --max-tokens-limit, which caps every request's completion: with the limit at 6, ignore_eos, the chat
    ends at 6 tokens with finish_reason length, streamed or not; an explicit max_tokens past it is a 400."""
    body = {"model": "lm", "messages": CHAT, "temperature": 0, "ignore_eos": True}

    async def go(client):
        over = await client.post("/v1/chat/completions", json=body | {"max_tokens": 7})
        return (await post(client, "/v1/chat/completions", body),
                await chunks(client, "/v1/chat/completions", body | {"stream_options": {"include_usage": True}}),
                over)

    whole, streamed, over = run(models, go, max_tokens_limit=6)
    assert whole["usage"]["completion_tokens"] == 6 and whole["choices"][0]["finish_reason"] == "length"
    assert streamed[-1]["usage"]["completion_tokens"] == 6
    assert [c["finish_reason"] for s in streamed for c in s["choices"] if c["finish_reason"]] == ["length"]
    assert over.status_code == 400 and "limit of 6" in over.json()["error"]["message"]


# --------------------------------------------------------------------------------------------------
# best_of: only equal to n is served
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("best_of", [1, 3], ids=["below-n", "beyond-n"])
def test_a_best_of_other_than_n_is_refused_whether_below_or_beyond(models, best_of):
    """OpenAI requires best_of >= n (best_of below n is an invalid request) and tserve serves best_of only equal
    to n: one below n is a 400 naming best_of, as one beyond it is, not n choices served as if it were absent."""
    async def go(client):
        return await client.post("/v1/completions", json=completion(n=2, best_of=best_of))

    resp = run(models, go)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == "unsupported_parameter" and "best_of" in error["message"]


# --------------------------------------------------------------------------------------------------
# structured_outputs: a json_object set to false asks for nothing
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"], ids=["completions", "chat"])
def test_structured_outputs_json_object_false_beside_a_regex_leaves_the_regex(models, path):
    """vLLM's structured_outputs takes exactly one constraint; `json_object: false` is not one (a client that
    fills every field sends it), so beside a regex the output matches the regex, not any JSON object, on both
    routes. The same body with json_object true and no regex is a JSON object."""
    make = completion if path == "/v1/completions" else chat
    regex = "(yes|no|maybe)"

    async def go(client):
        return (await post(client, path, make(max_tokens=8, structured_outputs={"regex": regex,
                                                                                "json_object": False})),
                await post(client, path, make(max_tokens=60, structured_outputs={"json_object": True})))

    with_regex, as_object = run(models, go)

    def text(answer):
        choice = answer["choices"][0]
        return choice["text"] if path == "/v1/completions" else choice["message"]["content"]

    assert re.fullmatch(regex, text(with_regex)), text(with_regex)
    assert with_regex["choices"][0]["finish_reason"] == "stop"
    assert text(as_object).startswith("{")


# --------------------------------------------------------------------------------------------------
# /v2 infer of a language model: a boolean is not a number
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("parameter", [{"max_tokens": True}, {"temperature": False}, {"seed": True},
                                       {"top_k": True}], ids=["max_tokens", "temperature", "seed", "top_k"])
def test_a_v2_number_parameter_sent_as_a_boolean_is_refused(models, parameter):
    """JSON true is not the number 1: a numeric /v2 parameter given as a boolean is a 400 naming it, not a
    request run with max_tokens 1 or temperature 0 (the /v2 parameters are typed strictly); ignore_eos, the one
    boolean parameter, takes it."""
    name = next(iter(parameter))

    def v2(parameters: dict) -> dict:
        return {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["Hello"]}],
                "parameters": {"max_tokens": 2} | parameters}

    async def go(client):
        return (await client.post("/v2/models/lm/infer", json=v2(parameter)),
                await client.post("/v2/models/lm/infer", json=v2({"ignore_eos": True})))

    refused, taken = run(models, go)
    assert refused.status_code == 400, refused.text
    assert name in refused.json()["error"]
    assert taken.status_code == 200, taken.text


# --------------------------------------------------------------------------------------------------
# Ids and objects of the answers
# --------------------------------------------------------------------------------------------------
def test_each_route_names_its_answers_with_its_own_id_prefix_and_object(models):
    """OpenAI's shapes: a completion is `cmpl-…` / text_completion, a chat `chatcmpl-…` / chat.completion and
    its chunks chat.completion.chunk; every chunk of one stream (the usage chunk too) carries the same id, and
    two requests get different ids."""
    async def go(client):
        return (await post(client, "/v1/completions", completion()),
                await post(client, "/v1/chat/completions", chat()),
                await post(client, "/v1/chat/completions", chat()),
                await chunks(client, "/v1/completions", completion(stream_options={"include_usage": True})),
                await chunks(client, "/v1/chat/completions", chat(stream_options={"include_usage": True})))

    plain, chatted, again, streamed, chat_streamed = run(models, go)
    assert plain["id"].startswith("cmpl-") and plain["object"] == "text_completion"
    assert chatted["id"].startswith("chatcmpl-") and chatted["object"] == "chat.completion"
    assert again["id"] != chatted["id"]
    for stream, prefix, obj in ((streamed, "cmpl-", "text_completion"),
                                (chat_streamed, "chatcmpl-", "chat.completion.chunk")):
        assert len({c["id"] for c in stream}) == 1 and stream[0]["id"].startswith(prefix)
        assert {c["object"] for c in stream} == {obj}



# --------------------------------------------------------------------------------------------------
# Echoed prompts' text offsets, a prompt of text and a prompt of ids
# --------------------------------------------------------------------------------------------------
def test_echoed_prompt_offsets_point_into_the_echoed_text_for_text_and_id_prompts(models):
    """`text_offset` says where each token starts in the returned text. A text prompt is echoed as written (its
    BOS is in no character of it); a prompt of ids is echoed as their text, special tokens included (`<s>`), so
    its tokens' offsets count them: the same prompt as ids has every offset after its BOS shifted by `<s>`, and
    each token's offset is where the echo's text of the tokens before it ends."""
    tokenizer = load_tokenizer(models["lm"])
    ids = tokenizer.encode("Hello world")
    assert ids[0] == tokenizer.bos_id and len(ids) > 3

    async def go(client):
        return [await post(client, "/v1/completions", completion(prompt=prompt, echo=True, logprobs=0,
                                                                  ignore_eos=True, max_tokens=3))
                for prompt in ("Hello world", ids)]

    (as_text,), (as_ids,) = (answer["choices"] for answer in run(models, go))
    text_offsets, id_offsets = as_text["logprobs"]["text_offset"], as_ids["logprobs"]["text_offset"]
    assert as_ids["text"] == "<s>" + as_text["text"]
    assert [o + len("<s>") for o in text_offsets[1:]] == id_offsets[1:]
    for k in range(1, len(ids)):
        assert id_offsets[k] == len(tokenizer.decode(ids[:k], skip_special_tokens=False))
