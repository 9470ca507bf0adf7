// Attention of a prompt's positions on the CPU (prefill; an encoder's unmasked pass): each kv head's query heads
// together, a block of their rows at a time, over keys transposed once so that a score tile is a run of
// multiply-adds with no horizontal sums (the layout a GEMM's packing gives), a row tile's scores kept whole (its
// keys up to the last it may attend to, a few hundred KB at most in L2) and turned into weights in one pass, then
// the values summed under them. PyTorch's CPU flash attention (SDPA) takes its keys in blocks, rescales its running
// sums at each, and repeats grouped kv heads for their query heads first.
//
// Float32. q (B, Tq, H, D), k and v (B, Tk, KV, D), any strides but the channels'; causal: query t of row b is
// position starts[b] + t (default Tk - Tq: the last Tq of the keys) and attends to keys [0, starts[b] + t] (a prompt
// after its cached prefix; a row's padding past Tk to all), otherwise to all. AVX-512
// (F, VL, DQ) and AVX2 paths (`prefill_tiles.h` written once for both), D a multiple of their lanes.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "vector_math.h"

void check_block_isa(const std::string& isa);

#if defined(TSERVE_VECTOR_MATH)  // x86-64 with AVX2 and FMA, what the kernels are compiled for there

namespace {

// The query rows a block attends with: the kv head's query heads at each of its positions, position by position
// (so their causal limits never decrease), already scaled; each row's keys [0, limit) and its output row.
struct QueryBlock {
  const float* qs;
  const int64_t* limit;
  float* const* out;
  int64_t rows;
};

}  // namespace

namespace prefill_avx2 {

using vec = __m256;
constexpr int64_t kW = 8, kRows = 6, kKeyVecs = 2, kValueVecs = 2;  // 12 accumulators of 16 registers
inline vec load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, vec x) { _mm256_storeu_ps(p, x); }
inline vec set1(float x) { return _mm256_set1_ps(x); }
inline vec zero() { return _mm256_setzero_ps(); }
inline vec fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec add(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec sub(vec a, vec b) { return _mm256_sub_ps(a, b); }
inline vec mul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec max(vec a, vec b) { return _mm256_max_ps(a, b); }
inline float reduce_add(vec x) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, x);
  float total = 0.0f;
  for (float lane : lanes) total += lane;
  return total;
}
inline float reduce_max(vec x) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, x);
  return *std::max_element(lanes, lanes + 8);
}
inline vec exp_nonpositive(vec x) { return tserve_vector::exp_nonpositive(x); }

#include "prefill_tiles.h"

}  // namespace prefill_avx2

#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512dq,fma")

namespace prefill_avx512 {

using vec = __m512;
constexpr int64_t kW = 16, kRows = 6, kKeyVecs = 4, kValueVecs = 4;  // 24 accumulators of 32 registers
inline vec load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, vec x) { _mm512_storeu_ps(p, x); }
inline vec set1(float x) { return _mm512_set1_ps(x); }
inline vec zero() { return _mm512_setzero_ps(); }
inline vec fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec add(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec sub(vec a, vec b) { return _mm512_sub_ps(a, b); }
inline vec mul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec max(vec a, vec b) { return _mm512_max_ps(a, b); }
inline float reduce_add(vec x) { return _mm512_reduce_add_ps(x); }
inline float reduce_max(vec x) { return _mm512_reduce_max_ps(x); }
// vector_math.h's exp_nonpositive (Cephes' polynomial), 16 lanes at a time.
inline vec exp_nonpositive(vec x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);
  const vec n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  vec r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  vec p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const vec e = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  const __m512i two_n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(e, _mm512_castsi512_ps(two_n));
}

#include "prefill_tiles.h"

}  // namespace prefill_avx512

#pragma GCC pop_options

namespace {

constexpr int64_t kKeyPad = 64;      // the transposed keys' rows padded to a multiple of every path's key tile
constexpr int64_t kBlockRows = 48;   // query rows a task takes (its kv head's query heads x positions)

using AttendBlock = void (*)(const QueryBlock&, const float*, int64_t, const float*, int64_t, int64_t, float*,
                             int64_t);

// Blocks taken alternately from the two ends of the positions, so that a thread given half the list (a parallel
// loop's static split) gets as much causal work as the other: block i's keys grow with i.
int64_t interleaved(int64_t i, int64_t n) { return i % 2 == 0 ? i / 2 : n - 1 - i / 2; }

}  // namespace

#endif  // TSERVE_VECTOR_MATH

// The attention of q over k, v (see the top of the file) -> (B, Tq, H, D), contiguous. isa: "avx512" or "avx2".
torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, bool causal, double scale,
                                const std::string& isa, c10::optional<torch::Tensor> starts) {
  check_block_isa(isa);
#if !defined(TSERVE_VECTOR_MATH)
  TORCH_CHECK(false, "prefill_attention is built for x86-64 only");
  (void)q, (void)k, (void)v, (void)causal, (void)scale, (void)starts;
  return {};
#else
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v: (B, T, heads, D)");
  TORCH_CHECK(q.scalar_type() == torch::kFloat && k.scalar_type() == torch::kFloat &&
                  v.scalar_type() == torch::kFloat, "float32 only");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "each head's channels contiguous");
  const int64_t B = q.size(0), Tq = q.size(1), H = q.size(2), D = q.size(3);
  const int64_t Tk = k.size(1), KV = k.size(2);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == B && k.size(3) == D, "k and v: (B, Tk, KV, D) as q");
  TORCH_CHECK(KV > 0 && H % KV == 0, "query heads a multiple of kv heads");
  const bool wide = isa == "avx512";
  const int64_t lanes = wide ? prefill_avx512::kW : prefill_avx2::kW;
  TORCH_CHECK(D % lanes == 0, "D a multiple of ", lanes, " on the ", isa, " path");
  TORCH_CHECK(!causal || starts.has_value() || Tq <= Tk, "causal queries are the last Tq of Tk positions");
  std::vector<int64_t> first(B, Tk - Tq);  // each row's first query position
  if (starts.has_value()) {
    const auto s = starts->contiguous();  // held: its data is read below
    TORCH_CHECK(s.dim() == 1 && s.size(0) == B && s.scalar_type() == torch::kLong && s.device().is_cpu(),
                "starts: (B,) int64 on the CPU");
    const auto* sp = s.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(0 <= sp[b] && sp[b] < Tk, "starts[", b, "] = ", sp[b], " is not a position of the ", Tk, " keys");
      first[b] = sp[b];
    }
  }
  const AttendBlock attend = wide ? prefill_avx512::attend_block : prefill_avx2::attend_block;
  auto out = torch::empty({B, Tq, H, D}, q.options().memory_format(torch::MemoryFormat::Contiguous));
  if (B == 0 || Tq == 0 || H == 0) return out;
  TORCH_CHECK(Tk > 0, "no keys to attend to");

  // The keys transposed: kt[b][g] is (D, ldk), its columns past Tk zero (scored, then never weighed).
  const int64_t ldk = (Tk + kKeyPad - 1) / kKeyPad * kKeyPad;
  auto kt = torch::empty({B, KV, D, ldk}, q.options());
  const float* kp = k.data_ptr<float>();
  float* ktp = kt.data_ptr<float>();
  at::parallel_for(0, B * KV, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bg = begin; bg < end; ++bg) {
      const int64_t b = bg / KV, g = bg % KV;
      const float* src = kp + b * k.stride(0) + g * k.stride(2);
      float* dst = ktp + bg * D * ldk;
      for (int64_t t0 = 0; t0 < ldk; t0 += 16) {  // 16 keys at a time: each of their channels' runs is one line
        for (int64_t d = 0; d < D; ++d) {
          float* row = dst + d * ldk + t0;
          for (int64_t t = 0; t < 16; ++t) row[t] = t0 + t < Tk ? src[(t0 + t) * k.stride(1) + d] : 0.0f;
        }
      }
    }
  });

  const int64_t group = H / KV;
  const int64_t positions = std::max<int64_t>(1, kBlockRows / group);  // a block's positions
  const int64_t blocks = (Tq + positions - 1) / positions;
  const float* qp = q.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * KV * blocks, 1, [&](int64_t begin, int64_t end) {
    const int64_t most = positions * group;
    std::vector<float> qs(most * D), scores(most * ldk);
    std::vector<int64_t> limit(most);
    std::vector<float*> rows(most);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bg = task / blocks, n = interleaved(task % blocks, blocks);
      const int64_t b = bg / KV, g = bg % KV;
      const int64_t t0 = n * positions, t1 = std::min(Tq, t0 + positions);
      int64_t r = 0;
      for (int64_t t = t0; t < t1; ++t) {
        for (int64_t h = g * group; h < (g + 1) * group; ++h, ++r) {
          const float* src = qp + b * q.stride(0) + t * q.stride(1) + h * q.stride(2);
          for (int64_t d = 0; d < D; ++d) qs[r * D + d] = src[d] * static_cast<float>(scale);
          limit[r] = causal ? std::min(first[b] + t + 1, Tk) : Tk;
          rows[r] = op + ((b * Tq + t) * H + h) * D;
        }
      }
      const QueryBlock block{qs.data(), limit.data(), rows.data(), r};
      attend(block, ktp + bg * D * ldk, ldk, vp + b * v.stride(0) + g * v.stride(2), v.stride(1), D,
             scores.data(), ldk);
    }
  });
  return out;
#endif
}
