"""A model served in half precision (`--dtype bfloat16` / `float16` on the CPU) beside the features that read
numbers from it: logprobs with logit_bias and penalties, the KV caches and their sizing by --kv-cache-memory, the
logit lens and text embeddings. The model's own products are half precision; what is computed from its logits
and states (log-softmax, probabilities, normalised vectors) is float32, and the caches hold keys and values in
the model's dtype, at that dtype's size. Each reference is a float32 computation of the same half precision
tensors (or exact sizes), so no rounding of the model can flip an outcome."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import factories
from tserve.model import checkpoint
from tserve.model.decoding.lm_runner import DecoderRunner, TextSequence
from tserve.model.decoding.params import SamplingParams
from tserve.model.embeddings import embed_token_lists
from tserve.model.logit_lens import logit_lens
from tserve.service.metrics import Metrics
from tserve.service.registry import ModelRegistry
from tserve.service.settings import Settings

HALF = {"bfloat16": torch.bfloat16, "float16": torch.float16}
BLOCK = 16
BUDGET_BLOCKS = 24  # float32 blocks of the LM that --kv-cache-memory pays for


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dtypes")
    return {"lm": factories.tiny_lm_dir(root / "lm"), "mt": factories.tiny_mt_dir(root / "mt")}


@pytest.fixture(scope="module")
def lm16(dirs):
    return checkpoint.load(dirs["lm"], dtype="bfloat16")


# --------------------------------------------------------------------------------------------------
# Logprobs, logit_bias and penalties
# --------------------------------------------------------------------------------------------------
def test_bfloat16_logprobs_with_a_bias_and_penalties_are_float32_over_the_models_logits(lm16):
    """The constraints (penalties, logit_bias) are applied to the bfloat16 logits widened to float32, and the
    reported logprobs are float32 log-softmaxes of those: a bias of 0.3 added in bfloat16 would be rounded to
    bfloat16's steps (1/32 at a logit of 4), far beyond float32's rounding."""
    prompt = lm16.tokenizer.encode("the quick")
    params = [SamplingParams(max_tokens=6, temperature=0.0, logit_bias={7: 0.3, 11: -0.7, 12: 1.1}, logprobs=3,
                             ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.9, seed=5, presence_penalty=0.37, frequency_penalty=0.21,
                             logit_bias={9: 0.45}, logprobs=2, ignore_eos=True)]
    runner = DecoderRunner(lm16, num_slots=len(params), cuda_graphs=False)
    eos = sorted(runner.eos_ids)
    seqs = [TextSequence(prompt, p, runner.device) for p in params]
    assert all(runner.admit(s) for s in seqs)
    logits = runner.prefill(seqs)
    assert logits.dtype == torch.bfloat16  # the model's own products stay in its dtype
    for step in range(3):
        want = logits.float().clone()
        for i, s in enumerate(seqs):
            counts = torch.bincount(torch.tensor(s.generated, dtype=torch.long), minlength=want.size(-1)).float()
            want[i] -= s.params.frequency_penalty * counts + s.params.presence_penalty * (counts > 0).float()
            for t, b in s.params.logit_bias.items():
                want[i, t] += b
            want[i, eos] = float("-inf")
        want = torch.log_softmax(want, -1)
        tokens, (chosen, top_v, top_i) = runner.choose(seqs, logits)
        for i, s in enumerate(seqs):
            assert chosen[i] == pytest.approx(float(want[i, tokens[i]]), abs=1e-5), (step, i)
            k = s.params.logprobs
            # Values, not the order of ids: equal bfloat16 logits may come in either order.
            assert top_v[i][:k] == pytest.approx(want[i].topk(k).values.tolist(), abs=1e-5), (step, i)
            assert [float(want[i, t]) for t in top_i[i][:k]] == pytest.approx(top_v[i][:k], abs=1e-5), (step, i)
        for s, t in zip(seqs, tokens, strict=True):
            assert runner.append(s, t) is None
        for s in seqs:
            assert runner.grow(s)
        logits = runner.decode(seqs)
    for s in seqs:
        runner.release(s)


# --------------------------------------------------------------------------------------------------
# The caches: their dtype, their size and --kv-cache-memory
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", sorted(HALF))
def test_a_half_precision_server_holds_its_caches_in_that_dtype_and_fits_twice_the_blocks(dirs, dtype):
    """--dtype bfloat16 / float16 with --kv-cache-memory: the LM's and the translator's caches hold their keys
    and values in the served dtype (not float32 beside a half precision model, which would double the memory
    the budget was sized for); a position of the LM costs half of float32's bytes, so the same budget buys
    twice float32's blocks, and the pool allocated stays within the budget."""
    cfg = checkpoint.load(dirs["lm"]).config
    f32_per_token = 2 * cfg.n_layers * cfg.kv_heads * cfg.d_head * 4
    budget = BUDGET_BLOCKS * BLOCK * f32_per_token
    reg = ModelRegistry(Settings(device="cpu", dtype=dtype, kv_cache_memory=f"{budget}B", kv_block_size=BLOCK,
                                 warmup=False, gc_freeze=False), Metrics())
    try:
        reg.load_model("lm", dirs["lm"])
        reg.load_model("mt", dirs["mt"])
        lm, mt = reg.models["lm"], reg.models["mt"]
        assert lm.loaded.dtype == mt.loaded.dtype == HALF[dtype]
        cache = lm.engine.runner.cache
        assert cache.k.dtype == cache.v.dtype == HALF[dtype]
        assert cache.bytes_per_token() == f32_per_token // 2
        assert lm.engine.runner.blocks.num_usable == 2 * BUDGET_BLOCKS
        assert cache.nbytes() <= budget + BLOCK * f32_per_token // 2  # (and the null block)
        mt_cache = mt.engine.runner.cache.self_kv
        assert mt_cache.k.dtype == mt_cache.v.dtype == HALF[dtype]
        text = reg.metrics.render().decode()
        assert f'tserve_kv_cache_bytes_per_token{{model="lm"}} {float(f32_per_token // 2)}' in text
    finally:
        reg.stop()


# --------------------------------------------------------------------------------------------------
# Inspection: the logit lens and embeddings
# --------------------------------------------------------------------------------------------------
def test_the_logit_lens_of_a_bfloat16_model_reports_float32_probabilities_of_its_logits(lm16):
    """Each lens layer's probabilities are the float32 softmax of the bfloat16 model's logits at that layer, not
    a softmax rounded to bfloat16 (whose steps near 0.5 are 1/256)."""
    ids = lm16.tokenizer.encode("the quick brown")
    model = lm16.model
    layers = list(range(model.cfg.n_layers + 1))
    got = logit_lens(lm16, ids, layers, top_k=3)
    states: list[torch.Tensor] = []
    with torch.inference_mode():
        positions = torch.arange(len(ids))[None]
        model._run(torch.tensor([ids]), positions, mask=None, is_causal=True, states=states)
        for lens in got:
            probs = torch.softmax(model.logits(model.norm_f(states[lens.layer][0])).float(), dim=-1)
            for pos, (top_ids, top_probs) in enumerate(zip(lens.top_ids, lens.top_probs, strict=True)):
                assert top_probs == pytest.approx(probs[pos].topk(3).values.tolist(), abs=1e-6), (lens.layer, pos)
                assert [float(probs[pos, t]) for t in top_ids] == pytest.approx(top_probs, abs=1e-6)


def test_bfloat16_text_embeddings_are_normalised_in_float32(lm16):
    """An LM's embeddings in bfloat16: the mean of its bfloat16 final states over each input's tokens (padding left
    out), normalised in float32: unit vectors to float32's precision, not to bfloat16's (about 1e-3)."""
    inputs = [lm16.tokenizer.encode("the quick brown fox"), lm16.tokenizer.encode("lazy dog")]
    got = embed_token_lists(lm16, inputs)
    assert got.dtype == torch.float32
    assert got.norm(dim=-1).tolist() == pytest.approx([1.0, 1.0], abs=1e-5)
    with torch.inference_mode():
        for ids in inputs:  # each input alone (no padding), as the reference's forward pass computes it
            alone = embed_token_lists(lm16, [ids])[0]
            states = lm16.model.hidden_states(torch.tensor([ids]))
            mean = states.sum(1) / torch.tensor([len(ids)], dtype=states.dtype)[:, None]
            assert torch.allclose(alone, F.normalize(mean.float(), dim=-1)[0], atol=1e-6)


def test_float16_loads_in_float16_and_bfloat16_in_bfloat16(dirs):
    """--dtype names the precision served: float16 and bfloat16 are different formats (float16 has 3 more bits of
    mantissa), and neither stands for the other."""
    assert checkpoint.resolve_dtype("float16", torch.device("cpu")) == torch.float16
    assert checkpoint.resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    assert checkpoint.load(Path(dirs["lm"]), dtype="float16").dtype == torch.float16
