"""Structured output over HTTP, on a real `tserve serve` with a byte-level BPE (Qwen2) and a SentencePiece
(Mistral) model: OpenAI's `response_format` (the official client's `parse` helper included), the
`structured_outputs` extension (choice, regex, grammar), streaming, and the 400s of bad constraints."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.helpers import factories
from tests.helpers.server import ServerProcess, concurrently

FAMILIES = ["qwen2", "mistral"]
pytestmark = pytest.mark.parametrize("family", FAMILIES)


class Station(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=8)
    platform: int = Field(ge=1, le=20)
    open: bool


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured-http")
    models = {f: factories.hf_family_dir(f, root / f) for f in FAMILIES}
    srv = ServerProcess([*factories.model_flags(models), "--max-running-requests", "16"],
                        root / "server.log").wait_ready()
    yield srv
    srv.stop()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def chat(family: str, **extra) -> dict:
    return {"model": family, "messages": [{"role": "user", "content": "Station?"}], "max_tokens": 50, **extra}


def test_the_openai_clients_parse_helper_gets_a_validated_object(server, family):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    parsed = []
    for seed in range(4):
        reply = client.chat.completions.parse(model=family, messages=chat(family)["messages"], max_tokens=50,
                                              temperature=1.0, seed=seed, response_format=Station)  # its schema, strict
        choice = reply.choices[0]
        assert choice.finish_reason in ("stop", "length")
        if choice.finish_reason == "stop":
            assert isinstance(choice.message.parsed, Station), choice.message.content
            parsed.append(choice.message.parsed)
    assert parsed


def test_every_concurrent_answer_that_stops_validates_and_free_ones_do_not(server, family):
    schema = {"type": "json_schema", "json_schema": {"name": "station", "schema": Station.model_json_schema(),
                                                     "strict": True}}
    bodies = [chat(family, temperature=1.0, seed=i, response_format=schema) for i in range(16)]
    answers = [r["choices"][0] for r in concurrently(server, "/v1/chat/completions", bodies)]
    stopped = [a["message"]["content"] for a in answers if a["finish_reason"] == "stop"]
    assert len(stopped) >= 4, answers
    for text in stopped:
        Station.model_validate_json(text)
    free = [post(server, "/v1/chat/completions", chat(family, temperature=1.0, seed=i)).json() for i in range(4)]
    for reply in free:
        with pytest.raises(ValueError):
            Station.model_validate_json(reply["choices"][0]["message"]["content"])
    obj = post(server, "/v1/chat/completions", chat(family, temperature=0, response_format={"type": "json_object"})).json()["choices"][0]
    if obj["finish_reason"] == "stop":
        assert isinstance(json.loads(obj["message"]["content"]), dict)


def test_choice_regex_and_grammar_on_completions_streamed_too(server, family):
    options = ["grün", "Straße", "東京"]
    for i in range(4):
        body = {"model": family, "prompt": "The answer:", "max_tokens": 12, "temperature": 1.0, "seed": i,
                "structured_outputs": {"choice": options}}
        choice = post(server, "/v1/completions", body).json()["choices"][0]
        assert choice["text"] in options and choice["finish_reason"] == "stop"
    date = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"
    body = {"model": family, "prompt": "Today is", "max_tokens": 16, "temperature": 1.0, "seed": 5, "stream": True,
            "structured_outputs": {"regex": date}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert re.fullmatch(date, text), text
    grammar = 'root ::= "platform " [1-9] " is " ("open" | "closed")'
    body = {"model": family, "prompt": "Status:", "max_tokens": 40, "temperature": 1.0, "seed": 2,
            "structured_outputs": {"grammar": grammar}}
    choice = post(server, "/v1/completions", body).json()["choices"][0]
    assert re.fullmatch(r"platform [1-9] is (open|closed)", choice["text"]) and choice["finish_reason"] == "stop"


def test_bad_constraints_are_400s_with_the_reason(server, family):
    cases = [
        ({"structured_outputs": {"regex": "(("}}, "unclosed group"),
        ({"structured_outputs": {"grammar": "start: missing"}}, "missing"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
         "nonsense"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "not both"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
        ({"response_format": {"type": "json_schema"}}, "json_schema"),
        ({"response_format": {"type": "xml"}}, "response_format"),
    ]
    for extra, words in cases:
        resp = post(server, "/v1/chat/completions", chat(family, **extra))
        assert resp.status_code == 400, (extra, resp.text)
        assert words in resp.text, (extra, resp.text)
    assert post(server, "/v1/chat/completions", chat(family, max_tokens=2)).status_code == 200  # still serving


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "additionalProperties": False,
                                                           "properties": {"city": {"type": "string", "maxLength": 4},
                                                                          "days": {"type": "integer", "minimum": 1,
                                                                                   "maximum": 7}},
                                                           "required": ["city", "days"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {},
                                                                             "additionalProperties": False}}}


def _valid_call(call) -> None:
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(args) == {"city", "days"} and isinstance(args["city"], str) and 1 <= args["days"] <= 7
    else:
        assert call.function.name == "get_time" and args == {}


def test_tool_choice_required_and_named_give_calls_that_validate(server, family):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    messages = [{"role": "user", "content": "Weather?"}]
    made = 0
    for seed in range(4):
        # One call each (parallel_tool_calls false): these small models would go on calling.
        reply = client.chat.completions.create(model=family, messages=messages, tools=[WEATHER, CLOCK][: 1 + seed % 2],
                                               seed=seed,
                                               tool_choice="required", parallel_tool_calls=False, temperature=1.0,
                                               max_tokens=70)
        choice = reply.choices[0]
        if choice.finish_reason == "tool_calls":
            made += 1
            assert choice.message.tool_calls and choice.message.content is None
            assert len(choice.message.tool_calls) == 1
            _valid_call(choice.message.tool_calls[0])
        else:
            assert choice.finish_reason == "length"
    assert made
    named = {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(model=family, messages=messages, tools=[WEATHER, CLOCK], tool_choice=named, temperature=1.0,
                  seed=7, max_tokens=70)
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and [c.function.name for c in whole.message.tool_calls] == ["get_weather"]
    _valid_call(whole.message.tool_calls[0])
    # Streamed: the call's head, then its arguments as deltas, adding up to the same call.
    head, arguments, finish = None, "", None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for delta_call in chunk.choices[0].delta.tool_calls or []:
            head = head or delta_call
            arguments += delta_call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert head.id and head.function.name == "get_weather" and finish == "tool_calls"
    assert json.loads(arguments) == json.loads(whole.message.tool_calls[0].function.arguments)


def test_auto_answers_text_and_tool_messages_go_back_through_the_template(server, family):
    body = chat(family, tools=[WEATHER], temperature=0, max_tokens=8)
    reply = post(server, "/v1/chat/completions", body).json()["choices"][0]
    assert reply["finish_reason"] in ("stop", "length") and isinstance(reply["message"]["content"], str)
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": "" if family == "qwen2" else None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Ulm", "days": 1}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'}]
    resp = post(server, "/v1/chat/completions", chat(family, messages=history, tools=[WEATHER], max_tokens=4))
    if family == "qwen2":  # ChatML renders every role
        assert resp.status_code == 200, resp.text
    else:  # this Mistral template allows user/assistant turns only: its own error, as a 400
        assert resp.status_code == 400 and "chat template" in resp.text
    for bad, words in (({"tool_choice": "required"}, "needs tools"),
                       ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
                        "not among"),
                       ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
                        "cannot be combined")):
        resp = post(server, "/v1/chat/completions", chat(family, **bad))
        assert resp.status_code == 400 and words in resp.text, resp.text


def test_n_seed_and_logprobs_keep_working_under_a_constraint(server, family):
    """Each of n choices under its own grammar state; seeded choices reproduce; the top logprobs hold only the
    tokens the grammar allows (never -inf)."""
    body = {"model": family, "prompt": "Answer:", "max_tokens": 16, "temperature": 1.0, "seed": 11, "n": 3,
            "logprobs": 5, "structured_outputs": {"choice": ["alpha", "beta", "gamma delta"]}}
    first = post(server, "/v1/completions", body).json()["choices"]
    assert post(server, "/v1/completions", body).json()["choices"] == first
    assert len(first) == 3
    for choice in first:
        assert choice["text"] in ("alpha", "beta", "gamma delta") and choice["finish_reason"] == "stop"
        for top in choice["logprobs"]["top_logprobs"]:
            assert top and all(v > float("-inf") for v in top.values())
