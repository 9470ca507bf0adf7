// What the CPU linear kernels (`int8_gemm.cpp`, `block_quant.cpp`) check the same way in their arguments.
#pragma once

#include <torch/extension.h>

namespace tserve {

// The bias of an (M, K) x (K, N) linear layer as N float32s, or nullptr without one.
inline const float* checked_bias(const c10::optional<torch::Tensor>& bias, int64_t N) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->numel() == N && bias->is_contiguous() && bias->scalar_type() == torch::kFloat, "bias");
  return bias->data_ptr<float>();
}

}  // namespace tserve
