"""The language model's serving path with its options in combination, in-process (the app through
httpx.ASGITransport, no server process): stop strings with streamed logprobs, with eos, with a grammar and
with each other; usage of streamed requests of several choices; seeds of several chat choices; several streamed
choices of a named tool; echo with `logprobs: 0`; chat logprobs without `top_logprobs`; requests asking for
different numbers of alternatives in one batch. Each test compares against the same request with the other
option at its default, which the single-option tests elsewhere already check."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.helpers import factories
from tests.http.test_http_contract import eos_at_sentence_end
from tserve.service.app import build_app
from tserve.service.settings import Settings

PROMPT = "the quick"  # the trained LM goes on " brown fox jumps over the lazy dog..." one character at a time
EOS_PROMPT = "The quick brown fox jumps over the"  # lm-eos: " lazy dog", then eos where '.' would come
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                                          "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm-options")
    return {"lm": factories.tiny_lm_dir(root / "lm"),
            "lm-eos": eos_at_sentence_end(factories.tiny_lm_dir(root / "lm-eos"))}


def run(models, go, **settings):
    """`await go(client)` against an app serving `models`, started and stopped around it (on this event loop)."""
    app = build_app(Settings(models=[f"{n}={p}" for n, p in models.items()], cuda_graphs=False, max_n=4,
                             **settings))

    async def main():
        async with app.router.lifespan_context(app):
            await asyncio.to_thread(app.state.registry.wait_loaded, 60)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                         timeout=60) as client:
                return await go(client)

    return asyncio.run(main())


async def post(client, path: str, body: dict) -> dict:
    resp = await client.post(path, json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


async def chunks(client, path: str, body: dict) -> list[dict]:
    """The SSE chunks of a streamed request ([DONE] checked and left out)."""
    async with client.stream("POST", path, json=body | {"stream": True}) as resp:
        assert resp.status_code == 200
        lines = [line[6:] async for line in resp.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def completion(**body) -> dict:
    return {"model": "lm", "prompt": PROMPT, "max_tokens": 16, "temperature": 0} | body


def chat(**body) -> dict:
    return {"model": "lm", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8} | body


# --------------------------------------------------------------------------------------------------
# Stop strings
# --------------------------------------------------------------------------------------------------
def test_streamed_logprobs_cover_the_tokens_a_stop_string_held_back(models):
    """"jumpz" never matches, but while " brown fox jump" is written the tokens j, u, m, p are held back as its
    possible start: their chunks have no text yet. Their logprobs must still be streamed, as the whole response
    has them."""
    body = completion(logprobs=1, stop=["jumpz"])

    async def go(client):
        return await post(client, "/v1/completions", body), await chunks(client, "/v1/completions", body)

    whole, streamed = run(models, go)
    tokens = whole["choices"][0]["logprobs"]["tokens"]
    assert "".join(tokens) == whole["choices"][0]["text"] and "jump" in whole["choices"][0]["text"]
    got = [t for c in streamed for ch in c["choices"] for t in ch["logprobs"]["tokens"]]
    assert got == tokens
    assert "".join(ch["text"] for c in streamed for ch in c["choices"]) == whole["choices"][0]["text"]


def test_a_stop_string_that_never_matches_changes_nothing_when_eos_ends_the_text(models):
    """" lazy dog" ends with eos. With the stop string "g!" the last "g" is held back as its possible start
    until eos comes: it must be let go then, and eos (not part of the output) must not be counted, streamed or
    not, exactly as without the stop string."""
    plain = {"model": "lm-eos", "prompt": EOS_PROMPT, "max_tokens": 30, "temperature": 0, "logprobs": 0}
    stopped = plain | {"stop": ["g!"]}

    async def go(client):
        return ([await post(client, "/v1/completions", b) for b in (plain, stopped)],
                await chunks(client, "/v1/completions", stopped | {"stream_options": {"include_usage": True}}))

    (want, got), streamed = run(models, go)
    assert want["choices"][0]["text"].endswith("dog") and want["choices"][0]["finish_reason"] == "stop"
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert got["choices"][0]["finish_reason"] == "stop"
    assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"] == \
        len(want["choices"][0]["logprobs"]["tokens"]) == len(got["choices"][0]["logprobs"]["tokens"])
    assert "".join(ch["text"] for c in streamed for ch in c["choices"]) == want["choices"][0]["text"]
    assert streamed[-1]["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]


def test_of_several_stop_strings_the_one_earliest_in_the_text_cuts_it(models):
    """" fo" is held back as the start of " fox"; the "x" that completes it is also the stop string "x", listed
    first. Both are found in the same text: it is cut where the earlier one starts, not the first listed."""
    async def go(client):
        return await post(client, "/v1/completions", completion(stop=["x", " fox"]))

    choice = run(models, go)["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (" brown", "stop")


def test_a_stop_string_spanning_tokens_is_found_beside_a_shorter_partial_one(models):
    """While " jump" is written it is held back as the start of " jumps"; that "p" is also the start of "pz"
    must not let " jum" out early, or " jumps" is never seen whole and the text runs on."""
    async def go(client):
        return await post(client, "/v1/completions", completion(stop=[" jumps", "pz"]))

    choice = run(models, go)["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (" brown fox", "stop")


def test_a_stop_string_prefix_held_back_is_let_go_when_a_grammar_completes(models):
    """A choice constraint ends the text with finish "stop" but no eos: the "g" held back as the start of "g!"
    is the end of the answer and must be sent, as without the stop string."""
    body = completion(prompt="the quick brown fox jumps over the lazy", structured_outputs={"choice": [" dog", " cat"]})

    async def go(client):
        return [await post(client, "/v1/completions", body | extra) for extra in ({}, {"stop": ["g!"]})]

    plain, stopped = (r["choices"][0] for r in run(models, go))
    assert plain["text"] == " dog" and plain["finish_reason"] == "stop"
    assert (stopped["text"], stopped["finish_reason"]) == (" dog", "stop")


# --------------------------------------------------------------------------------------------------
# Several choices
# --------------------------------------------------------------------------------------------------
def test_the_usage_of_a_streamed_request_of_several_choices_counts_each_choices_prompt(models):
    body = completion(n=2, max_tokens=6, ignore_eos=True)

    async def go(client):
        return (await post(client, "/v1/completions", body),
                await chunks(client, "/v1/completions", body | {"stream_options": {"include_usage": True}}))

    whole, streamed = run(models, go)
    usage = streamed[-1]["usage"]
    assert streamed[-1]["choices"] == [] and usage["completion_tokens"] == 12
    assert usage == whole["usage"] and usage["prompt_tokens"] % 2 == 0


def test_seeded_chat_choices_each_take_the_seed_plus_their_index(models):
    """Chat choice j of a seeded request samples as the request with seed + j alone: reproducible, and the
    choices differ."""
    body = chat(temperature=1.5, seed=11, ignore_eos=True, max_tokens=12)

    async def go(client):
        several = await post(client, "/v1/chat/completions", body | {"n": 3})
        alone = [await post(client, "/v1/chat/completions", body | {"seed": 11 + j}) for j in range(3)]
        return several, alone

    several, alone = run(models, go)
    texts = [c["message"]["content"] for c in several["choices"]]
    assert texts == [a["choices"][0]["message"]["content"] for a in alone]
    assert len(set(texts)) == 3


def test_several_streamed_choices_of_a_named_tool_each_stream_their_own_call(models):
    """tool_choice naming a function, n = 2, streamed: each choice's deltas begin with its call's head and carry
    its own arguments, those of the same request unstreamed."""
    body = chat(messages=[{"role": "user", "content": "Weather?"}], max_tokens=30, temperature=1.0, seed=3, n=2,
                tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})

    async def go(client):
        return await post(client, "/v1/chat/completions", body), await chunks(client, "/v1/chat/completions", body)

    whole, streamed = run(models, go)
    calls: dict[int, list[dict]] = {0: [], 1: []}
    finish = {}
    for c in streamed:
        for ch in c["choices"]:
            calls[ch["index"]] += ch["delta"].get("tool_calls") or []
            finish[ch["index"]] = ch["finish_reason"] or finish.get(ch["index"])
    for choice in whole["choices"]:
        i = choice["index"]
        (call,) = choice["message"]["tool_calls"]
        assert calls[i][0]["function"]["name"] == "get_weather" and calls[i][0]["id"]
        streamed_arguments = "".join(d["function"]["arguments"] for d in calls[i])
        assert json.loads(streamed_arguments) == json.loads(call["function"]["arguments"])
        assert finish[i] == choice["finish_reason"] == "tool_calls"


# --------------------------------------------------------------------------------------------------
# Logprobs
# --------------------------------------------------------------------------------------------------
def test_echo_with_logprobs_0_reports_the_prompt_tokens_too(models):
    """`logprobs: 0` asks for the chosen tokens' logprobs with no alternatives: with echo, the prompt's tokens
    are listed as with `logprobs: 1` (the first without a logprob)."""
    async def go(client):
        return [await post(client, "/v1/completions", completion(echo=True, max_tokens=4, logprobs=k))
                for k in (0, 1)]

    zero, one = (r["choices"][0] for r in run(models, go))
    assert zero["text"] == one["text"] and zero["text"].startswith(PROMPT)
    assert zero["logprobs"]["tokens"] == one["logprobs"]["tokens"] and len(zero["logprobs"]["tokens"]) > 4
    assert zero["logprobs"]["text_offset"] == one["logprobs"]["text_offset"]
    assert zero["logprobs"]["token_logprobs"][0] is None
    assert zero["logprobs"]["token_logprobs"][1:] == pytest.approx(one["logprobs"]["token_logprobs"][1:])
    assert all(t == {} for t in zero["logprobs"]["top_logprobs"][1:])


def test_chat_logprobs_without_top_logprobs_list_every_token(models):
    """`logprobs: true` alone (top_logprobs unset): every completion token with its logprob, no alternatives."""
    async def go(client):
        return await post(client, "/v1/chat/completions", chat(temperature=0, logprobs=True, ignore_eos=True))

    resp = run(models, go)
    content = resp["choices"][0]["logprobs"]["content"]
    assert len(content) == resp["usage"]["completion_tokens"] == 8
    assert "".join(e["token"] for e in content) == resp["choices"][0]["message"]["content"]
    assert all(e["logprob"] <= 0 and e["top_logprobs"] == [] for e in content)


def test_requests_batched_together_each_get_the_number_of_alternatives_they_asked_for(models):
    """A step computes the alternatives of its widest request; each row reports its own k of them."""
    async def go(client):
        bodies = [completion(logprobs=k, ignore_eos=True, max_tokens=8) for k in (0, 1, 3)]
        return await asyncio.gather(*(post(client, "/v1/completions", b) for b in bodies),
                                    post(client, "/v1/chat/completions", chat(temperature=0, logprobs=True,
                                                                              top_logprobs=2, ignore_eos=True)))

    *completions, chatted = run(models, go)
    for k, resp in zip((0, 1, 3), completions, strict=True):
        tops = resp["choices"][0]["logprobs"]["top_logprobs"]
        assert len(tops) == 8 and all(len(t) == k for t in tops), k
    assert all(len(e["top_logprobs"]) == 2 for e in chatted["choices"][0]["logprobs"]["content"])


def test_stop_strings_are_looked_for_only_once_min_tokens_tokens_are_out(models):
    """`min_tokens` holds back stop strings as it holds back eos (vLLM's rule): the text of the first min_tokens
    tokens is not searched, and the first stop string after it ends the text, streamed or not."""
    async def go(client):
        full = await post(client, "/v1/completions", completion(logprobs=0))
        cut, held = [await post(client, "/v1/completions", completion(stop=["o"], **extra))
                     for extra in ({}, {"min_tokens": 5})]
        return full, cut, held, await chunks(client, "/v1/completions", completion(stop=["o"], min_tokens=5))

    full, cut, held, streamed = run(models, go)
    text, tokens = full["choices"][0]["text"], full["choices"][0]["logprobs"]["tokens"]
    first = "".join(tokens[:5])
    rest = text[len(first):]
    assert "o" in first and "o" in rest  # the rule decides where the text ends
    assert cut["choices"][0]["text"] == text[: text.index("o")]
    assert (held["choices"][0]["text"], held["choices"][0]["finish_reason"]) == (first + rest[: rest.index("o")], "stop")
    assert "".join(ch["text"] for c in streamed for ch in c["choices"]) == held["choices"][0]["text"]


@pytest.mark.parametrize("tool_choice", ["auto", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["auto", "named"])
def test_a_streamed_chat_with_tools_streams_every_tokens_logprobs(models, tool_choice):
    """With tools, text is held back while a call may be starting; the logprobs of its tokens go out with the next
    chunk, so the streamed entries are the unstreamed ones, each once, in order (vLLM streams them with tools too)."""
    body = chat(messages=[{"role": "user", "content": "Weather?"}], max_tokens=12, temperature=0, logprobs=True,
                top_logprobs=1, tools=[WEATHER], tool_choice=tool_choice)

    async def go(client):
        return await post(client, "/v1/chat/completions", body), await chunks(client, "/v1/chat/completions", body)

    whole, streamed = run(models, go)
    want = whole["choices"][0]["logprobs"]["content"]
    assert len(want) == whole["usage"]["completion_tokens"] > 0
    got = [e for c in streamed for ch in c["choices"] if ch["logprobs"] for e in ch["logprobs"]["content"]]
    assert got == want
