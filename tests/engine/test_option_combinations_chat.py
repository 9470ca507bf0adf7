"""Chat and constrained generation with other options, in-process (the app through httpx.ASGITransport): what a
chat template is given (tools under every tool_choice, an assistant's earlier calls, a tool's answer, a template
that writes its own bos), a named tool's call cut by max_tokens while streaming, a tool choice beside a response
format, constraints of different kinds with the same text, a constraint under --speculative ngram, and
--max-grammar-compile-ms. Each compares against the same request with the other option at its default, or
against the template rendered by the tokenizer itself."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from tests.engine.test_option_combinations_lm import WEATHER, chat, chunks, post, run
from tests.helpers import factories
from tserve.model.tokenizer import load_tokenizer

# A template in the manner of the hub's tool-aware ones: its own bos first, the tools named, an assistant's
# earlier calls written with `tojson` (an object, as transformers passes them), a tool's answer after its call's id.
TOOLS_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|tools|>{% for t in tools %}{{ t.function.name }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<call>{{ c.function.name }} {{ c.function.arguments | tojson }}"
    "</call>{% endfor %}{% endif %}"
    "{% if m.role == 'tool' %}[{{ m.tool_call_id }}] {% endif %}"
    "{{ m.content if m.content is not none else '' }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat-options")
    lm = factories.tiny_lm_dir(root / "lm")
    tools_lm = root / "lm-tools"
    shutil.copytree(lm, tools_lm)
    config = json.loads((tools_lm / "tokenizer_config.json").read_text())
    (tools_lm / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": TOOLS_TEMPLATE}))
    return {"lm": lm, "lm-tools": tools_lm}


def prompt_tokens(models, messages, tools=None) -> int:
    """The prompt's length as the tokenizer renders and encodes the template itself (the template writes the
    special tokens: none is added)."""
    tok = load_tokenizer(models["lm-tools"])
    return len(tok.encode(tok.apply_chat_template(messages, tools=tools), add_special_tokens=False))


# --------------------------------------------------------------------------------------------------
# What the template is given
# --------------------------------------------------------------------------------------------------
def test_a_template_that_writes_its_own_bos_gets_no_second_one(models):
    """The tokenizer adds a bos to plain text (add_bos_token), but a rendered chat already holds the template's:
    the prompt must have exactly that one, as transformers' apply_chat_template(tokenize=True) does."""
    messages = [{"role": "user", "content": "Hello"}]

    async def go(client):
        return await post(client, "/v1/chat/completions", chat(model="lm-tools", messages=messages, max_tokens=1))

    tok = load_tokenizer(models["lm-tools"])
    rendered = tok.apply_chat_template(messages)
    assert rendered.startswith("<s>") and tok.encode("Hello")[0] == tok.bos_id  # both would add one
    assert run(models, go)["usage"]["prompt_tokens"] == prompt_tokens(models, messages)


@pytest.mark.parametrize("tool_choice", ["auto", "required", NAMED, "none"], ids=["auto", "required", "named", "none"])
def test_the_template_describes_the_tools_whatever_the_tool_choice(models, tool_choice):
    """A constrained tool choice (required, a named function) and `none` change what the model may answer, not
    what it is told: the template renders the tools under every choice, as under `auto`."""
    messages = [{"role": "user", "content": "Weather?"}]

    async def go(client):
        return await post(client, "/v1/chat/completions", chat(model="lm-tools", messages=messages, max_tokens=1,
                                                               tools=[WEATHER], tool_choice=tool_choice))

    with_tools = prompt_tokens(models, messages, [WEATHER])
    assert with_tools > prompt_tokens(models, messages) + 5
    assert run(models, go)["usage"]["prompt_tokens"] == with_tools


def test_a_conversation_with_a_call_and_its_answer_reaches_the_template_as_transformers_passes_it(models):
    """An assistant turn with tool_calls and no content, then the tool's answer: the template gets the call's
    arguments as an object (its `tojson` writes them once, not as a quoted string) and the answer's
    tool_call_id, beside tools and a system message."""
    sent = [{"role": "system", "content": "Hi."},
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_7", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Ulm"}'}}]},
            {"role": "tool", "tool_call_id": "call_7", "content": "sunny"}]
    expected = [*sent[:2],
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_7", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Ulm"}}}]},
                sent[3]]

    async def go(client):
        return await post(client, "/v1/chat/completions", chat(model="lm-tools", messages=sent, max_tokens=1,
                                                               tools=[WEATHER]))

    tok = load_tokenizer(models["lm-tools"])
    rendered = tok.apply_chat_template(expected, tools=[WEATHER])
    assert '<call>get_weather {"city": "Ulm"}</call>' in rendered and "[call_7] sunny" in rendered
    assert run(models, go)["usage"]["prompt_tokens"] == prompt_tokens(models, expected, [WEATHER])


# --------------------------------------------------------------------------------------------------
# Tool choices with other options
# --------------------------------------------------------------------------------------------------
def test_a_streamed_named_call_cut_by_max_tokens_finishes_with_length(models):
    """max_tokens ends a named function's arguments before they are complete: no call was made, so the
    finish reason is `length`, streamed as unstreamed (which answers the cut text as content)."""
    body = chat(messages=[{"role": "user", "content": "Weather?"}], max_tokens=3, temperature=0,
                tools=[WEATHER], tool_choice=NAMED)

    async def go(client):
        return await post(client, "/v1/chat/completions", body), await chunks(client, "/v1/chat/completions", body)

    whole, streamed = run(models, go)
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
    finishes = [ch["finish_reason"] for c in streamed for ch in c["choices"] if ch["finish_reason"]]
    assert finishes == ["length"]


def test_a_named_call_cut_by_a_stop_string_is_no_call_streamed_or_not(models):
    """A stop string ends a named function's arguments before they are complete (finish "stop", as a grammar that
    completes them also ends): the whole answer is the cut text, and the stream does not finish with `tool_calls`
    either. Once the grammar completes the arguments, both are a call."""
    cut = chat(messages=[{"role": "user", "content": "Weather?"}], max_tokens=30, temperature=0, tools=[WEATHER],
               tool_choice=NAMED, stop=['":'])

    async def go(client):
        return [(await post(client, "/v1/chat/completions", body), await chunks(client, "/v1/chat/completions", body))
                for body in (cut, cut | {"stop": None})]

    (whole, streamed), (called, called_streamed) = run(models, go)
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
    assert [ch["finish_reason"] for c in streamed for ch in c["choices"] if ch["finish_reason"]] == ["stop"]
    assert called["choices"][0]["finish_reason"] == "tool_calls"
    assert [ch["finish_reason"] for c in called_streamed for ch in c["choices"] if ch["finish_reason"]] == \
        ["tool_calls"]


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_a_constrained_tool_choice_beside_a_response_format_is_refused(models, tool_choice):
    """A named function or `required` constrains the answer to the call's JSON; a response format would
    constrain it otherwise. Neither may silently win: the request is a 400."""
    async def go(client):
        return [await client.post("/v1/chat/completions", json=chat(tools=[WEATHER], tool_choice=tool_choice,
                                                                    response_format=fmt))
                for fmt in ({"type": "json_object"},
                            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}})]

    for resp in run(models, go):
        assert resp.status_code == 400 and "cannot be combined" in resp.text, resp.text


# --------------------------------------------------------------------------------------------------
# Constraints with other options
# --------------------------------------------------------------------------------------------------
def test_a_regex_with_the_text_of_an_earlier_choice_list_is_its_own_constraint(models):
    """Compiled grammars are cached: a choice list ["yes", "no"] is held as the text '["yes", "no"]', which as a
    regex is a character class of one character. The regex, asked after the choice list, must get its own."""
    spec = ["yes", "no"]

    async def go(client):
        body = {"model": "lm", "prompt": "the quick", "max_tokens": 8, "temperature": 0}
        chosen = await post(client, "/v1/completions", body | {"structured_outputs": {"choice": spec}})
        matched = await post(client, "/v1/completions", body | {"structured_outputs": {"regex": json.dumps(spec)}})
        return chosen["choices"][0], matched["choices"][0]

    chosen, matched = run(models, go)
    assert chosen["text"] in spec
    assert re.fullmatch(json.dumps(spec), matched["text"]) and matched["finish_reason"] == "stop", matched


def test_a_constrained_answer_under_ngram_speculation_is_the_one_without_it(models):
    """The prompt repeats the text the model writes, so prompt-lookup drafts are found; the drafted tokens are
    not masked by the grammar, so a constrained row must not take them (the '.' that ends the sentence is not in
    the regex). Greedy, the answer is the one without speculation."""
    body = {"model": "lm", "prompt": "the quick brown fox jumps over the lazy dog. the quick", "max_tokens": 24,
            "temperature": 0, "structured_outputs": {"regex": "[a-z ]{1,40}"}}
    free = {k: v for k, v in body.items() if k != "structured_outputs"}

    async def go(client):
        return await post(client, "/v1/completions", body), await post(client, "/v1/completions", free)

    plain, _ = run(models, go)
    fast, unconstrained = run(models, go, speculative="ngram")
    assert "." in unconstrained["choices"][0]["text"]  # what the drafts propose
    assert re.fullmatch("[a-z ]{1,40}", fast["choices"][0]["text"])
    assert fast["choices"][0] == plain["choices"][0]


def schema_of(fields: int, tag: str) -> dict:
    """A schema of many patterned strings: some milliseconds to compile."""
    return {"type": "object", "required": [f"{tag}{i}" for i in range(fields)], "properties": {
        f"{tag}{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1},{i % 50 + 10}}}@{tag}{i}\\.(com|org)$"}
        for i in range(fields)}}


def test_max_grammar_compile_ms_refuses_a_constraint_slower_than_it(models):
    """--max-grammar-compile-ms reaches the model's compiler: with a limit of a microsecond, new schemas that take
    milliseconds are 400s that name the option (a compile is waited for at most that long; one may still be
    done in time when the waiting thread was not run, so of three at least one is refused). The default limit
    compiles them."""
    def body(tag: str) -> dict:
        return {"model": "lm", "prompt": "the quick", "max_tokens": 2, "response_format": {
            "type": "json_schema", "json_schema": {"name": "p", "schema": schema_of(300, tag)}}}

    async def go(client):
        return [await client.post("/v1/completions", json=body(tag)) for tag in ("a", "b", "c")]

    assert [r.status_code for r in run(models, go)] == [200] * 3
    refused = [r for r in run(models, go, max_grammar_compile_ms=0.001) if r.status_code != 200]
    assert refused and all(r.status_code == 400 and "--max-grammar-compile-ms" in r.text for r in refused)
