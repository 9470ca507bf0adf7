"""Speculative decoding with a draft model (`--draft-model`): the output is the target's own (greedy tokens, and
a seeded request's sampled tokens, with a draft that often disagrees); the draft cache holds exactly the
sequence's tokens (a draft model with the target's own weights has every greedy draft kept, also across
preemptions); blocks of both caches come back; a draft model of another vocabulary is refused."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_speculative import mixed_prompts
from tests.helpers import factories
from tests.helpers.fixture_training import CYCLE_TEXT
from tests.helpers.kv_rows import row_keys
from tests.helpers.one_request import lm_tokens
from tests.helpers.sampling_options import streamed
from tserve.model import checkpoint
from tserve.model.cuda_graphs import DecodeAhead
from tserve.model.decoding import DecoderRunner, SamplingParams, Speculation, TextSequence, generate
from tserve.model.decoding.draft_model import bucketed_steps
from tserve.service.engine import GenerationEngine
from tserve.service.metrics import Metrics
from tserve.service.settings import Settings

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    return factories.tiny_lm_dir(tmp_path_factory.mktemp("lm"))


@pytest.fixture(scope="module", params=list(factories.LM_LOADS))
def load(request) -> str:
    """How the target and its twin draft are loaded (`factories.LM_LOADS`): where `tserve serve` loads both, the
    draft's one-token steps run fused as the target's do."""
    return request.param


@pytest.fixture(scope="module")
def lm(lm_dir, load):
    return factories.lm_loaded(lm_dir, load)


@pytest.fixture(scope="module")
def twin(lm_dir, load):
    """The target's own weights, loaded apart: its greedy drafts are the target's choices."""
    return factories.lm_loaded(lm_dir, load)


@pytest.fixture(scope="module")
def noisy(lm_dir):
    """The target's weights with noise (0.3 of each tensor's spread): a draft model that agrees most of the time
    (on the CPU, as the targets: tests/engine/test_gpu.py drafts on the GPU)."""
    draft = checkpoint.load(lm_dir, device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in draft.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * p.std() * 0.3)
    return draft


def drafting_runner(lm, draft, rows: int = 4, **settings) -> DecoderRunner:  # noqa: ANN001
    return DecoderRunner(lm, num_slots=rows, cuda_graphs=False, speculation=Speculation(**settings), draft=draft)


def test_a_draft_model_with_the_targets_weights_has_every_greedy_draft_kept(lm, twin):
    """Each step feeds the draft model only what its cache lacks and keeps the draft positions the target kept:
    any position out of step would make its drafts differ from the target's choices."""
    prompts = mixed_prompts(lm, 8)
    params = [SamplingParams(max_tokens=10 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(len(prompts))]
    runner = drafting_runner(lm, twin, num_tokens=4)
    out = generate(lm, prompts, params, runner=runner, max_batch=4)
    assert [s.generated for s in out] == [s.generated for s in generate(lm, prompts, params)]
    drafted, kept = sum(s.drafted for s in out), sum(s.accepted for s in out)
    assert drafted > 100 and kept == drafted, (kept, drafted)
    assert runner.drafter.blocks.num_in_use == 0


@pytest.mark.parametrize("padded", [False, True], ids=["eager", "padded"])
def test_the_draft_cache_holds_exactly_each_sequences_tokens(lm, twin, padded):
    """With the target's own weights, the draft cache's keys at every position it counts as its own are the
    target cache's keys there: after each speculative step, and after a sequence is released (preempted: its
    draft blocks then hold other content) and admitted again. `padded`: both models' steps as CUDA graphs replay
    them (eager here): three rows padded to a bucket of four with the spare row, the target's rows to 5 positions."""
    runner = drafting_runner(lm, twin, rows=3, num_tokens=4)
    if padded:
        drafter = runner.drafter
        drafter.graphed = bucketed_steps(drafter.model, drafter.cache, max_rows=4, use_graphs=False)
        runner.graphed_ahead = DecodeAhead(lm.model, runner.cache, width=5, max_rows=4,
                                           max_positions=lm.config.max_seq_len, use_graphs=False)
    words = CYCLE_TEXT.split()
    seqs = [TextSequence(lm.tokenizer.encode(" ".join(words[a:a + 8])),
                         SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)) for a in (3, 20, 41)]
    assert all(runner.admit(s) for s in seqs)
    # Q4_0: the draft's one-token steps and the target's steps of several tokens code their activations per block of
    # 32 from float32 sums made in another order, and a value on a code's boundary takes the next code: keys within a
    # few thousandths (a stale block holds 1e4, another token's keys differ by tenths).
    tolerance = 5e-2 if lm.quantization == "q4_0" else 1e-4
    steps = [[t] for t in runner.choose(seqs, runner.prefill(seqs))[0]]
    bs, checked = runner.blocks.block_size, 0
    for step in range(10):
        for s, tokens in zip(seqs, steps, strict=True):
            assert all(runner.append(s, t) is None for t in tokens)
        if step == 4:
            first = seqs[0]
            held = torch.tensor(first.draft_table.blocks)
            runner.release(first)
            positions = (held[:, None] * bs + torch.arange(bs)).flatten()
            runner.drafter.cache.k[:, positions] = 1e4
            runner.drafter.cache.v[:, positions] = 1e4
            assert runner.admit(first)
            assert runner.append(first, runner.choose([first], runner.prefill([first]))[0][0]) is None
        drafts = runner.drafts(seqs)
        assert all(drafts) and all(runner.grow(s, len(d)) for s, d in zip(seqs, drafts, strict=True))
        steps = runner.choose_ahead(seqs, drafts, runner.decode_ahead(seqs, drafts))[0]
        for s in seqs:
            rows, n = torch.tensor([s.slot]), s.draft_computed
            torch.testing.assert_close(row_keys(runner.drafter.cache, rows)[:, :, :n],
                                       row_keys(runner.cache, rows)[:, :, :n], atol=tolerance, rtol=1e-4)
            checked += n
    assert checked > 3 * 10 * 20
    assert sum(s.accepted for s in seqs) == sum(s.drafted for s in seqs)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_output_is_the_targets_own_with_a_draft_model_that_often_disagrees(lm, noisy, temperature):
    prompts = mixed_prompts(lm, 12)
    params = [SamplingParams(max_tokens=8 + 3 * i, temperature=temperature, seed=i) for i in range(len(prompts))]
    plain = generate(lm, prompts, params)
    fast = generate(lm, prompts, params, runner=drafting_runner(lm, noisy), max_batch=4)
    assert [s.generated for s in fast] == [s.generated for s in plain]  # seeded: the very draws, too
    assert [s.finish_reason for s in fast] == [s.finish_reason for s in plain]
    drafted, kept = sum(s.drafted for s in fast), sum(s.accepted for s in fast)
    assert 0 < kept < drafted, (kept, drafted)


def test_preempted_requests_finish_the_same_and_both_caches_give_every_block_back(lm, twin):
    """A pool short of blocks preempts requests while they draft; each comes back, its draft cache rebuilt,
    with the tokens it has alone, and its drafts still all kept."""
    words = CYCLE_TEXT.split()
    prompts = [lm.tokenizer.encode(" ".join(words[a:a + 16] + words[a:a + 10])) for a in (8, 16, 36)]
    jobs = [(p, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)) for p in prompts]
    expected = [lm_tokens(lm, p, sp) for p, sp in jobs]
    block_bytes = 4 * 2 * lm.config.n_layers * lm.config.kv_heads * lm.config.d_head * 4
    blocks = sum(-(-len(p) // 4) for p in prompts) + 2  # all three admitted, then short as they grow
    engine = GenerationEngine("lm", lm, max_slots=3, max_queue=8, max_model_len=128, timeout_s=60.0,
                              metrics=Metrics(), kv_block_size=4, kv_cache_budget=(blocks * block_bytes, None),
                              speculation=Speculation(num_tokens=4), draft=twin)
    engine.start()
    results = streamed(engine, jobs)
    assert [ids for ids, _ in results] == expected
    assert engine.m.preemptions._value.get() > 0
    drafted, kept = engine.m.spec_drafted._value.get(), engine.m.spec_accepted._value.get()
    assert drafted > 20 and kept == drafted, (kept, drafted)
    assert engine.runner.blocks.num_in_use == 0 and engine.runner.drafter.blocks.num_in_use == 0


def test_a_draft_model_of_another_vocabulary_is_refused(lm, tmp_path):
    other = checkpoint.load(factories.hf_gpt2_dir(tmp_path / "gpt2"))  # the same size of vocabulary, other pieces
    with pytest.raises(ValueError, match=r"another vocabulary .*token \d+ is"):
        drafting_runner(lm, other)


def test_a_draft_model_and_prompt_lookup_are_not_asked_for_together():
    with pytest.raises(ValueError, match="choose one"):
        Settings(draft_model="some/model", speculative="ngram")
    assert Settings(draft_model="some/model").draft_model == "some/model"


def test_a_draft_model_of_another_vocabulary_size_is_refused_naming_both_sizes():
    from types import SimpleNamespace

    from tserve.model.decoding.draft_model import check_same_vocabulary

    def model(path: str, size: int) -> SimpleNamespace:
        return SimpleNamespace(path=path, tokenizer=SimpleNamespace(vocab_size=size, id_to_token=str))

    with pytest.raises(ValueError, match=r"^the draft model \(d\) has another vocabulary than the model it drafts for "
                                         r"\(t\): 9 tokens against 10; a draft model must use the same tokenizer$"):
        check_same_vocabulary(model("t", 10), model("d", 9))
    check_same_vocabulary(model("t", 10), model("d", 10))
