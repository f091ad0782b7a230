// Shared by the GPU oracle's test files: the skip when the oracle cannot run here (no usable
// CUDA device, or a build without CUDA), with the reason oracle_unavailable() gives.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "oracle_gpu.hpp"

#define M3_SKIP_WITHOUT_ORACLE()                                          \
  do {                                                                    \
    const std::string why_ = m3::gpu::oracle_unavailable();               \
    if (!why_.empty()) GTEST_SKIP() << "no GPU for the oracle: " << why_; \
  } while (0)
