// The CPU kernels' Python module (`model.kernels.cpu`).
#include <torch/extension.h>

#include <vector>

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor tables,
                           torch::Tensor lengths, int64_t block_size, double scale);
std::vector<torch::Tensor> int8_rows_in(torch::Tensor x, bool split);
torch::Tensor int8_rows_out(torch::Tensor product, torch::Tensor low, torch::Tensor span, torch::Tensor row_sums,
                            c10::optional<torch::Tensor> bias, bool split);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "one-token attention from a paged KV cache (float32)");
  m.def("int8_rows_in", &int8_rows_in, "each row mapped onto [0, 1] (or its 14-bit code's halves) for an int8 GEMM");
  m.def("int8_rows_out", &int8_rows_out, "an int8 GEMM's product mapped back to each row's range, plus the bias");
}
