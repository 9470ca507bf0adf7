// One-token attention straight from a paged KV cache, on the CPU: each row's heads read their positions through
// the row's block table (no gather of the rows' blocks into one tensor), score them, and sum the values under a
// softmax in one pass over the keys and one over the values. Float32 arithmetic; the cache may hold bfloat16 or
// float16, each value widened as it is read. A float32 cache is read 8 lanes at a time (AVX2, what the kernels are
// compiled for on x86-64), a thread's heads of a row together, position by position (`heads_attention_avx2`).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "step_team.h"
#include "vector_math.h"

namespace {

// The flat cache rows of the positions a row attends over: position t of the run (start + t of the row) is at
// row table[(start + t) / block_size] * block_size + (start + t) % block_size, walked block by block (no division
// per position: every head of the row reads them).
struct Run {
  const int64_t* rows;
  int64_t len;
  int64_t at(int64_t t) const { return rows[t]; }
};

Run read_run(const int64_t* table, int64_t start, int64_t len, int64_t block_size, int64_t* rows) {
  int64_t block = start / block_size, offset = start % block_size;
  for (int64_t t = 0; t < len; ++block, offset = 0) {
    const int64_t base = table[block] * block_size;
    for (; offset < block_size && t < len; ++offset, ++t) rows[t] = base + offset;
  }
  return Run{rows, len};
}

// One query head over its run: k / v the head's kv head at flat row 0, `stride` floats (KV x D) between rows;
// `scores` room for the run's length. Scalar loops, any cache type.
template <typename kv_t>
void head_attention(const float* qh, const kv_t* k, const kv_t* v, int64_t stride, const Run& run, int64_t D,
                    float scale, float* scores, float* oh) {
  float best = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < run.len; ++t) {
    const kv_t* kh = k + run.at(t) * stride;
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t d = 0; d < D; ++d) s += qh[d] * static_cast<float>(kh[d]);
    s *= scale;
    scores[t] = s;
    best = std::max(best, s);
  }
  float total = 0.0f;
  for (int64_t t = 0; t < run.len; ++t) {
    scores[t] = std::exp(scores[t] - best);
    total += scores[t];
  }
  std::fill(oh, oh + D, 0.0f);
  for (int64_t t = 0; t < run.len; ++t) {
    const kv_t* vh = v + run.at(t) * stride;
    const float p = scores[t];
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) oh[d] += p * static_cast<float>(vh[d]);
  }
  const float inv = 1.0f / total;
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) oh[d] *= inv;
}

#if defined(TSERVE_VECTOR_MATH)
// Channels [0, 8 N) of a head's value sums over positions [t0, t1) of the run, Σ_t p[t] v[t] in the order of t, held
// in N registers across the positions; `sums` holds the sums of the positions before t0 (read back unless t0 is the
// first) and takes them after t1: each channel is one chain of fused multiply-adds in the order of t, however the
// positions are split.
template <int N>
void weigh_values(const float* v, int64_t stride, const Run& run, const float* p, int64_t t0, int64_t t1,
                  float* sums) {
  __m256 acc[N];
  for (int j = 0; j < N; ++j) acc[j] = t0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(sums + 8 * j);
  for (int64_t t = t0; t < t1; ++t) {
    const float* vh = v + run.at(t) * stride;
    const __m256 weight = _mm256_set1_ps(p[t]);
    for (int j = 0; j < N; ++j) acc[j] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(vh + 8 * j), acc[j]);
  }
  for (int j = 0; j < N; ++j) _mm256_storeu_ps(sums + 8 * j, acc[j]);
}

// Positions [t0, t1) of one head's value sums, every channel (runs of 64 channels, then of 32, 16, 8).
void weigh_head(const float* v, int64_t stride, const Run& run, const float* p, int64_t t0, int64_t t1, int64_t D,
                float* sums) {
  for (int64_t d = 0; d < D;) {
    const int64_t vectors = (D - d) / 8, n = vectors >= 8 ? 8 : vectors >= 4 ? 4 : vectors >= 2 ? 2 : 1;
    switch (n) {
      case 8: weigh_values<8>(v + d, stride, run, p, t0, t1, sums + d); break;
      case 4: weigh_values<4>(v + d, stride, run, p, t0, t1, sums + d); break;
      case 2: weigh_values<2>(v + d, stride, run, p, t0, t1, sums + d); break;
      default: weigh_values<1>(v + d, stride, run, p, t0, t1, sums + d); break;
    }
    d += 8 * n;
  }
}

// Scores of positions [t0, t0 + 8) of the run (fewer at its end) for one head, 8 lanes wide: the 8 dot products'
// lanes summed together, times `scale`. The 8 products advance together, 8 channels at a time: 8 independent chains
// of multiply-adds, not one position's chain after another's (each waits on its last add: 4x slower).
void score_positions(const float* qh, const float* k, int64_t stride, const Run& run, int64_t t0, int64_t D,
                     float scale, float* scores) {
  const int64_t n = std::min<int64_t>(8, run.len - t0);
  const float* rows[8];
  for (int64_t i = 0; i < 8; ++i) rows[i] = k + run.at(t0 + std::min(i, n - 1)) * stride;  // past the end: unused
  __m256 dots[8];
  for (int i = 0; i < 8; ++i) dots[i] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 query = _mm256_loadu_ps(qh + d);
    for (int i = 0; i < 8; ++i) dots[i] = _mm256_fmadd_ps(query, _mm256_loadu_ps(rows[i] + d), dots[i]);
  }
  const __m256 s = _mm256_mul_ps(tserve_vector::lane_sums(dots), _mm256_set1_ps(scale));
  if (n == 8) {
    _mm256_storeu_ps(scores + t0, s);
  } else {
    alignas(32) float last[8];
    _mm256_store_ps(last, s);
    for (int64_t i = 0; i < n; ++i) scores[t0 + i] = last[i];
  }
}

// A head's scores turned into exp(score - max) in place, 8 at a time; returns their sum.
float exponentiate(float* scores, int64_t len) {
  const float top = *std::max_element(scores, scores + len);
  __m256 sums = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= len; t += 8) {
    const __m256 e = tserve_vector::exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores + t), _mm256_set1_ps(top)));
    _mm256_storeu_ps(scores + t, e);
    sums = _mm256_add_ps(sums, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sums);
  float total = 0.0f;
  for (float lane : lanes) total += lane;
  if (t < len) {
    alignas(32) float tail[8];
    for (int64_t i = 0; i < 8; ++i) tail[i] = t + i < len ? scores[t + i] - top : -87.0f;
    _mm256_store_ps(tail, tserve_vector::exp_nonpositive(_mm256_load_ps(tail)));
    for (int64_t i = 0; t + i < len; ++i) {
      scores[t + i] = tail[i];
      total += tail[i];
    }
  }
  return total;
}

constexpr int64_t kValueRun = 16;  // positions a pass over the heads' values takes (a cache block's worth)
constexpr int64_t kAhead = 16;     // positions ahead of the scores that their keys are fetched

// Asks for the cache lines of `width` floats from each row of positions [t0, t1) of the run (those it has).
inline void prefetch_rows(const float* base, int64_t stride, int64_t width, const Run& run, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < std::min(t1, run.len); ++t) {
    const char* row = reinterpret_cast<const char*>(base + run.at(t) * stride);
    for (int64_t at = 0; at < width * 4; at += 64) _mm_prefetch(row + at, _MM_HINT_T0);
  }
}

// Query heads [h0, h1) of one row over its run, for a float32 cache and D a multiple of 8. Each head's arithmetic is
// `head_attention`'s, 8 lanes wide, and the same whatever the range it is taken in (a head's result does not depend
// on the batch or on the threads). The loops go over positions outside and heads inside: the heads of a range are
// neighbours in each position's row of the cache, so the range reads a run of each row in turn (one stream the
// prefetchers follow), not a head's 4 lines a row for each head in turn. `scores`: room for (h1 - h0) x (len + 8).
void heads_attention_avx2(const float* q, const float* k, const float* v, int64_t stride, const Run& run, int64_t D,
                          int64_t group, float scale, int64_t h0, int64_t h1, float* scores, float* out) {
  const int64_t ld = run.len + 8;
  const int64_t first = (h0 / group) * D, width = ((h1 - 1) / group + 1) * D - first;  // the range's kv heads
  for (int64_t t0 = 0; t0 < run.len; t0 += 8) {
    prefetch_rows(k + first, stride, width, run, t0 + kAhead, t0 + kAhead + 8);
    for (int64_t j = h0; j < h1; ++j) {
      score_positions(q + j * D, k + (j / group) * D, stride, run, t0, D, scale, scores + (j - h0) * ld);
    }
  }
  std::vector<float> inverse(h1 - h0);
  for (int64_t j = h0; j < h1; ++j) inverse[j - h0] = 1.0f / exponentiate(scores + (j - h0) * ld, run.len);
  prefetch_rows(v + first, stride, width, run, 0, kValueRun);
  for (int64_t t0 = 0; t0 < run.len; t0 += kValueRun) {
    const int64_t t1 = std::min(run.len, t0 + kValueRun);
    prefetch_rows(v + first, stride, width, run, t1, t1 + kValueRun);
    for (int64_t j = h0; j < h1; ++j) {
      weigh_head(v + (j / group) * D, stride, run, scores + (j - h0) * ld, t0, t1, D, out + j * D);
    }
  }
  for (int64_t j = h0; j < h1; ++j) {
    const __m256 inv = _mm256_set1_ps(inverse[j - h0]);
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(out + j * D + d, _mm256_mul_ps(_mm256_loadu_ps(out + j * D + d), inv));
  }
}

// AVX-512 (F, VL, DQ; chosen at run time where the block kernels' AVX-512 path runs): D a multiple of 16, each kv
// head's query heads of a range up to 3 at a time. A key or value row is read into registers once and multiplies
// every head of the group (the AVX2 path reads it once per head, from L1), 16 lanes an instruction: about a quarter
// of the AVX2 path's instructions, which leaves a thread's time to the cache lines it waits for. Each head's
// arithmetic is its own (the same whatever heads share its pass), so a head's result does not depend on the batch,
// the threads or the range; it differs from the AVX2 path's in the order of the sums (float32 rounding).
#define TSERVE_AVX512_ATTENTION __attribute__((target("avx512f,avx512vl,avx512dq,fma")))

// The sums of 8 vectors' 16 lanes, as one vector of 8 (the two halves of each added, then `lane_sums`).
TSERVE_AVX512_ATTENTION inline __m256 lane_sums16(const __m512* a) {
  __m256 halves[8];
  for (int i = 0; i < 8; ++i) {
    halves[i] = _mm256_add_ps(_mm512_castps512_ps256(a[i]), _mm512_extractf32x8_ps(a[i], 1));
  }
  return tserve_vector::lane_sums(halves);
}

// Scores of positions [t0, t0 + 8) of the run (fewer at its end) for J heads of one kv head: q the first head's
// query (the others follow, D apart), k that kv head at flat row 0; head j's scores at scores + j * ld.
template <int J>
TSERVE_AVX512_ATTENTION void score_positions16(const float* q, const float* k, int64_t stride, const Run& run,
                                               int64_t t0, int64_t D, float scale, float* scores, int64_t ld) {
  const int64_t n = std::min<int64_t>(8, run.len - t0);
  const float* rows[8];
  for (int64_t i = 0; i < 8; ++i) rows[i] = k + run.at(t0 + std::min(i, n - 1)) * stride;  // past the end: unused
  __m512 dots[J][8];
  for (int j = 0; j < J; ++j) {
    for (int i = 0; i < 8; ++i) dots[j][i] = _mm512_setzero_ps();
  }
  for (int64_t d = 0; d < D; d += 16) {
    for (int i = 0; i < 8; ++i) {
      const __m512 key = _mm512_loadu_ps(rows[i] + d);
      for (int j = 0; j < J; ++j) dots[j][i] = _mm512_fmadd_ps(_mm512_loadu_ps(q + j * D + d), key, dots[j][i]);
    }
  }
  for (int j = 0; j < J; ++j) {
    const __m256 s = _mm256_mul_ps(lane_sums16(dots[j]), _mm256_set1_ps(scale));
    if (n == 8) {
      _mm256_storeu_ps(scores + j * ld + t0, s);
    } else {
      alignas(32) float last[8];
      _mm256_store_ps(last, s);
      for (int64_t i = 0; i < n; ++i) scores[j * ld + t0 + i] = last[i];
    }
  }
}

// Channels [0, 16 C) of J heads' value sums over positions [t0, t1), as `weigh_values` (head j's weights at
// p + j * ld, its sums at sums + j * D): one chain of multiply-adds a channel in the order of t.
template <int J, int C>
TSERVE_AVX512_ATTENTION void weigh_values16(const float* v, int64_t stride, const Run& run, const float* p, int64_t ld,
                                            int64_t t0, int64_t t1, int64_t D, float* sums) {
  __m512 acc[J][C];
  for (int j = 0; j < J; ++j) {
    for (int c = 0; c < C; ++c) acc[j][c] = t0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + j * D + 16 * c);
  }
  for (int64_t t = t0; t < t1; ++t) {
    const float* vh = v + run.at(t) * stride;
    __m512 value[C];
    for (int c = 0; c < C; ++c) value[c] = _mm512_loadu_ps(vh + 16 * c);
    for (int j = 0; j < J; ++j) {
      const __m512 weight = _mm512_set1_ps(p[j * ld + t]);
      for (int c = 0; c < C; ++c) acc[j][c] = _mm512_fmadd_ps(weight, value[c], acc[j][c]);
    }
  }
  for (int j = 0; j < J; ++j) {
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(sums + j * D + 16 * c, acc[j][c]);
  }
}

// Channels [0, D) of J heads' value sums over positions [t0, t1), in runs of 64 channels, then of 32, 16.
template <int J>
TSERVE_AVX512_ATTENTION void weigh_heads16(const float* v, int64_t stride, const Run& run, const float* p, int64_t ld,
                                           int64_t t0, int64_t t1, int64_t D, float* sums) {
  for (int64_t d = 0; d < D;) {
    const int64_t c = (D - d) >= 64 ? 4 : (D - d) >= 32 ? 2 : 1;
    if (c == 4) weigh_values16<J, 4>(v + d, stride, run, p, ld, t0, t1, D, sums + d);
    else if (c == 2) weigh_values16<J, 2>(v + d, stride, run, p, ld, t0, t1, D, sums + d);
    else weigh_values16<J, 1>(v + d, stride, run, p, ld, t0, t1, D, sums + d);
    d += 16 * c;
  }
}

// n heads' scores (ld apart) turned into exp(score - top) in place; the inverses of their sums.
std::vector<float> softmax_weights(float* scores, int64_t ld, int64_t len, int64_t n) {
  std::vector<float> inverse(n);
  for (int64_t i = 0; i < n; ++i) inverse[i] = 1.0f / exponentiate(scores + i * ld, len);
  return inverse;
}

// Heads [first, first + inverse.size()) of out (D apart) times their inverse.
TSERVE_AVX512_ATTENTION void normalize16(float* out, int64_t D, int64_t first, const std::vector<float>& inverse) {
  for (size_t i = 0; i < inverse.size(); ++i) {
    const __m512 inv = _mm512_set1_ps(inverse[i]);
    float* oh = out + (first + static_cast<int64_t>(i)) * D;
    for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(oh + d, _mm512_mul_ps(_mm512_loadu_ps(oh + d), inv));
  }
}

// Query heads [j0, j1) of one kv head (k, v at its channels) over the run, into out's heads: positions outside,
// the heads inside, 3 at a time, so that every key and value row is fetched once for the whole group (Qwen2.5's 7
// query heads a kv head: passes of 3, 3 and 1 over rows still in L1).
TSERVE_AVX512_ATTENTION void kv_head_attention16(const float* q, const float* k, const float* v, int64_t stride,
                                                 const Run& run, int64_t D, float scale, int64_t j0, int64_t j1,
                                                 float* scores, float* out) {
  const int64_t ld = run.len + 8;
  prefetch_rows(k, stride, D, run, 0, kAhead);
  for (int64_t t0 = 0; t0 < run.len; t0 += 8) {
    prefetch_rows(k, stride, D, run, t0 + kAhead, t0 + kAhead + 8);
    for (int64_t j = j0; j < j1; j += 3) {
      const int64_t n = std::min<int64_t>(3, j1 - j);
      float* s = scores + (j - j0) * ld;
      if (n == 3) score_positions16<3>(q + j * D, k, stride, run, t0, D, scale, s, ld);
      else if (n == 2) score_positions16<2>(q + j * D, k, stride, run, t0, D, scale, s, ld);
      else score_positions16<1>(q + j * D, k, stride, run, t0, D, scale, s, ld);
    }
  }
  const std::vector<float> inverse = softmax_weights(scores, ld, run.len, j1 - j0);
  prefetch_rows(v, stride, D, run, 0, kValueRun);
  for (int64_t t0 = 0; t0 < run.len; t0 += kValueRun) {
    const int64_t t1 = std::min(run.len, t0 + kValueRun);
    prefetch_rows(v, stride, D, run, t1, t1 + kValueRun);
    for (int64_t j = j0; j < j1; j += 3) {
      const int64_t n = std::min<int64_t>(3, j1 - j);
      const float* p = scores + (j - j0) * ld;
      if (n == 3) weigh_heads16<3>(v, stride, run, p, ld, t0, t1, D, out + j * D);
      else if (n == 2) weigh_heads16<2>(v, stride, run, p, ld, t0, t1, D, out + j * D);
      else weigh_heads16<1>(v, stride, run, p, ld, t0, t1, D, out + j * D);
    }
  }
  normalize16(out, D, j0, inverse);
}

// One query head a kv head (GPT-2): heads [h0, h1) position by position, as the AVX2 path goes (the range reads a run
// of each row in turn); taken kv head by kv head, as grouped heads are, its 12 one-head passes were 10-20% slower.
TSERVE_AVX512_ATTENTION void single_heads_attention16(const float* q, const float* k, const float* v, int64_t stride,
                                                      const Run& run, int64_t D, float scale, int64_t h0, int64_t h1,
                                                      float* scores, float* out) {
  const int64_t ld = run.len + 8;
  for (int64_t t0 = 0; t0 < run.len; t0 += 8) {
    prefetch_rows(k + h0 * D, stride, (h1 - h0) * D, run, t0 + kAhead, t0 + kAhead + 8);
    for (int64_t j = h0; j < h1; ++j) {
      score_positions16<1>(q + j * D, k + j * D, stride, run, t0, D, scale, scores + (j - h0) * ld, ld);
    }
  }
  const std::vector<float> inverse = softmax_weights(scores, ld, run.len, h1 - h0);
  prefetch_rows(v + h0 * D, stride, (h1 - h0) * D, run, 0, kValueRun);
  for (int64_t t0 = 0; t0 < run.len; t0 += kValueRun) {
    const int64_t t1 = std::min(run.len, t0 + kValueRun);
    prefetch_rows(v + h0 * D, stride, (h1 - h0) * D, run, t1, t1 + kValueRun);
    for (int64_t j = h0; j < h1; ++j) {
      weigh_heads16<1>(v + j * D, stride, run, scores + (j - h0) * ld, ld, t0, t1, D, out + j * D);
    }
  }
  normalize16(out, D, h0, inverse);
}

// Query heads [h0, h1) of one row over its run, as `heads_attention_avx2` (the same arguments; D a multiple of 16):
// grouped heads kv head by kv head (each kv head's rows one stream of 4 lines a row: SmolLM2-135M at 1,024 positions
// 19% faster than taking the range's kv heads position by position), single ones position by position.
// `scores`: room for (h1 - h0) x (len + 8).
TSERVE_AVX512_ATTENTION void heads_attention_avx512(const float* q, const float* k, const float* v, int64_t stride,
                                                    const Run& run, int64_t D, int64_t group, float scale, int64_t h0,
                                                    int64_t h1, float* scores, float* out) {
  if (group == 1) {
    single_heads_attention16(q, k, v, stride, run, D, scale, h0, h1, scores, out);
    return;
  }
  for (int64_t g = h0 / group; g * group < h1; ++g) {
    const int64_t j0 = std::max(h0, g * group), j1 = std::min(h1, (g + 1) * group);
    kv_head_attention16(q, k + g * D, v + g * D, stride, run, D, scale, j0, j1, scores, out);
  }
}
#endif

// q: (B, H, D); k, v: (positions, KV, D) with position p of block b at row b * block_size + p;
// tables: (B, W) int64 block ids; lengths: (B,) int64; window > 0: only a row's last `window` positions (sliding-window
// attention). out: (B, H, D).
// A task is one row's run of `span` query heads (all of them when there are rows enough for every thread; else
// fewer, down to one head a task, so that a single row's heads still spread over the threads); a thread takes its
// tasks' heads of a row as one range. A head's arithmetic is the same whatever its task or range: a row's result does
// not depend on the batch.
template <typename kv_t>
void paged_decode_rows(const float* q, const kv_t* k, const kv_t* v, const int64_t* tables,
                       const int64_t* lengths, float* out, int64_t B, int64_t H, int64_t KV, int64_t D,
                       int64_t W, int64_t block_size, int64_t max_len, float scale, int64_t window, int64_t span,
                       bool wide) {
  const int64_t group = H / KV;  // query heads per kv head
  const int64_t chunks = H / span;
  // PyTorch's own threads (its OpenMP runtime, `torch.set_num_threads`), not a second runtime of ours.
  tserve::parallel_for(0, B * chunks, 1, [=](int64_t task_begin, int64_t task_end) {
    // A thread's buffers, kept from call to call (a decode step calls this once a layer).
    thread_local std::vector<float> scores;
    thread_local std::vector<int64_t> rows;
    rows.resize(std::max<int64_t>(max_len, 1));
    for (int64_t task = task_begin; task < task_end;) {
      const int64_t b = task / chunks, last = std::min(task_end, (b + 1) * chunks);  // this row's tasks in the range
      const int64_t h0 = (task % chunks) * span, h1 = ((last - 1) % chunks + 1) * span;  // their query heads
      task = last;
      const int64_t end = std::min(lengths[b], max_len);
      const int64_t start = window > 0 ? std::max<int64_t>(end - window, 0) : 0;
      const Run run = read_run(tables + b * W, start, std::max<int64_t>(end - start, 0), block_size, rows.data());
      if (run.len <= 0) {
        std::fill(out + (b * H + h0) * D, out + (b * H + h1) * D, 0.0f);
        continue;
      }
#if defined(TSERVE_VECTOR_MATH)
      if constexpr (std::is_same_v<kv_t, float>) {
        scores.resize((h1 - h0) * (run.len + 8));
        if (wide && D % 16 == 0) {
          heads_attention_avx512(q + b * H * D, k, v, KV * D, run, D, group, scale, h0, h1, scores.data(),
                                 out + b * H * D);
          continue;
        }
        if (D % 8 == 0) {
          heads_attention_avx2(q + b * H * D, k, v, KV * D, run, D, group, scale, h0, h1, scores.data(),
                               out + b * H * D);
          continue;
        }
      }
#endif
      scores.resize(run.len + 8);
      for (int64_t j = h0; j < h1; ++j) {
        head_attention(q + (b * H + j) * D, k + (j / group) * D, v + (j / group) * D, KV * D, run, D, scale,
                       scores.data(), out + (b * H + j) * D);
      }
    }
  });
}

// Query heads a task. First whole groups of kv heads, as many a task as give every thread the same number of tasks
// (Qwen2.5's 2 kv heads on 2 threads: one each; a thread reads only its own kv heads' positions). Else whole rows
// when there are at least two rows a thread, or runs of query heads, the next smaller divisor of H each time, until
// there are two tasks a thread or one head a task (SmolLM2's 3 kv heads on 2 threads: one thread's range and the
// other's share a kv head, which both read).
int64_t head_span(int64_t B, int64_t H, int64_t KV) {
  const int64_t threads = tserve::thread_count();
  for (int64_t kv_span = KV; kv_span >= 1; --kv_span) {
    const int64_t tasks = B * (KV / kv_span);
    if (KV % kv_span == 0 && tasks >= threads && tasks % threads == 0) return kv_span * (H / KV);
  }
  int64_t span = H;
  while (span > 1 && B * (H / span) < 2 * threads) {
    int64_t smaller = span - 1;
    while (H % smaller != 0) --smaller;
    span = smaller;
  }
  return span;
}

}  // namespace

void check_block_isa(const std::string& isa);

// Every block id a row reads lies in a cache of `num_blocks` blocks: a bad table reads nothing outside it. Only the
// blocks its length reaches (a table is as wide as the longest context). tables (B, W), lengths (B,).
void check_block_ids(const int64_t* ids, const int64_t* lengths, int64_t B, int64_t W, int64_t block_size,
                     int64_t num_blocks) {
  for (int64_t b = 0; b < B; ++b) {
    const int64_t reached = std::min(W, (std::max<int64_t>(lengths[b], 0) + block_size - 1) / block_size);
    for (int64_t i = 0; i < reached; ++i) {
      TORCH_CHECK(ids[b * W + i] >= 0 && ids[b * W + i] < num_blocks, "block id out of range");
    }
  }
}

// `paged_decode` on a float32 cache, into out (B, H, D), past its checks (a fused decode step checks its tables
// once, with `check_block_ids`, and its path once). wide: the AVX-512 path.
void paged_decode_into(const float* q, const float* k, const float* v, const int64_t* tables, const int64_t* lengths,
                       float* out, int64_t B, int64_t H, int64_t KV, int64_t D, int64_t W, int64_t block_size,
                       float scale, int64_t window, bool wide) {
  paged_decode_rows<float>(q, k, v, tables, lengths, out, B, H, KV, D, W, block_size, W * block_size, scale, window,
                           head_span(B, H, KV), wide);
}

// isa: the path of a float32 cache ("avx512", "avx2": `block_isas`; "": the portable loops).
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor tables,
                           torch::Tensor lengths, int64_t block_size, double scale, int64_t window,
                           const std::string& isa) {
  if (!isa.empty()) check_block_isa(isa);
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(), "q (B, H, D), k/v (positions, KV, D)");
  TORCH_CHECK(q.scalar_type() == torch::kFloat && v.scalar_type() == k.scalar_type(),
              "q float32, k and v of one type");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "contiguous tensors only");
  TORCH_CHECK(tables.scalar_type() == torch::kLong && lengths.scalar_type() == torch::kLong, "int64 tables");
  tables = tables.contiguous();
  lengths = lengths.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KV = k.size(1), W = tables.size(1);
  TORCH_CHECK(k.size(2) == D && H % KV == 0 && tables.size(0) == B && lengths.size(0) == B, "shapes disagree");
  TORCH_CHECK(block_size > 0 && k.size(0) % block_size == 0, "the cache holds whole blocks");
  const int64_t max_len = W * block_size;
  check_block_ids(tables.data_ptr<int64_t>(), lengths.data_ptr<int64_t>(), B, W, block_size, k.size(0) / block_size);
  auto out = torch::empty_like(q);
  const int64_t span = head_span(B, H, KV);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "paged_decode", [&] {
    paged_decode_rows<scalar_t>(q.data_ptr<float>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                                tables.data_ptr<int64_t>(), lengths.data_ptr<int64_t>(), out.data_ptr<float>(), B, H,
                                KV, D, W, block_size, max_len, static_cast<float>(scale), window, span,
                                isa == "avx512");
  });
  return out;
}
