"""Inputs at the exact edges of a configuration's limits, where tests usually sample well inside them: a prompt of
exactly whole KV blocks read back from the prefix cache (and one token past), a sliding-window pool exactly full
when a prompt is admitted (and one block short), and a translator's source of exactly its maximum length (and one
token past). At each edge the documented rule holds (taken, or refused with a message naming the limit) and the
output equals that of the same request on a configuration with room to spare."""

from __future__ import annotations

import pytest

from tests.helpers import factories
from tests.helpers.fixture_training import CYCLE_TEXT
from tests.model.test_window_blocks import gemma  # noqa: F401 - a module fixture (Gemma 3, window 16)
from tserve.model import checkpoint
from tserve.model.decoding import DecoderRunner, SamplingParams, generate
from tserve.service.engine.translation_input import Translator
from tserve.service.errors import InvalidInput

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels

BS = 4  # small blocks: short prompts span several
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return checkpoint.load(factories.tiny_lm_dir(tmp_path_factory.mktemp("edges-lm")), device="cpu")


@pytest.fixture(scope="module")
def mt(tmp_path_factory):
    return checkpoint.load(factories.tiny_mt_dir(tmp_path_factory.mktemp("edges-mt"), trained=False), device="cpu")


def ids_of(loaded, n: int) -> list[int]:  # noqa: ANN001
    ids = loaded.tokenizer.encode(CYCLE_TEXT)[:n]
    assert len(ids) == n
    return ids


# ------------------------------------------------------------------------------------------------------------
# A prompt of exactly whole blocks, with the prefix cache on
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("past", [0, 1], ids=["whole-blocks", "one-token-past"])
def test_a_prompt_of_whole_blocks_sent_again_reads_its_prefix_and_writes_the_uncached_tokens(lm, past):
    """The prefix cache names a prompt's full blocks but the one holding its last token (whose logits are the point
    of a prefill, so it is always computed). A prompt of exactly 3 blocks sent again finds 2 of them cached and
    computes its last block; one token more finds all 3. Either way the tokens are those of a cache-less runner."""
    prompt = ids_of(lm, 3 * BS + past)
    reference = generate(lm, [prompt], GREEDY, runner=DecoderRunner(
        lm, num_slots=1, max_len=64, cuda_graphs=False, block_size=BS, prefix_caching=False))[0]
    runner = DecoderRunner(lm, num_slots=1, max_len=64, cuda_graphs=False, block_size=BS, prefix_caching=True)
    first = generate(lm, [prompt], GREEDY, runner=runner)[0]
    again = generate(lm, [prompt], GREEDY, runner=runner)[0]
    assert first.cached_tokens == 0
    assert again.cached_tokens == ((len(prompt) - 1) // BS) * BS == (2 + past) * BS
    assert first.generated == again.generated == reference.generated
    assert runner.blocks.num_in_use == 0  # every block came back


# ------------------------------------------------------------------------------------------------------------
# The sliding layers' own pool exactly full
# ------------------------------------------------------------------------------------------------------------
def test_a_window_pool_exactly_full_takes_the_prompt_and_one_block_short_is_refused(gemma):  # noqa: F811
    """A prompt of 22 tokens with max_tokens 2 needs 6 blocks of 4 positions in the sliding layers' pool while it
    is computed: a pool of exactly 6 usable blocks admits it (every one of them taken at once) and decodes what a
    pool with room to spare decodes; a pool of 5 refuses it up front, naming the blocks it needs."""
    prompt = ids_of(gemma, 22)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    roomy = DecoderRunner(gemma, num_slots=1, max_len=96, cuda_graphs=False, block_size=BS, window_blocks=1 + 24)
    reference = generate(gemma, [prompt], params, runner=roomy)[0]
    exact = DecoderRunner(gemma, num_slots=1, max_len=96, cuda_graphs=False, block_size=BS, window_blocks=1 + 6)
    assert exact.windows is not None and exact.windows.pool.num_usable == exact.blocks.blocks_for(22 + 2) == 6
    out = generate(gemma, [prompt], params, runner=exact)[0]
    assert out.generated == reference.generated and out.finish_reason == "length"
    assert exact.windows.pool.num_free == 6  # every block came back
    short = DecoderRunner(gemma, num_slots=1, max_len=96, cuda_graphs=False, block_size=BS, window_blocks=1 + 5)
    with pytest.raises(ValueError, match="needs 6 KV-cache blocks"):
        short.check(len(prompt), params.max_tokens)


# ------------------------------------------------------------------------------------------------------------
# A translator's source of exactly its maximum length
# ------------------------------------------------------------------------------------------------------------
def test_a_source_of_exactly_the_length_limit_is_one_job_and_one_token_more_is_refused(mt):
    """A translation job (the attention viewer's own translation takes this path) takes a source of as many tokens
    as the translator's limit whole, with the ids an unlimited translator gives; one token more is refused with a
    message naming the limit."""
    text = "three daughters know the king"
    ids = Translator(mt).encode_source(text, None)
    n = len(ids)
    assert 1 < n < mt.config.max_source_len
    job = Translator(mt, max_source_len=n).job(text, None, None)
    assert list(job.source_ids) == list(Translator(mt).job(text, None, None).source_ids) == ids
    with pytest.raises(InvalidInput, match=f"input has {n} tokens; this model takes at most {n - 1}"):
        Translator(mt, max_source_len=n - 1).job(text, None, None)
