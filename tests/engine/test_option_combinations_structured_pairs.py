"""Structured output beside another feature in the same request or batch: a checkpoint whose generation_config names
several eos ids (every one of them ends a constrained answer where its grammar may end, whichever a bias or the
model favours, min_tokens holding each back alike), and one batch of requests with different grammars and
different options (logprobs, penalties, a bias towards a token the grammar forbids, min_tokens, a stop string cutting
inside a constrained answer, seeded sampling with top-p / top-k) beside free rows, in the synchronous and the
overlapped engine. References: the grammar's own statement (the regex, the schema, the choices), and each request
run alone."""

from __future__ import annotations

import json
import re

import pytest

from tests.helpers import factories
from tests.helpers.fixture_training import cycle_prompts
from tests.helpers.sampling_options import events
from tests.model.test_structured_output import allowed_ids
from tserve.model import checkpoint
from tserve.model.decoding import DecoderRunner, SamplingParams, generate
from tserve.model.decoding.structured import Constraint, masks_for
from tserve.service.engine import GenerationEngine
from tserve.service.metrics import Metrics

MAY_GO_ON = "[a-z ]{1,40}"  # complete after one letter, yet open to forty


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """The Qwen2 fixture: its generation_config ends generation at two ids, the tokenizer's eos and another."""
    lm = checkpoint.load(factories.hf_family_dir("qwen2", tmp_path_factory.mktemp("qwen2")), device="cpu")
    eos_ids = list(lm.generation.eos_token_ids)
    assert len(eos_ids) == 2 and lm.tokenizer.eos_id in eos_ids, eos_ids
    return lm


@pytest.fixture(scope="module")
def runner(qwen2):
    return DecoderRunner(qwen2, num_slots=8, cuda_graphs=False)


def _prompt(lm) -> list[int]:  # noqa: ANN001
    return lm.tokenizer.encode("the quick")[:10]


# --------------------------------------------------------------------------------------------------
# Several eos ids
# --------------------------------------------------------------------------------------------------
def test_every_eos_id_is_allowed_exactly_where_the_grammar_may_end(qwen2, runner):
    """The grammar's mask knows each of the checkpoint's eos ids as an end: none before the regex can match, all
    of them once it can (not only the tokenizer's own eos, nor only the first of the list)."""
    state = runner.grammars.compile(Constraint("regex", MAY_GO_ON)).matcher()
    eos_ids = set(qwen2.generation.eos_token_ids)
    before = allowed_ids(masks_for([state], runner.vocab_size), runner.vocab_size)
    assert not before & eos_ids and before
    state.advance(qwen2.tokenizer.encode(" a", add_special_tokens=False)[0])
    after = allowed_ids(masks_for([state], runner.vocab_size), runner.vocab_size)
    assert eos_ids <= after, (sorted(eos_ids), sorted(after & eos_ids))


def test_a_bias_towards_any_eos_id_ends_a_constrained_answer_where_it_may_end_and_min_tokens_holds_each_back(qwen2,
                                                                                                              runner):
    """A +100 bias on one of the eos ids makes it the choice wherever the grammar allows an end: the answer ends
    (finish "stop", that id chosen) after its first token, for either id, batched together or alone. min_tokens
    holds the end back to its count for either id; a free row beside them keeps the answer it has alone."""
    grammar = runner.grammars.compile(Constraint("regex", MAY_GO_ON))
    prompt = _prompt(qwen2)
    params = []
    for eos in sorted(qwen2.generation.eos_token_ids):
        params += [SamplingParams(max_tokens=12, temperature=0.0, grammar=grammar, logit_bias={eos: 100.0}),
                   SamplingParams(max_tokens=12, temperature=0.0, grammar=grammar, logit_bias={eos: 100.0},
                                  min_tokens=3),
                   SamplingParams(max_tokens=12, temperature=1.0, seed=4, top_p=0.9, grammar=grammar,
                                  logit_bias={eos: 100.0}, min_tokens=2)]
    params.append(SamplingParams(max_tokens=12, temperature=0.0, grammar=grammar))  # no bias: the grammar's answer

    def outcome(seqs) -> list[tuple]:  # noqa: ANN001
        return [(s.generated, s.finish_reason, s.next_token) for s in seqs]

    together = outcome(generate(qwen2, [prompt] * len(params), params, runner=runner))
    alone = [outcome(generate(qwen2, [prompt], [sp], runner=runner))[0] for sp in params]
    assert together == alone
    for sp, (tokens, finish, last) in zip(params, together, strict=True):
        text = qwen2.tokenizer.decode(tokens)
        assert re.fullmatch(MAY_GO_ON, text), text
        if sp.logit_bias:
            (eos,) = sp.logit_bias
            assert (len(tokens), finish, last) == (max(1, sp.min_tokens), "stop", eos), (sp, tokens, finish, last)
    assert len(together[-1][0]) > 3  # unbiased, the model writes on: the bias is what ends the others early


# --------------------------------------------------------------------------------------------------
# Different grammars and options in one batch of the engine
# --------------------------------------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"w": {"type": "string", "maxLength": 10},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["w", "n"], "additionalProperties": False}
CHOICES = ["ja", "nein", "vielleicht"]
YES_NO = 'root ::= "yes" | "no" | "maybe " [a-z]+'
DIGITS = "[0-9]{2,6}( [a-z]{1,5}){0,3}"


def _engine(lm, mode: str) -> GenerationEngine:  # noqa: ANN001
    engine = GenerationEngine("lm", lm, metrics=Metrics(), async_scheduling=mode,
                              **{"max_slots": 12, "max_queue": 64, "max_model_len": 128, "timeout_s": 120.0,
                                 "kv_block_size": 4})
    engine.start()
    return engine


def _jobs(lm, engine: GenerationEngine) -> list[tuple[str, list[int], SamplingParams]]:  # noqa: ANN001
    """Five grammars and two free rows, most with another option; `check` names the rule its answer follows."""
    compile_ = engine.runner.grammars.compile
    schema = compile_(Constraint("json", json.dumps(SCHEMA)))
    choice, yes_no = compile_(Constraint("choice", json.dumps(CHOICES))), compile_(Constraint("grammar", YES_NO))
    digits, letters = compile_(Constraint("regex", DIGITS)), compile_(Constraint("regex", MAY_GO_ON))
    capital = lm.tokenizer.encode("Hallo", add_special_tokens=False)[0]  # "H": forbidden by the digits' grammar
    eos_ids = sorted(lm.generation.eos_token_ids)
    prompts = [lm.tokenizer.encode(t)[:10] for t in cycle_prompts(3, seed=41)]
    rows = [
        ("json", SamplingParams(max_tokens=40, temperature=0.0, logprobs=3, grammar=schema)),
        ("json cut", SamplingParams(max_tokens=40, temperature=1.0, seed=2, stop=['","', ',"n'], grammar=schema)),
        ("choice", SamplingParams(max_tokens=12, temperature=1.3, seed=5, top_k=3, logprobs=2, grammar=choice)),
        ("yes/no", SamplingParams(max_tokens=12, temperature=0.0, presence_penalty=1.5, frequency_penalty=0.5,
                                  grammar=yes_no)),
        ("yes/no", SamplingParams(max_tokens=12, temperature=0.0, grammar=yes_no)),  # greedy, nothing else
        ("digits", SamplingParams(max_tokens=16, temperature=0.0, logit_bias={capital: 100.0}, grammar=digits)),
        ("digits", SamplingParams(max_tokens=16, temperature=1.2, seed=7, top_p=0.8, grammar=digits)),
        ("letters", SamplingParams(max_tokens=16, temperature=0.0, min_tokens=4, logit_bias={eos_ids[-1]: 100.0},
                                   grammar=letters)),
        ("letters", SamplingParams(max_tokens=16, temperature=0.0, min_tokens=2, logit_bias={eos_ids[0]: 100.0},
                                   grammar=letters)),
        ("free", SamplingParams(max_tokens=12, temperature=0.0, logprobs=3)),
        ("free", SamplingParams(max_tokens=12, temperature=0.9, seed=3, top_p=0.9)),
    ]
    return [(check, prompts[i % len(prompts)], sp) for i, (check, sp) in enumerate(rows)]


def _follows(check: str, text: str, finish: str) -> bool:
    if finish != "stop" or check == "free":
        return True
    if check == "json":
        value = json.loads(text)
        return set(value) == {"w", "n"} and len(value["w"]) <= 10 and 0 <= value["n"] <= 999
    if check == "json cut":  # a stop string cuts it inside the object: what is left is the schema's beginning
        return text.startswith('{"w":"') and '","' not in text and ',"n' not in text
    if check == "letters":
        return bool(re.fullmatch(MAY_GO_ON, text))
    pattern = {"choice": "|".join(CHOICES), "yes/no": "yes|no|maybe [a-z]+", "digits": DIGITS}[check]
    return bool(re.fullmatch(pattern, text))


@pytest.mark.parametrize("mode", ["off", "on"])
def test_requests_with_different_grammars_and_options_in_one_batch_each_get_what_they_get_alone(qwen2, mode):
    """Every request of a mixed batch (five grammars, most rows with another option, and free rows) streams the
    events it streams alone; each constrained answer follows its own grammar (so each row had its own mask and
    state); the bias towards a token the grammar forbids never brings it in; min_tokens holds back the eos id a
    bias favours until its count, then that id ends the answer."""
    engine = _engine(qwen2, mode)
    jobs = _jobs(qwen2, engine)
    together = events(engine, [(p, sp) for _, p, sp in jobs])
    alone = [events(_engine(qwen2, mode), [(p, sp)])[0] for _, p, sp in jobs]  # the same compiled grammars
    for (check, _, sp), got, want in zip(jobs, together, alone, strict=True):
        assert got == want, (check, sp)
        _, tokens, finish = got[-1]
        text = "".join(e[0] for e in got[:-1])
        assert _follows(check, text, finish), (check, text, finish)
        if check == "digits" and sp.logit_bias:
            assert next(iter(sp.logit_bias)) not in tokens, tokens
        if check == "letters":
            assert (len(tokens), finish) == (sp.min_tokens, "stop"), (sp, tokens, finish)
    finishes = {got[-1][2] for got in together}
    assert "stop" in finishes and len({str(e) for e in together}) == len(together)  # the options tell rows apart
    assert any(got[-1][2] == "stop" for (check, _, _), got in zip(jobs, together, strict=True) if check == "json")

