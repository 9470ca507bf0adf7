// One-token attention straight from a paged KV cache, on the CPU: each (row, head) reads its own positions
// through its block table (no gather of the rows' blocks into one tensor), scores them, and sums the values
// under an online softmax in one pass over the keys and one over the values. Float32 arithmetic; the cache may
// hold bfloat16 or float16, each value widened as it is read.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

// q: (B, H, D); k, v: (positions, KV, D) with position p of block b at row b * block_size + p;
// tables: (B, W) int64 block ids; lengths: (B,) int64; window > 0: only a row's last `window` positions (sliding-window
// attention). out: (B, H, D).
// A task is one row's run of `span` kv heads (all of them when there are rows enough for every thread): it reads
// each position's keys of those heads as one contiguous run, which the prefetcher streams.
template <typename kv_t>
void paged_decode_rows(const float* q, const kv_t* k, const kv_t* v, const int64_t* tables,
                       const int64_t* lengths, float* out, int64_t B, int64_t H, int64_t KV, int64_t D,
                       int64_t W, int64_t block_size, int64_t max_len, float scale, int64_t window, int64_t span) {
  const int64_t group = H / KV;  // query heads per kv head
  const int64_t chunks = KV / span;
  // PyTorch's own thread pool (its OpenMP runtime, its `torch.set_num_threads`), not a second runtime of ours.
  at::parallel_for(0, B * chunks, 1, [&](int64_t task_begin, int64_t task_end) {
    std::vector<float> scores(std::max<int64_t>(max_len, 1) * span * group);
    std::vector<float> best(span * group), total(span * group);
    for (int64_t task = task_begin; task < task_end; ++task) {
      const int64_t b = task / chunks, first = (task % chunks) * span;  // kv heads first .. first + span
      const int64_t end = std::min(lengths[b], max_len);
      const int64_t start = window > 0 ? std::max<int64_t>(end - window, 0) : 0, len = end - start;
      const int64_t* table = tables + b * W;
      const int64_t nq = span * group;  // query heads of this task: first * group ..
      const float* qb = q + (b * H + first * group) * D;
      float* ob = out + (b * H + first * group) * D;
      if (len <= 0) {
        std::fill(ob, ob + nq * D, 0.0f);
        continue;
      }
      std::fill(best.begin(), best.end(), -std::numeric_limits<float>::infinity());
      for (int64_t t = 0; t < len; ++t) {
        const int64_t pos = table[(start + t) / block_size] * block_size + (start + t) % block_size;
        const kv_t* kp = k + (pos * KV + first) * D;
        for (int64_t j = 0; j < nq; ++j) {
          const kv_t* kh = kp + (j / group) * D;
          const float* qh = qb + j * D;
          float s = 0.0f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qh[d] * static_cast<float>(kh[d]);
          s *= scale;
          scores[j * len + t] = s;
          best[j] = std::max(best[j], s);
        }
      }
      for (int64_t j = 0; j < nq; ++j) {
        float* sj = scores.data() + j * len;
        float sum = 0.0f;
        for (int64_t t = 0; t < len; ++t) {
          sj[t] = std::exp(sj[t] - best[j]);
          sum += sj[t];
        }
        total[j] = sum;
      }
      std::fill(ob, ob + nq * D, 0.0f);
      for (int64_t t = 0; t < len; ++t) {
        const int64_t pos = table[(start + t) / block_size] * block_size + (start + t) % block_size;
        const kv_t* vp = v + (pos * KV + first) * D;
        for (int64_t j = 0; j < nq; ++j) {
          const kv_t* vh = vp + (j / group) * D;
          float* o = ob + j * D;
          const float p = scores[j * len + t];
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) o[d] += p * static_cast<float>(vh[d]);
        }
      }
      for (int64_t j = 0; j < nq; ++j) {
        const float inv = 1.0f / total[j];
        float* o = ob + j * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
      }
    }
  });
}

}  // namespace

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor tables,
                           torch::Tensor lengths, int64_t block_size, double scale, int64_t window) {
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
  const int64_t num_blocks = k.size(0) / block_size, max_len = W * block_size;
  // Every block id must lie in the cache: a bad table reads nothing outside it.
  const int64_t* ids = tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < tables.numel(); ++i) TORCH_CHECK(ids[i] >= 0 && ids[i] < num_blocks, "block id out of range");
  auto out = torch::empty_like(q);
  // Whole rows per task when there are at least two rows a thread; else runs of kv heads, halved until there are.
  int64_t span = KV;
  while (span % 2 == 0 && B * (KV / span) < 2 * at::get_num_threads()) span /= 2;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "paged_decode", [&] {
    paged_decode_rows<scalar_t>(q.data_ptr<float>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                                tables.data_ptr<int64_t>(), lengths.data_ptr<int64_t>(), out.data_ptr<float>(), B, H,
                                KV, D, W, block_size, max_len, static_cast<float>(scale), window, span);
  });
  return out;
}
