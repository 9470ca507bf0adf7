"""Tokenizers and chat templates with options away from their defaults, each held to transformers on the same
files: templates in the hub's two styles (tool-aware, with `tojson(indent=...)`, `strftime_now`, loop controls and
a system message; and an older one written without whitespace control) rendered with and without tools and a
generation prompt on byte-level BPE, SentencePiece and ChatML tokenizers; a config's list of named templates;
`add_special_tokens` off beside `add_bos_token`/`add_eos_token`, a text that already starts with the bos, special
tokens inside the text and decoding with and without `skip_special_tokens`; added tokens outside the byte-level
alphabet; a template that fails on a message without content."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFBackend

from tserve.model.tokenizer import load_tokenizer, token_bytes

transformers = pytest.importorskip("transformers")

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"

# In the manner of Llama 3.1's and Qwen 2.5's: the tools (when given) as indented JSON, today's date, a system
# message taken off the front, loop controls, and an assistant's calls written as JSON.
TOOL_AWARE = (
    "{%- if bos_token %}{{- bos_token }}{%- endif %}"
    "{%- if strftime_now is defined %}{%- set date_string = strftime_now('%d %b %Y') %}"
    "{%- else %}{%- set date_string = '26 Jul 2024' %}{%- endif %}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|im_start|>system\\nToday Date: ' + date_string + '\\n' + system_message }}"
    "{%- if tools is not none %}"
    "{{- '\\nEnvironment: ipython\\nYou may call these functions:\\n' }}"
    "{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n' }}{%- endfor %}"
    "{{- 'Compact: ' + (tools | tojson(separators=(',', ':'))) }}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'skip' %}{%- continue %}{%- endif %}"
    "{%- if message['role'] == 'stop' %}{%- break %}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message.tool_calls is defined %}{%- for c in message.tool_calls %}"
    "{{- '<tool_call>' + (c.function | tojson) + '</tool_call>' }}{%- endfor %}"
    "{%- else %}{{- message['content'] | trim }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# An older ChatML template written without `-`: trim_blocks and lstrip_blocks decide its newlines and indents.
PLAIN = (
    "{% for message in messages %}\n"
    "    {% if message['role'] == 'system' %}\n"
    "<|im_start|>system\n{{ message['content'] }}<|im_end|>\n"
    "    {% else %}\n"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "    {% endif %}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}\n"
    "<|im_start|>assistant\n"
    "{% endif %}"
)
TEMPLATES = {"tool-aware": TOOL_AWARE, "plain": PLAIN}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Wetter für einen Ort",
    # keys out of alphabetical order: a template writes them in the order the request gave them
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"unit": {"type": "string", "enum": ["c", "f"]}, "city": {"type": "string"}}}}}]
CHAT = [
    {"role": "system", "content": "  Be brief. Ünïcode ✓  "},
    {"role": "user", "content": "Wo ist <|im_end|> der Bahnhof?"},  # a special token's text inside user text
    {"role": "assistant", "content": None,
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"unit": "c", "city": "Köln"}}}]},
    {"role": "user", "content": "Danke </s> <s>"},
]
LAYOUTS = ["hf-llama", "hf-mistral", "hf-qwen2", "hf-gemma3"]  # byte-level BPE, SentencePiece, ChatML, Gemma


def _hf(d: Path):  # noqa: ANN202
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoTokenizer.from_pretrained(str(d))


def _tokenizer_dir(d: Path, layout: str, **config) -> Path:
    """A copy of a fixture's tokenizer files with `config` laid over its tokenizer_config.json."""
    d.mkdir(parents=True, exist_ok=True)
    shutil.copy(FIXTURES / layout / "tokenizer.json", d)
    base = json.loads((FIXTURES / layout / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps(base | config))
    return d


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("style", TEMPLATES)
def test_a_template_renders_as_transformers_renders_it_with_tools_or_none(tmp_path, layout, style):
    """Tools or none, with a generation prompt or without: the prompt string, and its ids (special-token text in
    a message becomes the token, as transformers' apply_chat_template(tokenize=True) makes it), are
    transformers'. The tool-aware template writes the tools with `tojson(indent=4)` in the request's key order,
    and tells "no tools" (None) from a list; the plain one depends on trim_blocks and lstrip_blocks."""
    d = _tokenizer_dir(tmp_path / "tok", layout, chat_template=TEMPLATES[style])
    ours, theirs = load_tokenizer(d), _hf(d)
    for tools in (None, TOOLS):
        for generation_prompt in (True, False):
            chat = CHAT if style == "tool-aware" else [{**m, "content": m["content"] or ""} for m in CHAT]
            expected = theirs.apply_chat_template(chat, tools=tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt)
            prompt = ours.apply_chat_template(chat, add_generation_prompt=generation_prompt, tools=tools)
            assert prompt == expected, (tools is not None, generation_prompt)
            ids = theirs.apply_chat_template(chat, tools=tools, tokenize=True, return_dict=False,
                                             add_generation_prompt=generation_prompt)
            assert ours.encode(prompt, add_special_tokens=False) == list(ids)
    if style == "tool-aware":
        assert json.dumps(TOOLS[0], indent=4, ensure_ascii=False) in ours.apply_chat_template(CHAT, tools=TOOLS)
        # loop controls: a skipped message is left out, and nothing after a stop is rendered
        chat = [CHAT[1], {"role": "skip", "content": "x"}, {"role": "user", "content": "y"},
                {"role": "stop", "content": "z"}, {"role": "user", "content": "never"}]
        assert ours.apply_chat_template(chat) == theirs.apply_chat_template(chat, tokenize=False,
                                                                           add_generation_prompt=True)


def test_a_config_with_named_templates_renders_its_default_one(tmp_path):
    """tokenizer_config.json may hold a list of named templates; without tools transformers renders the one named
    "default", wherever it stands in the list."""
    named = [{"name": "tool_use", "template": "TOOLS {{ messages[0]['content'] }}"},
             {"name": "default", "template": "DEFAULT {{ messages[0]['content'] }}"}]
    d = _tokenizer_dir(tmp_path / "tok", "hf-llama", chat_template=named)
    messages = [{"role": "user", "content": "hi"}]
    expected = _hf(d).apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert load_tokenizer(d).apply_chat_template(messages) == expected == "DEFAULT hi"


TEXTS = ["Hello world", " leading space", "Über 😀 ☃", "line\nbreak"]


@pytest.mark.parametrize("layout", ["hf-llama", "hf-mistral", "hf-gemma3"])
def test_add_special_tokens_off_adds_neither_bos_nor_eos_whatever_the_flags(tmp_path, layout):
    """A rendered chat is encoded with add_special_tokens off: whatever add_bos_token and add_eos_token say, nothing
    is added (transformers adds nothing either), so a chat prompt never ends in an eos the model then reads as the
    end of its turn. With the flags on, plain text gets both. A text that already starts with the bos keeps just
    that one."""
    d = _tokenizer_dir(tmp_path / "tok", layout, add_bos_token=True, add_eos_token=True)
    ours, theirs = load_tokenizer(d), _hf(d)
    bos = theirs.bos_token
    for text in [*TEXTS, f"{bos}Hello", f"{bos}{bos} twice"]:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == theirs(text, add_special_tokens=False).input_ids, text
        assert ours.eos_id not in ids
    for text in TEXTS:
        plain = ours.encode(text, add_special_tokens=False)
        assert ours.encode(text) == [ours.bos_id, *plain, ours.eos_id]
    assert ours.encode(f"{bos}Hello", add_special_tokens=False).count(ours.bos_id) == 1


@pytest.mark.parametrize("layout", ["hf-llama", "hf-mistral", "hf-qwen2", "hf-gemma3", "hf-phi3", "hf-nllb", "hf-t5"])
def test_special_tokens_inside_text_decode_as_transformers_with_and_without_skipping(layout):
    """Text holding the special tokens' own strings encodes to them (add_special_tokens on or off), and decoding
    drops exactly the specials transformers drops with skip_special_tokens, keeping them without it."""
    d = FIXTURES / layout
    ours, theirs = load_tokenizer(d), _hf(d)
    specials = [t for t in theirs.all_special_tokens if t]
    text = "a " + " b ".join(specials) + " c Ünï 😀"
    for add in (True, False):
        ids = theirs(text, add_special_tokens=add).input_ids
        assert ours.encode(text, add_special_tokens=add) == ids, add
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)



@pytest.mark.parametrize("layout", ["hf-llama", "hf-mistral", "hf-qwen2", "hf-gemma3"])
def test_each_tokens_bytes_are_the_pieces_of_the_text_it_splits(layout):
    """Byte-level BPE and SentencePiece's byte fallback both split a rare character into byte tokens, shown as
    "<0xE6>" (`id_to_token`): `token_bytes` of each shown token is what transformers decodes that token to, byte
    for byte, so that the tokens' bytes put together are the text's (OpenAI's logprobs `bytes`)."""
    d = FIXTURES / layout
    ours, theirs = load_tokenizer(d), _hf(d)
    text = "Grüße 日本語 ✓ 😀"
    ids = ours.encode(text, add_special_tokens=False)
    shown = ours.tokens(ids)
    assert any("<0x" in t for t in shown), shown
    joined = b"".join(token_bytes(t) for t in shown)
    assert joined.decode("utf-8").strip() == theirs.decode(ids).strip() == text


@pytest.mark.parametrize("layout", ["hf-llama", "hf-mistral", "hf-qwen2", "hf-gemma3"])
def test_a_chat_left_open_or_without_a_generation_prompt_renders_as_transformers_renders_it(layout):
    """`add_generation_prompt` false ends the text with the last message; `continue_final_message` leaves the
    final (assistant) message open, its given start the text's end, so that the reply goes on with it: each as
    transformers' apply_chat_template renders it, trailing spaces included."""
    d = FIXTURES / layout
    ours, theirs = load_tokenizer(d), _hf(d)
    for last in ("The station is", "Der Bahnhof ist  ", "Sure: "):
        chat = [{"role": "user", "content": "Where is the station?"}, {"role": "assistant", "content": last}]
        assert ours.apply_chat_template(chat, add_generation_prompt=False, continue_final_message=True) == \
            theirs.apply_chat_template(chat, tokenize=False, continue_final_message=True), (layout, last)
    question = [{"role": "user", "content": "Where is the station?"}]
    assert ours.apply_chat_template(question, add_generation_prompt=False) == theirs.apply_chat_template(
        question, tokenize=False, add_generation_prompt=False)
    with pytest.raises(ValueError, match="continue_final_message"):
        ours.apply_chat_template([*question, {"role": "assistant", "content": " "}], add_generation_prompt=False,
                                 continue_final_message=True)

def test_added_tokens_outside_the_byte_alphabet_read_as_their_own_text(tmp_path):
    """Added tokens are stored as text, not in the byte-level alphabet: one with characters past ASCII (`é`, which
    that alphabet uses for a byte of its own; DeepSeek's `<｜end▁of▁sentence｜>`) reads as itself in token strings
    (logprobs, attention labels), as transformers' convert_ids_to_tokens shows it, special or not."""
    backend = HFBackend.from_file(str(FIXTURES / "hf-llama" / "tokenizer.json"))
    backend.add_tokens([AddedToken("<|réponse|>", special=False, normalized=False)])
    backend.add_special_tokens([AddedToken("<｜end▁of▁sentence｜>", special=True, normalized=False)])
    d = tmp_path / "tok"
    d.mkdir()
    backend.save(str(d / "tokenizer.json"))
    shutil.copy(FIXTURES / "hf-llama" / "tokenizer_config.json", d)
    ours, theirs = load_tokenizer(d), _hf(d)
    added = [backend.token_to_id("<|réponse|>"), backend.token_to_id("<｜end▁of▁sentence｜>")]
    assert ours.tokens(added) == theirs.convert_ids_to_tokens(added) == ["<|réponse|>", "<｜end▁of▁sentence｜>"]
    ids = ours.encode("Hi <|réponse|> there<｜end▁of▁sentence｜>")
    assert ids == theirs("Hi <|réponse|> there<｜end▁of▁sentence｜>").input_ids and set(added) <= set(ids)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


def test_a_template_that_fails_on_a_message_without_content_is_refused_as_bad_messages(tmp_path):
    """A hub template that adds strings to a message's content raises TypeError on an assistant message holding
    only tool calls (content null); that is the request's fault, so it must come back as the ValueError the chat
    route turns into a 400, not escape as a server error."""
    template = "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' }}{% endfor %}"
    d = _tokenizer_dir(tmp_path / "tok", "hf-qwen2", chat_template=template)
    tok = load_tokenizer(d)
    with pytest.raises(ValueError, match="chat template rendering failed"):
        tok.apply_chat_template([CHAT[1], CHAT[2]])


def test_templates_are_chosen_and_given_their_tokens_as_transformers_does(tmp_path):
    """A chat_template.jinja file wins over a template in tokenizer_config.json; a list of named templates gives
    "tool_use" to a request with tools; a role the tokenizer has no token for (Qwen2 has no bos) renders as
    nothing, not "None"; `tojson(ensure_ascii=True)` escapes as json.dumps does. Each as transformers renders it."""
    messages = [{"role": "user", "content": "Grüße"}]

    def both(d: Path, **kwargs) -> tuple[str, str]:  # noqa: ANN003
        return (load_tokenizer(d).apply_chat_template(messages, **kwargs),
                _hf(d).apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs))

    d = _tokenizer_dir(tmp_path / "jinja", "hf-llama", chat_template="CONFIG {{ messages[0]['content'] }}")
    (d / "chat_template.jinja").write_text("JINJA {{ messages[0]['content'] }}")
    assert both(d) == ("JINJA Grüße",) * 2
    named = [{"name": "default", "template": "DEFAULT {{ messages[0]['content'] }}"},
             {"name": "tool_use", "template": "TOOLS {{ tools | length }} {{ messages[0]['content'] }}"}]
    d = _tokenizer_dir(tmp_path / "named", "hf-llama", chat_template=named)
    assert both(d, tools=TOOLS) == ("TOOLS 1 Grüße",) * 2
    assert both(d) == ("DEFAULT Grüße",) * 2
    d = _tokenizer_dir(tmp_path / "qwen2", "hf-qwen2",
                       chat_template="[{{ bos_token }}]{{ messages[0]['content'] | tojson(ensure_ascii=True) }}")
    assert both(d) == ('[]"Gr\\u00fc\\u00dfe"',) * 2
