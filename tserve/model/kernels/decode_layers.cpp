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

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kernel_entries.h"
#include "linear_args.h"
#include "step_team.h"
#include "vector_math.h"

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

// One layer's product of `kind` from K input features to N outputs, its weights checked once, when the plan is made.
struct Product {
  int64_t kind = kDense, K = 0, N = 0, padded_K = 0;  // padded_K: the block kinds' input features in whole blocks
  const torch::Tensor* a = nullptr;                    // the weight (float32, oneDNN's packed) or the panels
  const void* weights = nullptr;
  const uint16_t* scales = nullptr;
  const float* bias = nullptr;
  const torch::Tensor* bias_tensor = nullptr;
  bool wide = false;
  tserve::Upcoming upcoming;  // its weights as its kernel's loop splits them (none for oneDNN's, which splits its own)

  Product() = default;
  Product(int64_t kind_, int64_t K_, int64_t N_, const torch::Tensor& a_, const torch::Tensor& s,
          const torch::Tensor& bias_, const std::string& isa)
      : kind(kind_), K(K_), N(N_), padded_K(K_), a(&a_), bias_tensor(&bias_) {
    TORCH_CHECK(kind >= kDense && kind <= kQ4, "decode_layers: product kind ", kind);
    bias = present(bias_) ? tserve::checked_bias(bias_, N) : nullptr;
    if (kind == kDense) {
      TORCH_CHECK(a_.scalar_type() == torch::kFloat && a_.is_contiguous() && a_.dim() == 2 && a_.size(0) == N &&
                      a_.size(1) == K, "decode_layers: a float32 weight (N, K)");
      weights = a_.data_ptr<float>();
    } else if (kind != kPacked) {
      padded_K = a_.size(1) * 32;  // input features padded to whole blocks (zero weights)
      TORCH_CHECK(padded_K >= K, "decode_layers: panels narrower than the input");
      check_panels(a_, s, padded_K, N, kind == kQ8 ? 0 : 1);
      weights = a_.data_ptr<uint8_t>();
      scales = reinterpret_cast<const uint16_t*>(s.data_ptr<at::Half>());
      wide = isa == "avx512";
    }
    if (kind == kDense) upcoming = dense_rows_upcoming(a_.data_ptr<float>(), K, N);
    if (kind >= kQ8) {
      upcoming = block_linear_upcoming(a_.data_ptr<uint8_t>(), scales, padded_K, N, kind == kQ8 ? 0 : 1);
    }
  }

  // x (M, K) -> out (M, N).
  void run(const float* x, int64_t M, float* out) const {
    if (kind == kDense) {
      dense_rows_into(x, M, K, static_cast<const float*>(weights), N, bias, out);
    } else if (kind == kPacked) {
      auto rows = torch::from_blob(const_cast<float*>(x), {M, K}, torch::kFloat);
      const auto result = packed_linear(rows, *a, *bias_tensor).contiguous();
      std::copy(result.data_ptr<float>(), result.data_ptr<float>() + M * N, out);
    } else {
      if (padded_K > K) {
        thread_local std::vector<float> padded;
        padded.assign(M * padded_K, 0.0f);
        for (int64_t m = 0; m < M; ++m) std::copy(x + m * K, x + (m + 1) * K, padded.data() + m * padded_K);
        x = padded.data();
      }
      block_linear_rows(x, M, padded_K, static_cast<const uint8_t*>(weights), scales, bias, N, kind == kQ8 ? 0 : 1,
                        wide, out);
    }
  }
};

// `model.norms.RMSNorm` / `nn.LayerNorm` of each row of x (M, C) into out.
void norm_rows(const float* x, float* out, int64_t M, int64_t C, const Config& cfg, const float* w, const float* b) {
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

// A sub-layer's output into the residual stream: out = sandwich norm (Gemma) of out (in place), times the residual
// multiplier (Granite), added to x in place.
void add_residual(float* x, float* out, int64_t M, int64_t C, const Config& cfg, const float* out_norm) {
  if (out_norm != nullptr) {
    Config plain = cfg;
    plain.layer_norm = false;
    norm_rows(out, out, M, C, plain, out_norm, nullptr);  // a row's sum is taken before it is written
  }
  const float multiplier = static_cast<float>(cfg.residual_multiplier);
  for (int64_t i = 0; i < M * C; ++i) x[i] += multiplier == 1.0f ? out[i] : out[i] * multiplier;
}

}  // namespace

namespace {

// One of the step's two caches: the layers' keys and values (layers, positions, kv heads, head dim) float32, each
// row's new position in it (M,) and the rows' block tables (M, W), planned on the host for the step
// (`plan_writes`).
struct StepCache {
  torch::Tensor k, v;
  std::vector<int64_t> write, tables;
  int64_t width = 0, positions = 0;
  float *k_data = nullptr, *v_data = nullptr;

  StepCache() = default;
  StepCache(torch::Tensor k_, torch::Tensor v_, int64_t KV, int64_t D) : k(std::move(k_)), v(std::move(v_)) {
    TORCH_CHECK(k.scalar_type() == torch::kFloat && k.is_contiguous() && v.is_contiguous() && k.sizes() == v.sizes() &&
                    k.dim() == 4 && k.size(2) == KV && k.size(3) == D,
                "k_cache / v_cache: (layers, positions, kv heads, head dim) float32");
    positions = k.size(1);
    k_data = k.data_ptr<float>();
    v_data = v.data_ptr<float>();
  }
};

// A step's rows as the layers read them, made on the host with no tensor of their own (a tensor operator costs a
// few µs of dispatch, many more once a step's weights have swept the caches): the embeddings (M, C), each row's
// length (its position + 1), its rotary rows (M, rotary / 2; the sliding layers' own, or empty) and the two caches.
struct StepRows {
  int64_t M = 0;
  std::vector<float> x, cos, sin, local_cos, local_sin;
  std::vector<int64_t> lengths;
  StepCache full, local;
  bool has_local = false;
};

// A float32 tensor's rows (nullptr where the layer has none), checked to hold `n` values.
const float* rows_of(const torch::Tensor& t, int64_t n, const char* what) {
  if (!present(t)) return nullptr;
  TORCH_CHECK(t.scalar_type() == torch::kFloat && t.is_contiguous() && t.numel() == n, "decode_layers: ", what,
              ": ", n, " float32 values");
  return t.data_ptr<float>();
}

// One layer as a step reads it: its products and the raw rows of its norms, checked once when the plan is made (a
// step that checked ~20 tensors a layer read each one's metadata from memory after the previous step's weights had
// swept the caches).
struct LayerPlan {
  Product qkv, o, up, down;
  const float *norm1_w = nullptr, *norm1_b = nullptr, *norm2_w = nullptr, *norm2_b = nullptr;
  const float *q_norm = nullptr, *k_norm = nullptr, *norm1_out = nullptr, *norm2_out = nullptr;
  int64_t up_n = 0, window = 0;
  bool rotates = false;
};

// Every layer's plan, the final norm and the output layer, from the tensors and integers `FusedDecode.build` lists
// (per layer, as `Slot` / `IntSlot` order them; then the final norm's weight and bias, empty where the model has
// none, and the output layer as a layer's product, its kind and width last).
struct LayersPlan {
  Config cfg;
  std::vector<LayerPlan> layers;
  Product output;
  const float *final_w = nullptr, *final_b = nullptr;
  int64_t C = 0, vocabulary = 0, windowed = 0, widest = 0;
  bool packed = false;  // a product is oneDNN's pre-packed one

  LayersPlan(const std::vector<torch::Tensor>& tensors, const std::vector<int64_t>& ints, const Config& config, int64_t C_)
      : cfg(config), C(C_) {
    const int64_t count = (static_cast<int64_t>(ints.size()) - 2) / kInts;
    TORCH_CHECK(count >= 0 && static_cast<int64_t>(tensors.size()) == count * kTensors + 5 &&
                    static_cast<int64_t>(ints.size()) == count * kInts + 2, "decode_layers: tensors / ints per layer");
    const int64_t H = cfg.heads, KV = cfg.kv_heads, D = cfg.head_dim, q_width = H * D, kv_width = KV * D;
    const bool gated = cfg.activation == kSiluGated || cfg.activation == kGeluTanhGated;
    widest = std::max(C, q_width);  // the widest input or output a product has
    layers.resize(count);
    for (int64_t layer = 0; layer < count; ++layer) {
      const torch::Tensor* t = tensors.data() + layer * kTensors;
      const int64_t* n = ints.data() + layer * kInts;
      TORCH_CHECK(n[kQkvN] == q_width + 2 * kv_width && n[kON] == C && n[kDownN] == C && (!gated || n[kUpN] % 2 == 0),
                  "decode_layers: layer ", layer, "'s product widths");
      LayerPlan& l = layers[layer];
      l.qkv = Product(n[kQkvKind], C, n[kQkvN], t[kQkvA], t[kQkvS], t[kQkvBias], cfg.isa);
      l.o = Product(n[kOKind], q_width, C, t[kOA], t[kOS], t[kOBias], cfg.isa);
      l.up = Product(n[kUpKind], C, n[kUpN], t[kUpA], t[kUpS], t[kUpBias], cfg.isa);
      l.down = Product(n[kDownKind], gated ? n[kUpN] / 2 : n[kUpN], C, t[kDownA], t[kDownS], t[kDownBias], cfg.isa);
      l.norm1_w = rows_of(t[kNorm1W], C, "norm weight");
      l.norm1_b = rows_of(t[kNorm1B], C, "norm bias");
      l.norm2_w = rows_of(t[kNorm2W], C, "norm weight");
      l.norm2_b = rows_of(t[kNorm2B], C, "norm bias");
      TORCH_CHECK(l.norm1_w != nullptr && l.norm2_w != nullptr, "decode_layers: layer ", layer, "'s norm weights");
      l.q_norm = rows_of(t[kQNormW], D, "q norm");
      l.k_norm = rows_of(t[kKNormW], D, "k norm");
      TORCH_CHECK(!cfg.qk_norm || (l.q_norm != nullptr && l.k_norm != nullptr), "decode_layers: q / k norms");
      l.norm1_out = rows_of(t[kNorm1OutW], C, "sandwich norm");
      l.norm2_out = rows_of(t[kNorm2OutW], C, "sandwich norm");
      l.up_n = n[kUpN];
      l.rotates = n[kRotates] != 0;
      l.window = n[kWindow];
      windowed += l.window > 0;
      widest = std::max({widest, n[kQkvN], n[kUpN]});
      for (const Product* p : {&l.qkv, &l.o, &l.up, &l.down}) packed = packed || p->kind == kPacked;
    }
    const torch::Tensor* last = tensors.data() + count * kTensors;
    const int64_t* out = ints.data() + count * kInts;
    final_w = rows_of(last[0], C, "final norm");
    final_b = rows_of(last[1], C, "final norm bias");
    output = Product(out[0], C, out[1], last[2], last[3], last[4], cfg.isa);
    vocabulary = out[1];
    packed = packed || output.kind == kPacked;
    const bool blocks = output.kind >= kQ8 || std::any_of(layers.begin(), layers.end(), [](const LayerPlan& l) {
      return l.qkv.kind >= kQ8 || l.o.kind >= kQ8 || l.up.kind >= kQ8 || l.down.kind >= kQ8;
    });
    if (blocks || cfg.isa == "avx512") check_block_isa(cfg.isa);
  }
};

torch::Tensor layers_step(StepRows& rows, const LayersPlan& plan, int64_t block_size, const torch::Tensor& like) {
  Config cfg = plan.cfg;
  cfg.block_size = block_size;
  const int64_t M = rows.M, C = plan.C, widest = plan.widest;
  const int64_t H = cfg.heads, KV = cfg.kv_heads, D = cfg.head_dim;
  const bool has_local = rows.has_local;
  const int64_t layers = static_cast<int64_t>(plan.layers.size());
  const StepCache& full = rows.full;
  TORCH_CHECK(full.k.size(0) == (has_local ? layers - plan.windowed : layers), "k_cache: one entry per layer it holds");
  const StepCache& local = has_local ? rows.local : full;
  TORCH_CHECK(!has_local || local.k.size(0) == plan.windowed, "local_k: one entry per sliding-window layer");
  int64_t full_index = 0, local_index = 0;
  const int64_t half = cfg.rotary_dim / 2;
  if (half > 0) TORCH_CHECK(static_cast<int64_t>(rows.cos.size()) == M * half, "cos / sin: (M, rotary / 2)");
  if (cfg.has_local_rope) {
    TORCH_CHECK(rows.local_cos.size() == rows.cos.size(), "local cos / sin: (M, rotary / 2)");
  }
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  const float query_scale = static_cast<float>(cfg.query_scale);
  const int64_t q_width = H * D, kv_width = KV * D;
  const bool wide_attention = cfg.isa == "avx512";  // the attention's path, the block kernels'
  TORCH_CHECK(static_cast<int64_t>(rows.lengths.size()) == M && static_cast<int64_t>(rows.x.size()) == M * C,
              "lengths: (M,), x: (M, C)");
  for (const StepCache* cache : std::initializer_list<const StepCache*>{&full, &local}) {
    TORCH_CHECK(cache->positions % cfg.block_size == 0 && static_cast<int64_t>(cache->tables.size()) == M * cache->width,
                "decode_layers: a cache of whole blocks, tables (M, W)");
    check_block_ids(cache->tables.data(), rows.lengths.data(), M, cache->width, cfg.block_size,
                    cache->positions / cfg.block_size);
    for (int64_t m = 0; m < M; ++m) {
      TORCH_CHECK(cache->write[m] >= 0 && cache->write[m] < cache->positions, "write position out of range");
    }
  }
  // The step's rows, in one buffer: the residual stream, its norm, the widest product's output, the queries, the
  // attention's output and the activations.
  std::vector<float> buffer(M * (2 * C + 2 * widest + 2 * q_width));
  float* h = buffer.data();
  float* normed = h + M * C;
  float* wide = normed + M * C;
  float* act = wide + M * widest;
  float* q = act + M * widest;
  float* attended = q + M * q_width;
  std::copy(rows.x.begin(), rows.x.end(), h);
  const int64_t* length = rows.lengths.data();
  const bool gated = cfg.activation == kSiluGated || cfg.activation == kGeluTanhGated;
  for (int64_t layer = 0; layer < layers; ++layer) {
    const LayerPlan& l = plan.layers[layer];
    // Attention.
    norm_rows(h, normed, M, C, cfg, l.norm1_w, l.norm1_b);
    // Each loop names the product after it: its waiting threads ask for their chunks (`tserve::UpcomingLines`).
    tserve::expect_next(l.o.upcoming);
    l.qkv.run(normed, M, wide);
    const StepCache& cache = has_local && l.window > 0 ? local : full;
    const int64_t index = has_local && l.window > 0 ? local_index++ : full_index++;
    TORCH_CHECK(index < cache.k.size(0), "decode_layers: layer ", layer, " has no entry in the cache it reads");
    const int64_t* at_pos = cache.write.data();
    float* kc = cache.k_data + index * cache.positions * kv_width;
    float* vc = cache.v_data + index * cache.positions * kv_width;
    const bool local_rope = cfg.has_local_rope && l.window > 0;
    const float* cos_rows = half > 0 ? (local_rope ? rows.local_cos : rows.cos).data() : nullptr;
    const float* sin_rows = half > 0 ? (local_rope ? rows.local_sin : rows.sin).data() : nullptr;
    for (int64_t m = 0; m < M; ++m) {
      float* row = wide + m * (q_width + 2 * kv_width);
      float* qm = q + m * q_width;
      std::copy(row, row + q_width, qm);
      float* km = kc + at_pos[m] * kv_width;
      std::copy(row + q_width, row + q_width + kv_width, km);
      std::copy(row + q_width + kv_width, row + q_width + 2 * kv_width, vc + at_pos[m] * kv_width);
      for (int64_t j = 0; j < H + KV; ++j) {
        float* head = j < H ? qm + j * D : km + (j - H) * D;
        if (cfg.qk_norm) {
          norm_head(head, D, j < H ? l.q_norm : l.k_norm, static_cast<float>(cfg.qk_norm_eps),
                    static_cast<float>(cfg.norm_offset));
        }
        if (half > 0 && l.rotates) rotate_head(head, cfg.rotary_dim, cos_rows + m * half, sin_rows + m * half);
        if (j < H && query_scale != 0.0f) {
          for (int64_t d = 0; d < D; ++d) head[d] *= query_scale;
        }
      }
    }
    paged_decode_into(q, kc, vc, cache.tables.data(), length, attended, M, H, KV, D, cache.width, cfg.block_size,
                      scale, l.window, wide_attention);
    tserve::expect_next(l.up.upcoming);
    l.o.run(attended, M, wide);
    add_residual(h, wide, M, C, cfg, l.norm1_out);
    // MLP.
    norm_rows(h, normed, M, C, cfg, l.norm2_w, l.norm2_b);
    tserve::expect_next(l.down.upcoming);
    l.up.run(normed, M, wide);
    const int64_t width = l.down.K;
    for (int64_t m = 0; m < M; ++m) {
      const float* u = wide + m * l.up_n;
      float* a = act + m * width;
      const int64_t i = activate_lanes(u, gated ? u + width : nullptr, a, width, cfg.activation);
      activate_rest(u, gated ? u + width : nullptr, a, i, width, cfg.activation);
    }
    tserve::expect_next(layer + 1 < layers ? plan.layers[layer + 1].qkv.upcoming : plan.output.upcoming);
    l.down.run(act, M, wide);
    add_residual(h, wide, M, C, cfg, l.norm2_out);
  }
  if (plan.final_w != nullptr) {
    norm_rows(h, normed, M, C, cfg, plan.final_w, plan.final_b);
    h = normed;
  }
  tserve::expect_next(tserve::Upcoming{});
  auto logits = torch::empty({M, plan.vocabulary}, like.options());
  plan.output.run(h, M, logits.data_ptr<float>());
  return logits;
}

// The layers of a step (`layers_step`) on the step team, or as PyTorch runs loops where a product is oneDNN's
// pre-packed one (it opens OpenMP regions of its own: inside the team's they would run on one thread). Returns the
// logits (M, vocabulary) after the last layer, the final norm and the output layer, before any scaling or soft cap.
torch::Tensor decode_layers(StepRows& rows, const LayersPlan& plan, int64_t block_size, const torch::Tensor& like) {
  const auto step = [&] { return layers_step(rows, plan, block_size, like); };
  if (plan.packed) return step();
  torch::Tensor logits;
  tserve::on_step_team([&] { logits = step(); });
  return logits;
}

// A cache's plan for the step, as `PagedKVCache.view` makes it: each row's flat cache position for its new token
// (position p of a row is block tables[slot, p / block_size] at p % block_size; past the table's last block, the
// null block) and its block table, copied.
void plan_writes(StepCache& cache, const torch::Tensor& tables, const std::vector<int64_t>& slots,
                 const std::vector<int64_t>& positions, int64_t block_size) {
  TORCH_CHECK(tables.scalar_type() == torch::kLong && tables.dim() == 2 && tables.is_contiguous(),
              "tables: (rows, blocks) int64");
  const int64_t M = static_cast<int64_t>(slots.size()), width = tables.size(1), rows = tables.size(0);
  const int64_t* table = tables.data_ptr<int64_t>();
  cache.width = width;
  cache.write.resize(M);
  cache.tables.resize(M * width);
  for (int64_t m = 0; m < M; ++m) {
    TORCH_CHECK(slots[m] >= 0 && slots[m] < rows, "slot out of range");
    const int64_t block = positions[m] / block_size, offset = positions[m] % block_size;
    cache.write[m] = block < width ? table[slots[m] * width + block] * block_size + offset : offset;
    std::copy(table + slots[m] * width, table + (slots[m] + 1) * width, cache.tables.begin() + m * width);
  }
}

}  // namespace

// A model's fused decode step: what does not change between steps (every layer's tensors and integers, the config,
// the embeddings and position tables), held here once; each step then passes only what it changes. (Built in Python
// each step, the embeddings, the cache's plan and ~20 tensors a layer passed through pybind took ~290 µs of a small
// model's 3-4 ms step; made here, ~80 µs was left around the call: docs/benchmarks/fused-decode.md. A step's rows,
// tokens and positions come as host integers and everything but the logits is made without a tensor operator.)
struct DecodePlan {
  // Every layer's tensors (held here: the layers' plan points into them) and their plan.
  std::shared_ptr<const std::vector<torch::Tensor>> tensors;
  std::shared_ptr<const LayersPlan> layers;
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
  torch::Tensor step(const std::vector<int64_t>& tokens, const std::vector<int64_t>& positions,
                     const std::vector<int64_t>& slots, int64_t block_size, torch::Tensor k_cache,
                     torch::Tensor v_cache, const torch::Tensor& tables, torch::Tensor local_k, torch::Tensor local_v,
                     const torch::Tensor& local_tables) const {
    const int64_t M = static_cast<int64_t>(tokens.size());
    TORCH_CHECK(positions.size() == tokens.size() && slots.size() == tokens.size(), "tokens, positions, slots: (M,)");
    const int64_t C = embedding.size(1), V = embedding.size(0);
    const bool positioned = position_table.numel() > 0;
    StepRows rows;
    rows.M = M;
    rows.x.resize(M * C);
    rows.lengths.resize(M);
    const float scale = static_cast<float>(embed_scale);
    for (int64_t m = 0; m < M; ++m) {
      TORCH_CHECK(tokens[m] >= 0 && tokens[m] < V, "token id out of range");
      TORCH_CHECK(positions[m] >= 0 && (!positioned || positions[m] < position_table.size(0)),
                  "position out of range");
      const float* e = embedding.data_ptr<float>() + tokens[m] * C;
      const float* p = positioned ? position_table.data_ptr<float>() + positions[m] * C : nullptr;
      float* row = rows.x.data() + m * C;
      for (int64_t c = 0; c < C; ++c) row[c] = p != nullptr ? e[c] * scale + p[c] : e[c] * scale;
      rows.lengths[m] = positions[m] + 1;
    }
    const int64_t KV = layers->cfg.kv_heads, D = layers->cfg.head_dim;
    rows.full = StepCache(std::move(k_cache), std::move(v_cache), KV, D);
    plan_writes(rows.full, tables, slots, positions, block_size);
    rows.has_local = local_k.numel() > 0;
    if (rows.has_local) {
      rows.local = StepCache(std::move(local_k), std::move(local_v), KV, D);
      plan_writes(rows.local, local_tables, slots, positions, block_size);
    }
    rows_at(rope_cos, positions, rows.cos);
    rows_at(rope_sin, positions, rows.sin);
    rows_at(local_rope_cos, positions, rows.local_cos);
    rows_at(local_rope_sin, positions, rows.local_sin);
    return decode_layers(rows, *layers, block_size, embedding);
  }

  // The rows of a (positions, width) float32 table at each position, one after the other (nothing where the table
  // is empty).
  static void rows_at(const torch::Tensor& table, const std::vector<int64_t>& positions, std::vector<float>& out) {
    if (table.numel() == 0) return;
    const int64_t width = table.size(1);
    out.resize(positions.size() * width);
    for (size_t m = 0; m < positions.size(); ++m) {
      TORCH_CHECK(positions[m] < table.size(0), "position past the rotary table");
      const float* at = table.data_ptr<float>() + positions[m] * width;
      std::copy(at, at + width, out.begin() + m * width);
    }
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
  for (torch::Tensor* table : {&rope_cos, &rope_sin, &local_rope_cos, &local_rope_sin}) {
    TORCH_CHECK(table->numel() == 0 || (table->scalar_type() == torch::kFloat && table->dim() == 2),
                "rotary tables: (positions, rotary / 2) float32");
    *table = table->contiguous();
  }
  auto held = std::make_shared<const std::vector<torch::Tensor>>(std::move(tensors));
  auto layers = std::make_shared<const LayersPlan>(*held, ints, read_config(config, isa), embedding.size(1));
  return DecodePlan{std::move(held), std::move(layers), embedding, embed_scale, position_table, rope_cos, rope_sin,
                    local_rope_cos, local_rope_sin};
}

// `DecodePlan` in the kernels' Python module (`model.kernels.cpu`; `model.fused_decode.FusedDecode`).
void bind_decode_plan(pybind11::module& m) {
  pybind11::class_<DecodePlan>(m, "DecodePlan")
      .def("step", &DecodePlan::step, "one decode step through every layer from the rows' new tokens");
  m.def("decode_plan", &make_decode_plan, "a model's fused decode step, its unchanging arguments held once");
}
