"""What becomes `tool_calls` (tserve/service/generation/tool_calls.py): the constrained formats, the chat templates' formats under
`auto`, and the stream of deltas."""

from __future__ import annotations

import json

import pytest

from tserve.service.generation.tool_calls import ToolCall, ToolStream, parse_output, tool_mode

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def test_modes_and_their_constraints():
    assert tool_mode(None, None, None).mode == "none"
    assert tool_mode([WEATHER], None, None).mode == "auto"
    assert not tool_mode([WEATHER], "auto", None).constrained
    required = tool_mode([WEATHER, TIME], "required", False)
    schema = json.loads(required.constraint.spec)
    assert schema["maxItems"] == 1 and [c["properties"]["name"]["const"] for c in schema["items"]["anyOf"]] == \
        ["get_weather", "get_time"]
    assert [c["properties"]["arguments"] for c in schema["items"]["anyOf"]] == \
        [WEATHER["function"]["parameters"], {"type": "object", "properties": {}}]
    named = tool_mode([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, None)
    assert named.mode == "named" and json.loads(named.constraint.spec) == WEATHER["function"]["parameters"]
    for tools, choice, words in (([WEATHER], {"type": "function", "function": {"name": "nope"}}, "not among"),
                                 (None, "required", "needs tools"), ([WEATHER, WEATHER], "auto", "distinct")):
        with pytest.raises(ValueError, match=words):
            tool_mode(tools, choice, None)


def test_constrained_outputs_become_calls():
    required = tool_mode([WEATHER, TIME], "required", None)
    content, calls = parse_output(required, '[{"name":"get_weather","arguments":{"city":"Köln"}},'
                                            '{"name":"get_time","arguments":{}}]')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == \
        [("get_weather", {"city": "Köln"}), ("get_time", {})]
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")
    named = tool_mode([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None)
    assert [(c.name, c.arguments) for c in parse_output(named, '{"city":"Bonn"}')[1]] == \
        [("get_weather", '{"city": "Bonn"}')]


@pytest.mark.parametrize("text,content,calls", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None,
     [("get_weather", {"city": "Paris"})]),
    ('Let me look.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Rom"}}</tool_call>\n'
     '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', "Let me look.",
     [("get_weather", {"city": "Rom"}), ("get_time", {})]),
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', None, [("get_weather", {"city": "Oslo"})]),
    ('<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "X"}}',
     None, [("get_time", {}), ("get_weather", {"city": "X"})]),
    ('{"name": "unknown_tool", "parameters": {}}', '{"name": "unknown_tool", "parameters": {}}', []),
    ("It is sunny in Paris.", "It is sunny in Paris.", []),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>', None, []),
])
def test_auto_parses_the_templates_formats(text, content, calls):
    got_content, got = parse_output(tool_mode([WEATHER, TIME], "auto", None), text)
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    if calls or content is not None:
        assert got_content == content


def test_streams_named_arguments_as_they_come_and_hold_auto_until_known():
    named = ToolStream(tool_mode([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None))
    first, _ = named.deltas('{"city":', None)
    assert first[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert first[1]["tool_calls"][0]["function"] == {"arguments": '{"city":'}
    last, finish = named.deltas('"Ulm"}', "stop")
    assert last == [{"tool_calls": [{"index": 0, "function": {"arguments": '"Ulm"}'}}]}] and finish == "tool_calls"
    auto = ToolStream(tool_mode([WEATHER], "auto", None))
    assert auto.deltas("<tool", None) == ([], None)
    deltas, finish = auto.deltas('_call>{"name": "get_weather", "arguments": {"city": "Bern"}}</tool_call>', "stop")
    assert finish == "tool_calls" and json.loads(deltas[1]["tool_calls"][0]["function"]["arguments"]) == {"city": "Bern"}
    prose = ToolStream(tool_mode([WEATHER], "auto", None))
    assert prose.deltas("Hel", None) == ([{"content": "Hel"}], None)
    assert prose.deltas("lo", "stop") == ([{"content": "lo"}], "stop")


def test_calls_then_text_cut_by_max_tokens_finish_with_tool_calls_streamed_as_unstreamed():
    """auto: complete calls, then text until max_tokens ended the answer. The whole answer's parse finds the calls
    (its message carries them, so its finish_reason is "tool_calls", as vLLM answers); the stream says the same."""
    mode = tool_mode([WEATHER], "auto", None)
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Bern"}}</tool_call>\nand then some'
    assert parse_output(mode, text)[1]
    stream = ToolStream(mode)
    assert stream.deltas(text[:30], None) == ([], None)
    deltas, finish = stream.deltas(text[30:], "length")
    assert finish == "tool_calls" and any("tool_calls" in d for d in deltas)


def _rebuilt_as_openai_clients_do(deltas: list[dict]) -> list[dict]:
    """The calls a client rebuilds from a stream's deltas, as OpenAI documents it (and its SDK's stream helper
    does): a call is keyed by its `index`; the delta that opens it carries `id`, `type` and the function's name,
    and every later delta of that index appends to its arguments."""
    calls: dict[int, dict] = {}
    for delta in deltas:
        for part in delta.get("tool_calls", []):
            call = calls.get(part["index"])
            if call is None:
                assert part["id"] and part["type"] == "function" and part["function"]["name"], part
                calls[part["index"]] = call = {"id": part["id"], "name": part["function"]["name"], "arguments": ""}
            call["arguments"] += part["function"].get("arguments", "")
    return [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("mode", ["auto", "required"])
def test_several_calls_in_one_streamed_reply_rebuild_by_index(mode):
    """Parallel calls: each gets its own index, opened once with its own id; a client that rebuilds the stream
    gets every call with its own arguments, in order."""
    text = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Bern"}}</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Ulm"}}</tool_call>')
    if mode == "required":  # the constrained format: a JSON list of calls
        text = ('[{"name": "get_weather", "arguments": {"city": "Bern"}}, {"name": "get_time", "arguments": {}}, '
                '{"name": "get_weather", "arguments": {"city": "Ulm"}}]')
    stream = ToolStream(tool_mode([WEATHER, TIME], mode, None))
    deltas, finish = [], None
    for start in range(0, len(text), 17):  # the text as the engine's events bring it, a few tokens at a time
        piece = text[start:start + 17]
        got, finish = stream.deltas(piece, "stop" if start + 17 >= len(text) else None)
        deltas += got
    assert finish == "tool_calls"
    calls = _rebuilt_as_openai_clients_do(deltas)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Bern"}), ("get_time", {}), ("get_weather", {"city": "Ulm"})]
    assert len({c["id"] for c in calls}) == 3
    assert not any("content" in d and d["content"] for d in deltas)


def test_the_required_schema_allows_each_tool_with_its_own_arguments_and_nothing_else():
    schema = json.loads(tool_mode([WEATHER], "required", None).constraint.spec)
    assert schema == {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"const": "get_weather"},
                                          "arguments": WEATHER["function"]["parameters"]},
         "required": ["name", "arguments"], "additionalProperties": False}]}}


def test_a_call_whose_arguments_are_not_an_object_is_not_a_call():
    auto = tool_mode([WEATHER, TIME], "auto", None)
    for text in ('<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>',
                 '{"name": "get_time", "parameters": "[1]"}'):
        assert parse_output(auto, text) == (text, [])


def test_stream_deltas_in_full():
    named = ToolStream(tool_mode([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None))
    head, _ = named.deltas("{", None)
    assert head[0] == {"tool_calls": [{"index": 0, "id": named.call.id, "type": "function",
                                       "function": {"name": "get_weather", "arguments": ""}}]}
    prose = ToolStream(tool_mode([WEATHER], "auto", None))
    prose.deltas("Hello", None)
    assert prose.deltas("", "stop") == ([], "stop")  # an event without text adds no empty delta
    calls_then_text = ToolStream(tool_mode([TIME], "auto", None))
    deltas, finish = calls_then_text.deltas('<tool_call>{"name": "get_time", "arguments": {}}</tool_call> Done.',
                                            "stop")
    assert deltas[0] == {"content": "Done."} and finish == "tool_calls"


def test_what_an_auto_answer_must_be_to_be_a_call():
    auto = tool_mode([WEATHER, TIME], "auto", None)
    text = '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Graz\\", \\"days\\": 2}"}</tool_call>'
    (call,) = parse_output(auto, text)[1]  # arguments sent as a JSON string are read as the object they hold
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Graz", "days": 2}')
    for text in ('<tool_call>{"name": 5, "arguments": {}}</tool_call>', "[1]", '"get_time"'):
        assert parse_output(auto, text) == (text, [])


def test_a_call_as_openai_writes_it():
    call = ToolCall("get_time", "{}", id="call_1")
    assert call.openai() == {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    assert call.openai(2) == {"index": 2, **call.openai()}


def test_auto_holds_text_that_may_begin_a_call_and_lets_a_cut_off_call_through_as_text():
    for start in ('{"na', '\n <tool_call>', "<|python_tag|>"):
        assert ToolStream(tool_mode([TIME], "auto", None)).deltas(start, None) == ([], None)
    cut = ToolStream(tool_mode([WEATHER], "required", None))
    assert cut.deltas('[{"name": "get_weather", "argum', "length") == (
        [{"content": '[{"name": "get_weather", "argum'}], "length")
    calls = ToolStream(tool_mode([TIME], "auto", None))
    deltas, _ = calls.deltas('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', "stop")
    assert deltas[0] == {"tool_calls": [{"index": 0, "id": deltas[0]["tool_calls"][0]["id"], "type": "function",
                                         "function": {"name": "get_time", "arguments": ""}}]}
