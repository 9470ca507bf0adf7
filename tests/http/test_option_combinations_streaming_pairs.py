"""Two chat features in one request, streamed and unstreamed, in-process (the app through httpx.ASGITransport):
several choices of a tool call with logprobs, each with its own opening chunk; an `auto` tool answer that a
response format or a regex makes a call (the tiny model never writes one by itself), alone and followed by text
that max_tokens cuts. The streamed deltas, put together, must be the unstreamed answer: its calls, its content,
its finish_reason and every token's logprob entry, per choice."""

from __future__ import annotations

import json

import pytest

from tests.engine.test_option_combinations_lm import WEATHER, chat, chunks, post, run
from tests.helpers import factories
from tserve.model.tokenizer import token_bytes

NAMED = {"type": "function", "function": {"name": "get_weather"}}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Ulm"}}</tool_call>'  # 68 tokens of the tiny LM
# A bare JSON call, as Llama 3's templates write one: what `auto` takes for a call when its name is a tool's.
CALL_SCHEMA = {"type": "object", "required": ["name", "arguments"], "additionalProperties": False, "properties": {
    "name": {"const": "get_weather"}, "arguments": WEATHER["function"]["parameters"]}}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {"lm": factories.tiny_lm_dir(tmp_path_factory.mktemp("streaming-pairs") / "lm")}


def _tokens(entries: list[dict]) -> list:
    """Logprob entries without their values: each token, its bytes and its alternatives'."""
    return [(e["token"], e["bytes"], [(t["token"], t["bytes"]) for t in e["top_logprobs"]]) for e in entries]


def _values(entries: list[dict]) -> list[float]:
    return [v for e in entries for v in (e["logprob"], *(t["logprob"] for t in e["top_logprobs"]))]


def _per_choice(streamed: list[dict]) -> dict[int, dict]:
    """Per choice index: its deltas in order, content, tool calls rebuilt by index, logprob entries, finish."""
    out: dict[int, dict] = {}
    for chunk in streamed:
        for ch in chunk["choices"]:
            c = out.setdefault(ch["index"], {"deltas": [], "content": "", "calls": {}, "logprobs": [],
                                             "finish_reason": None})
            delta = ch["delta"]
            c["deltas"].append(delta)
            c["content"] += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                got = c["calls"].setdefault(call["index"], {"name": None, "arguments": ""})
                got["name"] = call.get("function", {}).get("name") or got["name"]
                got["arguments"] += call.get("function", {}).get("arguments") or ""
            c["logprobs"] += (ch["logprobs"] or {}).get("content") or []
            c["finish_reason"] = ch["finish_reason"] or c["finish_reason"]
    return out


def _calls(message: dict) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls") or []]


def _streamed_calls(choice: dict) -> list[tuple[str, dict]]:
    return [(c["name"], json.loads(c["arguments"])) for _, c in sorted(choice["calls"].items())]


def test_several_streamed_choices_of_a_tool_call_each_carry_their_own_logprobs(models):
    """A named tool, n = 2, logprobs: each choice's call is streamed with its own tokens' logprob entries, each
    once and in order, as the unstreamed answer lists them for that choice (the two seeded choices differ)."""
    body = chat(messages=[{"role": "user", "content": "Weather?"}], max_tokens=30, temperature=1.0, seed=3, n=2,
                logprobs=True, top_logprobs=1, tools=[WEATHER], tool_choice=NAMED)

    async def go(client):
        return await post(client, "/v1/chat/completions", body), await chunks(client, "/v1/chat/completions", body)

    whole, streamed = run(models, go)
    joined = _per_choice(streamed)
    assert sorted(joined) == [0, 1]
    wanted = {c["index"]: c["logprobs"]["content"] for c in whole["choices"]}
    assert wanted[0] != wanted[1] and all(wanted.values())
    for choice in whole["choices"]:
        got = joined[choice["index"]]
        # The same tokens and alternatives; their values within float32 rounding (the two requests' steps may batch
        # their rows differently: other row counts in the products), far closer than another choice's would be.
        assert _tokens(got["logprobs"]) == _tokens(wanted[choice["index"]]), choice["index"]
        assert _values(got["logprobs"]) == pytest.approx(_values(wanted[choice["index"]]), abs=1e-4)
        assert _streamed_calls(got) == _calls(choice["message"])
        assert got["finish_reason"] == choice["finish_reason"] == "tool_calls"


def test_each_streamed_choice_opens_with_its_own_assistant_role(models):
    """n = 3 streamed, with tools: every choice's first chunk is the assistant's role under that choice's index
    (a client rebuilds each message from its own chunks), and none of them repeats it."""
    body = chat(n=3, temperature=1.0, seed=1, max_tokens=4, tools=[WEATHER], tool_choice="none",
                stream_options={"include_usage": True})

    async def go(client):
        return await chunks(client, "/v1/chat/completions", body)

    joined = _per_choice(run(models, go))
    assert sorted(joined) == [0, 1, 2]
    for index, choice in joined.items():
        assert choice["deltas"][0] == {"role": "assistant", "content": ""}, index
        assert all("role" not in d for d in choice["deltas"][1:]), index
        assert choice["finish_reason"] == "length"


def test_an_auto_answer_that_is_a_call_streams_as_the_call_it_is_unstreamed(models):
    """tool_choice auto beside a response format whose schema is a call ({"name", "arguments"}): the answer is a
    call, unstreamed (tool_calls, no content, finish tool_calls) and streamed (the same call as tool_call deltas,
    no content, finish tool_calls). The response format is allowed: only required or a named function constrain
    the answer themselves."""
    body = chat(messages=[{"role": "user", "content": "Weather?"}], max_tokens=60, temperature=0, tools=[WEATHER],
                tool_choice="auto", response_format={"type": "json_schema", "json_schema": {
                    "name": "call", "schema": CALL_SCHEMA}})

    async def go(client):
        return await post(client, "/v1/chat/completions", body), await chunks(client, "/v1/chat/completions", body)

    whole, streamed = run(models, go)
    choice = whole["choices"][0]
    (call,) = _calls(choice["message"])
    assert call[0] == "get_weather" and isinstance(call[1]["city"], str)
    assert choice["finish_reason"] == "tool_calls" and not choice["message"]["content"]
    got = _per_choice(streamed)[0]
    assert _streamed_calls(got) == [call] and got["content"] == ""
    assert got["finish_reason"] == "tool_calls"


def test_a_call_then_text_cut_by_max_tokens_finishes_with_tool_calls_streamed_or_not(models):
    """auto, the answer a Hermes call (a regex writes it) then text that max_tokens cuts: a call was made, so the
    finish reason is tool_calls, unstreamed as streamed, and the text after the call is the content."""
    body = chat(messages=[{"role": "user", "content": "Weather?"}], max_tokens=80, temperature=0, tools=[WEATHER],
                structured_outputs={"regex": CALL.replace("{", "\\{").replace("}", "\\}") + " [a-z]{40,60}"})

    async def go(client):
        return await post(client, "/v1/chat/completions", body), await chunks(client, "/v1/chat/completions", body)

    whole, streamed = run(models, go)
    choice = whole["choices"][0]
    assert whole["usage"]["completion_tokens"] == 80  # cut inside the text after the call
    assert _calls(choice["message"]) == [("get_weather", {"city": "Ulm"})]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"]
    got = _per_choice(streamed)[0]
    assert _streamed_calls(got) == [("get_weather", {"city": "Ulm"})]
    assert got["content"] == choice["message"]["content"] and got["finish_reason"] == "tool_calls"


def test_chat_logprobs_bytes_join_into_the_characters_a_token_splits(models):
    """A regex makes the answer "Grüße, 日本" (characters the tiny LM's byte-level tokens split into pieces, each
    shown as "<0xE6>"): each token's `bytes`, streamed or not, are the UTF-8 bytes it stands for, so that the
    entries put together are the answer's bytes, and so are each top alternative's (a client joins them to show
    a character whose pieces are tokens of their own)."""
    text = "Grüße, 日本"
    body = chat(max_tokens=40, temperature=0, logprobs=True, top_logprobs=2, structured_outputs={"regex": text})

    async def go(client):
        return await post(client, "/v1/chat/completions", body), await chunks(client, "/v1/chat/completions", body)

    whole, streamed = run(models, go)
    choice = whole["choices"][0]
    assert choice["message"]["content"] == text
    entries = choice["logprobs"]["content"]
    assert any("<0x" in e["token"] for e in entries)  # a character split over tokens
    assert bytes(b for e in entries for b in e["bytes"]) == text.encode("utf-8")
    assert _per_choice(streamed)[0]["logprobs"] == entries
    for e in entries:
        for top in e["top_logprobs"]:
            assert top["bytes"] == list(token_bytes(top["token"]))
            assert "<0x" in top["token"] or top["bytes"] == list(top["token"].encode("utf-8"))
