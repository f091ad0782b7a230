// Shared by the GPU test files: the skip when no usable device is present (with the reason the
// device query gives), and the family-A stage cases (norm, split, BCNorm, RoPE, gating, GEMMs)
// that the stage test files (tests/gpu/stages/: f32 and bf16/f16) run.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "capture.hpp"
#include "config.hpp"
#include "device.hpp"

// GTEST_SKIP with m3::gpu::describe(query_device()) when no usable CUDA device is present.
#define M3_SKIP_WITHOUT_GPU()                                     \
  do {                                                            \
    const auto info_ = m3::gpu::query_device();                   \
    if (!info_.present) GTEST_SKIP() << m3::gpu::describe(info_); \
  } while (0)

// The first key of a whose tensor b lacks or holds in other bits ("" when every tensor of a is
// in b bit for bit): the comparison of runs that must agree exactly (determinism, isolated runs).
inline std::string first_bit_difference(const m3::Capture& a, const m3::Capture& b) {
  for (const auto& key : a.keys()) {
    const m3::Tensor* t = b.find(key);
    const auto& x = a.at(key).data;
    if (!t || t->data.size() != x.size() ||
        std::memcmp(x.data(), t->data.data(), x.size() * sizeof(double)) != 0)
      return key;
  }
  return "";
}

struct StageCase {
  const char* name;
  m3::Idx d_model, headdim, d_state, ngroups;
  double rope_fraction;
  m3::Idx B, T;
};

// Ragged small dims (hd 6, ds 10, one colsum chunk); the official defaults hd 64 / ds 128 with
// two groups; na = 0 (ds 3); hd 32 / ds 16 with one head per group and a row count just past
// one colsum chunk; rows longer than the RMSNorm kernels keep in registers (1088 > 1024: their
// chunked second pass) with d_state 24 (6 rotated pairs: an 8-value typed RoPE vector holding
// rotated and copied pairs).
inline std::vector<StageCase> stage_cases() {
  return {
      {"ragged_dm21_hd6_ds10_B2_T37", 21, 6, 10, 1, 0.5, 2, 37},
      {"hd64_ds128_ng2_B2_T160", 256, 64, 128, 2, 0.5, 2, 160},
      {"na0_hd16_ds3_ng2_B3_T100", 32, 16, 3, 2, 0.5, 3, 100},
      {"hd32_ds16_ng4_rf1_B4_T65", 64, 32, 16, 4, 1.0, 4, 65},
      {"long_dm1088_hd64_ds24_ng2_B1_T9", 1088, 64, 24, 2, 0.5, 1, 9},
  };
}
