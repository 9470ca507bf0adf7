// A float32 linear layer for a few rows (a decode step's): out (M, N) = x (M, K) @ w (N, K)^T + bias, the weight
// read as `nn.Linear` stores it. A decode step's products are a pass over their weights each, and there the
// reading is the work: each thread streams its own blocks of 24 weight rows, and every input row is multiplied
// against a block while the block is in cache. The multiplying is done in register tiles of R weight rows x C input
// rows, as many accumulators as the vector registers hold beside the vectors loaded (`kHeights2`, `kHeights512`):
// each weight vector loaded once for the tile's C input rows, more products a load than in pairs of rows. On
// AVX-512 a decode batch of up to 8 rows is one tile wide, so its weights are read from memory once and from no
// cache after.
//
// Each output is one dot product, a vector of lanes wide in order over K (the last K % lanes products in a masked
// vector of their own), its lanes then summed in a fixed order (`sum_lanes`): the same arithmetic whatever tile the
// output falls in, so a row's result does not depend on its batch. Two paths: AVX-512 (16 lanes, compiled for it
// by function attributes) and AVX2 + FMA (8 lanes, what the kernels are compiled for on x86-64); `dense_rows`
// takes AVX-512 where the CPU has it and PyTorch's own kernels run at it, `dense_rows_on` the path named.
// Elsewhere `at::linear`.
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <torch/extension.h>

#include <algorithm>
#include <string>
#include <vector>

#include "step_team.h"
#include "vector_math.h"

namespace {

#if defined(TSERVE_VECTOR_MATH)
constexpr int64_t kBlock = 24;  // weight rows a thread's block: a multiple of every tile's height (8, 6, 4, 3)

// One register tile: outputs out[c * N + r] (+ bias[r]) of input rows x + c * K against weight rows w + r * K.
struct Tile {
  const float* x;
  const float* w;
  const float* bias;  // the tile's first column's, or nullptr
  float* out;
  int64_t K, N;
};
using TileFn = void (*)(const Tile&);

// The weight rows after the tile's (the next tile's), at the column the tile is at: a tile of several input rows
// spends longer a weight row than the memory's prefetchers look ahead, and its next rows would start cold (1.3-1.4x
// at 8 rows, docs/benchmarks/fused-decode.md). Not at one input row, which the prefetchers keep up with.
template <int R, int C>
inline void prefetch_next_tile(const Tile& t, int r, int64_t k) {
  if constexpr (C > 1) _mm_prefetch(reinterpret_cast<const char*>(t.w + (R + r) * t.K + k), _MM_HINT_T0);
}

// ---- AVX2: 8 lanes, 16 registers (R x C accumulators, the smaller side's vectors held, one streamed) ----

// The lanes of v summed as ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)), the order of `lane_sums`.
inline float sum_lanes(__m256 v) {
  const __m256 pairs = _mm256_hadd_ps(v, v);
  const __m256 quads = _mm256_hadd_ps(pairs, pairs);
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(quads), _mm256_extractf128_ps(quads, 1)));
}

inline __m256i first_lanes(int64_t n) {  // a mask of the first n (< 8) lanes
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

template <int R, int C, bool kMasked>
inline void step_avx2(const Tile& t, int64_t k, __m256 (&acc)[R][C], __m256i mask) {
  auto load = [&](const float* p) { return kMasked ? _mm256_maskload_ps(p + k, mask) : _mm256_loadu_ps(p + k); };
  if constexpr (R > C) {  // the input rows' vectors held, each weight row's streamed through one register
    __m256 xv[C];
    for (int c = 0; c < C; ++c) xv[c] = load(t.x + c * t.K);
    for (int r = 0; r < R; ++r) prefetch_next_tile<R, C>(t, r, k);
    for (int r = 0; r < R; ++r) {
      const __m256 wv = load(t.w + r * t.K);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(wv, xv[c], acc[r][c]);
    }
  } else {  // the weight rows' vectors held
    __m256 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load(t.w + r * t.K);
    for (int r = 0; r < R; ++r) prefetch_next_tile<R, C>(t, r, k);
    for (int c = 0; c < C; ++c) {
      const __m256 xv = load(t.x + c * t.K);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(wv[r], xv, acc[r][c]);
    }
  }
}

template <int R, int C>
void tile_avx2(const Tile& t) {
  __m256 acc[R][C];
  for (auto& row : acc) {
    for (auto& a : row) a = _mm256_setzero_ps();
  }
  const int64_t whole = t.K & ~int64_t{7};
  for (int64_t k = 0; k < whole; k += 8) step_avx2<R, C, false>(t, k, acc, _mm256_setzero_si256());
  if (whole < t.K) step_avx2<R, C, true>(t, whole, acc, first_lanes(t.K - whole));
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      const float total = sum_lanes(acc[r][c]);
      t.out[c * t.N + r] = t.bias != nullptr ? total + t.bias[r] : total;
    }
  }
}

// ---- AVX-512: 16 lanes, 32 registers ----

#define TSERVE_AVX512 __attribute__((target("avx512f,fma")))

// Lanes i and i + 8 added, then those 8 summed as `sum_lanes` sums them.
TSERVE_AVX512 inline float sum_lanes_512(__m512 v) {
  const __m256 halves = _mm256_add_ps(_mm512_castps512_ps256(v),
                                      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  const __m256 pairs = _mm256_hadd_ps(halves, halves);
  const __m256 quads = _mm256_hadd_ps(pairs, pairs);
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(quads), _mm256_extractf128_ps(quads, 1)));
}

template <bool kMasked>
TSERVE_AVX512 inline __m512 load_512(const float* p, __mmask16 mask) {
  return kMasked ? _mm512_maskz_loadu_ps(mask, p) : _mm512_loadu_ps(p);
}

template <int R, int C, bool kMasked>
TSERVE_AVX512 inline void step_avx512(const Tile& t, int64_t k, __m512 (&acc)[R][C], __mmask16 mask) {
  if constexpr (R > C) {
    __m512 xv[C];
    for (int c = 0; c < C; ++c) xv[c] = load_512<kMasked>(t.x + c * t.K + k, mask);
    for (int r = 0; r < R; ++r) prefetch_next_tile<R, C>(t, r, k);
    for (int r = 0; r < R; ++r) {
      const __m512 wv = load_512<kMasked>(t.w + r * t.K + k, mask);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(wv, xv[c], acc[r][c]);
    }
  } else {
    __m512 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load_512<kMasked>(t.w + r * t.K + k, mask);
    for (int r = 0; r < R; ++r) prefetch_next_tile<R, C>(t, r, k);
    for (int c = 0; c < C; ++c) {
      const __m512 xv = load_512<kMasked>(t.x + c * t.K + k, mask);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(wv[r], xv, acc[r][c]);
    }
  }
}

template <int R, int C>
TSERVE_AVX512 void tile_avx512(const Tile& t) {
  __m512 acc[R][C];
  for (auto& row : acc) {
    for (auto& a : row) a = _mm512_setzero_ps();
  }
  const int64_t whole = t.K & ~int64_t{15};
  for (int64_t k = 0; k < whole; k += 16) step_avx512<R, C, false>(t, k, acc, 0xFFFF);
  if (whole < t.K) step_avx512<R, C, true>(t, whole, acc, static_cast<__mmask16>((1u << (t.K - whole)) - 1u));
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      const float total = sum_lanes_512(acc[r][c]);
      t.out[c * t.N + r] = t.bias != nullptr ? total + t.bias[r] : total;
    }
  }
}

// A path: its tiles' heights by width (input rows, 1 .. the widest), the tiles of that height and of one weight row.
struct Path {
  int widest;
  const int* heights;
  const TileFn* tiles;
  const TileFn* single;
};

constexpr int kHeights2[] = {0, 8, 6, 4, 3};  // R x C + min(R, C) + 1 <= 16 registers
constexpr TileFn kTiles2[] = {nullptr, tile_avx2<8, 1>, tile_avx2<6, 2>, tile_avx2<4, 3>, tile_avx2<3, 4>};
constexpr TileFn kSingle2[] = {nullptr, tile_avx2<1, 1>, tile_avx2<1, 2>, tile_avx2<1, 3>, tile_avx2<1, 4>};
constexpr int kHeights512[] = {0, 8, 8, 8, 6, 4, 4, 3, 3};  // <= 32 registers
constexpr TileFn kTiles512[] = {nullptr,           tile_avx512<8, 1>, tile_avx512<8, 2>,
                                tile_avx512<8, 3>, tile_avx512<6, 4>, tile_avx512<4, 5>,
                                tile_avx512<4, 6>, tile_avx512<3, 7>, tile_avx512<3, 8>};
constexpr TileFn kSingle512[] = {nullptr,           tile_avx512<1, 1>, tile_avx512<1, 2>,
                                 tile_avx512<1, 3>, tile_avx512<1, 4>, tile_avx512<1, 5>,
                                 tile_avx512<1, 6>, tile_avx512<1, 7>, tile_avx512<1, 8>};

const Path kAvx512{8, kHeights512, kTiles512, kSingle512};
const Path kAvx2{4, kHeights2, kTiles2, kSingle2};

bool has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
}

// out[m, n0 .. n0 + rows) for every input row m, rows <= kBlock: the input rows in tiles of the path's widest (the
// rest in one narrower), the weight rows in tiles of the width's height (the last block's rest one by one).
void block_rows(const Path& p, const float* x, const float* w, const float* bias, float* out, int64_t M, int64_t K,
                int64_t N, int64_t n0, int64_t rows) {
  for (int64_t m0 = 0; m0 < M; m0 += p.widest) {
    const int C = static_cast<int>(std::min<int64_t>(p.widest, M - m0));
    const int64_t R = p.heights[C];
    Tile t{x + m0 * K, nullptr, nullptr, nullptr, K, N};
    for (int64_t r0 = 0; r0 < rows;) {
      const bool whole = r0 + R <= rows;
      t.w = w + (n0 + r0) * K;
      t.bias = bias != nullptr ? bias + n0 + r0 : nullptr;
      t.out = out + m0 * N + n0 + r0;
      (whole ? p.tiles : p.single)[C](t);
      r0 += whole ? R : 1;
    }
  }
}

// out (M, N) = x (M, K) w (N, K)^T + bias, the threads taking blocks of the output columns.
void rows_on(const Path& p, const float* x, const float* w, const float* bias, float* out, int64_t M, int64_t K,
             int64_t N) {
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  tserve::parallel_for(0, blocks, 1, [=, &p](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const int64_t n0 = block * kBlock;
      block_rows(p, x, w, bias, out, M, K, N, n0, std::min(kBlock, N - n0));
    }
  });
}

// This process's path: AVX-512 where the CPU has it and PyTorch's own kernels run at it (not held to AVX2:
// `ATEN_CPU_CAPABILITY`, as `tserve.testing.avx2_only` sets), decided once.
const Path& process_path() {
  static const Path& path = has_avx512() && at::get_cpu_capability() == "AVX512" ? kAvx512 : kAvx2;
  return path;
}
#endif

}  // namespace

// The weight (N, K) as `dense_rows_into` splits it over threads: a block of rows an item.
tserve::Upcoming dense_rows_upcoming(const float* w, int64_t K, int64_t N) {
#if defined(TSERVE_VECTOR_MATH)
  return tserve::Upcoming{reinterpret_cast<const char*>(w), kBlock * K * static_cast<int64_t>(sizeof(float)),
                          (N + kBlock - 1) / kBlock, nullptr, 0};
#else
  return tserve::Upcoming{};  // `at::linear`'s own split
#endif
}

// `dense_rows` on float32 rows and weights the caller has checked, into out (M, N) (a fused decode step).
void dense_rows_into(const float* x, int64_t M, int64_t K, const float* w, int64_t N, const float* bias, float* out) {
#if defined(TSERVE_VECTOR_MATH)
  rows_on(process_path(), x, w, bias, out, M, K, N);
#else
  const auto options = torch::TensorOptions().dtype(torch::kFloat);
  const auto b = bias != nullptr ? c10::optional<torch::Tensor>(torch::from_blob(const_cast<float*>(bias), {N}, options))
                                 : c10::nullopt;
  const auto result = at::linear(torch::from_blob(const_cast<float*>(x), {M, K}, options),
                                 torch::from_blob(const_cast<float*>(w), {N, K}, options), b);
  std::copy(result.data_ptr<float>(), result.data_ptr<float>() + M * N, out);
#endif
}

// The paths this CPU runs the product on: "avx2", and "avx512" where it has AVX-512F; none off x86-64.
std::vector<std::string> dense_rows_paths() {
#if defined(TSERVE_VECTOR_MATH)
  if (has_avx512()) return {"avx2", "avx512"};
  return {"avx2"};
#else
  return {};
#endif
}

// The product on a named path (`dense_rows_paths`).
torch::Tensor dense_rows_on(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias,
                            const std::string& path) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "dense_rows: x (M, K), w (N, K)");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat, "dense_rows: float32");
  TORCH_CHECK(!bias.has_value() || (bias->numel() == w.size(0) && bias->scalar_type() == torch::kFloat),
              "dense_rows: bias (N,) float32");
  const auto paths = dense_rows_paths();
  TORCH_CHECK(std::find(paths.begin(), paths.end(), path) != paths.end(), "this CPU does not run dense_rows' ",
              path, " path");
#if defined(TSERVE_VECTOR_MATH)
  const Path& p = path == "avx512" ? kAvx512 : kAvx2;
  x = x.contiguous();
  w = w.contiguous();
  const auto b = bias.has_value() ? bias->contiguous() : torch::Tensor();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto out = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  rows_on(p, xp, wp, bp, op, M, K, N);
  return out;
#else
  return at::linear(x, w, bias);  // (unreached: no path is run here)
#endif
}

// The product on this process's path (`process_path`); `at::linear` off x86-64.
torch::Tensor dense_rows(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
#if defined(TSERVE_VECTOR_MATH)
  return dense_rows_on(std::move(x), std::move(w), std::move(bias), &process_path() == &kAvx512 ? "avx512" : "avx2");
#else
  return at::linear(x, w, bias);
#endif
}
