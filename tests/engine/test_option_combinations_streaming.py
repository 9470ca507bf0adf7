"""What a client receives from `/v1/completions` and `/v1/chat/completions`, streamed and not, with options in
combination, in-process (the app through httpx.ASGITransport): the streamed answer must be the unstreamed one
(text, tokens, logprobs, usage, finish_reason) under stop strings, echo, logprobs, n > 1 and several prompts, on a
byte-level BPE (hf-llama) and a SentencePiece (hf-mistral) tokenizer; a stop string completed by the last token
max_tokens allows; chat's default max_tokens (the rest of the context); chat messages as the template receives them
(text parts, a participant's `name`, a system message)."""

from __future__ import annotations

import pytest

from tests.engine.test_option_combinations_lm import chat, chunks, completion, post, run
from tests.helpers import factories
from tserve.model.tokenizer import load_tokenizer

GERMAN = "Der schnelle braune Fuchs springt"  # the families go on " über den faulen Hund.": a multi-byte character


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("streaming-options")
    return {"lm": factories.tiny_lm_dir(root / "lm"),
            "llama": factories.hf_family_dir("llama", root / "llama"),  # byte-level BPE
            "mistral": factories.hf_family_dir("mistral", root / "mistral"),  # SentencePiece, byte fallback
            "qwen2": factories.hf_family_dir("qwen2", root / "qwen2")}  # ChatML: writes a message's name


def _counts(usage: dict) -> dict:
    """A usage's token counts (the prefix cache's share of the prompt depends on the requests before)."""
    return {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def _joined_completion(streamed: list[dict]) -> dict[int, dict]:
    """Per choice index: the streamed text, logprob columns, finish_reason; plus the last chunk's usage."""
    out: dict[int, dict] = {}
    for chunk in streamed:
        for ch in chunk["choices"]:
            c = out.setdefault(ch["index"], {"text": "", "tokens": [], "token_logprobs": [], "top_logprobs": [],
                                             "text_offset": [], "finish_reason": None})
            c["text"] += ch["text"]
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                c[key] += (ch["logprobs"] or {}).get(key) or []
            c["finish_reason"] = ch["finish_reason"] or c["finish_reason"]
    return out


def _assert_streamed_equals_whole(whole: dict, streamed: list[dict]) -> None:
    joined = _joined_completion(streamed)
    assert sorted(joined) == [c["index"] for c in whole["choices"]]
    for choice in whole["choices"]:
        got = joined[choice["index"]]
        assert (got["text"], got["finish_reason"]) == (choice["text"], choice["finish_reason"])
        if choice.get("logprobs") is not None:
            for key in ("tokens", "top_logprobs", "text_offset"):
                assert got[key] == choice["logprobs"][key], key
            assert got["token_logprobs"] == pytest.approx(choice["logprobs"]["token_logprobs"], abs=1e-5)
    assert streamed[-1]["choices"] == [] and _counts(streamed[-1]["usage"]) == _counts(whole["usage"])


# (name, body): each streamed with include_usage and compared with the same request unstreamed.
COMBINATIONS = [
    ("plain", {}),
    ("logprobs", {"logprobs": 2}),
    ("stop-inside-a-word", {"stop": ["ber"], "logprobs": 1}),
    ("stop-after-a-multibyte-character", {"stop": ["b", "zz"], "logprobs": 0}),
    ("echo-logprobs-0", {"echo": True, "logprobs": 0}),
    ("echo-n-2-prompts", {"echo": True, "logprobs": 1, "n": 2, "temperature": 1.0, "seed": 5,
                          "prompt": [GERMAN, "Hallo Welt, dies ist"]}),
    ("n-2-seeded-stop", {"n": 2, "temperature": 1.2, "seed": 9, "stop": [" d"], "logprobs": 1}),
    ("ignore-eos-max-tokens", {"ignore_eos": True, "max_tokens": 20}),
]


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_a_streamed_completion_is_the_unstreamed_one_under_every_combination(models, family):
    """Stop strings, echo, logprobs and several choices, on a byte-level and a SentencePiece tokenizer: the chunks
    add up to the whole answer (text, tokens, logprobs, offsets, finish_reason) and the usage chunk is its usage.
    Each choice's text is its tokens' text: the first word keeps the space before it, a multi-byte character
    comes whole."""
    bodies = [completion(model=family, prompt=GERMAN, max_tokens=12) | extra for _, extra in COMBINATIONS]

    async def go(client):
        return [(await post(client, "/v1/completions", b),
                 await chunks(client, "/v1/completions", b | {"stream_options": {"include_usage": True}}))
                for b in bodies]

    for (name, extra), (whole, streamed) in zip(COMBINATIONS, run(models, go), strict=True):
        _assert_streamed_equals_whole(whole, streamed)
        for choice in whole["choices"]:
            lp = choice["logprobs"]
            if lp is not None and not extra.get("echo") and "stop" not in extra:  # (a stop string cuts the text)
                assert "".join(lp["tokens"]) == choice["text"], name
        if name == "plain":
            assert whole["choices"][0]["text"].startswith(" über"), whole["choices"][0]["text"]
        if name == "stop-inside-a-word":
            assert (whole["choices"][0]["text"], whole["choices"][0]["finish_reason"]) == (" ü", "stop")
        if name == "echo-logprobs-0":
            lp = whole["choices"][0]["logprobs"]
            assert lp["token_logprobs"][0] is None and len(lp["tokens"]) > whole["usage"]["completion_tokens"]


def test_a_stop_string_completed_by_the_last_allowed_token_finishes_with_stop(models):
    """" brown fox" is six tokens (" br", "ow", "n", " f", "o", "x"): " fox" is complete with the sixth. With
    max_tokens 6 that token is both the last allowed
    and the end of the stop string: the text is cut, and the reason is the stop string, streamed or not."""
    body = completion(max_tokens=6, stop=[" fox"])

    async def go(client):
        return (await post(client, "/v1/completions", completion(max_tokens=6, logprobs=0)),
                await post(client, "/v1/completions", body), await chunks(client, "/v1/completions", body))

    full, whole, streamed = run(models, go)
    assert full["choices"][0]["text"] == " brown fox" and full["choices"][0]["finish_reason"] == "length"
    assert (whole["choices"][0]["text"], whole["choices"][0]["finish_reason"]) == (" brown", "stop")
    joined = _joined_completion(streamed)[0]
    assert (joined["text"], joined["finish_reason"]) == (" brown", "stop")


def test_tokens_held_back_by_a_possible_stop_string_keep_their_own_text_offsets(models):
    """" f", "o", "x" could begin the stop string " foxy", so their text waits until the next token rules it out;
    each token's text_offset is still where its own text starts, as without the stop string, streamed or not."""
    free = completion(max_tokens=8, logprobs=0)
    held = free | {"stop": [" foxy"]}

    async def go(client):
        return (await post(client, "/v1/completions", free), await post(client, "/v1/completions", held),
                await chunks(client, "/v1/completions", held))

    free_answer, whole, streamed = run(models, go)
    want = free_answer["choices"][0]["logprobs"]
    assert " fox" in free_answer["choices"][0]["text"] and whole["choices"][0]["text"] == free_answer["choices"][0]["text"]
    assert len(set(want["text_offset"])) == len(want["text_offset"])  # one token's text each
    assert whole["choices"][0]["logprobs"]["text_offset"] == want["text_offset"]
    assert _joined_completion(streamed)[0]["text_offset"] == want["text_offset"]


# --------------------------------------------------------------------------------------------------
# Chat
# --------------------------------------------------------------------------------------------------
def _joined_chat(streamed: list[dict]) -> tuple[dict[int, dict], dict | None]:
    out: dict[int, dict] = {}
    usage = None
    for chunk in streamed:
        usage = chunk.get("usage") or usage
        for ch in chunk["choices"]:
            c = out.setdefault(ch["index"], {"content": "", "logprobs": [], "finish_reason": None})
            c["content"] += ch["delta"].get("content") or ""
            c["logprobs"] += (ch["logprobs"] or {}).get("content") or []
            c["finish_reason"] = ch["finish_reason"] or c["finish_reason"]
    return out, usage


def test_a_streamed_chat_of_several_choices_counts_each_choices_prompt(models):
    """n = 2, streamed with include_usage: the usage chunk is the unstreamed usage, each choice's prompt counted."""
    body = chat(n=2, max_tokens=5, ignore_eos=True, temperature=1.0, seed=3)

    async def go(client):
        return (await post(client, "/v1/chat/completions", body),
                await chunks(client, "/v1/chat/completions", body | {"stream_options": {"include_usage": True}}))

    whole, streamed = run(models, go)
    joined, usage = _joined_chat(streamed)
    assert _counts(usage) == _counts(whole["usage"]) and usage["completion_tokens"] == 10
    for choice in whole["choices"]:
        assert joined[choice["index"]]["content"] == choice["message"]["content"]


@pytest.mark.parametrize("top_logprobs", [None, 2], ids=["logprobs-alone", "with-top-logprobs"])
def test_streamed_chat_logprobs_are_the_unstreamed_ones(models, top_logprobs):
    """`logprobs: true` streamed, with or without `top_logprobs`: every token's entry comes once, in order, as
    the whole answer lists them."""
    body = chat(temperature=0, logprobs=True, ignore_eos=True) | (
        {"top_logprobs": top_logprobs} if top_logprobs is not None else {})

    async def go(client):
        return await post(client, "/v1/chat/completions", body), await chunks(client, "/v1/chat/completions", body)

    whole, streamed = run(models, go)
    want = whole["choices"][0]["logprobs"]["content"]
    assert len(want) == whole["usage"]["completion_tokens"] == 8
    joined, _ = _joined_chat(streamed)
    assert joined[0]["logprobs"] == want
    assert joined[0]["content"] == whole["choices"][0]["message"]["content"]
    assert all(len(e["top_logprobs"]) == (top_logprobs or 0) for e in want)


def test_a_chat_without_max_tokens_writes_up_to_the_end_of_the_context(models):
    """Without max_tokens (or max_completion_tokens) a chat may use what the context leaves after its prompt:
    --max-model-len 40, ignore_eos: prompt and completion fill it exactly, streamed or not."""
    body = {"model": "lm", "messages": [{"role": "user", "content": "Hello"}], "temperature": 0, "ignore_eos": True}

    async def go(client):
        return (await post(client, "/v1/chat/completions", body),
                await chunks(client, "/v1/chat/completions", body | {"stream_options": {"include_usage": True}}))

    whole, streamed = run({"lm": models["lm"]}, go, max_model_len=40)
    assert whole["usage"]["total_tokens"] == 40 and whole["choices"][0]["finish_reason"] == "length"
    joined, usage = _joined_chat(streamed)
    assert _counts(usage) == _counts(whole["usage"]) and joined[0]["finish_reason"] == "length"


def test_a_message_of_text_parts_is_the_message_of_their_joined_text(models):
    """OpenAI's content as a list of text parts reaches the template as one text, the parts one per line (as vLLM
    joins them): the same prompt and the same answer as that string content."""
    text = chat(max_tokens=6, temperature=0, messages=[{"role": "user", "content": "Where is\nthe station?"}])
    parts = text | {"messages": [{"role": "user", "content": [{"type": "text", "text": "Where is"},
                                                               {"type": "text", "text": "the station?"}]}]}

    async def go(client):
        return [await post(client, "/v1/chat/completions", b) for b in (text, parts)]

    as_text, as_parts = run(models, go)
    assert _counts(as_parts["usage"]) == _counts(as_text["usage"])
    assert as_parts["choices"][0]["message"] == as_text["choices"][0]["message"]


def test_a_participants_name_and_a_system_message_reach_the_template(models):
    """A ChatML template writes a message's `name` before its content and a given system message in place of its
    default one: the prompt the server counts is the template rendered by the tokenizer with both."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello", "name": "ann"}]
    tok = load_tokenizer(models["qwen2"])
    want = len(tok.encode(tok.apply_chat_template(messages), add_special_tokens=False))
    unnamed = len(tok.encode(tok.apply_chat_template([messages[0], {"role": "user", "content": "Hello"}]),
                             add_special_tokens=False))
    assert want > unnamed
    body = {"model": "qwen2", "messages": messages, "max_tokens": 4, "temperature": 0}

    async def go(client):
        return (await post(client, "/v1/chat/completions", body),
                await chunks(client, "/v1/chat/completions", body | {"stream_options": {"include_usage": True}}))

    whole, streamed = run(models, go)
    assert whole["usage"]["prompt_tokens"] == want
    joined, usage = _joined_chat(streamed)
    assert _counts(usage) == _counts(whole["usage"]) and joined[0]["content"] == whole["choices"][0]["message"]["content"]
