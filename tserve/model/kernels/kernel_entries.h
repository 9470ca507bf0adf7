// The kernels' entries past their checks (`paged_decode.cpp`, `block_quant.cpp`, `dense_rows.cpp`) for a fused
// decode step (`decode_layers.cpp`): a step checks its weights and tables once, then runs every layer on raw rows in
// buffers it holds for the step.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <string>

#include "step_team.h"

void check_block_ids(const int64_t* ids, const int64_t* lengths, int64_t B, int64_t W, int64_t block_size,
                     int64_t num_blocks);
void paged_decode_into(const float* q, const float* k, const float* v, const int64_t* tables, const int64_t* lengths,
                       float* out, int64_t B, int64_t H, int64_t KV, int64_t D, int64_t W, int64_t block_size,
                       float scale, int64_t window, bool wide);
void check_panels(const torch::Tensor& panels, const torch::Tensor& scales, int64_t K, int64_t N, int64_t format);
void check_block_isa(const std::string& isa);
void block_linear_rows(const float* x, int64_t M, int64_t K, const uint8_t* panels, const uint16_t* scales,
                       const float* bias, int64_t N, int format, bool wide, float* out);
void dense_rows_into(const float* x, int64_t M, int64_t K, const float* w, int64_t N, const float* bias, float* out);
tserve::Upcoming block_linear_upcoming(const uint8_t* panels, const uint16_t* scales, int64_t K, int64_t N,
                                       int format);
tserve::Upcoming dense_rows_upcoming(const float* w, int64_t K, int64_t N);
