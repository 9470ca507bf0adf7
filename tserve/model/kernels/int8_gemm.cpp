// An int8 linear layer with 8-bit activations that is exact on every x86 CPU with AVX2 (`model.quantize`'s `full`
// activations where PyTorch's kernel cannot take them).
//
// Without VNNI, fbgemm multiplies u8 activations by s8 weights with `vpmaddubsw`, which sums each pair of products
// into a saturating int16: 255 x 127 x 2 overflows it, so 8-bit activations come out wrong and PyTorch feeds 7-bit
// ones (or `split` feeds two 7-bit halves, a GEMM of twice the rows). Here the weights are widened to int16 in
// registers (`vpmovsxbw`) and multiplied by the activations with `vpmaddwd`, which sums each pair into an int32: no
// product or pair sum can overflow, and the int32 sums are exact. That is one multiply instruction per 16
// multiply-adds, as many as `vpmaddubsw` + its `vpmaddwd` widening give, so one 8-bit GEMM costs about what one
// 7-bit GEMM costs; the weights stay int8 in memory.
//
// Each row is mapped onto its own range (as `Int8Linear` does for PyTorch's kernel): code = round((x - min) /
// span * 255), 0..255; the output is bias + min * rowsum(W) + span * (W_scale / 255) * (W_int8 . code), per row.
// A row's result depends on that row only: the same alone and in any batch.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "int8_row_range.h"
#include "linear_args.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kCols = 16;  // output columns per packed panel: two vectors of 8 int32 sums
constexpr int kMaxRows = 6;    // rows per register tile: 6 x 2 accumulators + 2 weight vectors + 1 broadcast
constexpr float kLevels = 255.0f;

// Rows [0, rows) of `codes` (int16, `pairs` x 2 a row) times one panel of weights ((pairs, kCols, 2) int8) ->
// sums (rows, kCols) int32.
template <int kRows>
void tile(const int16_t* codes, int64_t code_stride, const int8_t* panel, int64_t pairs, int32_t* sums) {
#if defined(__AVX2__)
  // Named accumulators (an array of vectors makes GCC copy them around every iteration); the rows a tile does
  // not have are compiled out.
  __m256i c00 = _mm256_setzero_si256(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00,
          c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  const int16_t* a0 = codes;
  for (int64_t p = 0; p < pairs; ++p) {
    const int8_t* w = panel + p * kCols * 2;
    const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16)));
#define TSERVE_ROW(r, lo, hi)                                                      \
    if constexpr (kRows > r) {                                                   \
      int32_t pair; /* this row's two codes at k = 2p, 2p + 1 */                 \
      std::memcpy(&pair, a0 + r * code_stride + 2 * p, sizeof(pair));            \
      const __m256i a = _mm256_set1_epi32(pair);                                 \
      lo = _mm256_add_epi32(lo, _mm256_madd_epi16(a, w0));                       \
      hi = _mm256_add_epi32(hi, _mm256_madd_epi16(a, w1));                       \
    }
    TSERVE_ROW(0, c00, c01)
    TSERVE_ROW(1, c10, c11)
    TSERVE_ROW(2, c20, c21)
    TSERVE_ROW(3, c30, c31)
    TSERVE_ROW(4, c40, c41)
    TSERVE_ROW(5, c50, c51)
#undef TSERVE_ROW
  }
  const __m256i results[kMaxRows][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
  for (int r = 0; r < kRows; ++r) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(sums + r * kCols), results[r][0]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(sums + r * kCols + 8), results[r][1]);
  }
#else
  for (int r = 0; r < kRows; ++r) {
    for (int64_t c = 0; c < kCols; ++c) {
      int32_t sum = 0;
      for (int64_t p = 0; p < pairs; ++p) {
        const int8_t* w = panel + p * kCols * 2 + 2 * c;
        sum += codes[r * code_stride + 2 * p] * w[0] + codes[r * code_stride + 2 * p + 1] * w[1];
      }
      sums[r * kCols + c] = sum;
    }
  }
#endif
}

using TileFn = void (*)(const int16_t*, int64_t, const int8_t*, int64_t, int32_t*);
constexpr TileFn kTiles[kMaxRows + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>};

}  // namespace

// W (N, K) int8 -> its panels: (ceil(N / 16), ceil(K / 2), 16, 2) int8, zero-padded: panel j holds output columns
// 16j..16j+15, and for each pair of inputs k = 2p, 2p + 1 the 16 columns' two weights side by side (what one
// `vpmaddwd` takes against a broadcast pair of codes).
torch::Tensor int8_pack_panels(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kChar, "weight: (N, K) int8");
  auto w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kCols - 1) / kCols, pairs = (K + 1) / 2;
  auto packed = torch::zeros({panels, pairs, kCols, 2}, w.options());
  const int8_t* src = w.data_ptr<int8_t>();
  int8_t* dst = packed.data_ptr<int8_t>();
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t k = 0; k < K; ++k) {
      dst[(((n / kCols) * pairs + k / 2) * kCols + n % kCols) * 2 + k % 2] = src[n * K + k];
    }
  }
  return packed;
}

// x (M, K) float32, W's panels (`int8_pack_panels`) -> x W^T + b (M, N) float32. `coefficients` (N): W's scale per
// output column / 255; `row_sums` (N): Σ_k of W's dequantized row (restores each input row's minimum).
torch::Tensor int8_linear_exact(torch::Tensor x, torch::Tensor panels, torch::Tensor coefficients,
                                torch::Tensor row_sums, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: (M, K) float32");
  TORCH_CHECK(panels.dim() == 4 && panels.scalar_type() == torch::kChar && panels.is_contiguous(), "panels");
  const int64_t M = x.size(0), K = x.size(1), pairs = panels.size(1), N = coefficients.numel();
  TORCH_CHECK(pairs == (K + 1) / 2 && panels.size(0) == (N + kCols - 1) / kCols && panels.size(2) == kCols,
              "panels do not match x and the coefficients");
  TORCH_CHECK(row_sums.numel() == N && coefficients.is_contiguous() && row_sums.is_contiguous(), "row sums");
  TORCH_CHECK(coefficients.scalar_type() == torch::kFloat && row_sums.scalar_type() == torch::kFloat, "float32");
  const float* b = tserve::checked_bias(bias, N);
  auto out = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  // Each row's codes (int16, padded to whole pairs with a 0), its minimum and its span.
  const int64_t stride = 2 * pairs;
  std::vector<int16_t> codes(M * stride, 0);
  std::vector<float> lows(M), spans(M);
  const float* xs = x.data_ptr<float>();
  at::parallel_for(0, M, tserve::grain_rows(K), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xs + r * K;
      float lo, span;
      tserve::row_range(row, K, lo, span);
      int16_t* code = codes.data() + r * stride;
      for (int64_t k = 0; k < K; ++k) {
        code[k] = static_cast<int16_t>(std::min(kLevels, std::max(0.0f, std::nearbyint((row[k] - lo) / span * kLevels))));
      }
      lows[r] = lo;
      spans[r] = span;
    }
  });
  const int8_t* w = panels.data_ptr<int8_t>();
  const float *coef = coefficients.data_ptr<float>(), *sums = row_sums.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t n_panels = panels.size(0);
  // Threads split the columns (a decode step has few rows): each reads only its own panels of W.
  at::parallel_for(0, n_panels, 1, [&](int64_t begin, int64_t end) {
    int32_t tile_sums[kMaxRows * kCols];
    for (int64_t j = begin; j < end; ++j) {
      const int8_t* panel = w + j * pairs * kCols * 2;
      const int64_t n0 = j * kCols, cols = std::min(kCols, N - n0);
      for (int64_t r0 = 0; r0 < M; r0 += kMaxRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, M - r0));
        kTiles[rows](codes.data() + r0 * stride, stride, panel, pairs, tile_sums);
        for (int r = 0; r < rows; ++r) {
          const float lo = lows[r0 + r], span = spans[r0 + r];
          float* orow = o + (r0 + r) * N + n0;
          for (int64_t c = 0; c < cols; ++c) {
            const float product = static_cast<float>(tile_sums[r * kCols + c]) * coef[n0 + c];
            const float base = b != nullptr ? std::fma(lo, sums[n0 + c], b[n0 + c]) : lo * sums[n0 + c];
            orow[c] = std::fma(product, span, base);
          }
        }
      }
    }
  });
  return out;
}
