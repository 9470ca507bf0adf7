// The tiles of `prefill_attention.cpp`, written once for a vector of kW float32 lanes: that file includes this
// twice, in a namespace per instruction set (AVX2, and AVX-512 under its target pragma), after defining there
// `vec`, kW, load, store, set1, zero, fma, add, mul, sub, max, reduce_add, reduce_max, exp_nonpositive, and the
// tiles' sizes in vectors, kKeyVecs and kValueVecs (as many accumulators as the registers hold beside them). A
// tile's every output is one chain of multiply-adds in the order of its sum (the channels for a score, the
// positions for a value sum), whatever the rows beside it: a query's result does not depend on the batch, the
// threads or the block it is taken in.

constexpr int64_t kKeyTile = kKeyVecs * kW;  // keys a score tile takes at once
constexpr int64_t kValueRun = 64;              // keys a pass over the rows' value sums takes (in L1 for all of them)

// Scores of R query rows (qs, D floats apart, already scaled) against keys [j, j + kKeyTile) of the transposed keys
// kt (D rows, ldk floats apart): s[i][j'] = Σ_d qs[i][d] kt[d][j'], s's rows lds apart.
template <int R>
void score_tile(const float* qs, int64_t D, const float* kt, int64_t ldk, int64_t j, float* s, int64_t lds) {
  vec acc[R][kKeyVecs];
  for (int i = 0; i < R; ++i) {
    for (int c = 0; c < kKeyVecs; ++c) acc[i][c] = zero();
  }
  const float* k = kt + j;
  for (int64_t d = 0; d < D; ++d, k += ldk) {
    vec key[kKeyVecs];
    for (int c = 0; c < kKeyVecs; ++c) key[c] = load(k + c * kW);
    for (int i = 0; i < R; ++i) {
      const vec q = set1(qs[i * D + d]);
      for (int c = 0; c < kKeyVecs; ++c) acc[i][c] = fma(q, key[c], acc[i][c]);
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int c = 0; c < kKeyVecs; ++c) store(s + i * lds + j + c * kW, acc[i][c]);
  }
}

// Row s's scores [0, len) as exp(score - their largest); [len, end) zeroed (a row tile's later keys, which this
// row may not attend to). Returns the sum of the exponentials.
inline float exponentiate_row(float* s, int64_t len, int64_t end) {
  int64_t j = 0;
  vec top = set1(-std::numeric_limits<float>::infinity());
  for (; j + kW <= len; j += kW) top = max(top, load(s + j));
  float best = reduce_max(top);
  for (; j < len; ++j) best = std::max(best, s[j]);
  const vec shift = set1(best);
  vec sums = zero();
  for (j = 0; j + kW <= len; j += kW) {
    const vec e = exp_nonpositive(sub(load(s + j), shift));
    store(s + j, e);
    sums = add(sums, e);
  }
  float total = reduce_add(sums);
  for (; j < len; ++j) {
    s[j] = std::exp(s[j] - best);
    total += s[j];
  }
  std::fill(s + len, s + end, 0.0f);
  return total;
}

// Channels [0, C kW) of R rows' value sums, over positions [t0, t1): out[i] += Σ_t p[i][t] v[t] (p's rows lds
// apart, v at position 0 with rows stride floats apart, out's rows at out[i], zero before the first positions).
template <int R, int C>
void weigh_tile(const float* p, int64_t lds, const float* v, int64_t stride, int64_t t0, int64_t t1,
                float* const* out) {
  vec acc[R][C];
  for (int i = 0; i < R; ++i) {
    for (int c = 0; c < C; ++c) acc[i][c] = t0 == 0 ? zero() : load(out[i] + c * kW);
  }
  v += t0 * stride;
  for (int64_t t = t0; t < t1; ++t, v += stride) {
    vec value[C];
    for (int c = 0; c < C; ++c) value[c] = load(v + c * kW);
    for (int i = 0; i < R; ++i) {
      const vec w = set1(p[i * lds + t]);
      for (int c = 0; c < C; ++c) acc[i][c] = fma(w, value[c], acc[i][c]);
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int c = 0; c < C; ++c) store(out[i] + c * kW, acc[i][c]);
  }
}

// All channels [0, D) of R rows over positions [t0, t1), in runs of kValueVecs vectors, then 2, then 1 (D a
// multiple of kW).
template <int R>
void weigh_rows(const float* p, int64_t lds, const float* v, int64_t stride, int64_t t0, int64_t t1, int64_t D,
                float* const* rows) {
  float* out[R];
  for (int64_t d = 0; d < D;) {
    const int64_t c = (D - d) >= kValueVecs * kW ? kValueVecs : (D - d) >= 2 * kW ? 2 : 1;
    for (int i = 0; i < R; ++i) out[i] = rows[i] + d;
    if (c == kValueVecs) weigh_tile<R, kValueVecs>(p, lds, v + d, stride, t0, t1, out);
    else if (c == 2) weigh_tile<R, 2>(p, lds, v + d, stride, t0, t1, out);
    else weigh_tile<R, 1>(p, lds, v + d, stride, t0, t1, out);
    d += c * kW;
  }
}

template <int R>
void score_or_weigh(bool score, const float* qs, int64_t D, const float* kt, int64_t ldk, int64_t j, float* s,
                    int64_t lds, const float* v, int64_t stride, int64_t t1, float* const* rows) {
  if (score) score_tile<R>(qs, D, kt, ldk, j, s, lds);
  else weigh_rows<R>(s, lds, v, stride, j, t1, D, rows);
}

// One block of query rows of one kv head (rows: `QueryBlock`), scored against the transposed keys, weighed, and
// written to their output rows. Tiles of kRows rows, each over the keys its last row may attend to, taken key
// tile by key tile with every row tile inside: a tile of keys or values is read from L2 once for the block and
// then from L1 (a whole key run per row tile would stream it from L2 again for every few rows).
inline void attend_block(const QueryBlock& block, const float* kt, int64_t ldk, const float* v, int64_t stride,
                         int64_t D, float* s, int64_t lds) {
  const int64_t tiles = (block.rows + kRows - 1) / kRows;
  const auto tile_end = [&](int64_t tile) { return block.limit[std::min(block.rows, (tile + 1) * kRows) - 1]; };
  const auto each_tile = [&](bool score, int64_t j, int64_t step) {
    for (int64_t tile = 0; tile < tiles; ++tile) {
      const int64_t end = tile_end(tile);
      if (j >= end) continue;
      const int64_t r0 = tile * kRows, r = std::min<int64_t>(kRows, block.rows - r0);
      const float* qs = block.qs + r0 * D;
      float* st = s + r0 * lds;
      float* const* rows = block.out + r0;
      const int64_t t1 = std::min(end, j + step);
      switch (r) {
        case 6: score_or_weigh<6>(score, qs, D, kt, ldk, j, st, lds, v, stride, t1, rows); break;
        case 5: score_or_weigh<5>(score, qs, D, kt, ldk, j, st, lds, v, stride, t1, rows); break;
        case 4: score_or_weigh<4>(score, qs, D, kt, ldk, j, st, lds, v, stride, t1, rows); break;
        case 3: score_or_weigh<3>(score, qs, D, kt, ldk, j, st, lds, v, stride, t1, rows); break;
        case 2: score_or_weigh<2>(score, qs, D, kt, ldk, j, st, lds, v, stride, t1, rows); break;
        default: score_or_weigh<1>(score, qs, D, kt, ldk, j, st, lds, v, stride, t1, rows); break;
      }
    }
  };
  const int64_t last = block.limit[block.rows - 1];
  for (int64_t j = 0; j < last; j += kKeyTile) each_tile(true, j, kKeyTile);
  std::vector<float> inverse(block.rows);
  for (int64_t i = 0; i < block.rows; ++i) {
    inverse[i] = 1.0f / exponentiate_row(s + i * lds, block.limit[i], tile_end(i / kRows));
  }
  for (int64_t t0 = 0; t0 < last; t0 += kValueRun) each_tile(false, t0, kValueRun);
  for (int64_t i = 0; i < block.rows; ++i) {
    const vec inv = set1(inverse[i]);
    for (int64_t d = 0; d < D; d += kW) store(block.out[i] + d, mul(load(block.out[i] + d), inv));
  }
}
