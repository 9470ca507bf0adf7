"""The causal language model's runner when requests with different options share a prefill: a fresh prompt
(computed from position 0) placed in the batch BEFORE prompts that read a cached prefix (computed from their
first uncached position on), each with its own sampling options. Every request must write exactly what it
writes alone, on the layers' own steps and on the fused Q4_0 step (`factories.LM_LOADS`). The existing prefix
tests put the cached row first, where a rule that reads the first row's start (whether any row starts past 0,
how far the batch attends) happens to hold for the others too."""

from __future__ import annotations

import pytest

from tests.helpers import factories
from tests.helpers.fixture_training import assert_varied, cycle_prompts
from tests.helpers.one_request import lm_tokens
from tserve.model.decoding import DecoderRunner, SamplingParams, generate

# The outcome depends on the CPU's kernels (the fused step and cpu-decode read the cache themselves).
pytestmark = pytest.mark.kernels

BLOCK = 4


@pytest.fixture(scope="module", params=["layers", "fused-q4_0"])
def lm(request, tmp_path_factory):
    return factories.tiny_lm_loaded(tmp_path_factory.mktemp("batched-options"), request.param)


def _prompts(lm) -> tuple[list[int], list[list[int]], list[int]]:  # noqa: ANN001
    """A system prompt of several blocks, two prompts behind it with their own tails, and a short unrelated one
    (shorter than either prompt behind the system prompt, so that attending as far as the first row's positions
    reaches would not cover theirs)."""
    system = lm.tokenizer.encode(cycle_prompts(1, seed=41, min_words=10, max_words=10)[0])
    tails = [lm.tokenizer.encode(" " + t, add_special_tokens=False) for t in cycle_prompts(2, seed=42, max_words=4)]
    fresh = lm.tokenizer.encode(cycle_prompts(1, seed=43, min_words=2, max_words=2)[0])
    assert len(system) >= 3 * BLOCK and len(fresh) < len(system)
    return system, [system + t for t in tails], fresh


def test_a_fresh_prompt_prefilled_before_cached_prefix_readers_leaves_every_row_as_alone(lm):
    """The system prompt is computed once (its blocks stay named); then a fresh prompt and two prompts behind the
    system prompt are prefilled in ONE batch, the fresh one first, with different options (greedy with a bias,
    seeded sampling with top-k and penalties, greedy with logprobs and min_tokens). The readers must find the
    system prompt's blocks, and each of the three must generate the tokens it generates alone on an empty
    cache: their positions and attention start after their cached prefix, whatever the first row starts at."""
    system, readers, fresh = _prompts(lm)
    eos = lm.tokenizer.eos_id
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logit_bias={eos: 3.0}),
              SamplingParams(max_tokens=10, temperature=1.1, seed=5, top_k=8, presence_penalty=0.5,
                             ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.0, min_tokens=4, logprobs=2)]
    prompts = [fresh, *readers]
    alone = [lm_tokens(lm, p, sp) for p, sp in zip(prompts, params, strict=True)]
    assert_varied(alone)

    runner = DecoderRunner(lm, num_slots=4, cuda_graphs=False, block_size=BLOCK, prefix_caching=True)
    generate(lm, [system], SamplingParams(max_tokens=2, temperature=0.0), runner=runner)
    together = generate(lm, prompts, params, runner=runner)
    assert together[0].cached_tokens == 0
    assert all(s.cached_tokens >= len(system) // BLOCK * BLOCK - BLOCK for s in together[1:])
    assert all(s.cached_tokens > 0 for s in together[1:])
    got = [s.generated + ([s.next_token] if s.finish_reason == "stop" else []) for s in together]
    assert got == alone
    assert runner.blocks.num_in_use == 0


def test_a_cached_prefix_shared_by_rows_of_different_options_stays_intact_for_a_later_request(lm):
    """The same mixed batch, then the first reader's prompt again with the first one's options: its cached
    prefix (which the batch read and must not have overwritten) gives it the tokens it has alone."""
    system, readers, fresh = _prompts(lm)
    runner = DecoderRunner(lm, num_slots=4, cuda_graphs=False, block_size=BLOCK, prefix_caching=True)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=8, temperature=0.9, seed=3, top_p=0.9, ignore_eos=True)
    generate(lm, [system], greedy, runner=runner)
    generate(lm, [fresh, *readers], [sampled, greedy, sampled], runner=runner)
    (again,) = generate(lm, [readers[0]], greedy, runner=runner)
    assert again.cached_tokens > 0
    assert again.generated == lm_tokens(lm, readers[0], greedy)


def test_seed_0_draws_the_same_tokens_each_time_beside_other_seeds(lm):
    """Seed 0 is a seed like any other (not "no seed"): at a high temperature, where an unseeded request would
    draw other tokens each time, it draws the same ones alone and batched with requests seeded 1 and 2."""
    prompts = [lm.tokenizer.encode(p) for p in cycle_prompts(3, seed=44)]
    params = [SamplingParams(max_tokens=24, temperature=2.0, seed=s, ignore_eos=True) for s in (0, 1, 2)]
    alone = [lm_tokens(lm, p, sp) for p, sp in zip(prompts, params, strict=True)]
    assert lm_tokens(lm, prompts[0], params[0]) == alone[0]
    together = generate(lm, prompts, params, runner=DecoderRunner(lm, num_slots=4, cuda_graphs=False))
    assert [s.generated for s in together] == alone
