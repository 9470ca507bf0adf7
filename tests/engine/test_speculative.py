"""Speculative decoding with prompt-lookup drafts (`--speculative ngram`): greedy output identical to decoding
without it, in the one-request path and in the engine beside other requests; sampled output from the model's
own distribution (a two-sample chi-square test at a stated significance, at a temperature where most drafts
are rejected) and, seeded, the very tokens decoding without speculation draws; drafting paused where drafts
fail."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from tests.helpers import factories
from tests.helpers.fixture_training import CYCLE_TEXT, cycle_prompts
from tests.helpers.one_request import lm_tokens
from tests.helpers.sampling_options import events, option_matrix, streamed
from tserve.model import checkpoint
from tserve.model.cuda_graphs import DecodeAhead
from tserve.model.decoding import DecoderRunner, SamplingParams, Speculation, TextSequence, generate
from tserve.model.decoding.speculative import JUDGED_EVERY, PAUSE_TOKENS, NgramIndex
from tserve.service.engine import GenerationEngine
from tserve.service.metrics import Metrics

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels

SIGNIFICANCE = 1e-3  # of each chi-square test (Bonferroni-split over the positions compared)


@pytest.fixture(scope="module", params=list(factories.LM_LOADS))
def lm(request, tmp_path_factory):
    """The tiny LM as each of `factories.LM_LOADS` loads it: speculative steps then verify drafts by layers beside
    one-token steps that run fused."""
    return factories.tiny_lm_loaded(tmp_path_factory.mktemp("lm"), request.param)


def mixed_prompts(lm, n: int) -> list[list[int]]:  # noqa: ANN001
    """Prompts whose context holds the cycle's words in a shuffled order, then a piece of the cycle: lookups
    find both continuations the model agrees with and ones it does not."""
    words = CYCLE_TEXT.split()
    out = []
    for i, tail in enumerate(cycle_prompts(n, seed=5, min_words=4, max_words=10)):
        rng = random.Random(i)
        start = rng.randrange(len(words) - 12)
        shuffled = words[start:start + 12]
        rng.shuffle(shuffled)
        out.append(lm.tokenizer.encode(" ".join(shuffled) + " " + tail))
    return out


def speculative_runner(lm, rows: int, **settings) -> DecoderRunner:  # noqa: ANN001
    return DecoderRunner(lm, num_slots=rows, cuda_graphs=False, speculation=Speculation(**settings))


def test_a_draft_is_what_followed_the_latest_occurrence_of_the_longest_suffix():
    index = NgramIndex(1, 3)
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3]
    # suffix (2, 3) last occurred ending at position 7 (followed by 7, 5, ...); (9, 2, 3) never did
    assert index.draft(tokens, 3) == [7, 5, 2]
    tokens += [8]
    assert index.draft(tokens, 2) == []  # 8 never occurred before
    tokens += [1]  # suffix (8, 1) unseen, (1,) last ended at position 5: followed by 2, 3
    assert index.draft(tokens, 4) == [2, 3, 7, 5]
    assert NgramIndex(1, 1).draft([4, 4, 4], 5) == [4]  # the continuation ends where the sequence does


def _draft_by_search(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The same rule by a search of the whole sequence: the longest suffix of min_n..max_n tokens that occurred
    earlier, and what followed its latest earlier occurrence."""
    for n in range(max_n, min_n - 1, -1):
        ends = [end for end in range(n, len(tokens)) if tokens[end - n:end] == tokens[len(tokens) - n:]]
        if len(tokens) >= n and ends:
            return tokens[ends[-1]:ends[-1] + k]
    return []


def test_a_draft_from_the_index_kept_up_to_date_equals_one_from_a_search_of_the_sequence():
    rng = random.Random(3)
    for min_n, max_n in ((1, 3), (2, 2), (2, 4)):
        index, tokens = NgramIndex(min_n, max_n), []
        for _ in range(120):  # one token, sometimes several, between drafts, as a sequence grows
            tokens += [rng.randrange(4) for _ in range(rng.choice((1, 1, 3)))]
            assert index.draft(tokens, 3) == _draft_by_search(tokens, 3, min_n, max_n), (min_n, max_n, tokens)


def test_greedy_output_is_identical_with_speculation_and_drafts_are_both_kept_and_rejected(lm):
    prompts = mixed_prompts(lm, 12)
    params = [SamplingParams(max_tokens=8 + 3 * i, temperature=0.0) for i in range(len(prompts))]
    plain = generate(lm, prompts, params)
    assert sum(s.drafted for s in plain) == 0  # a runner without speculation drafts nothing
    fast = generate(lm, prompts, params, runner=speculative_runner(lm, 4, num_tokens=4), max_batch=4)
    assert [s.generated for s in fast] == [s.generated for s in plain]
    assert [s.finish_reason for s in fast] == [s.finish_reason for s in plain]
    drafted, kept = sum(s.drafted for s in fast), sum(s.accepted for s in fast)
    assert 0 < kept < drafted, (kept, drafted)


def test_steps_padded_to_the_captured_width_and_bucket_give_the_same_output(lm, monkeypatch):
    """The speculative step that CUDA graphs replay (`DecodeAhead`: every row fed 1 + num_tokens positions, the
    batch padded with the spare row), eager here: greedy output equals decoding without speculation. Steps whose
    padding would pass the last position it allows run unpadded, and give the same too."""
    prompts = mixed_prompts(lm, 6)
    params = [SamplingParams(max_tokens=10 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(len(prompts))]
    plain = generate(lm, prompts, params)
    runner = speculative_runner(lm, 3, num_tokens=4)
    runner.graphed_ahead = DecodeAhead(lm.model, runner.cache, width=5, max_rows=4,  # buckets 1, 2, 4
                                       max_positions=max(map(len, prompts)) + 4, use_graphs=False)
    shapes, calls = [], []
    padded = runner.graphed_ahead.bucketed.step
    runner.graphed_ahead.bucketed.step = lambda *inputs: shapes.append(tuple(inputs[0].shape)) or padded(*inputs)
    eager = lm.model.decode_tokens
    monkeypatch.setattr(lm.model, "decode_tokens", lambda *a, **kw: calls.append(1) or eager(*a, **kw))
    fast = generate(lm, prompts, params, runner=runner, max_batch=3)
    assert [s.generated for s in fast] == [s.generated for s in plain]
    assert sum(s.accepted for s in fast) > 0
    assert (4, 5) in shapes and set(shapes) <= {(1, 5), (2, 5), (4, 5)}, set(shapes)  # 3 rows: one spare
    assert len(calls) > len(shapes) > 0  # some steps padded, some (near the limit) not


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma3", "phi3"])
def test_families_with_sliding_windows_write_with_drafts_what_they_write_without(tmp_path, family):
    """A draft's tokens attend through the sliding layers' masks (Gemma 3: 16 positions on its first layer; Phi-3:
    48 on both, a rotary half-head), prompts and replies past the window: greedy and seeded sampling the same."""
    model = checkpoint.load(factories.hf_family_dir(family, tmp_path / family), device="cpu")
    prompts = mixed_prompts(model, 6)
    params = [SamplingParams(max_tokens=40, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    plain = generate(model, prompts, params)
    fast = generate(model, prompts, params, runner=speculative_runner(model, 3, num_tokens=4), max_batch=3)
    assert [s.generated for s in fast] == [s.generated for s in plain]
    assert sum(s.drafted for s in fast) > 0


def make_engine(lm, **kw) -> GenerationEngine:  # noqa: ANN001
    engine = GenerationEngine("lm", lm, max_slots=8, max_queue=64, max_model_len=None, timeout_s=60.0,
                              metrics=Metrics(), **kw)
    engine.start()
    return engine


def test_the_engine_streams_what_plain_greedy_decoding_gives(lm):
    """Five requests at once (drafting) with stop strings, logprobs and different lengths: every token, text
    and logprob equals decoding without speculation; the metrics count drafts and kept tokens. The last
    request follows the cycle (its drafts are kept) and stops at a word in the middle of a kept draft."""
    words = CYCLE_TEXT.split()[8:24]  # the cycle model continues its last 10 words as they went on before
    cycle = lm.tokenizer.encode(" ".join(words + words[:10]))
    prompts = [*mixed_prompts(lm, 4), cycle]
    params = [SamplingParams(max_tokens=20, temperature=0.0, logprobs=2),
              SamplingParams(max_tokens=30, temperature=0.0, stop=["Hallo W"]),
              SamplingParams(max_tokens=7, temperature=0.0),
              SamplingParams(max_tokens=25, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.0, stop=["world"])]
    spec_engine = make_engine(lm, speculation=Speculation(num_tokens=4, max_rows=8))
    plain_engine = make_engine(lm)
    fast = streamed(spec_engine, list(zip(prompts, params, strict=True)))
    plain = streamed(plain_engine, list(zip(prompts, params, strict=True)))
    assert fast == plain
    # Tokens counted once each: none past a request's end (a stop string or eos among its kept draft).
    assert spec_engine.m.generated_tokens._value.get() == plain_engine.m.generated_tokens._value.get()
    ids, text = fast[1]
    assert "Hallo W" not in text and "Hallo" in text and len(ids) < 30  # the stop string cut it
    assert fast[4][1] == " Hello "
    for p, sp, (ids, _) in zip(prompts, params, fast, strict=True):
        if not sp.stop:
            assert ids == lm_tokens(lm, p, sp, with_eos=False)
    m = spec_engine.m
    assert m.spec_accepted._value.get() > 0 and m.spec_drafted._value.get() > m.spec_accepted._value.get()


def _chi_square_p(a: Counter, b: Counter) -> float:
    """Two-sample chi-square test of homogeneity; categories with fewer than 10 draws in both samples pooled."""
    keys = [k for k in set(a) | set(b) if a[k] + b[k] >= 10]
    rest = [sum(c[k] for k in c if k not in keys) for c in (a, b)]
    table = torch.tensor([[a[k] for k in keys] + [rest[0]], [b[k] for k in keys] + [rest[1]]], dtype=torch.float64)
    table = table[:, table.sum(0) > 0]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    statistic = ((table - expected) ** 2 / expected).sum()
    dof = table.size(1) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2))


@pytest.mark.slow  # 6 s of draws; its planted bug is caught by two tests that `make test` runs too
def test_sampled_tokens_have_the_models_distribution():
    """Temperature 2 on the cycle model: drafts from the cycle are mostly rejected (about 30% kept), so both
    kept drafts and rejections decide tokens. 3,000 draws with speculation and 3,000 without, seeded apart
    (seeds 0.. and 10^6..): each of tokens 2-4 has the same distribution (chi-square, p > 1e-3 / 3 each)."""
    import tempfile
    from pathlib import Path

    lm = checkpoint.load(factories.tiny_lm_dir(Path(tempfile.mkdtemp())), device="cpu")
    n, prompt = 3000, lm.tokenizer.encode(cycle_prompts(1, seed=2, min_words=12, max_words=12)[0])
    prompt = prompt + prompt[:6]

    def draws(runner: DecoderRunner | None, seed0: int) -> list[list[int]]:
        params = [SamplingParams(max_tokens=4, temperature=2.0, seed=seed0 + i, ignore_eos=True) for i in range(n)]
        return [s.generated for s in generate(lm, [prompt] * n, params, runner=runner, max_batch=n)], runner

    spec_runner = speculative_runner(lm, n, num_tokens=3, max_rows=n)
    fast, _ = draws(spec_runner, 0)
    plain, _ = draws(None, 10**6)
    for position in (1, 2, 3):
        p = _chi_square_p(Counter(g[position] for g in fast), Counter(g[position] for g in plain))
        assert p > SIGNIFICANCE / 3, (position, p)


def test_acceptance_of_the_sampled_fixture_leaves_both_branches_in_use():
    """The statistical test means something only if drafts are both kept and rejected often."""
    import tempfile
    from pathlib import Path

    lm = checkpoint.load(factories.tiny_lm_dir(Path(tempfile.mkdtemp())), device="cpu")
    prompt = lm.tokenizer.encode(cycle_prompts(1, seed=2, min_words=12, max_words=12)[0])
    prompt = prompt + prompt[:6]
    params = [SamplingParams(max_tokens=4, temperature=2.0, seed=i, ignore_eos=True) for i in range(400)]
    out = generate(lm, [prompt] * 400, params, runner=speculative_runner(lm, 400, num_tokens=3, max_rows=400),
                   max_batch=400)
    drafted, kept = sum(s.drafted for s in out), sum(s.accepted for s in out)
    assert drafted > 400 and 0.15 < kept / drafted < 0.7, (kept, drafted)


def test_seeded_sampled_requests_draw_what_they_draw_without_speculation():
    """A sampled row draws each token as plain decoding does and keeps the draft while the draws agree: with a
    seed, the same tokens with speculation or without, whether a step drafts (within the row limit) or not."""
    import tempfile
    from pathlib import Path

    lm = checkpoint.load(factories.tiny_lm_dir(Path(tempfile.mkdtemp())), device="cpu")
    prompt = lm.tokenizer.encode(cycle_prompts(1, seed=2, min_words=12, max_words=12)[0])
    prompt = prompt + prompt[:6]
    params = [SamplingParams(max_tokens=10, temperature=1.5, seed=100 + i, ignore_eos=True) for i in range(40)]
    plain = generate(lm, [prompt] * 40, params, max_batch=40)
    fast = generate(lm, [prompt] * 40, params, runner=speculative_runner(lm, 40, num_tokens=3, max_rows=40),
                    max_batch=40)
    assert [s.generated for s in fast] == [s.generated for s in plain]
    drafted, kept = sum(s.drafted for s in fast), sum(s.accepted for s in fast)
    assert 0 < kept < drafted, (kept, drafted)
    beyond = generate(lm, [prompt] * 40, params, runner=speculative_runner(lm, 40, num_tokens=3, max_rows=4),
                      max_batch=40)
    assert [s.generated for s in beyond] == [s.generated for s in plain]
    assert 0 < sum(s.drafted for s in beyond) < drafted  # the first row alone drafts (the rest read its prefix later)


def test_drafting_pauses_after_mostly_rejected_drafts_and_resumes_later():
    spec = Speculation(min_acceptance=0.5)

    class Seq:
        params, grammar = SamplingParams(temperature=0.0), None
        num_generated = 10
        recent_drafted, recent_accepted, resume_at = JUDGED_EVERY, JUDGED_EVERY // 4, 0

    seq = Seq()
    assert not spec.drafting(seq)  # a quarter kept: paused
    assert seq.resume_at == 10 + PAUSE_TOKENS and seq.recent_drafted == 0
    seq.num_generated += PAUSE_TOKENS
    assert spec.drafting(seq)
    seq.recent_drafted, seq.recent_accepted = JUDGED_EVERY, JUDGED_EVERY // 2
    assert spec.drafting(seq)  # half kept: goes on
    seq.params = SamplingParams(temperature=0.0, presence_penalty=0.5)
    assert not spec.drafting(seq)  # a penalty's scores depend on the tokens before: never drafted for


def test_a_speculative_step_records_what_each_row_drafted_and_kept(lm):
    """The counts `Speculation.drafting` judges (and the totals the metrics read) grow by each row's draft and by
    the part of it the model kept, and its cache then holds its next token and the kept draft."""
    runner = speculative_runner(lm, 2, num_tokens=4)
    seqs = [TextSequence(p, SamplingParams(max_tokens=12, temperature=0.0)) for p in mixed_prompts(lm, 2)]
    for s in seqs:
        assert runner.admit(s)
    for s, t in zip(seqs, runner.choose(seqs, runner.prefill(seqs))[0], strict=True):
        assert runner.append(s, t) is None
    drafts = runner.drafts(seqs)
    assert all(drafts)
    for s, d in zip(seqs, drafts, strict=True):
        assert runner.grow(s, len(d))
    before = [s.num_computed for s in seqs]
    tokens = runner.choose_ahead(seqs, drafts, runner.decode_ahead(seqs, drafts))[0]
    for s, d, t, n in zip(seqs, drafts, tokens, before, strict=True):
        kept = len(t) - 1
        assert t[:kept] == d[:kept]
        assert (s.drafted, s.accepted, s.recent_drafted, s.recent_accepted) == (len(d), kept, len(d), kept)
        assert s.num_computed == n + 1 + kept


def test_no_drafts_beyond_the_row_limit(lm):
    runner = speculative_runner(lm, 8, max_rows=2)
    prompts = mixed_prompts(lm, 3)
    out = generate(lm, prompts, SamplingParams(max_tokens=10, temperature=0.0), runner=runner, max_batch=3)
    assert sum(s.drafted for s in out) == 0


def test_drafts_take_only_blocks_nobody_needs_and_preempted_requests_finish_the_same(lm):
    """A pool that holds the requests' whole contexts and nothing more: drafts never preempt anyone (they are
    dropped when no block is free); and in a smaller pool, requests preempted while drafting finish with the
    tokens they have without speculation."""
    words = CYCLE_TEXT.split()
    prompts = [lm.tokenizer.encode(" ".join(words[a:a + 16] + words[a:a + 10])) for a in (8, 16, 36)]
    jobs = [(p, SamplingParams(max_tokens=24, temperature=0.0 if i % 2 == 0 else 1.0, seed=i, ignore_eos=True))
            for i, p in enumerate(prompts)]
    expected = [lm_tokens(lm, p, sp) for p, sp in jobs]
    block_bytes = 4 * 2 * lm.config.n_layers * lm.config.kv_heads * lm.config.d_head * 4
    exact = sum(-(-(len(p) + sp.max_tokens) // 4) for p, sp in jobs)
    prompts_only = sum(-(-len(p) // 4) for p in prompts)  # all three admitted, then short as they grow
    for blocks, preempts in ((exact, False), (prompts_only + 2, True)):
        engine = GenerationEngine("lm", lm, max_slots=3, max_queue=8, max_model_len=128, timeout_s=60.0,
                                  metrics=Metrics(), kv_block_size=4, kv_cache_budget=(blocks * block_bytes, None),
                                  speculation=Speculation(num_tokens=4))
        engine.start()
        results = streamed(engine, jobs)
        assert [ids for ids, _ in results] == expected
        assert engine.m.spec_accepted._value.get() > 0
        assert (engine.m.preemptions._value.get() > 0) == preempts, blocks
        assert engine.runner.blocks.num_in_use == 0


# Every sampling and stopping option the API accepts, each on its own and beside the others in one batch: the
# tokens, text and logprobs with drafts are those without (the contract of speculative decoding).
def assert_same_events(got: list[tuple], want: list[tuple], name: str) -> None:
    """Event for event the same text, tokens, finish and top alternatives; each logprob within 1e-4 (a draft's
    positions are scored in one forward over several tokens, the plain steps one token at a time)."""
    assert len(got) == len(want), name
    for a, b in zip(got, want, strict=True):
        if a[0] == "tokens counted":
            assert a == b, name
            continue
        assert (a[0], a[1], a[3]) == (b[0], b[1], b[3]), name
        assert [(t, top) for t, _, top in a[2]] == [(t, top) for t, _, top in b[2]], name
        assert all(abs(x - y) <= 1e-4 for (_, x, _), (_, y, _) in zip(a[2], b[2], strict=True)), name


def test_every_sampling_and_stopping_option_gives_with_drafts_what_it_gives_without(lm):
    words = CYCLE_TEXT.split()[8:24]
    prompts = [*mixed_prompts(lm, 2), lm.tokenizer.encode(" ".join(words + words[:10]))]  # the last: drafts kept
    options = option_matrix(lm)
    jobs = [(p, sp) for sp in options.values() for p in prompts]
    spec_engine = make_engine(lm, speculation=Speculation(num_tokens=4, max_rows=8))
    fast = events(spec_engine, jobs)
    plain = events(make_engine(lm), jobs)
    for k, name in enumerate(options):
        for got, want in zip(fast[k * len(prompts):(k + 1) * len(prompts)],
                             plain[k * len(prompts):(k + 1) * len(prompts)], strict=True):
            assert_same_events(got, want, name)
    assert any(e[2] for stream in fast for e in stream[:-1]), "the logprobs option reports logprobs"
    plain_ids = [stream[-1][1] for stream in plain]  # the tokens each request counts
    assert len({tuple(ids) for ids in plain_ids}) > len(plain) * 0.6  # the options change what is written
    # min_tokens: the biased eos comes exactly where the ban ends, drafts or not (the cycle's first draft spans
    # the end of the ban: each of its positions must see its own count of tokens generated).
    held = plain_ids[2 * len(prompts):3 * len(prompts)]
    assert all(len(ids) == 3 for ids in held), held
    m = spec_engine.m
    assert m.spec_accepted._value.get() > 0 and m.spec_drafted._value.get() > m.spec_accepted._value.get()
    assert m.spec_acceptance._value.get() == pytest.approx(m.spec_accepted._value.get() / m.spec_drafted._value.get())
