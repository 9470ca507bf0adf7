"""The next-token rules where their options meet, each checked against a plain PyTorch statement of the rule:
temperature with top-k and top-p (tempered first, then filtered, each row by its own settings in a mixed batch);
the logprobs a step reports beside a bias, penalties and an eos ban (the constrained scores, before temperature);
min_tokens and ignore_eos on a model with several eos ids (every one of them banned, whichever path a step takes);
a grammar whose only continuation is eos while min_tokens bans it (the grammar wins); and beam search stopping
under early_stopping="never" with a length penalty that is not positive (transformers' rule)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import pytest
import torch

from tserve.model.checkpoint import load
from tserve.model.decoding import (
    BeamSearch,
    BeamSettings,
    DecoderRunner,
    LogitsPipeline,
    SamplingParams,
    TextSequence,
    generate,
)
from tserve.model.decoding.structured import mask_words

INF = float("-inf")


@dataclass
class Row:
    """A row as the pipeline sees it (a grammar's `token_mask` when it has one)."""

    params: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))
    num_generated: int = 0
    token_mask: torch.Tensor | None = None

    def token_counts(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(vocab_size, device=device)


# --------------------------------------------------------------------------------------------------
# Temperature, top-k and top-p
# --------------------------------------------------------------------------------------------------
def shaped_by_the_rule(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One sampled row: logits / temperature; then of the tokens sorted by probability (of the tempered
    distribution) keep the first top_k, and of those the ones whose preceding mass, in the distribution renormalised
    over the top_k, is below top_p (the first always), as vLLM and transformers apply the two."""
    x = logits / p.temperature
    order = x.argsort(descending=True)
    kept = order[: p.top_k] if p.top_k > 0 else order
    probs = torch.full_like(x, 0.0).index_copy(0, kept, torch.softmax(x[kept], -1))
    keep = torch.zeros_like(x, dtype=torch.bool)
    mass = 0.0
    for rank, t in enumerate(order.tolist()):
        if (p.top_k > 0 and rank >= p.top_k) or (rank > 0 and mass >= p.top_p):
            break
        keep[t] = True
        mass += float(probs[t])
    return x.masked_fill(~keep, INF)


def test_each_row_is_tempered_before_its_top_k_and_top_p_in_a_mixed_batch():
    """Rows with different temperatures, top_k and top_p side by side, and a greedy row: each row's scores are its
    own tempered logits with its own filters applied to the tempered distribution. The first row shows the order:
    at temperature 2 the nucleus of 0.7 holds three tokens, untempered it would hold two."""
    first = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05, 1e-6, 1e-6]))
    logits = torch.cat([first[None], torch.randn(5, 6, generator=torch.Generator().manual_seed(3)) * 2])
    params = [SamplingParams(temperature=2.0, top_p=0.7), SamplingParams(temperature=0.5, top_k=3),
              # top_k with top_p: on this row the nucleus lies inside the top 4 whether or not its mass is taken
              # after top-k renormalises (transformers' and vLLM's order), so the row holds either reading
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.5, top_k=4, top_p=0.6),
              SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=2)]
    out = LogitsPipeline(None)(logits, [Row(p) for p in params])
    assert torch.isfinite(out[0]).tolist() == [True, True, True, False, False, False]
    for i, p in enumerate(params):
        want = logits[i] if p.greedy else shaped_by_the_rule(logits[i], p)
        assert torch.equal(torch.isfinite(out[i]), torch.isfinite(want)), (i, p)
        torch.testing.assert_close(out[i][torch.isfinite(want)], want[torch.isfinite(want)], msg=str((i, p)))


def test_top_p_measures_the_mass_of_what_top_k_kept():
    """top_k 2 then top_p 0.6 on probabilities 0.5, 0.3, 0.15, 0.05: renormalised over the two tokens top-k keeps
    (0.625, 0.375) the first already holds 0.6, so the nucleus is that token alone (transformers' warpers and vLLM
    agree); measured over the whole distribution it would take the second too."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    out = LogitsPipeline(None)(logits, [Row(SamplingParams(temperature=1.0, top_k=2, top_p=0.6))])
    assert torch.isfinite(out[0]).tolist() == [True, False, False, False]
    transformers = pytest.importorskip("transformers")
    theirs = transformers.TopPLogitsWarper(0.6)(None, transformers.TopKLogitsWarper(2)(None, logits.clone()))
    assert torch.isfinite(theirs[0]).tolist() == [True, False, False, False]


# --------------------------------------------------------------------------------------------------
# Logprobs beside the constraints
# --------------------------------------------------------------------------------------------------
def test_reported_logprobs_are_the_constrained_distributions_before_temperature(tiny_lm):
    """Rows with a bias, penalties, min_tokens and ignore_eos (their eos banned), sampled at other temperatures
    and filters, and asking for different numbers of alternatives, step by step in one batch: each row's chosen
    token and its alternatives carry log_softmax(logits - penalties + bias, eos banned while it is), the
    distribution the constraints leave, not the raw one and not the tempered or filtered one."""
    lm = load(tiny_lm)
    prompt = lm.tokenizer.encode("the quick")
    params = [SamplingParams(max_tokens=8, temperature=0.0, logit_bias={7: 3.0, 11: -2.0}, logprobs=2,
                             ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=1.5, seed=3, presence_penalty=0.9, frequency_penalty=0.6,
                             top_p=0.8, logprobs=3, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.8, seed=4, top_k=5, min_tokens=3, logprobs=1),
              SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)]
    runner = DecoderRunner(lm, num_slots=len(params), cuda_graphs=False)
    eos = sorted(runner.eos_ids)
    seqs = [TextSequence(prompt, p, runner.device) for p in params]
    assert all(runner.admit(s) for s in seqs)
    logits = runner.prefill(seqs)
    for _ in range(3):  # min_tokens 3: every row's eos banned at each of these steps
        want = logits.float().clone()
        for i, s in enumerate(seqs):
            counts = torch.bincount(torch.tensor(s.generated, dtype=torch.long), minlength=want.size(-1)).float()
            want[i] -= s.params.frequency_penalty * counts + s.params.presence_penalty * (counts > 0).float()
            for t, b in s.params.logit_bias.items():
                want[i, t] += b
            want[i, eos] = INF
        want = torch.log_softmax(want, -1)
        tokens, (chosen, top_v, top_i) = runner.choose(seqs, logits)
        for i, s in enumerate(seqs):
            if s.params.logprobs is None:
                continue
            assert chosen[i] == pytest.approx(float(want[i, tokens[i]]), abs=1e-4), i
            k = s.params.logprobs
            values, ids = want[i].topk(k)
            assert top_i[i][:k] == ids.tolist(), i
            assert top_v[i][:k] == pytest.approx(values.tolist(), abs=1e-4), i
        for s, t in zip(seqs, tokens, strict=True):
            assert t not in eos and runner.append(s, t) is None
            assert runner.grow(s)
        logits = runner.decode(seqs)
    for s in seqs:
        runner.release(s)


# --------------------------------------------------------------------------------------------------
# Several eos ids
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch", ["greedy", "sampled", "sampled beside a row that may end"])
def test_ignore_eos_and_min_tokens_ban_every_eos_id_of_the_checkpoint(tiny_lm, batch):
    """generation_config.json may name several eos ids; ignore_eos and min_tokens ban each of them, whether the
    step takes the greedy path (argmax past the excluded ids), bans eos on every row, or on some rows only.
    The second eos id here is the token greedy decoding writes first (greedy rows), or one a bias of +100
    makes the only choice (sampled rows): banned, it never comes."""
    lm = load(tiny_lm)
    eos = lm.tokenizer.eos_id
    prompt = lm.tokenizer.encode("the quick")
    (first,) = generate(lm, [prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    second = first.generated[0]
    assert second != eos
    lm = replace(lm, generation=replace(lm.generation, eos_token_ids=[eos, second]))
    greedy = batch == "greedy"
    how = {"temperature": 0.0} if greedy else {"temperature": 1.0, "seed": 5, "logit_bias": {second: 100.0}}
    params = [SamplingParams(max_tokens=6, ignore_eos=True, **how), SamplingParams(max_tokens=6, min_tokens=4, **how)]
    if batch == "sampled beside a row that may end":
        params.append(SamplingParams(max_tokens=6, temperature=1.0, seed=6, logit_bias={second: 100.0}))
    seqs = generate(lm, [prompt] * len(params), params)
    assert len(seqs[0].generated) == 6 and second not in seqs[0].generated and eos not in seqs[0].generated
    # min_tokens: no eos of either id for four tokens (then the bias makes the second one end a sampled row)
    assert len(seqs[1].generated) >= 4 and second not in seqs[1].generated and eos not in seqs[1].generated
    if not greedy:
        assert (len(seqs[1].generated), seqs[1].finish_reason, seqs[1].next_token) == (4, "stop", second)
    if len(seqs) == 3:
        assert (seqs[2].generated, seqs[2].finish_reason) == ([], "stop")


# --------------------------------------------------------------------------------------------------
# A grammar beside min_tokens
# --------------------------------------------------------------------------------------------------
def _mask(allowed: list[int], vocab_size: int) -> torch.Tensor:
    words = torch.zeros(mask_words(vocab_size), dtype=torch.int64)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def test_a_grammar_that_allows_only_eos_wins_over_min_tokens():
    """A grammar complete but for its eos, on a row whose min_tokens bans eos: the grammar wins (eos scored 0,
    every other token -inf). A grammar that allows eos and other tokens leaves min_tokens' ban in place, and a
    free row beside them keeps its scores."""
    V, eos = 40, 35
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    early = SamplingParams(temperature=0.0, min_tokens=5)
    rows = [Row(early, num_generated=2, token_mask=_mask([eos], V)),
            Row(early, num_generated=2, token_mask=_mask([eos, 3, 33], V)), Row(early, num_generated=2)]
    out = LogitsPipeline(eos)(logits, rows)
    assert out[0].tolist() == [INF] * eos + [0.0] + [INF] * (V - eos - 1)
    assert torch.isfinite(out[1]).nonzero()[:, 0].tolist() == [3, 33]
    want = logits[2].clone()
    want[eos] = INF
    assert torch.equal(out[2], want)
    for sampled in (SamplingParams(temperature=0.9, min_tokens=5), SamplingParams(temperature=1.2, top_p=0.5,
                                                                                  min_tokens=5)):
        shaped = LogitsPipeline(eos)(logits[:1], [Row(sampled, num_generated=2, token_mask=_mask([eos], V))])
        assert int(shaped.argmax()) == eos and torch.isfinite(shaped).sum() == 1


# --------------------------------------------------------------------------------------------------
# Beam search: early_stopping="never" with a length penalty that is not positive
# --------------------------------------------------------------------------------------------------
def _row(vocab: int, best: dict[int, float]) -> torch.Tensor:
    rest = (1.0 - sum(best.values())) / (vocab - len(best))
    row = torch.full((vocab,), rest)
    for t, p in best.items():
        row[t] = p
    return row.log()


def test_never_stopping_early_with_a_negative_length_penalty_judges_running_beams_at_their_length():
    """transformers' rule: with early_stopping="never" a running beam's best attainable score is taken at the
    longest length only when length_penalty > 0; otherwise (here -0.5: score = log-prob sum * sqrt(length)) at
    its current length. Two beams; step 1 finishes [eos] (-1.20); step 2 finishes [a, eos] (-2.47) and keeps
    [a, y] (log-prob -1.20, -1.70 at length 2: it can still beat -2.47, so the search goes on); step 3 finishes
    [a, y, eos] (-2.17), which replaces [a, eos]. Judged at the longest length (9: -3.61) the search would
    have stopped after step 2."""
    V, start, a, y, b, eos = 8, 0, 1, 2, 4, 3
    search = BeamSearch(BeamSettings(num_beams=2, max_new_tokens=9, eos_token_id=eos, length_penalty=-0.5,
                                     early_stopping="never"), start)
    search.advance(torch.stack([_row(V, {a: 0.5, eos: 0.3, b: 0.1})] * 2))
    assert not search.done
    search.advance(torch.stack([_row(V, {y: 0.6, eos: 0.35}), _row(V, {5: 0.3})]))  # beams [a], [b]
    assert not search.done
    search.advance(torch.stack([_row(V, {eos: 0.95}), _row(V, {6: 0.3})]))  # beams [a, y], [a, ...]
    got = search.hypotheses(2)
    la, ly, le = math.log(0.5), math.log(0.6), math.log(0.95)
    assert [ids for ids, _ in got] == [[eos], [a, y, eos]]
    assert [s for _, s in got] == pytest.approx([math.log(0.3), (la + ly + le) * math.sqrt(3)], rel=1e-5)
