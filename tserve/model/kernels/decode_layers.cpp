// A language model's one-token decode step through every decoder layer in one call (`model.fused_decode`): the
// norms, the products, q/k norms, rotary positions, the cache writes, the paged attention, the activation and the
// residual adds, with no Python between them. A step was ~180 PyTorch operators a layer (each a few µs of
// dispatch on a CPU, more than the arithmetic of one row); here it is the products, on the layers' own kernels
// (our Q8_0 / Q4_0 kernels, our float32 `dense_rows` or oneDNN's pre-packed product), and a few loops over one
// row's vector in between.
//
// The maths is the modules' (`model.layers.Block`, `model.attention.Attention`, `model.norms.RMSNorm`): the
// same operations in the same order, in float32; reductions (a norm's mean) may add in another order, so results
// equal the modules' within float32 rounding, not bit for bit.
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/extension.h>

#include <cmath>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "step_team.h"
#include "vector_math.h"

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor tables,
                           torch::Tensor lengths, int64_t block_size, double scale, int64_t window);
torch::Tensor block_linear(torch::Tensor x, torch::Tensor panels, torch::Tensor scales,
                           c10::optional<torch::Tensor> bias, int64_t N, int64_t format, const std::string& isa);
torch::Tensor dense_rows(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);

namespace {

// Per layer, `kTensors` tensors in this order (an empty tensor where the layer has none), and `kInts` integers.
enum Slot {
  kNorm1W, kNorm1B, kQkvA, kQkvS, kQkvBias, kQNormW, kKNormW, kOA, kOS, kOBias, kNorm2W, kNorm2B,
  kUpA, kUpS, kUpBias, kDownA, kDownS, kDownBias, kNorm1OutW, kNorm2OutW, kTensors
};
// Integers: each product's kind and output width (qkv, o, up, down), whether the layer rotates, its window.
enum IntSlot { kQkvKind, kQkvN, kOKind, kON, kUpKind, kUpN, kDownKind, kDownN, kRotates, kWindow, kInts };
// Product kinds: a float32 weight (`dense_rows`), oneDNN's pre-packed weight, Q8_0 / Q4_0 panels.
enum Kind { kDense = 0, kPacked = 1, kQ8 = 2, kQ4 = 3 };
// Activations (`Config::activation`).
enum Activation { kSiluGated = 0, kGeluTanhGated = 1, kGelu = 2, kGeluTanh = 3, kRelu = 4, kSilu = 5 };

struct Config {
  int64_t heads, kv_heads, head_dim, block_size, rotary_dim, activation;
  bool layer_norm, qk_norm, has_local_rope;
  double norm_eps, norm_offset, qk_norm_eps, query_scale, residual_multiplier;
  std::string isa;
};

Config read_config(const std::vector<double>& c, const std::string& isa) {
  TORCH_CHECK(c.size() == 14, "decode_layers: 14 config values");
  return Config{static_cast<int64_t>(c[0]), static_cast<int64_t>(c[1]), static_cast<int64_t>(c[2]),
                static_cast<int64_t>(c[3]), static_cast<int64_t>(c[4]), static_cast<int64_t>(c[5]),
                c[6] != 0.0, c[7] != 0.0, c[8] != 0.0, c[9], c[10], c[11], c[12], c[13], isa};
}

bool present(const torch::Tensor& t) { return t.defined() && t.numel() > 0; }

c10::optional<torch::Tensor> maybe(const torch::Tensor& t) {
  return present(t) ? c10::optional<torch::Tensor>(t) : c10::nullopt;
}

torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias) {
  // `model.packed_linear.PackedLinear`'s forward: oneDNN's product on the weight it laid out at load.
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x, weight, maybe(bias), std::string("none"), c10::List<c10::optional<at::Scalar>>(),
                                 c10::optional<std::string>()};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// x (M, K) -> (M, N) through one layer's product of `kind`.
torch::Tensor product(const torch::Tensor& x, int64_t kind, int64_t N, const torch::Tensor& a, const torch::Tensor& s,
                      const torch::Tensor& bias, const std::string& isa) {
  if (kind == kDense) return dense_rows(x, a, maybe(bias));
  if (kind == kPacked) return packed_linear(x, a, bias);
  const int64_t pad = a.size(1) * 32 - x.size(1);  // input features padded to whole blocks (zero weights)
  const auto rows = pad > 0 ? at::constant_pad_nd(x, {0, pad}) : x;
  return block_linear(rows.contiguous(), a, s, maybe(bias), N, kind == kQ8 ? 0 : 1, isa);
}

// `model.norms.RMSNorm` / `nn.LayerNorm` of each row of x (M, C) into out.
void norm_rows(const float* x, float* out, int64_t M, int64_t C, const Config& cfg, const torch::Tensor& weight,
               const torch::Tensor& bias) {
  const float* w = weight.data_ptr<float>();
  const float* b = present(bias) ? bias.data_ptr<float>() : nullptr;
  const float eps = static_cast<float>(cfg.norm_eps), offset = static_cast<float>(cfg.norm_offset);
  for (int64_t m = 0; m < M; ++m) {
    const float* r = x + m * C;
    float* o = out + m * C;
    if (cfg.layer_norm) {
      double sum = 0.0, squares = 0.0;
      for (int64_t c = 0; c < C; ++c) sum += r[c];
      const double mean = sum / C;
      for (int64_t c = 0; c < C; ++c) squares += (r[c] - mean) * (r[c] - mean);
      const float inv = static_cast<float>(1.0 / std::sqrt(squares / C + cfg.norm_eps));
      const float mu = static_cast<float>(mean);
      for (int64_t c = 0; c < C; ++c) o[c] = (r[c] - mu) * inv * w[c] + (b != nullptr ? b[c] : 0.0f);
    } else {
      float squares = 0.0f;
      for (int64_t c = 0; c < C; ++c) squares += r[c] * r[c];
      const float inv = 1.0f / std::sqrt(squares / static_cast<float>(C) + eps);
      for (int64_t c = 0; c < C; ++c) o[c] = r[c] * inv * (offset + w[c]);
    }
  }
}

// One head's RMSNorm (q/k norms: Qwen3, Gemma 3), in place.
void norm_head(float* h, int64_t D, const float* w, float eps, float offset) {
  float squares = 0.0f;
  for (int64_t d = 0; d < D; ++d) squares += h[d] * h[d];
  const float inv = 1.0f / std::sqrt(squares / static_cast<float>(D) + eps);
  for (int64_t d = 0; d < D; ++d) h[d] = h[d] * inv * (offset + w[d]);
}

// GPT-NeoX's rotation of a head's first `rotary` channels in place: halves (x1, x2) -> (x1 cos - x2 sin,
// x1 sin + x2 cos).
void rotate_head(float* h, int64_t rotary, const float* cos, const float* sin) {
  const int64_t half = rotary / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = h[i], x2 = h[half + i];
    h[i] = x1 * cos[i] - x2 * sin[i];
    h[half + i] = x1 * sin[i] + x2 * cos[i];
  }
}

float activate(float x, int64_t kind) {
  switch (kind) {
    case kSiluGated:
    case kSilu:
      return x / (1.0f + std::exp(-x));
    case kGeluTanhGated:
    case kGeluTanh: {
      const float inner = 0.7978845608028654f * (x + 0.044715f * x * x * x);
      return 0.5f * x * (1.0f + std::tanh(inner));
    }
    case kGelu:
      return 0.5f * x * (1.0f + std::erf(x * 0.7071067811865476f));
    default:
      return x > 0.0f ? x : 0.0f;
  }
}

// act(u[i]) (times gate_by[i] where given: [gate | fc1] as one product, `MLP.fuse_gate`) for i in [from, width).
void activate_rest(const float* u, const float* gate_by, float* a, int64_t from, int64_t width, int64_t kind) {
  for (int64_t i = from; i < width; ++i) a[i] = activate(u[i], kind) * (gate_by != nullptr ? gate_by[i] : 1.0f);
}

// The same 8 lanes at a time for SiLU and GELU's tanh form (the exponential as a polynomial: within 1e-6 of
// std::exp's result); returns where it stopped (0 for the other activations, which `activate_rest` computes).
int64_t activate_lanes(const float* u, const float* gate_by, float* a, int64_t width, int64_t kind) {
  int64_t i = 0;
#if defined(TSERVE_VECTOR_MATH)
  const bool silu = kind == kSiluGated || kind == kSilu, gelu_tanh = kind == kGeluTanhGated || kind == kGeluTanh;
  if (!silu && !gelu_tanh) return 0;
  for (; i + 8 <= width; i += 8) {
    const __m256 x = _mm256_loadu_ps(u + i);
    __m256 y;
    if (silu) {
      y = tserve_vector::silu(x);
    } else {
      const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
      const __m256 inner = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                         _mm256_add_ps(x, _mm256_mul_ps(_mm256_set1_ps(0.044715f), cube)));
      y = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x),
                        _mm256_add_ps(_mm256_set1_ps(1.0f), tserve_vector::tanh(inner)));
    }
    if (gate_by != nullptr) y = _mm256_mul_ps(y, _mm256_loadu_ps(gate_by + i));
    _mm256_storeu_ps(a + i, y);
  }
#endif
  return i;
}

// A sub-layer's output into the residual stream: out = sandwich norm (Gemma) of out, times the residual multiplier
// (Granite), added to x in place.
void add_residual(float* x, torch::Tensor out, int64_t M, int64_t C, const Config& cfg, const torch::Tensor& out_norm) {
  if (present(out_norm)) {
    auto normed = torch::empty_like(out);
    Config plain = cfg;
    plain.layer_norm = false;
    norm_rows(out.data_ptr<float>(), normed.data_ptr<float>(), M, C, plain, out_norm, torch::Tensor());
    out = normed;
  }
  const float* o = out.data_ptr<float>();
  const float multiplier = static_cast<float>(cfg.residual_multiplier);
  for (int64_t i = 0; i < M * C; ++i) x[i] += multiplier == 1.0f ? o[i] : o[i] * multiplier;
}

}  // namespace

namespace {

// One of the step's two caches: the layers' keys and values (layers, positions, kv heads, head dim) float32, each
// row's new position in it (M,) and the rows' block tables (M, W).
struct StepCache {
  torch::Tensor k, v, write, tables;
  const int64_t* at = nullptr;
  int64_t positions = 0;

  StepCache(torch::Tensor k_, torch::Tensor v_, torch::Tensor write_, torch::Tensor tables_, int64_t M, int64_t KV,
            int64_t D)
      : k(k_), v(v_), write(write_.contiguous()), tables(tables_) {
    TORCH_CHECK(k.scalar_type() == torch::kFloat && k.is_contiguous() && v.is_contiguous() && k.sizes() == v.sizes() &&
                    k.dim() == 4 && k.size(2) == KV && k.size(3) == D,
                "k_cache / v_cache: (layers, positions, kv heads, head dim) float32");
    TORCH_CHECK(write.scalar_type() == torch::kLong && write.numel() == M, "write: (M,) int64");
    positions = k.size(1);
    at = write.data_ptr<int64_t>();
    for (int64_t m = 0; m < M; ++m) TORCH_CHECK(at[m] >= 0 && at[m] < positions, "write position out of range");
  }
};

}  // namespace

namespace {

torch::Tensor layers_step(torch::Tensor x, const std::vector<torch::Tensor>& tensors, const std::vector<int64_t>& ints,
                          const std::vector<double>& config, const std::string& isa, torch::Tensor k_cache,
                          torch::Tensor v_cache, torch::Tensor write, torch::Tensor tables, torch::Tensor lengths,
                          torch::Tensor local_k, torch::Tensor local_v, torch::Tensor local_write,
                          torch::Tensor local_tables, torch::Tensor cos, torch::Tensor sin, torch::Tensor local_cos,
                          torch::Tensor local_sin) {
  const Config cfg = read_config(config, isa);
  const int64_t layers = (static_cast<int64_t>(ints.size()) - 2) / kInts, M = x.size(0), C = x.size(1);
  const int64_t H = cfg.heads, KV = cfg.kv_heads, D = cfg.head_dim;
  TORCH_CHECK(static_cast<int64_t>(tensors.size()) == layers * kTensors + 5 &&
                  static_cast<int64_t>(ints.size()) == layers * kInts + 2, "decode_layers: tensors / ints per layer");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "x: (M, C) float32");
  const bool has_local = local_k.numel() > 0;
  int64_t windowed = 0;
  for (int64_t layer = 0; layer < layers; ++layer) windowed += ints[layer * kInts + kWindow] > 0;
  StepCache full(k_cache, v_cache, write, tables, M, KV, D);
  TORCH_CHECK(full.k.size(0) == (has_local ? layers - windowed : layers), "k_cache: one entry per layer it holds");
  const StepCache local = has_local ? StepCache(local_k, local_v, local_write, local_tables, M, KV, D) : full;
  TORCH_CHECK(!has_local || local.k.size(0) == windowed, "local_k: one entry per sliding-window layer");
  int64_t full_index = 0, local_index = 0;
  const int64_t half = cfg.rotary_dim / 2;
  cos = cos.contiguous();
  sin = sin.contiguous();
  if (half > 0) TORCH_CHECK(cos.size(0) == M && cos.size(1) == half && sin.sizes() == cos.sizes(), "cos / sin");
  if (cfg.has_local_rope) {
    local_cos = local_cos.contiguous();
    local_sin = local_sin.contiguous();
    TORCH_CHECK(local_cos.sizes() == cos.sizes() && local_sin.sizes() == cos.sizes(), "local cos / sin");
  }
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  const float query_scale = static_cast<float>(cfg.query_scale);
  auto hidden = x.contiguous().clone();
  float* h = hidden.data_ptr<float>();
  auto normed = torch::empty_like(hidden);
  const int64_t q_width = H * D, kv_width = KV * D;
  for (int64_t layer = 0; layer < layers; ++layer) {
    const torch::Tensor* t = tensors.data() + layer * kTensors;
    const int64_t* n = ints.data() + layer * kInts;
    // Attention.
    norm_rows(h, normed.data_ptr<float>(), M, C, cfg, t[kNorm1W], t[kNorm1B]);
    auto qkv = product(normed, n[kQkvKind], n[kQkvN], t[kQkvA], t[kQkvS], t[kQkvBias], cfg.isa).contiguous();
    TORCH_CHECK(qkv.size(1) == q_width + 2 * kv_width, "qkv width");
    auto q = torch::empty({M, H, D}, x.options());
    const StepCache& cache = has_local && n[kWindow] > 0 ? local : full;
    const int64_t index = has_local && n[kWindow] > 0 ? local_index++ : full_index++;
    TORCH_CHECK(index < cache.k.size(0), "decode_layers: layer ", layer, " has no entry in the cache it reads");
    const int64_t* at_pos = cache.at;
    float* kc = cache.k.data_ptr<float>() + index * cache.positions * kv_width;
    float* vc = cache.v.data_ptr<float>() + index * cache.positions * kv_width;
    const bool local = cfg.has_local_rope && n[kWindow] > 0;
    const float* cos_rows = half > 0 ? (local ? local_cos : cos).data_ptr<float>() : nullptr;
    const float* sin_rows = half > 0 ? (local ? local_sin : sin).data_ptr<float>() : nullptr;
    for (int64_t m = 0; m < M; ++m) {
      float* row = qkv.data_ptr<float>() + m * (q_width + 2 * kv_width);
      float* qm = q.data_ptr<float>() + m * q_width;
      std::copy(row, row + q_width, qm);
      float* km = kc + at_pos[m] * kv_width;
      std::copy(row + q_width, row + q_width + kv_width, km);
      std::copy(row + q_width + kv_width, row + q_width + 2 * kv_width, vc + at_pos[m] * kv_width);
      for (int64_t j = 0; j < H + KV; ++j) {
        float* head = j < H ? qm + j * D : km + (j - H) * D;
        if (cfg.qk_norm) {
          norm_head(head, D, t[j < H ? kQNormW : kKNormW].data_ptr<float>(), static_cast<float>(cfg.qk_norm_eps),
                    static_cast<float>(cfg.norm_offset));
        }
        if (half > 0 && n[kRotates] != 0) rotate_head(head, cfg.rotary_dim, cos_rows + m * half, sin_rows + m * half);
        if (j < H && query_scale != 0.0f) {
          for (int64_t d = 0; d < D; ++d) head[d] *= query_scale;
        }
      }
    }
    auto k_layer = cache.k.select(0, index), v_layer = cache.v.select(0, index);
    auto attended = paged_decode(q, k_layer, v_layer, cache.tables, lengths, cfg.block_size, scale, n[kWindow]);
    auto out = product(attended.view({M, q_width}), n[kOKind], n[kON], t[kOA], t[kOS], t[kOBias], cfg.isa);
    add_residual(h, out.contiguous(), M, C, cfg, t[kNorm1OutW]);
    // MLP.
    norm_rows(h, normed.data_ptr<float>(), M, C, cfg, t[kNorm2W], t[kNorm2B]);
    auto up = product(normed, n[kUpKind], n[kUpN], t[kUpA], t[kUpS], t[kUpBias], cfg.isa).contiguous();
    const bool gated = cfg.activation == kSiluGated || cfg.activation == kGeluTanhGated;
    const int64_t width = gated ? n[kUpN] / 2 : n[kUpN];
    auto act = torch::empty({M, width}, x.options());
    for (int64_t m = 0; m < M; ++m) {
      const float* u = up.data_ptr<float>() + m * n[kUpN];
      float* a = act.data_ptr<float>() + m * width;
      const int64_t i = activate_lanes(u, gated ? u + width : nullptr, a, width, cfg.activation);
      activate_rest(u, gated ? u + width : nullptr, a, i, width, cfg.activation);
    }
    out = product(act, n[kDownKind], n[kDownN], t[kDownA], t[kDownS], t[kDownBias], cfg.isa);
    add_residual(h, out.contiguous(), M, C, cfg, t[kNorm2OutW]);
  }
  const torch::Tensor* last = tensors.data() + layers * kTensors;  // the final norm's weight and bias, the output
  const int64_t* output = ints.data() + layers * kInts;              // layer's weight, scales, bias; its kind, width
  if (present(last[0])) {
    norm_rows(h, normed.data_ptr<float>(), M, C, cfg, last[0], last[1]);
    hidden = normed;
  }
  return product(hidden, output[0], output[1], last[2], last[3], last[4], cfg.isa);
}

}  // namespace

// x (M, C) float32: the embeddings of one new token per row (scaled, positions added). tensors / ints: per layer, as
// `Slot` / `IntSlot` list them. k_cache, v_cache (layers, positions, kv heads, head dim) float32; write (M,) each
// row's new position in the flat cache; tables (M, W) and lengths (M,) what each row attends over. local_k, local_v,
// local_write, local_tables: the same for the sliding-window layers where they keep a cache of their own
// (`PagedKVCache.local`; empty tensors where they do not): the layers with a window take those, in order. cos / sin
// (M, rotary / 2) at each row's position (local_cos / local_sin: the sliding layers' own, or empty). Returns the
// logits (M, vocabulary): after the last layer, the final norm (tensors' third and second last: its weight and
// bias, empty where the model has none) and the output layer (the last three tensors, as a layer's product; the
// last two integers its kind and width), before any scaling or soft cap of the logits.
torch::Tensor decode_layers(torch::Tensor x, const std::vector<torch::Tensor>& tensors, const std::vector<int64_t>& ints,
                            const std::vector<double>& config, const std::string& isa, torch::Tensor k_cache,
                            torch::Tensor v_cache, torch::Tensor write, torch::Tensor tables, torch::Tensor lengths,
                            torch::Tensor local_k, torch::Tensor local_v, torch::Tensor local_write,
                            torch::Tensor local_tables, torch::Tensor cos, torch::Tensor sin, torch::Tensor local_cos,
                            torch::Tensor local_sin) {
  const auto step = [&] {
    return layers_step(x, tensors, ints, config, isa, k_cache, v_cache, write, tables, lengths, local_k, local_v,
                       local_write, local_tables, cos, sin, local_cos, local_sin);
  };
  // oneDNN's pre-packed products open OpenMP regions of their own (inside the team's they would run on one thread):
  // a step with one runs every loop as PyTorch does.
  const size_t layer_ints = ints.size() >= 2 ? ints.size() - 2 : 0;
  bool packed = ints.size() >= 2 && ints[layer_ints] == kPacked;
  for (size_t layer = 0; layer + kInts <= layer_ints; layer += kInts) {
    for (const int slot : {kQkvKind, kOKind, kUpKind, kDownKind}) packed = packed || ints[layer + slot] == kPacked;
  }
  if (packed) return step();
  torch::Tensor logits;
  tserve::on_step_team([&] { logits = step(); });
  return logits;
}

namespace {

// Each row's flat cache position for its new token and its block table, as `PagedKVCache.view` plans them: position
// p of a row is block tables[slot, p / block_size] at p % block_size; past the table's last block, the null block.
std::pair<torch::Tensor, torch::Tensor> plan_writes(const torch::Tensor& tables, const torch::Tensor& slots,
                                                    const int64_t* positions, int64_t block_size) {
  TORCH_CHECK(tables.scalar_type() == torch::kLong && tables.dim() == 2 && tables.is_contiguous(),
              "tables: (rows, blocks) int64");
  const int64_t M = slots.size(0), width = tables.size(1), rows = tables.size(0);
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* table = tables.data_ptr<int64_t>();
  auto write = torch::empty({M}, slots.options());
  int64_t* at = write.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) {
    TORCH_CHECK(slot[m] >= 0 && slot[m] < rows, "slot out of range");
    const int64_t block = positions[m] / block_size, offset = positions[m] % block_size;
    at[m] = block < width ? table[slot[m] * width + block] * block_size + offset : offset;
  }
  return {write, tables.index_select(0, slots)};
}

}  // namespace

// A model's fused decode step: what does not change between steps (every layer's tensors and integers, the config,
// the embeddings and position tables), held here once; each step then passes only what it changes. (Built in Python
// each step, the embeddings, the cache's plan and ~20 tensors a layer passed through pybind took ~290 µs of a small
// model's 3-4 ms step; made here, ~80 µs is left around the call: docs/benchmarks/fused-decode.md.)
struct DecodePlan {
  std::vector<torch::Tensor> tensors;
  std::vector<int64_t> ints;
  std::vector<double> config;
  std::string isa;
  // embedding (vocabulary, C) float32 and its scale; position_table (positions, C) or empty; rope_cos / rope_sin
  // (positions, rotary / 2) or empty, local_rope_cos / local_rope_sin the sliding layers' own or empty.
  torch::Tensor embedding;
  double embed_scale;
  torch::Tensor position_table, rope_cos, rope_sin, local_rope_cos, local_rope_sin;

  // One step from the rows' new tokens (M,) at `positions` (M,) in cache rows `slots` (M,): what
  // `Decoder.decode_step` and `PagedKVCache.view` built in Python for a step (the embeddings, scaled, with the
  // position table added where the model has one; each row's write position, block table and length; its rotary
  // rows) made here, then `decode_layers`. tables (rows, blocks) int64, local_tables the sliding layers' own cache's
  // (or empty).
  torch::Tensor step(torch::Tensor tokens, torch::Tensor positions, torch::Tensor slots, int64_t block_size,
                     torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables, torch::Tensor local_k,
                     torch::Tensor local_v, torch::Tensor local_tables) const {
    tokens = tokens.contiguous();
    positions = positions.contiguous();
    slots = slots.contiguous();
    const int64_t M = tokens.size(0);
    TORCH_CHECK(tokens.scalar_type() == torch::kLong && positions.scalar_type() == torch::kLong &&
                    slots.scalar_type() == torch::kLong && tokens.dim() == 1 && positions.sizes() == tokens.sizes() &&
                    slots.sizes() == tokens.sizes(),
                "tokens, positions, slots: (M,) int64");
    const int64_t C = embedding.size(1), V = embedding.size(0);
    const bool positioned = position_table.numel() > 0;
    const int64_t* token = tokens.data_ptr<int64_t>();
    const int64_t* position = positions.data_ptr<int64_t>();
    auto x = torch::empty({M, C}, embedding.options());
    const float scale = static_cast<float>(embed_scale);
    for (int64_t m = 0; m < M; ++m) {
      TORCH_CHECK(token[m] >= 0 && token[m] < V, "token id out of range");
      TORCH_CHECK(position[m] >= 0 && (!positioned || position[m] < position_table.size(0)),
                  "position out of range");
      const float* e = embedding.data_ptr<float>() + token[m] * C;
      const float* p = positioned ? position_table.data_ptr<float>() + position[m] * C : nullptr;
      float* row = x.data_ptr<float>() + m * C;
      for (int64_t c = 0; c < C; ++c) row[c] = p != nullptr ? e[c] * scale + p[c] : e[c] * scale;
    }
    std::vector<double> step_config = config;
    step_config.at(3) = static_cast<double>(block_size);
    const auto [write, row_tables] = plan_writes(tables, slots, position, block_size);
    torch::Tensor local_write = torch::empty({0}, slots.options()), local_row_tables = local_write;
    if (local_k.numel() > 0) {
      std::tie(local_write, local_row_tables) = plan_writes(local_tables, slots, position, block_size);
    }
    const auto rows_of = [&](const torch::Tensor& table) {
      return table.numel() > 0 ? table.index_select(0, positions) : table;
    };
    return decode_layers(x, tensors, ints, step_config, isa, k_cache, v_cache, write, row_tables, positions + 1,
                         local_k, local_v, local_write, local_row_tables, rows_of(rope_cos), rows_of(rope_sin),
                         rows_of(local_rope_cos), rows_of(local_rope_sin));
  }
};

DecodePlan make_decode_plan(std::vector<torch::Tensor> tensors, std::vector<int64_t> ints, std::vector<double> config,
                            std::string isa, torch::Tensor embedding, double embed_scale, torch::Tensor position_table,
                            torch::Tensor rope_cos, torch::Tensor rope_sin, torch::Tensor local_rope_cos,
                            torch::Tensor local_rope_sin) {
  TORCH_CHECK(embedding.scalar_type() == torch::kFloat && embedding.dim() == 2 && embedding.is_contiguous(),
              "embedding: (vocabulary, C) float32");
  TORCH_CHECK(position_table.numel() == 0 ||
                  (position_table.scalar_type() == torch::kFloat && position_table.is_contiguous() &&
                   position_table.dim() == 2 && position_table.size(1) == embedding.size(1)),
              "position_table: (positions, C) float32");
  return DecodePlan{std::move(tensors), std::move(ints), std::move(config), std::move(isa), embedding, embed_scale,
                    position_table, rope_cos, rope_sin, local_rope_cos, local_rope_sin};
}

// `DecodePlan` in the kernels' Python module (`model.kernels.cpu`; `model.fused_decode.FusedDecode`).
void bind_decode_plan(pybind11::module& m) {
  pybind11::class_<DecodePlan>(m, "DecodePlan")
      .def("step", &DecodePlan::step, "one decode step through every layer from the rows' new tokens");
  m.def("decode_plan", &make_decode_plan, "a model's fused decode step, its unchanging arguments held once");
}
