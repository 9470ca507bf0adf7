"""Greedy and beam choices taken from the raw logits (`top_tokens`: each row's best tokens, read in its
log-softmax, with no (rows, V) tensor written) equal the full path (log_softmax -> constraints -> topk / argmax):
the same tokens, the same log-probabilities, beams in the same order; and every rule that needs the whole
distribution sends its rows down the full path. The vocabulary's chunks are made small here so that the tiny
models' vocabularies take the chunked path NLLB's 256k outputs take."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from tests.helpers import factories
from tserve.model.checkpoint import load
from tserve.model.decoding import top_tokens as top_tokens_module
from tserve.model.decoding.logits import LogitsPipeline
from tserve.model.decoding.params import SamplingParams
from tserve.model.decoding.sampler import sample, token_logprobs
from tserve.model.decoding.seq2seq_runner import Seq2SeqRunner, TranslationJob, run_jobs
from tserve.model.decoding.top_tokens import beam_candidates, greedy_tokens, top_tokens

EOS, BANNED, V = 2, [1, 40], 203  # V: 25 chunks of 8 and a short last one


@pytest.fixture(params=["chunked", "plain"])
def chunking(request, monkeypatch):
    """Small chunks and blocks of 3 rows (several blocks, rows out of order); or the default chunk, which the
    tiny vocabulary is too small for (the plain operations)."""
    if request.param == "chunked":
        monkeypatch.setattr(top_tokens_module, "_CHUNK", 8)
        monkeypatch.setattr(top_tokens_module, "_BLOCK_BYTES", 3 * 4 * V)
    return request.param


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=g) * 3


@pytest.mark.parametrize("places", [None, [6, 2, 3, 0, 5], [1, 2, 3, 4]])
@pytest.mark.parametrize("banned", [None, BANNED])
def test_top_tokens_are_topk_and_argmax_of_the_allowed_columns_with_their_log_probabilities(chunking, places, banned):
    logits = random_logits(7)
    logits[2, 40] = logits[2].max() + 5  # a banned column is the row's best
    logits[3, [17, 150]] = logits[3].max() + 1  # two best columns, far apart: argmax takes the first
    logits[4, V - 2] = logits[4].max() + 1  # the best in the short last chunk
    rows = logits if places is None else logits[places]
    masked = rows if banned is None else rows.index_fill(-1, torch.tensor(banned), float("-inf"))
    banned_t = None if banned is None else torch.tensor(banned)

    log_softmax = torch.log_softmax(rows, -1)  # over every column, the banned ones too
    values, ids, log_probs = top_tokens(logits, 1, places, banned_t)
    assert torch.equal(ids[:, 0], masked.argmax(-1)) and torch.equal(values[:, 0], masked.amax(-1))
    assert torch.equal(log_probs, log_softmax.gather(1, ids))

    values, ids, log_probs = top_tokens(logits, 6, places, banned_t)
    expected_values, expected_ids = masked.topk(6, -1)
    assert torch.equal(values, expected_values)
    untied = [j for j, p in enumerate(places or range(7)) if p != 3]
    assert torch.equal(ids[untied], expected_ids[untied])
    assert torch.equal(log_probs, log_softmax.gather(1, ids))
    assert top_tokens(logits, 6, places, banned_t, log_probs=False)[2] is None


@dataclass
class Row:
    """A decoding row as the pipeline sees it."""

    params: SamplingParams = field(default_factory=lambda: SamplingParams(max_tokens=10, temperature=0.0))
    num_generated: int = 3
    forced_first_token: int | None = None
    token_mask: torch.Tensor | None = None

    def token_counts(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(vocab_size, device=device).index_fill_(0, torch.tensor([5, 9]), 2.0)


def greedy_params(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=10, temperature=0.0, **kw)


def only_tokens(*allowed: int) -> torch.Tensor:
    """A grammar's bitmask (int32 words, bit set: allowed) that allows `allowed`."""
    words = torch.zeros((V + 31) // 32, dtype=torch.int64)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


WHOLE_ROWS = {  # every rule besides the checkpoint's banned ids, each on a row where it applies
    "penalties": Row(greedy_params(presence_penalty=0.7, frequency_penalty=0.4)),
    "logit_bias": Row(greedy_params(logit_bias={7: 30.0, 11: -5.0})),
    "min_tokens": Row(greedy_params(min_tokens=5)),
    "ignore_eos": Row(greedy_params(ignore_eos=True)),
    "forced_eos_at_the_last_position": Row(num_generated=9),
    "forced_first_token": Row(num_generated=0, forced_first_token=33),
    "grammar": Row(token_mask=only_tokens(12, 60, 61)),
}
FREE_ROWS = {  # rows the same rules leave alone this step
    "plain": Row(),
    "forced_first_token_later": Row(num_generated=1, forced_first_token=33),
    "not_yet_the_last_position": Row(num_generated=8),
    "min_tokens_reached": Row(greedy_params(min_tokens=2)),
}


def test_every_rule_but_the_banned_ids_sends_its_row_down_the_full_path_and_the_rest_take_top_tokens(chunking):
    """A batch mixing each rule's row with free ones: `whole_rows` names exactly the rules' rows, and the
    beam candidates and greedy tokens of every row equal the full path's (the constraints on log_softmax),
    which they could not if a rule's row took the raw logits."""
    pipeline = LogitsPipeline(EOS, BANNED, force_eos_at_max=True)
    rows = [*WHOLE_ROWS.values(), *FREE_ROWS.values()]
    assert pipeline.whole_rows(rows) == [True] * len(WHOLE_ROWS) + [False] * len(FREE_ROWS)
    logits = random_logits(len(rows) + 2, seed=1)
    places = [len(rows) + 1 - j for j in range(len(rows))]  # not the batch's order
    scores = logits[places]

    full = pipeline.constrain(torch.log_softmax(scores, -1), rows)
    expected_values, expected_ids = full.topk(6, -1)
    values, ids = beam_candidates(pipeline, logits, places, rows, 6)
    finite = torch.isfinite(expected_values)  # a grammar or a forced token leaves few tokens; the rest: -inf
    assert torch.equal(ids[finite], expected_ids[finite]) and torch.equal(finite, torch.isfinite(values))
    assert torch.equal(values[finite], expected_values[finite])

    tokens, logprobs = greedy_tokens(pipeline, logits, places, rows)
    expected_tokens = pipeline.constrain(scores, rows).argmax(-1)
    assert torch.equal(tokens, expected_tokens)
    unconstrained = torch.log_softmax(scores, -1).gather(1, expected_tokens[:, None])[:, 0]
    assert torch.equal(logprobs, unconstrained)


@pytest.mark.parametrize("rows", [[WHOLE_ROWS["ignore_eos"]] * 2, [WHOLE_ROWS["min_tokens"], FREE_ROWS["plain"]]],
                         ids=["every-row", "one-row"])
def test_bans_write_into_the_scores_only_where_they_are_handed_over(rows):
    """`constrain` leaves the caller's scores as they were (beam search and a speculative step read them again);
    with `owned=True` (a step's own logits, `choose_later`) eos and the banned ids are written into them instead
    of a copy, with the same result."""
    pipeline = LogitsPipeline(EOS, BANNED)
    logits = random_logits(2, seed=3)
    before = logits.clone()
    copied = pipeline.constrain(logits, rows)
    assert torch.equal(logits, before), "the caller's scores were written into"
    assert copied[:, BANNED].eq(float("-inf")).all() and copied[0, EOS] == float("-inf")
    assert torch.isfinite(copied).sum() == 2 * V - 2 * len(BANNED) - (2 if rows[1] is rows[0] else 1)
    with torch.inference_mode():
        made_in_inference = logits.clone()
    kept = pipeline.constrain(made_in_inference, rows, owned=True)  # outside inference mode: not writable, copied
    assert torch.equal(made_in_inference, before) and torch.equal(kept, copied)
    owned = pipeline.constrain(logits, rows, owned=True)
    assert owned.data_ptr() == logits.data_ptr() and torch.equal(owned, copied)


def test_the_samplers_argmax_and_reported_logprobs_equal_log_softmaxs(chunking):
    logits = random_logits(5, seed=2)
    logits[4, [3, 190]] = 50.0  # a tie: the lowest column, as argmax
    params = [SamplingParams(temperature=0.0)] * 5
    tokens = sample(logits, params, [None] * 5)
    assert torch.equal(tokens, logits.argmax(-1)) and int(tokens[4]) == 3
    chosen, top_values, top_ids = token_logprobs(logits, tokens, 3)
    logp = torch.log_softmax(logits, -1)
    expected_values, expected_ids = logp.topk(3, -1)
    assert torch.equal(chosen, logp.gather(1, tokens[:, None])[:, 0]) and torch.equal(top_values, expected_values)
    assert torch.equal(top_ids[:4], expected_ids[:4])
    chosen, top_values, top_ids = token_logprobs(logits[:0], tokens[:0], 3)  # a one-token prompt's scores
    assert chosen.shape == (0,) and top_values.shape == top_ids.shape == (0, 3)


def test_logprobs_0_reports_the_chosen_tokens_own_log_probabilities():
    """`logprobs: 0` (no alternatives): each chosen token's log-softmax value, sampled tokens as well as the
    argmax, and no alternatives."""
    logits = random_logits(4, seed=3)
    tokens = torch.tensor([0, 17, 190, int(logits[3].argmax())])
    chosen, top_values, top_ids = token_logprobs(logits, tokens, 0)
    assert torch.equal(chosen, torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0])
    assert top_values.shape == top_ids.shape == (4, 0)


@pytest.fixture(scope="module")
def random_mt(tmp_path_factory):
    """Random weights: flat distributions, whose beams reorder at every step."""
    return load(factories.tiny_mt_dir(tmp_path_factory.mktemp("random-mt"), trained=False), device="cpu")


def translate_all(loaded, jobs: list[TranslationJob]) -> list:
    runner = Seq2SeqRunner(loaded, num_rows=sum(j.num_beams for j in jobs), cuda_graphs=False)
    runner.pipeline = LogitsPipeline(runner.eos, [loaded.tokenizer.pad_id], force_eos_at_max=True)  # Marian's
    seqs = run_jobs(loaded, jobs, runner=runner)
    return [(runner.hypotheses(s), s.output_ids) for s in seqs]


@pytest.mark.slow  # several seconds each; its planted bug is caught by the rules test above too
def test_a_translators_greedy_and_beam_results_equal_the_full_log_softmax_path(random_mt, chunking, monkeypatch):
    """Greedy and 4-beam jobs in one batch (two with a forced first token, every job's last position forced
    to eos): the same ids, the same hypotheses in the same order with the same scores (bitwise), as when every
    row takes the full path."""
    tok = random_mt.tokenizer
    sources = [tok.encode(s) for s in ("the house", "a small old tree by the river", "water", "the good book")]
    forced = tok.encode("Haus", add_special_tokens=False)[0]

    def jobs() -> list[TranslationJob]:
        return [TranslationJob(src, num_beams=beams, max_new_tokens=12, forced_first_token=first)
                for src in sources for beams, first in ((1, None), (4, None), (4, forced), (1, forced))]

    calls = []
    original = top_tokens_module.top_tokens
    monkeypatch.setattr(top_tokens_module, "top_tokens", lambda *a, **kw: calls.append(a[1]) or original(*a, **kw))
    fast = translate_all(random_mt, jobs())
    assert 1 in calls and 8 in calls  # greedy and beam rows took the raw logits' top tokens
    monkeypatch.setattr(LogitsPipeline, "whole_rows", lambda self, rows: [True] * len(rows))
    full = translate_all(random_mt, jobs())
    for (fast_hyps, fast_ids), (full_hyps, full_ids) in zip(fast, full, strict=True):
        assert fast_ids == full_ids
        assert [ids for ids, _ in fast_hyps] == [ids for ids, _ in full_hyps]
        assert [s for _, s in fast_hyps] == [s for _, s in full_hyps]
