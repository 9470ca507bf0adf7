"""Multi-turn chat conversations where two features meet, in-process (the app through httpx.ASGITransport): the
prefix cache across the turns of one conversation (a later turn finds the blocks of the earlier turn's prompt *and*
answer; an edited earlier message reuses nothing stale; `n` choices of a later turn each count the blocks they
read), a response format on a later turn that also offers tools, an assistant's earlier calls (with their ids) and
the tools' answers as the template receives them, and content parts that are not text. References: the same
conversation served without the prefix cache, the block rule of the cache written out in plain Python, and
transformers' own apply_chat_template."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.engine.test_option_combinations_lm import post, run
from tests.helpers import factories
from tests.helpers.one_request import lm_tokens
from tserve.model import checkpoint
from tserve.model.decoding import SamplingParams
from tserve.model.tokenizer import load_tokenizer

BLOCK = 16  # --kv-block-size's default
TURN_1 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the quick brown fox"}]
WEATHER = {"type": "function", "function": {
    "name": "wx", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# A template in the manner of Mistral's: an assistant's earlier calls written with their ids, a tool's answer
# after the id of the call it answers (so the model can tell two calls of one function apart).
CALL_IDS_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}[{{ c.id }}] {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}\n{% endfor %}{% endif %}"
    "{% if m.role == 'tool' %}({{ m.tool_call_id }}) {% endif %}"
    "{{ m.content if m.content is not none else '' }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("conversations")
    lm = factories.tiny_lm_dir(root / "lm")
    ids_lm = root / "lm-call-ids"
    shutil.copytree(lm, ids_lm)
    config = json.loads((ids_lm / "tokenizer_config.json").read_text())
    (ids_lm / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": CALL_IDS_TEMPLATE}))
    return {"lm": lm, "lm-call-ids": ids_lm}


def chat(messages, **body) -> dict:
    return {"model": "lm", "messages": messages, "max_tokens": 20, "temperature": 0} | body


def ids_of(models, messages, model: str = "lm") -> list[int]:
    """The prompt's ids as the tokenizer renders and encodes the template (the route adds no special token)."""
    tok = load_tokenizer(models[model])
    return tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)


def cached_by_rule(prompt: list[int], in_cache: list[list[int]]) -> int:
    """What the prefix cache may serve of `prompt`: the whole blocks of its longest common prefix with a sequence
    already computed, its last token excluded (its logits are what the prefill is for)."""
    common = max(next((i for i, (a, b) in enumerate(zip(prompt, seq, strict=False)) if a != b), min(len(prompt), len(seq)))
                 for seq in in_cache)
    return min(common, len(prompt) - 1) // BLOCK * BLOCK


def reply(answer: dict) -> str:
    return answer["choices"][0]["message"]["content"]


# --------------------------------------------------------------------------------------------------
# The prefix cache across turns
# --------------------------------------------------------------------------------------------------
def test_a_later_turn_reads_the_blocks_of_the_earlier_prompt_and_answer_and_an_edited_one_reads_none(models):
    """Turn 2 is turn 1's prompt, its answer and a new message: the blocks the answer filled while it was generated
    are in the cache too, so turn 2 reads every whole block of prompt + answer, not only of the prompt. The
    same turn 2 with its first (system) message edited shares no whole block with anything computed: it must read
    nothing, and answer as the same conversation served without the prefix cache."""
    async def go(client):
        first = await post(client, "/v1/chat/completions", chat(TURN_1))
        turn_2 = TURN_1 + [{"role": "assistant", "content": reply(first)}, {"role": "user", "content": "and then?"}]
        edited = [{"role": "system", "content": "Be kind."}] + turn_2[1:]
        return (first, turn_2, edited, await post(client, "/v1/chat/completions", chat(turn_2, max_tokens=6)),
                await post(client, "/v1/chat/completions", chat(edited, max_tokens=6)))

    first, turn_2, edited, second, after_edit = run(models, go)
    _, _, _, plain_second, plain_edit = run(models, go, prefix_cache=False)
    tok = load_tokenizer(models["lm"])
    p1, p2, p3 = ids_of(models, TURN_1), ids_of(models, turn_2), ids_of(models, edited)
    answer = tok.encode(reply(first), add_special_tokens=False)
    assert len(answer) == first["usage"]["completion_tokens"] == 20 and p2[:len(p1) + len(answer)] == p1 + answer
    assert second["usage"]["prompt_tokens"] == len(p2) and after_edit["usage"]["prompt_tokens"] == len(p3)
    want = cached_by_rule(p2, [p1 + answer])
    assert want > (len(p1) - 1) // BLOCK * BLOCK  # the answer completes a block of its own
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == want
    assert after_edit["usage"]["prompt_tokens_details"]["cached_tokens"] == cached_by_rule(p3, [p1 + answer, p2]) == 0
    assert plain_second["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert (reply(second), reply(after_edit)) == (reply(plain_second), reply(plain_edit))


def test_each_choice_of_a_later_turn_counts_the_cached_blocks_it_read(models):
    """n=2 on turn 2: both choices start from turn 1's blocks, so `cached_tokens` (the request's, summed over its
    choices, as `prompt_tokens` is) is at least twice one choice's share; without the prefix cache it is 0, and the
    choices are the same either way (seeded)."""
    body = {"max_tokens": 4, "temperature": 0.9, "seed": 5, "n": 2}

    async def go(client):
        first = await post(client, "/v1/chat/completions", chat(TURN_1))
        turn_2 = TURN_1 + [{"role": "assistant", "content": reply(first)}, {"role": "user", "content": "more"}]
        return first, turn_2, await post(client, "/v1/chat/completions", chat(turn_2, **body))

    first, turn_2, later = run(models, go)
    _, _, plain = run(models, go, prefix_cache=False)
    tok = load_tokenizer(models["lm"])
    p1, p2 = ids_of(models, TURN_1), ids_of(models, turn_2)
    one_choice = cached_by_rule(p2, [p1 + tok.encode(reply(first), add_special_tokens=False)])
    assert one_choice > 0 and later["usage"]["prompt_tokens"] == 2 * len(p2)
    assert 2 * one_choice <= later["usage"]["prompt_tokens_details"]["cached_tokens"] <= 2 * cached_by_rule(p2, [p2])
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert [c["message"] for c in later["choices"]] == [c["message"] for c in plain["choices"]]


def test_a_stop_string_and_max_tokens_cut_a_mostly_cached_turn_as_an_uncached_one(models):
    """A later turn whose prompt is read from the cache ends where the same turn computed in full ends: at the
    stop string (finish stop) or at max_tokens (finish length), with the same text and counts."""
    async def go(client):
        first = await post(client, "/v1/chat/completions", chat(TURN_1))
        turn_2 = TURN_1 + [{"role": "assistant", "content": reply(first)}, {"role": "user", "content": "the quick"}]
        return [await post(client, "/v1/chat/completions", chat(turn_2, **extra))
                for extra in ({"max_tokens": 12}, {"max_tokens": 12, "stop": [" der"]}, {"max_tokens": 3})]

    cached, plain = run(models, go), run(models, go, prefix_cache=False)
    assert all(a["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for a in cached)
    for a, b in zip(cached, plain, strict=True):
        assert a["choices"] == b["choices"]
        assert a["usage"]["completion_tokens"] == b["usage"]["completion_tokens"]
    assert [a["choices"][0]["finish_reason"] for a in cached[1:]] == ["stop", "length"]


# --------------------------------------------------------------------------------------------------
# Tools, response formats and content on a later turn
# --------------------------------------------------------------------------------------------------
def test_a_response_format_on_a_later_turn_holds_when_tools_are_offered_too(models):
    """tool_choice auto lets the model answer in text; a response_format then still constrains that text. This
    model's template does not render tools, so the same turn without tools has the very same prompt: with tools
    (auto) the answer must be the constrained answer without them, a JSON value of the schema."""
    schema = {"type": "string", "enum": ["yes", "no", "maybe"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}

    async def go(client):
        first = await post(client, "/v1/chat/completions", chat(TURN_1))
        turn_2 = TURN_1 + [{"role": "assistant", "content": reply(first)}, {"role": "user", "content": "Sure?"}]
        return [await post(client, "/v1/chat/completions", chat(turn_2, response_format=fmt, **extra))
                for extra in ({}, {"tools": [WEATHER]}, {"tools": [WEATHER], "tool_choice": "auto"})]

    without_tools, *with_tools = run(models, go)
    assert json.loads(reply(without_tools)) in schema["enum"]
    for answer in with_tools:
        assert answer["usage"]["prompt_tokens"] == without_tools["usage"]["prompt_tokens"]
        assert answer["choices"][0]["message"] == without_tools["choices"][0]["message"]
        assert answer["choices"][0]["finish_reason"] == "stop"


def test_earlier_calls_reach_the_template_with_their_ids_as_transformers_renders_them(models):
    """A conversation in which the assistant called one function twice and each call was answered: the template
    writes each call's id and the id each answer refers to. The prompt must be the one transformers'
    apply_chat_template renders from the same messages, and a second conversation that differs only in the ids
    must not be read from the first one's blocks past where they differ."""
    from transformers import AutoTokenizer  # noqa: PLC0415 - only this test needs it

    def conversation(a: str, b: str) -> list[dict]:
        calls = [{"id": i, "type": "function", "function": {"name": "wx", "arguments": {"city": c}}}
                 for i, c in ((a, "Rome"), (b, "Oslo"))]
        return [{"role": "user", "content": "Rome, Oslo?"}, {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "tool_call_id": a, "content": "sun"}, {"role": "tool", "tool_call_id": b, "content": "rain"}]

    def as_openai(messages: list[dict]) -> list[dict]:  # arguments as JSON text, as OpenAI clients send them
        return [m | {"tool_calls": [c | {"function": c["function"] | {"arguments": json.dumps(c["function"][
            "arguments"])}} for c in m["tool_calls"]]} if "tool_calls" in m else m for m in messages]

    one, other = conversation("c1", "c2"), conversation("c1", "c9")

    async def go(client):
        return [await post(client, "/v1/chat/completions", chat(as_openai(m), model="lm-call-ids", max_tokens=2,
                                                                tools=[WEATHER])) for m in (one, other)]

    first, second = run(models, go)
    theirs = AutoTokenizer.from_pretrained(str(models["lm-call-ids"]))
    for messages, answer in ((one, first), (other, second)):
        text = theirs.apply_chat_template(messages, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
        assert "[c1] wx" in text and "(c1) sun" in text
        assert answer["usage"]["prompt_tokens"] == len(ids_of(models, messages, "lm-call-ids")) == \
            len(theirs(text, add_special_tokens=False)["input_ids"])
        assert load_tokenizer(models["lm-call-ids"]).apply_chat_template(messages, tools=[WEATHER]) == text
    p1, p2 = ids_of(models, one, "lm-call-ids"), ids_of(models, other, "lm-call-ids")
    assert p1 != p2
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == cached_by_rule(p2, [p1])


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
                                  {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}],
                         ids=["image", "audio"])
def test_a_content_part_a_text_model_cannot_read_is_refused_not_dropped(models, part):
    """A later turn that adds an image (or audio) part beside its text: this text-only model cannot see it, so the
    request is refused with a 400 naming the part, never answered as if the part were not there."""
    messages = TURN_1 + [{"role": "assistant", "content": "ok"},
                         {"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}]

    async def go(client):
        resp = await client.post("/v1/chat/completions", json=chat(messages))
        return resp.status_code, resp.json()

    status, body = run(models, go)
    assert status == 400 and "choices" not in body
    assert body["error"]["code"] == "invalid_request" and "type" in body["error"]["message"]


def test_a_reply_whose_start_is_given_goes_on_from_it(models):
    """`continue_final_message` (vLLM's) with `add_generation_prompt` false: the final assistant message is left
    open and the reply goes on from its text, as the model writes after that text's ids (its prompt is
    the template's text cut after that message, not a new assistant turn); without the flag, the answer is a new
    turn. Both flags at once are refused, as vLLM refuses them."""
    turn = [*TURN_1, {"role": "assistant", "content": "the lazy"}]
    tok = load_tokenizer(models["lm"])
    text = tok.apply_chat_template(turn, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("the lazy")

    async def go(client):
        open_reply = await post(client, "/v1/chat/completions",
                                chat(turn, add_generation_prompt=False, continue_final_message=True))
        new_turn = await post(client, "/v1/chat/completions", chat(turn))
        both = await client.post("/v1/chat/completions", json=chat(turn, continue_final_message=True))
        return open_reply, new_turn, both

    open_reply, new_turn, both = run(models, go)
    assert open_reply["usage"]["prompt_tokens"] == len(tok.encode(text, add_special_tokens=False))
    prompt = tok.encode(text, add_special_tokens=False)
    going_on = lm_tokens(checkpoint.load(models["lm"], device="cpu"), prompt,
                         SamplingParams(max_tokens=20, temperature=0.0), with_eos=False)
    assert open_reply["choices"][0]["message"]["content"] == tok.decode(going_on)
    assert new_turn["usage"]["prompt_tokens"] == len(ids_of(models, turn)) != open_reply["usage"]["prompt_tokens"]
    assert both.status_code == 400 and both.json()["error"]["code"] == "invalid_messages"
