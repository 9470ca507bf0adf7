"""Speculative decoding beside another feature in the same batch or request: every sampling option, penalties of
one kind only and two grammars in one batch whose other rows draft (prompt lookup and a draft model), the prefix
cache a speculative request fills and a follow-up turn reads, and a draft model whose output layer is padded past
the shared vocabulary. In every case the output is the one decoding without speculation gives."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_speculative import assert_same_events, make_engine, mixed_prompts
from tests.helpers import factories
from tests.helpers.fixture_training import CYCLE_TEXT
from tests.helpers.sampling_options import events, option_matrix
from tserve.model import checkpoint
from tserve.model.decoding import DecoderRunner, SamplingParams, Speculation, generate
from tserve.model.decoding.structured import Constraint

KINDS = ["ngram", "draft-model"]


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    return factories.tiny_lm_dir(tmp_path_factory.mktemp("lm"))


@pytest.fixture(scope="module")
def lm(lm_dir):
    return checkpoint.load(lm_dir, device="cpu")


@pytest.fixture(scope="module")
def stranger(lm_dir):
    """The served model's weights with much noise: a draft model whose drafts are often turned down."""
    draft = checkpoint.load(lm_dir, device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in draft.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * p.std() * 0.6)
    return draft


@pytest.fixture(scope="module")
def twin(lm_dir):
    """The served model's weights loaded apart, as a draft model: its greedy drafts are the model's own
    unconstrained choices, which a grammar or a penalty must still be free to turn down."""
    return checkpoint.load(lm_dir, device="cpu")


def drafting_prompts(lm) -> list[list[int]]:  # noqa: ANN001
    """One prompt whose drafts are partly rejected, one that repeats the cycle (its drafts are kept)."""
    words = CYCLE_TEXT.split()[8:24]
    return [*mixed_prompts(lm, 1), lm.tokenizer.encode(" ".join(words + words[:10]))]


@pytest.mark.parametrize("kind", KINDS)
def test_constrained_and_penalized_rows_in_a_drafting_batch_write_what_they_write_without_speculation(lm, twin,
                                                                                                     kind):
    """Every option of the API, a presence penalty alone, a frequency penalty alone and two grammars (greedy and
    seeded), all in batches whose other rows draft: the scores of a draft position depend on the position alone
    only without a grammar and without either penalty, so those rows never take drafts, yet they run in the
    speculative steps of their neighbours (their grammar mask applied there too). Tokens, text and logprobs are
    the ones of an engine without speculation; drafts are proposed by the prompt lookup and by a draft model
    alike."""
    plain_engine = make_engine(lm)
    alternating = plain_engine.runner.grammars.compile(Constraint("regex", "([a-z][0-9]){1,8}"))
    matrix = option_matrix(lm)
    options = {  # the first batch: greedy rows that draft beside grammar and penalized rows that may not
        "greedy": matrix["greedy"],
        "grammar, greedy, logprobs": SamplingParams(max_tokens=16, temperature=0.0, grammar=alternating, logprobs=2),
        "grammar, seeded": SamplingParams(max_tokens=16, temperature=1.0, seed=3, grammar=alternating),
        "presence penalty alone": SamplingParams(max_tokens=16, temperature=0.0, presence_penalty=1.5),
        "frequency penalty alone": SamplingParams(max_tokens=16, temperature=0.0, frequency_penalty=1.5),
        "seeded frequency penalty alone": SamplingParams(max_tokens=16, temperature=0.9, seed=2,
                                                         frequency_penalty=1.0),
        **matrix,
    }
    prompts = drafting_prompts(lm)
    jobs = [(p, sp) for sp in options.values() for p in prompts]
    spec_engine = make_engine(lm, speculation=Speculation(num_tokens=4, max_rows=8),
                              draft=twin if kind == "draft-model" else None)
    steps: list[list[tuple[str, int]]] = []  # per speculative step, each row's rule and the length of its draft
    decode_ahead = spec_engine.runner.decode_ahead

    def recorded(seqs, drafts):  # noqa: ANN001, ANN202
        steps.append([("grammar" if s.grammar is not None else "penalty" if s.params.penalized else "", len(d))
                      for s, d in zip(seqs, drafts, strict=True)])
        return decode_ahead(seqs, drafts)

    spec_engine.runner.decode_ahead = recorded
    fast = events(spec_engine, jobs)
    plain = events(plain_engine, jobs)
    for k, name in enumerate(options):
        for got, want in zip(fast[k * len(prompts):(k + 1) * len(prompts)],
                             plain[k * len(prompts):(k + 1) * len(prompts)], strict=True):
            assert_same_events(got, want, name)
    assert all(n == 0 for step in steps for rule, n in step if rule), "a constrained row took a draft"
    # Grammar and penalized rows rode along in steps where others drafted: their masks and counts applied there
    assert {rule for step in steps for rule, _ in step} == {"grammar", "penalty", ""}, steps
    greedy = plain[0][-1][1]  # greedy decoding of the shuffled prompt: each penalty alone changes it
    assert all(plain[2 * k][-1][1] != greedy for k in (3, 4, 5)), plain
    assert spec_engine.m.spec_accepted._value.get() > 0


@pytest.mark.parametrize("kind", KINDS)
def test_a_follow_up_turn_reads_every_block_a_speculative_answer_filled(lm, stranger, kind):
    """Prefix caching under speculation, with blocks of 2 positions and drafts of 4 tokens (drafting never
    paused): a step names the full blocks of what it kept, never those of the draft tokens it turned down (their
    positions are written again with the request's own tokens). The next turn of the conversation (prompt, answer,
    more words) finds the blocks of the whole prompt and answer, and writes what a runner without a prefix cache
    writes."""
    words = CYCLE_TEXT.split()
    prompts = [*mixed_prompts(lm, 2), lm.tokenizer.encode(" ".join(words[3:15] + words[3:8]))]
    params = SamplingParams(max_tokens=19, temperature=0.0, ignore_eos=True)
    runner = DecoderRunner(lm, num_slots=3, cuda_graphs=False, block_size=2, num_blocks=400,
                           speculation=Speculation(num_tokens=4, min_acceptance=0.0),
                           draft=stranger if kind == "draft-model" else None)
    answers = generate(lm, prompts, params, runner=runner, max_batch=3)
    assert [s.generated for s in answers] == [s.generated for s in generate(lm, prompts, params)]
    drafted, kept = sum(s.drafted for s in answers), sum(s.accepted for s in answers)
    assert drafted > kept > 0, (kept, drafted)
    more = lm.tokenizer.encode(" and then", add_special_tokens=False)
    follow_ups = [s.prompt_ids + s.generated + more for s in answers]
    reply = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for answer, follow_up in zip(answers, follow_ups, strict=True):
        (turn,) = generate(lm, [follow_up], reply, runner=runner, max_batch=1)
        computed = len(answer.prompt_ids) + len(answer.generated) - 1  # the last token was chosen, never fed
        assert turn.cached_tokens >= computed // 2 * 2, (turn.cached_tokens, computed)
        uncached = DecoderRunner(lm, num_slots=1, cuda_graphs=False, prefix_caching=False)
        assert turn.generated == generate(lm, [follow_up], reply, runner=uncached)[0].generated


def test_a_draft_model_whose_output_layer_is_padded_drafts_only_shared_tokens(lm, tmp_path):
    """A draft checkpoint of the same tokenizer whose output layer has 16 more rows than the vocabulary (as
    checkpoints pad it for their kernels), scoring those rows above every real token: its drafts are still
    tokens of the served model (the padded rows are never drafted), and the output is the plain one."""
    vocab = lm.config.vocab_size
    padded = checkpoint.load(factories.tiny_lm_dir(tmp_path / "padded", trained=False, vocab_size=vocab + 16),
                             device="cpu")
    with torch.no_grad():  # the real tokens score 0, some padded row scores more
        padded.model.lm_head.weight[:vocab] = 0.0
    assert padded.model.lm_head.weight.size(0) == vocab + 16
    prompts = drafting_prompts(lm)
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=1.0, seed=4, ignore_eos=True)]
    runner = DecoderRunner(lm, num_slots=2, cuda_graphs=False, speculation=Speculation(num_tokens=3), draft=padded)
    proposed: list[list[int]] = []
    drafts = runner.drafts
    runner.drafts = lambda seqs: [proposed.append(d) or d for d in drafts(seqs)]
    fast = generate(lm, prompts, params, runner=runner, max_batch=2)
    assert [s.generated for s in fast] == [s.generated for s in generate(lm, prompts, params)]
    assert any(proposed) and all(t < vocab for d in proposed for t in d), proposed
