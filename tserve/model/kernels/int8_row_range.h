// What the int8 kernels (`int8_rows.cpp`, `int8_gemm.cpp`) share: each row's range, and the rows a thread takes.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

namespace tserve {

constexpr float kMinSpan = 1e-12f;  // a constant row's span: (high - low).clamp_(min=1e-12)

// A row's minimum and its span (maximum - minimum, at least kMinSpan).
inline void row_range(const float* row, int64_t width, float& low, float& span) {
  float lo = std::numeric_limits<float>::infinity(), hi = -lo;
#pragma omp simd reduction(min : lo) reduction(max : hi)
  for (int64_t k = 0; k < width; ++k) {
    lo = std::min(lo, row[k]);
    hi = std::max(hi, row[k]);
  }
  low = lo;
  span = std::max(hi - lo, kMinSpan);
}

// Rows per task of a parallel loop over rows `width` floats wide: about 32K floats a task.
inline int64_t grain_rows(int64_t width) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(width, 1)); }

}  // namespace tserve
