// A float32 linear layer for a few rows (a decode step's): out (M, N) = x (M, K) @ w (N, K)^T + bias, the weight
// read as `nn.Linear` stores it. A decode step's products are a pass over their weights each, and there the
// reading is the work: each thread streams its own blocks of 8 weight rows once, and every input row is multiplied
// against a block while the block is in cache. oneDNN's pre-packed product (`model.packed_linear`) read the same
// weights at two thirds of this speed on one row, and stalled whenever another thread took one of its cores.
//
// Each output is one dot product, 8 lanes wide in order over K, its lanes then summed (`lane_sums`), the last
// K % 8 products added after: the same arithmetic whatever the number of rows, so a row's result does not depend
// on its batch. AVX2 + FMA (what the kernels are compiled for on x86-64); elsewhere `at::linear`.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>

#include "vector_math.h"

namespace {

#if defined(TSERVE_VECTOR_MATH)
constexpr int64_t kRows = 8;  // weight rows a block

// out[m, n0 .. n0 + rows) of every input row m, from the block of weight rows starting at w (rows <= 8).
void block_rows(const float* x, const float* w, const float* bias, float* out, int64_t M, int64_t K, int64_t N,
                int64_t n0, int64_t rows) {
  const int64_t whole = K & ~int64_t{7};
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * K;
    __m256 acc[kRows];
    for (auto& a : acc) a = _mm256_setzero_ps();
    if (rows == kRows) {
      for (int64_t k = 0; k < whole; k += 8) {
        const __m256 xv = _mm256_loadu_ps(xm + k);
        for (int64_t r = 0; r < kRows; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(w + r * K + k), xv, acc[r]);
      }
    } else {
      for (int64_t k = 0; k < whole; k += 8) {
        const __m256 xv = _mm256_loadu_ps(xm + k);
        for (int64_t r = 0; r < rows; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(w + r * K + k), xv, acc[r]);
      }
    }
    alignas(32) float sums[kRows];
    _mm256_store_ps(sums, tserve_vector::lane_sums(acc));
    for (int64_t r = 0; r < rows; ++r) {
      float s = sums[r];
      for (int64_t k = whole; k < K; ++k) s += w[r * K + k] * xm[k];
      out[m * N + n0 + r] = bias != nullptr ? s + bias[n0 + r] : s;
    }
  }
}
#endif

}  // namespace

torch::Tensor dense_rows(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "dense_rows: x (M, K), w (N, K)");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat, "dense_rows: float32");
  TORCH_CHECK(!bias.has_value() || (bias->numel() == w.size(0) && bias->scalar_type() == torch::kFloat),
              "dense_rows: bias (N,) float32");
#if defined(TSERVE_VECTOR_MATH)
  x = x.contiguous();
  w = w.contiguous();
  const auto b = bias.has_value() ? bias->contiguous() : torch::Tensor();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto out = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t blocks = (N + kRows - 1) / kRows;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const int64_t n0 = block * kRows;
      block_rows(xp, wp + n0 * K, bp, op, M, K, N, n0, std::min(kRows, N - n0));
    }
  });
  return out;
#else
  return at::linear(x, w, bias);
#endif
}
