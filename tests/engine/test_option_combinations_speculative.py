"""Speculative decoding where its options meet: prompt-lookup drafts and a draft model at 1, 4 and 16 draft tokens
against max_tokens reached inside a draft, a row at the context's end beside rows that draft, exactly as many rows
as `--speculative-max-rows`, a draft model whose own context is shorter than the served model's, steps padded to a
bucket as the batch shrinks, and the serve flags (`--num-speculative-tokens`, `--speculative-max-rows`, the
prompt-lookup sizes, `--async-scheduling on`, `--draft-model`) with the metrics they report. In every case the output
is the one decoding without speculation gives."""

from __future__ import annotations

import pytest

from tests.engine.test_speculative import mixed_prompts
from tests.helpers import factories
from tests.helpers.fixture_training import CYCLE_TEXT
from tests.helpers.in_process import InProcessApp
from tests.helpers.one_request import lm_tokens
from tserve.model import checkpoint
from tserve.model.cuda_graphs import DecodeAhead
from tserve.model.decoding import DecoderRunner, SamplingParams, Speculation, generate

KINDS = ["ngram", "draft-model"]


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    return factories.tiny_lm_dir(tmp_path_factory.mktemp("lm"))


@pytest.fixture(scope="module")
def lm(lm_dir):
    return checkpoint.load(lm_dir, device="cpu")


@pytest.fixture(scope="module")
def twin(lm_dir):
    """The served model's own weights loaded apart, as a draft model: its greedy drafts are all kept."""
    return checkpoint.load(lm_dir, device="cpu")


def runner_for(lm, twin, kind: str, rows: int, **settings) -> DecoderRunner:  # noqa: ANN001
    return DecoderRunner(lm, num_slots=rows, cuda_graphs=False, speculation=Speculation(**settings),
                         draft=twin if kind == "draft-model" else None)


def cycle_prompt(lm, start: int) -> list[int]:  # noqa: ANN001
    """A piece of the cycle that repeats its own beginning: lookups find the model's continuation."""
    words = CYCLE_TEXT.split()
    return lm.tokenizer.encode(" ".join(words[start:start + 16] + words[start:start + 10]))


@pytest.mark.parametrize("num_tokens", [1, 4, 16])
@pytest.mark.parametrize("kind", KINDS)
def test_drafts_stay_within_num_speculative_tokens_and_the_tokens_max_tokens_leaves(lm, twin, kind, num_tokens):
    """A draft is at most `num_tokens` long and never longer than the tokens a request may still write after the
    step's own (max_tokens is reached inside a draft, not past it): tokens past it would be scored, counted as
    proposed and accepted, and written into blocks for nothing. The output is the plain one."""
    prompts = [cycle_prompt(lm, a) for a in (8, 16, 36)]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (3, 7, 20)]
    runner = runner_for(lm, twin, kind, 3, num_tokens=num_tokens)
    seen: list[tuple[int, int]] = []
    drafts = runner.drafts

    def recorded(seqs):  # noqa: ANN001, ANN202
        out = drafts(seqs)
        seen.extend((len(d), s.params.max_tokens - s.num_generated - 1) for s, d in zip(seqs, out, strict=True))
        return out

    runner.drafts = recorded
    fast = generate(lm, prompts, params, runner=runner, max_batch=3)
    assert [s.generated for s in fast] == [s.generated for s in generate(lm, prompts, params)]
    assert any(n for n, _ in seen), "the requests draft"
    assert all(n <= min(num_tokens, left) for n, left in seen), (num_tokens, seen)
    assert sum(s.accepted for s in fast) <= sum(len(s.generated) - 1 for s in fast)


@pytest.mark.parametrize("kind", KINDS)
def test_as_many_rows_as_speculative_max_rows_still_draft(lm, twin, kind):
    """`--speculative-max-rows N`: a step of N rows drafts; one of N + 1 does not."""
    prompts = mixed_prompts(lm, 4)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain = [s.generated for s in generate(lm, prompts[:3], params)]
    at_limit = generate(lm, prompts[:3], params, runner=runner_for(lm, twin, kind, 3, max_rows=3), max_batch=3)
    assert [s.generated for s in at_limit] == plain
    assert all(s.drafted > 0 for s in at_limit), [s.drafted for s in at_limit]
    beyond = generate(lm, prompts, params, runner=runner_for(lm, twin, kind, 4, max_rows=3), max_batch=4)
    assert sum(s.drafted for s in beyond) == 0


@pytest.mark.parametrize("kind", KINDS)
def test_a_row_at_the_context_end_beside_rows_that_draft_writes_what_it_writes_alone(lm, twin, kind):
    """A step's rows are padded to its longest draft: a row a few positions from the end of the model's context
    (128 positions, learned) runs beside rows that draft 4 tokens, so every draft is cut to what that row holds,
    and its padding never feeds a position the model has none for."""
    long_prompt = lm.tokenizer.encode(" ".join(CYCLE_TEXT.split() * 3))[:116]
    words = CYCLE_TEXT.split()
    prompts = [long_prompt, *(lm.tokenizer.encode(" ".join(words[a:a + 8] + words[a:a + 5])) for a in (8, 36))]
    params = [SamplingParams(max_tokens=128 - 116, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0.9, seed=4, ignore_eos=True)]
    fast = generate(lm, prompts, params, runner=runner_for(lm, twin, kind, 3, num_tokens=4), max_batch=3)
    assert [s.generated for s in fast] == [s.generated for s in generate(lm, prompts, params)]
    assert fast[0].finish_reason == "length" and len(fast[0].prompt_ids) + len(fast[0].generated) == 128
    assert sum(s.drafted for s in fast[1:]) > 0


def test_a_draft_model_with_a_shorter_context_drafts_only_inside_it(lm, tmp_path):
    """A draft model of the same vocabulary whose context (48 positions, learned) is shorter than the served
    model's: it drafts while the sequence fits in its own context, and the request goes on past it without
    drafts, with the served model's own tokens."""
    short = checkpoint.load(factories.tiny_lm_dir(tmp_path / "short", trained=False, max_seq_len=48), device="cpu")
    words = CYCLE_TEXT.split()
    prompts = [lm.tokenizer.encode(" ".join(words[a:a + 6] + words[a:a + 3])) for a in (8, 36)]
    assert all(len(p) < 40 for p in prompts)
    params = [SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=60, temperature=1.0, seed=2, ignore_eos=True)]
    runner = DecoderRunner(lm, num_slots=2, cuda_graphs=False, speculation=Speculation(num_tokens=4), draft=short)
    assert runner.drafter.max_len == 48
    fast = generate(lm, prompts, params, runner=runner, max_batch=2)
    assert [s.generated for s in fast] == [s.generated for s in generate(lm, prompts, params)]
    assert all(len(s.prompt_ids) + len(s.generated) > 48 for s in fast)
    assert sum(s.drafted for s in fast) > 0


def test_steps_padded_to_a_bucket_as_the_batch_shrinks_give_the_plain_output(lm):
    """Speculative steps at the captured width and batch bucket (`DecodeAhead`, eager here) while requests of
    different lengths finish one by one: four rows, then three padded to the bucket of four, then two. A padding
    row feeds the spare row, never what a row of an earlier, larger step fed."""
    prompts = [cycle_prompt(lm, a) for a in (8, 16, 36, 3)]
    params = [SamplingParams(max_tokens=6 + 4 * i, temperature=0.0, ignore_eos=True) for i in range(len(prompts))]
    runner = DecoderRunner(lm, num_slots=4, cuda_graphs=False, speculation=Speculation(num_tokens=4))
    runner.graphed_ahead = DecodeAhead(lm.model, runner.cache, width=5, max_rows=4,  # buckets 1, 2, 4
                                       max_positions=lm.config.max_seq_len, use_graphs=False)
    fed_rows: list[list[int]] = []
    step = runner.graphed_ahead.bucketed.step
    runner.graphed_ahead.bucketed.step = lambda *inputs: fed_rows.append(inputs[2].tolist()) or step(*inputs)
    fast = generate(lm, prompts, params, runner=runner, max_batch=4)
    assert [s.generated for s in fast] == [s.generated for s in generate(lm, prompts, params)]
    padded = [rows for rows in fed_rows if len(rows) == 4 and rows.count(runner.cache.num_rows)]
    assert padded, fed_rows  # some steps ran three rows padded with the spare row
    assert all(len(set(rows) - {runner.cache.num_rows}) == len([r for r in rows if r != runner.cache.num_rows])
               for rows in fed_rows), fed_rows  # no row fed twice in one step


def test_serve_flags_reach_the_engine_and_prompt_lookup_answers_what_plain_decoding_gives(lm_dir, lm):
    """`--speculative ngram --num-speculative-tokens 16 --speculative-max-rows 7 --prompt-lookup-min 5
    --prompt-lookup-max 2 --async-scheduling on`: the engine drafts with those settings (the shortest lookup
    held to the longest), and a completion is the plain one."""
    served = InProcessApp({"lm": lm_dir}, speculative="ngram", num_speculative_tokens=16, speculative_max_rows=7,
                          prompt_lookup_min=5, prompt_lookup_max=2, async_scheduling="on")
    try:
        engine = served.registry.models["lm"].engine
        assert engine.runner.speculation == Speculation(num_tokens=16, max_ngram=2, min_ngram=2, max_rows=7)
        prompt = " ".join(CYCLE_TEXT.split()[8:24] + CYCLE_TEXT.split()[8:18])
        body = {"model": "lm", "prompt": prompt, "max_tokens": 12, "temperature": 0}
        choice = served.post("/v1/completions", body).json()["choices"][0]
        expected = lm_tokens(lm, lm.tokenizer.encode(prompt), SamplingParams(max_tokens=12, temperature=0.0),
                             with_eos=False)
        assert choice["text"] == lm.tokenizer.decode(expected)
        assert served.app.state.metrics.registry.get_sample_value("tserve_speculative_draft_tokens_total",
                                                                  {"model": "lm"}) > 0
    finally:
        served.stop()


def test_a_draft_models_step_metrics_count_each_token_of_the_step_once(lm_dir, lm, tmp_path):
    """`--draft-model` with the served model's weights and 16 draft tokens, max_tokens 6: the first token comes
    from the prompt's step, the other five from one speculative step (four kept drafts and the model's own). The
    tokens-per-step histogram counts those five; proposed and accepted counts are the four the request could
    write, not sixteen. Cut by a stop string, a step counts the tokens the request took, not the drafts after."""
    served = InProcessApp({"lm": lm_dir}, draft_model=str(factories.tiny_lm_dir(tmp_path / "draft")),
                          num_speculative_tokens=16)
    try:
        prompt = " ".join(CYCLE_TEXT.split()[8:24] + CYCLE_TEXT.split()[8:18])
        body = {"model": "lm", "prompt": prompt, "max_tokens": 6, "temperature": 0}
        answer = served.post("/v1/completions", body).json()
        expected = lm_tokens(lm, lm.tokenizer.encode(prompt), SamplingParams(max_tokens=6, temperature=0.0),
                             with_eos=False)
        assert answer["choices"][0]["text"] == lm.tokenizer.decode(expected)
        assert answer["choices"][0]["finish_reason"] == "length"

        def metric(name: str) -> float:
            return served.app.state.metrics.registry.get_sample_value(name, {"model": "lm"}) or 0.0

        tokens = answer["usage"]["completion_tokens"]
        assert tokens == 6
        assert metric("tserve_speculative_tokens_per_step_sum") == tokens - 1
        assert metric("tserve_speculative_tokens_per_step_count") == 1
        assert metric("tserve_speculative_draft_tokens_total") == metric("tserve_speculative_accepted_tokens_total") \
            == tokens - 2
        # A stop string at the third token: the step's kept drafts after it are not output, nor counted as taken
        stop = lm.tokenizer.decode(expected[2:3])
        assert stop.strip() and lm.tokenizer.decode(expected).find(stop) == len(lm.tokenizer.decode(expected[:2]))
        cut = served.post("/v1/completions", body | {"stop": [stop]}).json()
        assert cut["choices"][0]["finish_reason"] == "stop" and cut["usage"]["completion_tokens"] == 3
        assert metric("tserve_speculative_tokens_per_step_sum") == tokens - 1 + 2  # tokens 2 and 3, both drafts
        assert metric("tserve_speculative_accepted_tokens_total") == tokens - 2 + 2
    finally:
        served.stop()
