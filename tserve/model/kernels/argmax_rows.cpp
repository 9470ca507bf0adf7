// Each row's argmax of a float32 matrix (`model.kernels.cpu.argmax_rows`): a greedy step's choice over the
// vocabulary. PyTorch's `argmax(dim=-1)` on the CPU walks a row one element at a time with its index (about 1 ms
// for 49,152 logits, more than the output layer's product on a small model); here one vectorised pass finds the
// row's maximum and a second the first position that holds it (AVX2; plain loops elsewhere). The same result as
// `torch.argmax`: the first of equal maxima, and the first NaN where a row has one.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>
#include <limits>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

int64_t argmax_row(const float* r, int64_t n) {
  int64_t i = 0;
  float best = -std::numeric_limits<float>::infinity();
  bool nan = false;
#if defined(__AVX2__)
  __m256 top = _mm256_set1_ps(best), unordered = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(r + i);
    top = _mm256_max_ps(top, v);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top);
  for (float lane : lanes) best = std::max(best, lane);
  nan = _mm256_movemask_ps(unordered) != 0;
#endif
  for (; i < n; ++i) {
    best = std::max(best, r[i]);
    nan = nan || r[i] != r[i];
  }
  i = 0;
#if defined(__AVX2__)
  const __m256 target = _mm256_set1_ps(best);
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(r + i);
    const int hits = _mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, target, _CMP_EQ_OQ));
    if (hits != 0) return i + __builtin_ctz(static_cast<unsigned>(hits));
  }
#endif
  for (; i < n; ++i) {
    if (nan ? r[i] != r[i] : r[i] == best) return i;
  }
  return 0;  // every value -inf: the first
}

}  // namespace

// excluded: empty, or per row the ids it may not take (written -inf into x in place first, as the logits pipeline's
// bans would be: a greedy step's eos ban or banned ids with no pass of their own over the vocabulary).
torch::Tensor argmax_rows(torch::Tensor x, const std::vector<std::vector<int64_t>>& excluded) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.size(1) > 0, "x: (rows, n > 0) float32");
  TORCH_CHECK(excluded.empty() || static_cast<int64_t>(excluded.size()) == x.size(0), "excluded: none, or one per row");
  const int64_t rows = x.size(0), n = x.size(1);
  if (!excluded.empty()) {
    TORCH_CHECK(x.is_contiguous(), "x: contiguous where ids are excluded (written in place)");
    float* written = x.data_ptr<float>();
    for (int64_t m = 0; m < rows; ++m) {
      for (const int64_t id : excluded[m]) {
        TORCH_CHECK(id >= 0 && id < n, "excluded id out of range");
        written[m * n + id] = -std::numeric_limits<float>::infinity();
      }
    }
  }
  x = x.contiguous();
  auto out = torch::empty({rows}, x.options().dtype(torch::kLong));
  const float* data = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  // A row is worth a thread from a few thousand values on.
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / n), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) o[m] = argmax_row(data + m * n, n);
  });
  return out;
}
