"""A model loaded from a GGUF file, served with another feature: its chat template rendered and encoded as the chat
route encodes it (special tokens in the text, on a SentencePiece vocabulary), its end-of-generation ids (several:
eos, and the control tokens that end a turn) meeting structured output and logit_bias. The reference is the same
model served from the safetensors directory the file was written from, or a plain statement of the rule.
tests/model/test_gguf*.py hold each file to its original alone (tokenizer ids of plain text, template strings,
logits); these check what only shows once a request runs through the service."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.helpers import factories
from tests.helpers.gguf_files import write_gguf
from tests.helpers.in_process import InProcessApp
from tserve.model import checkpoint
from tserve.model.gguf import GGUFCheckpoint
from tserve.model.tokenizer import load_tokenizer

FAMILIES = ("llama", "mistral", "qwen2", "gemma3")


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    root = tmp_path_factory.mktemp("served-families-hf")
    return {f: factories.hf_family_dir(f, root / f) for f in FAMILIES}


@pytest.fixture(scope="module")
def gguf_files(originals, tmp_path_factory):
    root = tmp_path_factory.mktemp("served-families-gguf")
    return {f: write_gguf(d, root / f"{f}.gguf", f) for f, d in originals.items()}


@pytest.fixture(scope="module")
def app(originals, gguf_files):
    """The SentencePiece Mistral from its directory and from its file, and the ChatML Qwen2 from its file."""
    served = InProcessApp({"mistral": originals["mistral"], "mistral-gguf": gguf_files["mistral"],
                           "qwen2-gguf": gguf_files["qwen2"]})
    yield served
    served.stop()


def _chat_ids(tokenizer, messages) -> list[int]:  # noqa: ANN001
    """The prompt as /v1/chat/completions encodes it: the template's text (bos and every marker written in it),
    encoded without adding special tokens again."""
    return tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)


# --- a chat template's special tokens on a SentencePiece vocabulary ----------------------------------------------
CHATS = [[{"role": "user", "content": "Good morning. Where is the station?"}],
         [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Guten Morgen."},
          {"role": "user", "content": "Wo ist der Bahnhof?"}]]


@pytest.mark.parametrize("chat", range(len(CHATS)))
@pytest.mark.parametrize("family", FAMILIES)
def test_a_files_chat_prompt_is_its_originals_around_each_special_token(family, chat, originals, gguf_files):
    """The rendered chat prompt holds special tokens with text right after them: Mistral's `<s>[INST] ... [/INST]`
    and `</s>` between turns, where SentencePiece puts its space marker in front of the text's first piece only
    (the tokenizer.json's prepend scheme "first"), not in front of every piece after a special token; ChatML's and
    Llama 3's markers followed by a newline, which is text of its own (the control tokens strip nothing around
    them). Plain text and the template's string being the same does not make these ids the same."""
    want = checkpoint.load(originals[family]).tokenizer
    got = checkpoint.load(gguf_files[family]).tokenizer
    messages = CHATS[chat]
    assert got.apply_chat_template(messages) == want.apply_chat_template(messages)
    assert _chat_ids(got, messages) == _chat_ids(want, messages)


def test_a_sentencepiece_file_chats_as_its_original_is_served(app):
    """Over /v1/chat/completions: the file's prompt tokens, message and logprobs are the directory's."""
    body = {"messages": CHATS[1], "max_tokens": 8, "temperature": 0, "logprobs": True}
    answers = [app.post("/v1/chat/completions", body | {"model": m}).json() for m in ("mistral", "mistral-gguf")]
    assert answers[1]["usage"] == answers[0]["usage"]
    assert answers[1]["choices"][0]["message"] == answers[0]["choices"][0]["message"]
    assert [t["token"] for t in answers[1]["choices"][0]["logprobs"]["content"]] == \
        [t["token"] for t in answers[0]["choices"][0]["logprobs"]["content"]]


# --- end-of-generation ids ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_a_files_end_ids_are_exactly_its_originals(family, originals, gguf_files):
    """The control tokens that end a turn (`<|eot_id|>`, `<|im_end|>`, `<end_of_turn>`, ...) end generation; the
    ones that open a turn or a header (`<|im_start|>`, `<|start_header_id|>`, `<start_of_turn>`, bos) do not, though
    they are control tokens too."""
    original, loaded = checkpoint.load(originals[family]), checkpoint.load(gguf_files[family])
    want = set(original.generation.eos_token_ids or [original.tokenizer.eos_id])
    assert set(loaded.generation.eos_token_ids) == want


def _token_id(gguf_files, token: str) -> int:  # noqa: ANN001
    return checkpoint.load(gguf_files["qwen2"]).tokenizer.backend.token_to_id(token)


def test_a_control_token_that_opens_a_turn_is_generated_not_an_end(app, gguf_files):
    """`<|im_start|>` pushed up by logit_bias is chosen at every step and the answer runs to max_tokens (its text is
    empty: the token is special), while `<|im_end|>` pushed up ends it at once."""
    start, end = _token_id(gguf_files, "<|im_start|>"), _token_id(gguf_files, "<|im_end|>")
    body = {"model": "qwen2-gguf", "prompt": "Good morning.", "max_tokens": 3, "temperature": 0}
    opened = app.post("/v1/completions", body | {"logit_bias": {str(start): 100}}).json()
    assert (opened["choices"][0]["finish_reason"], opened["usage"]["completion_tokens"]) == ("length", 3)
    ended = app.post("/v1/completions", body | {"logit_bias": {str(end): 100}}).json()
    assert (ended["choices"][0]["finish_reason"], ended["usage"]["completion_tokens"]) == ("stop", 0)


@pytest.mark.parametrize("end", ["<|im_end|>", "<|endoftext|>"])
def test_every_end_id_ends_a_constrained_answer_as_it_ends_a_free_one(end, app, gguf_files):
    """A regex that may end anywhere (`[a-z ]*`): the grammar allows ending at every step, with any of the model's
    end ids, not only the tokenizer's eos (`<|im_end|>`; the file's `<|endoftext|>` ends a turn as well). Pushed up
    by logit_bias, either one ends the constrained answer at once, as it ends the unconstrained one."""
    bias = {str(_token_id(gguf_files, end)): 100}
    body = {"model": "qwen2-gguf", "prompt": "Good morning.", "max_tokens": 6, "temperature": 0, "logit_bias": bias}
    free = app.post("/v1/completions", body).json()["choices"][0]
    constrained = app.post("/v1/completions", body | {"structured_outputs": {"regex": "[a-z ]*"}}).json()["choices"][0]
    assert (free["finish_reason"], free["text"]) == ("stop", "")
    assert (constrained["finish_reason"], constrained["text"]) == ("stop", "")


def test_a_files_tool_use_template_renders_a_request_with_tools_as_its_original(originals, tmp_path):
    """A checkpoint with named templates (a default and a `tool_use` one): llama.cpp's converter writes the second
    as `tokenizer.chat_template.tool_use` beside the default. Loaded from the file, a request with tools renders the
    tool_use template and one without the default, as the directory it was written from renders them."""
    d = tmp_path / "qwen2"
    shutil.copytree(originals["qwen2"], d)
    config = json.loads((d / "tokenizer_config.json").read_text())
    default = config["chat_template"]
    config["chat_template"] = [{"name": "default", "template": default},
                               {"name": "tool_use", "template": "TOOLS {{ tools | length }}: " + default}]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    (d / "chat_template.jinja").unlink(missing_ok=True)
    ours = GGUFCheckpoint(write_gguf(d, tmp_path / "qwen2.gguf", "qwen2")).tokenizer()
    theirs = load_tokenizer(d)
    messages = [{"role": "user", "content": "Weather in Ulm?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with_tools = ours.apply_chat_template(messages, tools=tools)
    assert with_tools.startswith("TOOLS 1") and with_tools == theirs.apply_chat_template(messages, tools=tools)
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(messages)
    assert not ours.apply_chat_template(messages).startswith("TOOLS")
