// The per-row affine mapping around an int8 GEMM (`model.quantize.Int8Linear`), one pass in and one out instead of
// a chain of PyTorch element-wise calls (eight to fifteen per layer, each a pass over the rows and a dispatch).
// Every value is computed with the same float32 operations in the same order as that chain (its fused
// multiply-adds where it has them, none elsewhere: built with -ffp-contract=off), so the results are bitwise the
// same.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>
#include <vector>

#include "int8_row_range.h"

namespace {

constexpr float kSplit = 128.0f;  // a 14-bit code is 128 x its high half + its low half
constexpr float kSplitLevels = 127.0f * 128.0f;
using tserve::grain_rows;

}  // namespace

// x (N, K) -> {the GEMM's input: (x - min) / span per row (N, K), or with `split` each row's 14-bit code as its
// low halves then its high halves (2N, K); each row's min (N, 1); its span (N, 1), divided by the code's
// levels with `split`}.
std::vector<torch::Tensor> int8_rows_in(torch::Tensor x, bool split) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: (N, K) float32");
  const int64_t N = x.size(0), K = x.size(1);
  auto gemm_in = torch::empty({split ? 2 * N : N, K}, x.options());
  auto low = torch::empty({N, 1}, x.options()), span = torch::empty({N, 1}, x.options());
  const float* xs = x.data_ptr<float>();
  float *in = gemm_in.data_ptr<float>(), *lows = low.data_ptr<float>(), *spans = span.data_ptr<float>();
  at::parallel_for(0, N, grain_rows(K), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xs + r * K;
      float lo, s;
      tserve::row_range(row, K, lo, s);
      lows[r] = lo;
      if (!split) {
        float* out = in + r * K;
        for (int64_t k = 0; k < K; ++k) out[k] = (row[k] - lo) / s;  // (rows - low).div_(span)
        spans[r] = s;
        continue;
      }
      const float scale = (1.0f / s) * kSplitLevels;  // _SPLIT_LEVELS / span: reciprocal, then the product
      float *low_half = in + r * K, *high_half = in + (N + r) * K;
      for (int64_t k = 0; k < K; ++k) {
        const float code = std::nearbyint((row[k] - lo) * scale);  // round_(): half to even
        const float high = std::floor(code / kSplit);
        high_half[k] = high;
        low_half[k] = code - kSplit * high;
      }
      spans[r] = s / kSplitLevels;
    }
  });
  return {gemm_in, low, span};
}

// The GEMM's product (N, M), or (2N, M) with `split` (the low halves' rows, then the high halves') -> x W^T + b:
// bias + min * rowsum(W) + span * product, per row.
torch::Tensor int8_rows_out(torch::Tensor product, torch::Tensor low, torch::Tensor span, torch::Tensor row_sums,
                            c10::optional<torch::Tensor> bias, bool split) {
  TORCH_CHECK(product.dim() == 2 && product.scalar_type() == torch::kFloat && product.is_contiguous(), "product");
  const int64_t N = low.size(0), M = product.size(1);
  TORCH_CHECK(product.size(0) == (split ? 2 * N : N) && span.size(0) == N && row_sums.numel() == M, "shapes");
  TORCH_CHECK(low.is_contiguous() && span.is_contiguous() && row_sums.is_contiguous(), "contiguous");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == M && bias->is_contiguous() && bias->scalar_type() == torch::kFloat, "bias");
    b = bias->data_ptr<float>();
  }
  // Written over the product (the GEMM's own output, which no one else holds; `split`: over its first N rows,
  // each read before it is written): an output layer's product is the step's largest tensor (NLLB: 128 beams x
  // 256k columns, 131 MB), and a fresh one of that size is fresh pages to fault in and zero on every step.
  const float *p = product.data_ptr<float>(), *lows = low.data_ptr<float>(), *spans = span.data_ptr<float>();
  const float* sums = row_sums.data_ptr<float>();
  float* o = product.data_ptr<float>();
  at::parallel_for(0, N, grain_rows(M), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float *pr = p + r * M, *ph = split ? p + (N + r) * M : nullptr;
      const float lo = lows[r], s = spans[r];
      float* orow = o + r * M;
      for (int64_t m = 0; m < M; ++m) {
        const float prod = split ? pr[m] + kSplit * ph[m] : pr[m];  // add(low products, high products, alpha=128)
        // PyTorch's addcmul is one fused multiply-add on its vectorised CPU kernels: so here.
        const float base = b != nullptr ? std::fma(lo, sums[m], b[m]) : lo * sums[m];  // addcmul(bias, low, sums)
        orow[m] = std::fma(prod, s, base);  // addcmul_(product, span)
      }
    }
  });
  return split ? product.narrow(0, 0, N) : product;
}
