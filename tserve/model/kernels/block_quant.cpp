// Linear layers on block-quantized weights in llama.cpp's Q8_0 and Q4_0 formats (`model.block_quant`): 32 weights
// a block with one float16 scale, int8 codes (Q8_0) or 4-bit codes with an offset of 8 (Q4_0). Each row of the
// input is quantized here to int8 in the same blocks of 32 (one float32 scale a block, llama.cpp's Q8_0 for
// activations), each block's dot product is an exact int32 sum, and the float32 output adds the blocks' terms in
// order:
//
//   out[m, n] = bias[n] + Σ_b float(isum[m, n, b]) * (w_scale[n, b] * x_scale[m, b])     (b = 0, 1, ... in turn)
//
// `model.block_quant.reference_linear` states the same maths as PyTorch calls; every ISA path here equals it bit
// for bit, whatever the number of rows (a row's result is its own: the same alone and in any batch).
//
// The weights are repacked at load (not requantized) into panels of 16 output columns: for each block, the 16
// columns' codes four at a time, so that one vector holds 16 columns x 4 inputs and one `vpdpbusd` (or
// `vpmaddubsw` + `vpmaddwd`) adds each column's 4 products against a broadcast run of 4 activations. The 16
// columns' accumulators are then one vector each, and each block's float terms are added to them in order: the
// order the reference adds them in. Q8_0 codes are stored plus 128 (unsigned, what `vpdpbusd` multiplies by the
// signed activations; each block's 128 x Σ activations is taken off after), Q4_0 codes as llama.cpp's nibbles
// (low: inputs 0..15 of the block, high: 16..31; 0..15 with 8 taken off the same way).
//
// A pass takes a tile of rows over a chunk of blocks of one panel (the chunk stays in L1 while every tile of
// rows reads it): decode steps (1 to 8 rows) read each weight once, as one tile; prefill reads it once per
// chunk. Threads split the panels (the output columns).
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "linear_args.h"
#include "step_team.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define TSERVE_BLOCK_KERNELS 1
#endif

namespace {

constexpr int64_t kBlock = 32;      // weights (and activations) per scale
constexpr int64_t kCols = 16;       // output columns per panel
constexpr int64_t kChunk = 8;       // blocks per pass of a tile of rows over a panel
constexpr int kQ8 = 0, kQ4 = 1;     // formats
constexpr int kAvx2 = 1, kAvx512 = 2;  // instruction sets

int64_t block_bytes(int format) { return format == kQ8 ? kBlock * kCols : kBlock * kCols / 2; }
int32_t code_offset(int format) { return format == kQ8 ? 128 : 8; }

// Each row's activations as int8 codes in blocks of 32, with each block's scale and the sum of its codes.
struct Activations {
  int64_t K = 0, blocks = 0;
  std::vector<int8_t> codes;   // (M, K)
  std::vector<uint8_t> magnitudes;  // (M, K): |codes| (the AVX2 Q8_0 path's unsigned operand), else empty
  std::vector<float> scales;   // (M, blocks)
  std::vector<int32_t> sums;   // (M, blocks)
};

// The same, as the passes read it: plain pointers, copied into each pass (a thread that takes a loop's chunk reads
// them from the loop's own values, not through the posting thread's buffers).
struct ActivationView {
  const int8_t* codes;
  const uint8_t* magnitudes;
  const float* scales;
  const int32_t* sums;
  int64_t K, blocks;
};

#if defined(__AVX2__)
// One block of 32 as below, 8 lanes at a time: the same products (x * (127 / amax) in float32) and the same
// rounding (`vcvtps2dq` rounds half to even, as `std::nearbyint` does in the default mode); the largest magnitude is
// the same whatever order it is taken in.
inline void quantize_block_avx2(const float* v, int8_t* codes, uint8_t* magnitudes, float& scale, int32_t& sum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 x[4], largest = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    x[i] = _mm256_loadu_ps(v + 8 * i);
    largest = _mm256_max_ps(largest, _mm256_andnot_ps(sign, x[i]));
  }
  __m128 half = _mm_max_ps(_mm256_castps256_ps128(largest), _mm256_extractf128_ps(largest, 1));
  half = _mm_max_ps(half, _mm_movehl_ps(half, half));
  half = _mm_max_ss(half, _mm_movehdup_ps(half));
  const float amax = _mm_cvtss_f32(half);
  const __m256 inverse = _mm256_set1_ps(amax != 0.0f ? 127.0f / amax : 0.0f);
  __m256i q[4], total = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(x[i], inverse));
    total = _mm256_add_epi32(total, q[i]);
  }
  // int32 -> int8 in order: the packs interleave 128-bit lanes, the permutation puts them back.
  const __m256i packed = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes), packed);
  if (magnitudes != nullptr) _mm256_storeu_si256(reinterpret_cast<__m256i*>(magnitudes), _mm256_abs_epi8(packed));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  sum = _mm_cvtsi128_si32(s4);
  scale = amax / 127.0f;
}
#endif

// llama.cpp's quantize_row_q8_0: d = amax / 127, code = round-half-even(x * (127 / amax)). Plain float32
// operations (compiled without contraction), as the reference's. Into `a`, whose buffers are reused from call to
// call (a decode step makes ~120 products of one row each: their allocations cost more than quantizing the row).
void quantize_rows(const float* x, int64_t M, int64_t K, bool magnitudes, Activations& a) {
  a.K = K;
  a.blocks = K / kBlock;
  a.codes.resize(M * K);
  a.magnitudes.resize(magnitudes ? M * K : 0);
  a.scales.resize(M * a.blocks);
  a.sums.resize(M * a.blocks);
  tserve::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t b = 0; b < a.blocks; ++b) {
        const float* v = x + m * K + b * kBlock;
#if defined(__AVX2__)
        quantize_block_avx2(v, a.codes.data() + m * K + b * kBlock,
                            magnitudes ? a.magnitudes.data() + m * K + b * kBlock : nullptr, a.scales[m * a.blocks + b],
                            a.sums[m * a.blocks + b]);
#else
        float amax = 0.0f;
        for (int64_t k = 0; k < kBlock; ++k) amax = std::max(amax, std::fabs(v[k]));
        const float inverse = amax != 0.0f ? 127.0f / amax : 0.0f;
        int8_t* code = a.codes.data() + m * K + b * kBlock;
        int32_t sum = 0;
        for (int64_t k = 0; k < kBlock; ++k) {
          code[k] = static_cast<int8_t>(std::nearbyint(v[k] * inverse));
          sum += code[k];
        }
        if (magnitudes) {
          for (int64_t k = 0; k < kBlock; ++k) a.magnitudes[m * K + b * kBlock + k] = std::abs(code[k]);
        }
        a.scales[m * a.blocks + b] = amax / 127.0f;
        a.sums[m * a.blocks + b] = sum;
#endif
      }
    }
  });
}

// One pass: rows [row0, row0 + R) over blocks [b0, b1) of one panel, into out's columns [n0, n0 + cols).
struct Pass {
  ActivationView a;
  int64_t row0, b0, b1, n0, ldo;
  int cols;
  const uint8_t* panel;     // the panel's first block
  const uint16_t* scales;   // the panel's first block's 16 float16 scales
  float* out;
  bool ahead;               // ask for the lines ahead (one tile of rows: each weight is read once, from memory)
};

#if defined(TSERVE_BLOCK_KERNELS)

#define TSERVE_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))
#define TSERVE_AVX2 __attribute__((target("avx2,f16c,fma")))

// A decode step's pass (one tile of rows) asks for its panels' lines 8 KB ahead of the block it multiplies: the
// hardware prefetchers alone leave a thread waiting on each next line when the memory is fast (SmolLM2-135M's Q4_0
// step at ~78 GB/s read 1.97 -> 1.62 ms natively, 2.18 -> 1.83 ms on AVX2 kernels; Q8_0 2.86 -> 2.70; no change at
// ~45 GB/s), and in the taller tiles of several rows at any speed (AVX-512, 8 rows: Q4_0 5.18 -> 4.67 ms a step, Q8_0
// 6.30 -> 5.24; 4 rows: Q4_0 3.07 -> 2.71; docs/benchmarks/step-overhead.md). A prompt's tiles read each chunk from L1
// after the first, and ask for nothing. A prefetch past the panels' end is harmless (it never faults), so the address
// is formed as an integer.
constexpr int64_t kPrefetchBytes = 8192;

template <int kFormat>
inline void prefetch_ahead(const uint8_t* w, const uint16_t* scales) {
  const uintptr_t ahead = reinterpret_cast<uintptr_t>(w) + kPrefetchBytes;
  for (int64_t line = 0; line < block_bytes(kFormat); line += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T0);
  }
  const uintptr_t ahead_scales =
      reinterpret_cast<uintptr_t>(scales) + kPrefetchBytes / block_bytes(kFormat) * kCols * sizeof(uint16_t);
  _mm_prefetch(reinterpret_cast<const char*>(ahead_scales), _MM_HINT_T0);
}

inline int32_t quad(const int8_t* codes) {  // 4 activation codes, to broadcast
  int32_t v;
  std::memcpy(&v, codes, sizeof(v));
  return v;
}

template <int kFormat, int R>
TSERVE_AVX512 void pass_avx512(const Pass& p) {
  const ActivationView& a = p.a;
  const __mmask16 mask = static_cast<__mmask16>((1u << p.cols) - 1u);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = p.b0 == 0 ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, p.out + (p.row0 + r) * p.ldo + p.n0);
  }
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  for (int64_t b = p.b0; b < p.b1; ++b) {
    const uint8_t* w = p.panel + (b - p.b0) * block_bytes(kFormat);
    if (p.ahead) prefetch_ahead<kFormat>(w, p.scales + (b - p.b0) * kCols);
    // Two sums a row (Q8_0: the even and odd runs of 4 inputs; Q4_0: the low and the high nibbles), added at the
    // end (the same int32 total), so that a row's products are two chains of dependent `vpdpbusd`s, not one.
    __m512i isum[R], odd[R];
    for (int r = 0; r < R; ++r) isum[r] = odd[r] = _mm512_setzero_si512();
    if constexpr (kFormat == kQ8) {
      for (int j = 0; j < 8; j += 2) {
        const __m512i even_w = _mm512_loadu_si512(w + 64 * j), odd_w = _mm512_loadu_si512(w + 64 * (j + 1));
        for (int r = 0; r < R; ++r) {
          const int8_t* x = a.codes + (p.row0 + r) * a.K + b * kBlock + 4 * j;
          isum[r] = _mm512_dpbusd_epi32(isum[r], even_w, _mm512_set1_epi32(quad(x)));
          odd[r] = _mm512_dpbusd_epi32(odd[r], odd_w, _mm512_set1_epi32(quad(x + 4)));
        }
      }
    } else {
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512(w + 64 * j);
        const __m512i lo = _mm512_and_si512(v, low_nibbles);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low_nibbles);
        for (int r = 0; r < R; ++r) {
          const int8_t* x = a.codes + (p.row0 + r) * a.K + b * kBlock + 4 * j;
          isum[r] = _mm512_dpbusd_epi32(isum[r], lo, _mm512_set1_epi32(quad(x)));
          odd[r] = _mm512_dpbusd_epi32(odd[r], hi, _mm512_set1_epi32(quad(x + 16)));
        }
      }
    }
    for (int r = 0; r < R; ++r) isum[r] = _mm512_add_epi32(isum[r], odd[r]);
    const __m512 w_scale = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.scales + (b - p.b0) * kCols)));
    for (int r = 0; r < R; ++r) {
      const int64_t at = (p.row0 + r) * a.blocks + b;
      const __m512i exact = _mm512_sub_epi32(isum[r], _mm512_set1_epi32(code_offset(kFormat) * a.sums[at]));
      const __m512 scale = _mm512_mul_ps(w_scale, _mm512_set1_ps(a.scales[at]));
      acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(exact), scale));
    }
  }
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(p.out + (p.row0 + r) * p.ldo + p.n0, mask, acc[r]);
}

// AVX2, 3 or 4 rows: each half of a panel (8 columns) in turn. `vpmaddubsw` sums pairs of u8 x s8 products into a
// saturating int16, so Q8_0 multiplies a magnitude by a signed code carrying the other's sign (`vpsignb`: 2 x 127 x
// 127 fits), and Q4_0 its 0..15 codes by the activations (2 x 2 x 15 x 127 fits even for a low and a high pair
// summed).
template <int kFormat, int R>
TSERVE_AVX2 void half_pass_avx2(const Pass& p, int half) {
  const ActivationView& a = p.a;
  const int cols = std::min(8, p.cols - 8 * half);
  if (cols <= 0) return;
  const int64_t n0 = p.n0 + 8 * half;
  alignas(32) int32_t lanes[8];
  for (int c = 0; c < 8; ++c) lanes[c] = c < cols ? -1 : 0;
  const __m256i mask = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
  __m256 acc[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = p.b0 == 0 ? _mm256_setzero_ps() : _mm256_maskload_ps(p.out + (p.row0 + r) * p.ldo + n0, mask);
  }
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = p.b0; b < p.b1; ++b) {
    const uint8_t* w = p.panel + (b - p.b0) * block_bytes(kFormat) + 32 * half;
    if (p.ahead && half == 0) prefetch_ahead<kFormat>(w, p.scales + (b - p.b0) * kCols);  // the second half: from L1
    __m256i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
    if constexpr (kFormat == kQ8) {
      for (int j = 0; j < 8; ++j) {
        const __m256i signed_w = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * j)), flip);
        // |w| (made once for the rows) times x carrying w's sign (`narrow_pass_avx2`, 1 or 2 rows, takes |x| times w
        // carrying x's sign: no operation on the weights alone).
        const __m256i w_magnitude = _mm256_sign_epi8(signed_w, signed_w);
        for (int r = 0; r < R; ++r) {
          const int64_t at = (p.row0 + r) * a.K + b * kBlock + 4 * j;
          const __m256i signed_x = _mm256_set1_epi32(quad(a.codes + at));
          const __m256i pairs = _mm256_maddubs_epi16(w_magnitude, _mm256_sign_epi8(signed_x, signed_w));
          isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(pairs, ones));
        }
      }
    } else {
      for (int j = 0; j < 4; ++j) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * j));
        const __m256i lo = _mm256_and_si256(v, low_nibbles);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low_nibbles);
        for (int r = 0; r < R; ++r) {
          const int8_t* x = a.codes + (p.row0 + r) * a.K + b * kBlock + 4 * j;
          const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(quad(x))),
                                                 _mm256_maddubs_epi16(hi, _mm256_set1_epi32(quad(x + 16))));
          isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
    const __m256 w_scale = _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p.scales + (b - p.b0) * kCols + 8 * half)));
    for (int r = 0; r < R; ++r) {
      const int64_t at = (p.row0 + r) * a.blocks + b;
      // Q8_0's signed products need no offset taken off here; Q4_0's codes do (8 x Σ activations).
      const int32_t offset = kFormat == kQ8 ? 0 : code_offset(kFormat) * a.sums[at];
      const __m256i exact = _mm256_sub_epi32(isum[r], _mm256_set1_epi32(offset));
      const __m256 scale = _mm256_mul_ps(w_scale, _mm256_set1_ps(a.scales[at]));
      acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(_mm256_cvtepi32_ps(exact), scale));
    }
  }
  for (int r = 0; r < R; ++r) _mm256_maskstore_ps(p.out + (p.row0 + r) * p.ldo + n0, mask, acc[r]);
}

// AVX2, 1 or 2 rows (decode steps): both halves of the panel block by block, each broadcast activation used for
// both, and Q4_0's products summed in int16 over the whole block before they widen (4 x 2 x 2 x 15 x 127 = 30,480
// fits). The same int32 sums as `half_pass_avx2`, added to the accumulators in the same order.
template <int kFormat, int R>
TSERVE_AVX2 void narrow_pass_avx2(const Pass& p) {
  const ActivationView& a = p.a;
  alignas(32) int32_t lanes[16];
  for (int c = 0; c < 16; ++c) lanes[c] = c < p.cols ? -1 : 0;
  const __m256i mask[2] = {_mm256_load_si256(reinterpret_cast<const __m256i*>(lanes)),
                           _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes + 8))};
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) {
    for (int h = 0; h < 2; ++h) {
      float* o = p.out + (p.row0 + r) * p.ldo + p.n0 + 8 * h;
      acc[r][h] = p.b0 == 0 ? _mm256_setzero_ps() : _mm256_maskload_ps(o, mask[h]);
    }
  }
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = p.b0; b < p.b1; ++b) {
    const uint8_t* w = p.panel + (b - p.b0) * block_bytes(kFormat);
    if (p.ahead) prefetch_ahead<kFormat>(w, p.scales + (b - p.b0) * kCols);
    __m256i isum[R][2];
    if constexpr (kFormat == kQ8) {
      for (int r = 0; r < R; ++r) isum[r][0] = isum[r][1] = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) {
        const __m256i w0 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * j)), flip);
        const __m256i w1 =
            _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * j + 32)), flip);
        for (int r = 0; r < R; ++r) {
          const int64_t at = (p.row0 + r) * a.K + b * kBlock + 4 * j;
          const __m256i signed_x = _mm256_set1_epi32(quad(a.codes + at));
          const __m256i x_magnitude = _mm256_set1_epi32(quad(reinterpret_cast<const int8_t*>(&a.magnitudes[at])));
          isum[r][0] = _mm256_add_epi32(
              isum[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(x_magnitude, _mm256_sign_epi8(w0, signed_x)), ones));
          isum[r][1] = _mm256_add_epi32(
              isum[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(x_magnitude, _mm256_sign_epi8(w1, signed_x)), ones));
        }
      }
    } else {
      __m256i pairs[R][2];
      for (int r = 0; r < R; ++r) pairs[r][0] = pairs[r][1] = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {
        const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * j));
        const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * j + 32));
        const __m256i lo0 = _mm256_and_si256(v0, low_nibbles);
        const __m256i hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low_nibbles);
        const __m256i lo1 = _mm256_and_si256(v1, low_nibbles);
        const __m256i hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low_nibbles);
        for (int r = 0; r < R; ++r) {
          const int8_t* x = a.codes + (p.row0 + r) * a.K + b * kBlock + 4 * j;
          const __m256i x_low = _mm256_set1_epi32(quad(x)), x_high = _mm256_set1_epi32(quad(x + 16));
          pairs[r][0] = _mm256_add_epi16(pairs[r][0], _mm256_add_epi16(_mm256_maddubs_epi16(lo0, x_low),
                                                                       _mm256_maddubs_epi16(hi0, x_high)));
          pairs[r][1] = _mm256_add_epi16(pairs[r][1], _mm256_add_epi16(_mm256_maddubs_epi16(lo1, x_low),
                                                                       _mm256_maddubs_epi16(hi1, x_high)));
        }
      }
      for (int r = 0; r < R; ++r) {
        for (int h = 0; h < 2; ++h) isum[r][h] = _mm256_madd_epi16(pairs[r][h], ones);
      }
    }
    const __m256 w_scale[2] = {
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.scales + (b - p.b0) * kCols))),
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.scales + (b - p.b0) * kCols + 8)))};
    for (int r = 0; r < R; ++r) {
      const int64_t at = (p.row0 + r) * a.blocks + b;
      const __m256i offset = _mm256_set1_epi32(kFormat == kQ8 ? 0 : code_offset(kFormat) * a.sums[at]);
      const __m256 x_scale = _mm256_set1_ps(a.scales[at]);
      for (int h = 0; h < 2; ++h) {
        const __m256i exact = _mm256_sub_epi32(isum[r][h], offset);
        acc[r][h] = _mm256_add_ps(acc[r][h],
                                  _mm256_mul_ps(_mm256_cvtepi32_ps(exact), _mm256_mul_ps(w_scale[h], x_scale)));
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int h = 0; h < 2; ++h) _mm256_maskstore_ps(p.out + (p.row0 + r) * p.ldo + p.n0 + 8 * h, mask[h], acc[r][h]);
  }
}

template <int kFormat, int R>
TSERVE_AVX2 void pass_avx2(const Pass& p) {
  if constexpr (R <= 2) {
    narrow_pass_avx2<kFormat, R>(p);
  } else {
    half_pass_avx2<kFormat, R>(p, 0);
    half_pass_avx2<kFormat, R>(p, 1);
  }
}

using PassFn = void (*)(const Pass&);
constexpr int kMaxRows512 = 8;  // 8 int32 + 8 float32 accumulators of 16 lanes
constexpr int kMaxRows2 = 4;    // per half panel: 4 + 4 accumulators of 8 lanes, beside the weights

template <int kFormat>
constexpr PassFn kPasses512[kMaxRows512 + 1] = {
    nullptr, pass_avx512<kFormat, 1>, pass_avx512<kFormat, 2>, pass_avx512<kFormat, 3>, pass_avx512<kFormat, 4>,
    pass_avx512<kFormat, 5>, pass_avx512<kFormat, 6>, pass_avx512<kFormat, 7>, pass_avx512<kFormat, 8>};
template <int kFormat>
constexpr PassFn kPasses2[kMaxRows2 + 1] = {nullptr, pass_avx2<kFormat, 1>, pass_avx2<kFormat, 2>,
                                            pass_avx2<kFormat, 3>, pass_avx2<kFormat, 4>};

#endif  // TSERVE_BLOCK_KERNELS

}  // namespace

// The instruction sets this CPU runs the kernels on ("avx2", "avx512": AVX-512 with VNNI); none where they are
// not compiled (not x86-64).
std::vector<std::string> block_isas() {
  std::vector<std::string> isas;
#if defined(TSERVE_BLOCK_KERNELS)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
    isas.emplace_back("avx2");
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni")) {
      isas.emplace_back("avx512");
    }
  }
#endif
  return isas;
}

// x (M, K) float32 rows times the panels, plus bias (or nullptr), into out (M, N): `block_linear` past its checks,
// for callers that have checked their weights (a fused decode step, `decode_layers.cpp`). wide: the AVX-512 path.
void block_linear_rows(const float* x, int64_t M, int64_t K, const uint8_t* panels, const uint16_t* scales,
                       const float* bias, int64_t N, int format, bool wide, float* out) {
#if defined(TSERVE_BLOCK_KERNELS)
  if (M == 0 || N == 0) return;
  const int64_t blocks = K / kBlock, n_panels = (N + kCols - 1) / kCols;
  const int max_rows = wide ? kMaxRows512 : kMaxRows2;
  const PassFn* passes = wide ? (format == kQ8 ? kPasses512<kQ8> : kPasses512<kQ4>)
                              : (format == kQ8 ? kPasses2<kQ8> : kPasses2<kQ4>);
  // The activations' magnitudes where an AVX2 Q8_0 tile of 1 or 2 rows reads them (the last tile's height).
  const bool narrow_tile = M % kMaxRows2 == 1 || M % kMaxRows2 == 2;
  // A decode step's few rows: this thread's activations, reused (a call runs to its end before the thread's next
  // one), named here as a reference the loop's threads share (inside the loop a thread_local is each thread's own).
  // A prompt's many rows: their own, freed after the call.
  thread_local Activations reused;
  Activations many;
  Activations& acts = M <= kMaxRows512 ? reused : many;
  quantize_rows(x, M, K, !wide && format == kQ8 && narrow_tile, acts);
  const int64_t panel_bytes = blocks * block_bytes(format);
  // One tile of rows reads each weight once whatever the chunks: it takes a panel's blocks in one pass.
  const int64_t chunk = M <= max_rows ? blocks : kChunk;
  const ActivationView view{acts.codes.data(), acts.magnitudes.data(), acts.scales.data(), acts.sums.data(), acts.K,
                            acts.blocks};
  tserve::parallel_for(0, n_panels, 1, [=](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      Pass p{view, 0, 0, 0, j * kCols, N, static_cast<int>(std::min(kCols, N - j * kCols)), nullptr, nullptr, out,
             M <= max_rows};
      for (p.b0 = 0; p.b0 < blocks; p.b0 += chunk) {
        p.b1 = std::min(blocks, p.b0 + chunk);
        p.panel = panels + j * panel_bytes + p.b0 * block_bytes(format);
        p.scales = scales + (j * blocks + p.b0) * kCols;
        for (p.row0 = 0; p.row0 < M; p.row0 += max_rows) {
          passes[std::min<int64_t>(max_rows, M - p.row0)](p);
        }
      }
      if (bias != nullptr) {
        for (int64_t m = 0; m < M; ++m) {
          for (int64_t c = 0; c < p.cols; ++c) out[m * N + p.n0 + c] += bias[p.n0 + c];
        }
      }
    }
  });
#else
  TORCH_CHECK(false, "the block kernels are not compiled on this CPU");
#endif
}

// The panels and scales of an (N, K) layer as `block_linear_rows` splits them over threads: a panel an item.
tserve::Upcoming block_linear_upcoming(const uint8_t* panels, const uint16_t* scales, int64_t K, int64_t N,
                                       int format) {
  const int64_t blocks = K / kBlock;
  return tserve::Upcoming{reinterpret_cast<const char*>(panels), blocks * block_bytes(format), (N + kCols - 1) / kCols,
                          reinterpret_cast<const char*>(scales),
                          blocks * kCols * static_cast<int64_t>(sizeof(uint16_t))};
}

// Whether panels (ceil(N / 16), K / 32, block bytes) uint8 and scales (ceil(N / 16), K / 32, 16) float16 hold an
// (N, K) layer in `format` (0: Q8_0, 1: Q4_0).
void check_panels(const torch::Tensor& panels, const torch::Tensor& scales, int64_t K, int64_t N, int64_t format) {
  TORCH_CHECK(format == kQ8 || format == kQ4, "format: 0 (Q8_0) or 1 (Q4_0)");
  TORCH_CHECK(K % kBlock == 0, "K must be a multiple of 32");
  const int64_t blocks = K / kBlock, n_panels = (N + kCols - 1) / kCols;
  TORCH_CHECK(panels.scalar_type() == torch::kByte && panels.is_contiguous() && panels.dim() == 3 &&
                  panels.size(0) == n_panels && panels.size(1) == blocks &&
                  panels.size(2) == block_bytes(static_cast<int>(format)),
              "panels do not match x, N and the format");
  TORCH_CHECK(scales.scalar_type() == torch::kHalf && scales.is_contiguous() && scales.dim() == 3 &&
                  scales.size(0) == n_panels && scales.size(1) == blocks && scales.size(2) == kCols,
              "scales do not match the panels");
}

// Whether this CPU runs the block kernels' `isa` path ("avx2", "avx512"); raises where it does not.
void check_block_isa(const std::string& isa) {
#if defined(TSERVE_BLOCK_KERNELS)
  static const auto supported = block_isas();  // the CPU's, which do not change
  TORCH_CHECK(std::find(supported.begin(), supported.end(), isa) != supported.end(),
              "this CPU does not run the block kernels' ", isa, " path");
#else
  TORCH_CHECK(false, "the block kernels are not compiled on this CPU (", isa, ")");
#endif
}

// x (M, K) float32, K a multiple of 32; panels (ceil(N / 16), K / 32, block bytes) uint8 and scales
// (ceil(N / 16), K / 32, 16) float16 (`model.block_quant.pack_panels`) -> x W^T + bias (M, N) float32.
torch::Tensor block_linear(torch::Tensor x, torch::Tensor panels, torch::Tensor scales,
                           c10::optional<torch::Tensor> bias, int64_t N, int64_t format, const std::string& isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: (M, K) float32");
  const int64_t M = x.size(0), K = x.size(1);
  check_panels(panels, scales, K, N, format);
  const float* b = tserve::checked_bias(bias, N);
  auto out = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  check_block_isa(isa);
  block_linear_rows(x.data_ptr<float>(), M, K, panels.data_ptr<uint8_t>(),
                    reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()), b, N, static_cast<int>(format),
                    isa == "avx512", out.data_ptr<float>());
  return out;
}
