// The CPU kernels' Python module (`model.kernels.cpu`).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif
#include <string>
#include <vector>

#include "step_team.h"

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor tables,
                           torch::Tensor lengths, int64_t block_size, double scale, int64_t window,
                           const std::string& isa);
std::vector<torch::Tensor> int8_rows_in(torch::Tensor x, bool split);
torch::Tensor int8_rows_out(torch::Tensor product, torch::Tensor low, torch::Tensor span, torch::Tensor row_sums,
                            c10::optional<torch::Tensor> bias, bool split);
torch::Tensor int8_pack_panels(torch::Tensor weight);
torch::Tensor int8_linear_exact(torch::Tensor x, torch::Tensor panels, torch::Tensor coefficients,
                                torch::Tensor row_sums, c10::optional<torch::Tensor> bias);
std::vector<std::string> block_isas();
torch::Tensor block_linear(torch::Tensor x, torch::Tensor panels, torch::Tensor scales,
                           c10::optional<torch::Tensor> bias, int64_t N, int64_t format, const std::string& isa);
torch::Tensor argmax_rows(torch::Tensor x, const std::vector<std::vector<int64_t>>& excluded);
torch::Tensor dense_rows(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
std::vector<std::string> dense_rows_paths();
torch::Tensor dense_rows_on(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias,
                            const std::string& path);
void bind_decode_plan(pybind11::module& m);
torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, bool causal, double scale,
                                const std::string& isa, c10::optional<torch::Tensor> starts);

// The lines each of `threads` threads asks for as it waits before a product of `items` items (`item_bytes` of
// weights, `scale_bytes` of scales each), in the order asked: per thread, each line's offset from the weights' start,
// or from the scales' start plus 2^40.
std::vector<std::vector<int64_t>> upcoming_lines(int64_t items, int64_t item_bytes, int64_t scale_bytes,
                                                 int64_t threads) {
  constexpr uintptr_t kData = uintptr_t{1} << 44, kScales = uintptr_t{1} << 45;  // never read: only counted
  const tserve::Upcoming next{reinterpret_cast<const char*>(kData), item_bytes, items,
                              scale_bytes > 0 ? reinterpret_cast<const char*>(kScales) : nullptr, scale_bytes};
  std::vector<std::vector<int64_t>> asked(threads);
  for (int64_t t = 0; t < threads; ++t) {
    tserve::UpcomingLines lines(next, static_cast<int>(threads), static_cast<int>(t));
    const auto record = [&](uintptr_t address) {
      asked[t].push_back(address >= kScales ? static_cast<int64_t>(address - kScales) + (int64_t{1} << 40)
                                            : static_cast<int64_t>(address - kData));
    };
    while (lines.next(record)) {
    }
  }
  return asked;
}

// The time a cache line takes to go from one core to another and back (ns, the best of `rounds` rounds of
// `iterations` exchanges), between the first two CPUs this process may run on; -1 where it has fewer than two (or
// is not on Linux). A decode step's threads hand each loop and its rows over in such exchanges; on a VM the same
// two vCPUs are ~100 ns apart on one CCD and ~400 ns on two (each with its own path to memory: a faster triad).
double core_round_trip_ns(int64_t iterations, int64_t rounds) {
#if defined(__linux__)
  cpu_set_t allowed;
  if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0 || CPU_COUNT(&allowed) < 2) return -1.0;
  int cpus[2], found = 0;
  for (int c = 0; c < CPU_SETSIZE && found < 2; ++c) {
    if (CPU_ISSET(c, &allowed)) cpus[found++] = c;
  }
  const auto pin = [](int cpu) {  // the calling thread, to one CPU
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    pthread_setaffinity_np(pthread_self(), sizeof(one), &one);
  };
  double best = -1.0;
  for (int64_t round = 0; round < rounds; ++round) {
    // -1: the answering thread not yet on its CPU; 2i + 1: exchange i asked; 2i + 2: answered.
    alignas(64) std::atomic<int64_t> turn{-1};
    std::thread answer([&] {
      pin(cpus[1]);
      turn.store(0, std::memory_order_release);
      for (int64_t i = 0; i < iterations; ++i) {
        while (turn.load(std::memory_order_acquire) != 2 * i + 1) tserve::StepTeam::pause(0);
        turn.store(2 * i + 2, std::memory_order_release);
      }
    });
    std::thread ask([&] {
      pin(cpus[0]);
      while (turn.load(std::memory_order_acquire) != 0) std::this_thread::yield();
      const auto start = std::chrono::steady_clock::now();
      for (int64_t i = 0; i < iterations; ++i) {
        turn.store(2 * i + 1, std::memory_order_release);
        while (turn.load(std::memory_order_acquire) != 2 * i + 2) tserve::StepTeam::pause(0);
      }
      const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
      best = best < 0.0 ? ns / iterations : std::min(best, ns / iterations);
    });
    ask.join();
    answer.join();
  }
  return best;
#else
  (void)iterations;
  (void)rounds;
  return -1.0;
#endif
}

// How many of PyTorch's threads a parallel loop of `n` items runs on, as the kernels' loops do (1 where the module
// was compiled without OpenMP: `at::parallel_for` is a header template, serial unless compiled with it).
int64_t parallel_threads(int64_t n) {
  std::atomic<int64_t> seen{0};
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) { seen.fetch_or(int64_t{1} << at::get_thread_num()); });
  return __builtin_popcountll(static_cast<uint64_t>(seen.load()));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("parallel_threads", &parallel_threads, "the threads a parallel loop of n items runs on");
  m.def("paged_decode", &paged_decode, "one-token attention from a paged KV cache (float32)");
  m.def("prefill_attention", &prefill_attention, "a prompt's attention over its keys, causal or not (float32)",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("causal"), pybind11::arg("scale"),
        pybind11::arg("isa"), pybind11::arg("starts") = pybind11::none());
  m.def("int8_rows_in", &int8_rows_in, "each row mapped onto [0, 1] (or its 14-bit code's halves) for an int8 GEMM");
  m.def("int8_rows_out", &int8_rows_out, "an int8 GEMM's product mapped back to each row's range, plus the bias");
  m.def("int8_pack_panels", &int8_pack_panels, "int8 weights (N, K) as the exact GEMM's panels of 16 columns");
  m.def("int8_linear_exact", &int8_linear_exact, "an int8 linear layer with 8-bit activations, exact on AVX2");
  m.def("block_isas", &block_isas, "the instruction sets this CPU runs the Q8_0 / Q4_0 kernels on");
  m.def("block_linear", &block_linear, "a linear layer on Q8_0 (format 0) or Q4_0 (format 1) weight panels");
  m.def("argmax_rows", &argmax_rows, "each row's argmax (float32), as torch.argmax(dim=-1), its excluded ids written -inf first");
  m.def("dense_rows", &dense_rows, "a float32 linear layer for a few rows, on the weight as nn.Linear holds it");
  m.def("dense_rows_paths", &dense_rows_paths, "the instruction sets this CPU runs dense_rows on");
  m.def("dense_rows_on", &dense_rows_on, "dense_rows on a named path (avx512, avx2)");
  m.def("upcoming_lines", &upcoming_lines, "the weights' and scales' lines each thread asks for before a product");
  m.def("core_round_trip_ns", &core_round_trip_ns, "ns for a cache line between two cores and back",
        pybind11::arg("iterations") = 100000, pybind11::arg("rounds") = 3);
  bind_decode_plan(m);
}
