"""Attention backends and masks: sdpa == math, probabilities are distributions, masks mean what they say."""

import pytest
import torch

from tserve.model.attention import (
    Attention,
    causal_mask,
    get_backend,
    math_attention,
    padding_mask,
    resolve_backend,
    sdpa_attention,
)

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels


def _qkv(B=2, H=3, Tq=5, Tk=5, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, Tq, D, generator=g), torch.randn(B, H, Tk, D, generator=g),
            torch.randn(B, H, Tk, D, generator=g))


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape", [(5, 5), (1, 7), (3, 9)])
def test_sdpa_equals_math(is_causal, shape):
    q, k, v = _qkv(Tq=shape[0], Tk=shape[1])
    lengths = torch.tensor([shape[1], max(shape[1] - 2, shape[1] - shape[0] + 1)])
    for mask in (None, padding_mask(lengths, shape[1])):
        ref, probs = math_attention(q, k, v, mask, is_causal)
        out, none = sdpa_attention(q, k, v, mask, is_causal)
        assert none is None
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(probs.sum(-1), torch.ones_like(probs.sum(-1)), atol=1e-6, rtol=0)


def test_causal_probabilities_zero_above_diagonal_bottom_right_aligned():
    q, k, v = _qkv(Tq=3, Tk=6)
    _, probs = math_attention(q, k, v, None, True)
    # Query i is position 3 + i of 6: it may see keys 0..3+i.
    for i in range(3):
        assert torch.all(probs[..., i, 4 + i :] == 0)
        assert torch.all(probs[..., i, : 4 + i] > 0)


def test_padding_mask_zeroes_padded_keys():
    q, k, v = _qkv()
    lengths = torch.tensor([5, 2])
    _, probs = math_attention(q, k, v, padding_mask(lengths, 5), False)
    assert torch.all(probs[1, ..., 2:] == 0)
    assert torch.all(probs[0] > 0)


def test_causal_mask_against_positions():
    m = causal_mask(torch.tensor([[2], [0]]), 4)
    assert m.shape == (2, 1, 1, 4)
    assert m[0, 0, 0].tolist() == [True, True, True, False]
    assert m[1, 0, 0].tolist() == [True, False, False, False]


def test_module_weights_whatever_backend_and_permutation_equivariance():
    torch.manual_seed(0)
    attn = Attention(16, 4, backend="sdpa").eval()
    x = torch.randn(2, 6, 16)
    out_sdpa, none = attn(x)
    out_math, probs = attn(x, need_weights=True)
    assert none is None and probs.shape == (2, 4, 6, 6)
    torch.testing.assert_close(out_sdpa, out_math, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 4, 6), atol=1e-6, rtol=0)
    perm = torch.randperm(6)
    permuted, _ = attn(x[:, perm])
    torch.testing.assert_close(permuted, out_sdpa[:, perm], atol=1e-5, rtol=1e-5)


def test_cross_attention_uses_context():
    torch.manual_seed(0)
    attn = Attention(16, 2, cross=True).eval()
    x, ctx = torch.randn(1, 3, 16), torch.randn(1, 5, 16)
    out1, _ = attn(x, context=ctx)
    out2, _ = attn(x, context_kv=attn.project_kv(ctx))
    torch.testing.assert_close(out1, out2)
    out3, _ = attn(x, context=torch.randn(1, 5, 16))
    assert not torch.allclose(out1, out3)


def test_backend_names():
    assert resolve_backend("auto") == "cpu-decode"  # on the CPU, where its kernel builds (tests/model/test_cpu_decode.py)
    assert get_backend("math") is math_attention
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend("nope")
    with pytest.raises(ValueError, match="CUDA"):
        resolve_backend("flash", "cpu")


@pytest.mark.parametrize("backend", ["sdpa", "math"])
@pytest.mark.parametrize("Tq", [1, 6])
def test_grouped_query_attention_equals_repeated_kv_heads(backend, Tq):
    """Query head j reads kv head j // (H / KV), one query (decode) or many (prefill), with a padding mask."""
    from tserve.model.attention import _grouped

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, Tq, 8, generator=g)
    k, v = torch.randn(2, 2, 9, 8, generator=g), torch.randn(2, 2, 9, 8, generator=g)
    mask = padding_mask(torch.tensor([9, 7]), 9)
    got, _ = _grouped(get_backend(backend), q, k, v, mask, Tq > 1, 0.0)
    expected = torch.cat([math_attention(q[:, h:h + 1], k[:, h // 3:h // 3 + 1], v[:, h // 3:h // 3 + 1], mask,
                                         Tq > 1)[0] for h in range(6)], dim=1)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
