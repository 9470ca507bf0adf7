"""Structured output with other options and in its less common forms: a JSON schema given as text, `response_format`
text beside `structured_outputs`, json_object against a json_schema without a schema, choices holding quotes and
backslashes, a constraint that may go on past a point where it could end, logprobs under a mask, a constrained
request preempted and recomputed, and two models with different vocabularies compiling the same constraint.
Each compares against the same request with the other option at its default, or against what the grammar allows."""

from __future__ import annotations

import json
import re

from tests.engine.test_option_combinations_lm import chunks, completion, models, post, run  # noqa: F401
from tests.helpers import factories
from tests.helpers.fixture_training import cycle_prompts
from tests.helpers.sampling_options import streamed
from tests.model.test_structured_output import allowed_ids, lms  # noqa: F401
from tserve.model.decoding import SamplingParams
from tserve.model.decoding.structured import Constraint, masks_for
from tserve.service.engine import GenerationEngine
from tserve.service.metrics import Metrics
from tserve.service.routes.completions import _constraint
from tserve.service.schemas import CompletionRequest

LETTERS = "[a-z ]{1,40}"  # the trained LM writes " brown fox jumps over the lazy dog." after "the quick"


# --------------------------------------------------------------------------------------------------
# How a request names its constraint
# --------------------------------------------------------------------------------------------------
def test_a_schema_given_as_text_constrains_as_the_same_schema_given_as_an_object(models):  # noqa: F811
    """vLLM's `structured_outputs.json` takes a schema object or its JSON text: both are the same constraint."""
    schema = {"type": "object", "properties": {"w": {"type": "string", "maxLength": 6}}, "required": ["w"],
              "additionalProperties": False}

    async def go(client):
        as_object = await post(client, "/v1/completions", completion(structured_outputs={"json": schema}))
        as_text = await post(client, "/v1/completions", completion(structured_outputs={"json": json.dumps(schema)}))
        return as_object["choices"][0], as_text["choices"][0]

    as_object, as_text = run(models, go)
    assert as_text == as_object
    assert as_text["text"].startswith('{"w":"'), as_text


def test_response_format_text_beside_structured_outputs_leaves_the_structured_outputs_constraint(models):  # noqa: F811
    """`response_format: {"type": "text"}` is the default (no constraint): sent beside `structured_outputs`, as
    clients that always send a response format do, it is not a second constraint and is not refused."""
    choice = {"choice": ["brown", "green"]}

    async def go(client):
        alone = await post(client, "/v1/completions", completion(structured_outputs=choice))
        both = await post(client, "/v1/completions", completion(structured_outputs=choice,
                                                                 response_format={"type": "text"}))
        return alone["choices"][0], both["choices"][0]

    alone, both = run(models, go)
    assert both == alone and both["text"] in choice["choice"]


def test_json_object_starts_with_a_brace_and_a_json_schema_without_a_schema_takes_any_json_value(lms):  # noqa: F811
    """`json_object` means an object: its first token opens one. A json_schema format without a schema means
    any JSON value (OpenAI's default), so a number or an array may start the answer too."""
    lm = lms["gpt2"]
    tok = lm.loaded.tokenizer

    def first_texts(response_format: dict) -> set[str]:
        body = CompletionRequest(model="lm", prompt="x", response_format=response_format)
        state = lm.runner.grammars.compile(_constraint(body)).matcher()
        allowed = allowed_ids(masks_for([state], lm.runner.vocab_size), lm.runner.vocab_size)
        return {tok.decode([t]) for t in allowed}

    objects = first_texts({"type": "json_object"})
    assert objects and all(t.startswith("{") for t in objects), objects
    values = first_texts({"type": "json_schema", "json_schema": {"name": "any"}})
    assert {"{", "[", "1", '"'} <= values, values
    # vLLM's structured_outputs with the empty schema is the same: any JSON value, not a request refused
    body = CompletionRequest(model="lm", prompt="x", structured_outputs={"json": {}})
    assert _constraint(body).spec == "{}"


def test_choices_holding_quotes_and_backslashes_are_offered_verbatim(lms):  # noqa: F811
    """A choice is a literal string, whatever characters it holds: quotes and backslashes come back as sent."""
    lm = lms["qwen2"]
    options = ['say "hi"', "C:\\temp", "a|b"]
    grammar = lm.grammar("choice", json.dumps(options))
    answers = lm.generate(lm.prompts(8, seed=4), [SamplingParams(max_tokens=16, temperature=1.0, seed=i,
                                                                 grammar=grammar) for i in range(8)])
    assert all(reason == "stop" and text in options for text, reason in answers), answers


# --------------------------------------------------------------------------------------------------
# Where a constrained answer ends, and what it reports
# --------------------------------------------------------------------------------------------------
def test_a_regex_that_may_go_on_is_not_cut_where_it_could_first_end_streamed_or_not(models):  # noqa: F811
    """A regex that matches after one letter allows forty: the answer ends where the grammar allows nothing
    more (or at max_tokens), not where it could first end. Greedy, it is the free answer as long as that stays
    in the regex; the stream gives the same text and finish."""
    body = completion(max_tokens=12, structured_outputs={"regex": LETTERS})

    async def go(client):
        free = await post(client, "/v1/completions", completion(max_tokens=12))
        whole = await post(client, "/v1/completions", body)
        parts = await chunks(client, "/v1/completions", body)
        return free["choices"][0], whole["choices"][0], parts

    free, whole, parts = run(models, go)
    assert re.fullmatch(LETTERS, free["text"])  # the free answer stays in the regex for 12 tokens
    assert (whole["text"], whole["finish_reason"]) == (free["text"], "length")
    streamed_text = "".join(c["choices"][0]["text"] for c in parts if c["choices"])
    assert streamed_text == whole["text"]
    assert [c["choices"][0]["finish_reason"] for c in parts if c["choices"]][-1] == "length"


def test_logprobs_under_a_constraint_are_those_of_the_masked_distribution(models):  # noqa: F811
    """The reported logprobs read the scores after the grammar's mask: every alternative listed is a token the
    regex allows, and the chosen token's logprob is at least the one it has free (its mass renormalised over
    the allowed tokens), higher where the mask removed something."""
    async def go(client):
        free = await post(client, "/v1/completions", completion(max_tokens=10, logprobs=5))
        constrained = await post(client, "/v1/completions",
                                 completion(max_tokens=10, logprobs=5, structured_outputs={"regex": LETTERS}))
        return free["choices"][0], constrained["choices"][0]

    free, constrained = run(models, go)
    assert constrained["text"] == free["text"]
    for top in constrained["logprobs"]["top_logprobs"]:
        assert top and all(re.fullmatch("[a-z ]+", t) for t in top), top
    gains = [c - f for c, f in zip(constrained["logprobs"]["token_logprobs"], free["logprobs"]["token_logprobs"],
                                   strict=True)]
    assert all(g >= -1e-5 for g in gains) and sum(gains) > 1e-4, gains


# --------------------------------------------------------------------------------------------------
# Preemption, and one compiler per model
# --------------------------------------------------------------------------------------------------
def test_a_constrained_request_preempted_mid_answer_resumes_its_grammar(tmp_path):
    """A KV pool so small that requests are preempted and recomputed: each constrained answer goes on from where
    its grammar was (not from the grammar's start), and is the answer it gets with room to spare."""
    lm = factories.tiny_lm_loaded(tmp_path, "layers")
    block_bytes = 4 * 2 * lm.config.n_layers * lm.config.kv_heads * lm.config.d_head * 4
    prompts = [lm.tokenizer.encode(t)[:12] for t in cycle_prompts(6, seed=7)]

    def engine(**kw) -> GenerationEngine:
        e = GenerationEngine("lm", lm, metrics=Metrics(), async_scheduling="off",
                             **({"max_slots": 6, "max_queue": 64, "max_model_len": 96, "timeout_s": 120.0,
                                 "kv_block_size": 4} | kw))
        e.start()
        return e

    roomy = engine()
    grammar = roomy.runner.grammars.compile(Constraint("regex", "[0-9]{2,6}( [a-z]{1,5}){2,12}"))
    jobs = [(p, SamplingParams(max_tokens=40, temperature=1.0, seed=i, grammar=grammar)) for i, p in enumerate(prompts)]
    expected = streamed(roomy, jobs)
    small = engine(kv_cache_budget=(20 * block_bytes, None))
    jobs = [(p, SamplingParams(**{**vars(sp), "grammar": small.runner.grammars.compile(grammar.constraint)}))
            for p, sp in jobs]
    got = streamed(small, jobs)
    assert small.m.preemptions._value.get() > 0
    assert got == expected
    assert all(re.fullmatch(r"[0-9]{2,6}( [a-z]{1,5}){0,12}( [a-z]{0,5})?", text) for _, text in got), got


def test_two_models_with_different_vocabularies_each_compile_their_own_grammar(lms):  # noqa: F811
    """The compiled-grammar cache is one model's: the same schema on a byte-level BPE and a SentencePiece model
    gives each a grammar over its own vocabulary, and each model's constrained answers parse."""
    schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
                         "required": ["n"], "additionalProperties": False})
    for first, second in (("qwen2", "mistral"), ("mistral", "gpt2")):
        a, b = lms[first].grammar("json", schema), lms[second].grammar("json", schema)
        assert a is not b
        for kind in (first, second):
            lm = lms[kind]
            answers = lm.generate(lm.prompts(6, seed=5), [SamplingParams(max_tokens=24, temperature=1.0, seed=i,
                                  grammar=lm.grammar("json", schema)) for i in range(6)])
            stopped = [text for text, reason in answers if reason == "stop"]
            assert stopped, (kind, answers)
            for text in stopped:
                assert 0 <= json.loads(text)["n"] <= 99, (kind, text)
