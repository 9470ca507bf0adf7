// A float32 linear layer for a few rows (a decode step's): out (M, N) = x (M, K) @ w (N, K)^T + bias, the weight
// read as `nn.Linear` stores it. A decode step's products are a pass over their weights each, and there the
// reading is the work: each thread streams its own blocks of 8 weight rows once, and every input row is multiplied
// against a block while the block is in cache (two rows at a time, each weight vector loaded once for both).
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

// Weight rows r0 .. r0 + 4 of a block (w: the block's first row) against input rows m and m + 1: 8 dot products,
// each 8 lanes wide in order over K (each weight vector read once for both rows).
inline void four_by_two(const float* xm, const float* w, int64_t K, int64_t whole, int64_t r0, __m256* acc) {
  for (int64_t k = 0; k < whole; k += 8) {
    const __m256 x0 = _mm256_loadu_ps(xm + k), x1 = _mm256_loadu_ps(xm + K + k);
    for (int64_t r = 0; r < 4; ++r) {
      const __m256 wv = _mm256_loadu_ps(w + (r0 + r) * K + k);
      acc[r] = _mm256_fmadd_ps(wv, x0, acc[r]);
      acc[4 + r] = _mm256_fmadd_ps(wv, x1, acc[4 + r]);
    }
  }
}

// out[m, n0 + r] for the block's `rows` weight rows (w: the first; rows <= 8) and every input row m. Rows go in
// pairs through whole blocks (the weight read once a pair), alone otherwise; each output's arithmetic is the same
// either way.
void block_rows(const float* x, const float* w, const float* bias, float* out, int64_t M, int64_t K, int64_t N,
                int64_t n0, int64_t rows) {
  const int64_t whole = K & ~int64_t{7};
  alignas(32) float sums[2][kRows];
  auto finish = [&](int64_t m, const float* s) {
    const float* xm = x + m * K;
    for (int64_t r = 0; r < rows; ++r) {
      float total = s[r];
      for (int64_t k = whole; k < K; ++k) total += w[r * K + k] * xm[k];
      out[m * N + n0 + r] = bias != nullptr ? total + bias[n0 + r] : total;
    }
  };
  int64_t m = 0;
  if (rows == kRows) {
    for (; m + 2 <= M; m += 2) {
      __m256 acc[2][kRows];
      for (int64_t half = 0; half < 2; ++half) {  // weight rows 0-3, then 4-7, of rows m and m + 1
        __m256 part[8];
        for (auto& a : part) a = _mm256_setzero_ps();
        four_by_two(x + m * K, w, K, whole, 4 * half, part);
        for (int64_t r = 0; r < 4; ++r) {
          acc[0][4 * half + r] = part[r];
          acc[1][4 * half + r] = part[4 + r];
        }
      }
      _mm256_store_ps(sums[0], tserve_vector::lane_sums(acc[0]));
      _mm256_store_ps(sums[1], tserve_vector::lane_sums(acc[1]));
      finish(m, sums[0]);
      finish(m + 1, sums[1]);
    }
  }
  for (; m < M; ++m) {
    const float* xm = x + m * K;
    __m256 acc[kRows];
    for (auto& a : acc) a = _mm256_setzero_ps();
    if (rows == kRows) {  // (a constant bound: the accumulators stay in registers)
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
    _mm256_store_ps(sums[0], tserve_vector::lane_sums(acc));
    finish(m, sums[0]);
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
