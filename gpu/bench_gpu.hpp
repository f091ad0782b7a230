// Timing of the GPU backbone (METHOD.md: CUDA events around the region, warm-up first, the
// median of repeats): forward, and forward + backward, of one window of (B, T) with seeded
// realistic inputs resident on the device, launched on the stream or replayed as CUDA graphs.
// And the device's two ceilings (METHOD.md "two numbers first"): device-to-device copy
// bandwidth and cuBLAS GEMM rates. Plain C++ header.
#pragma once

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "config.hpp"
#include "backbone_gpu.hpp"
#include "context.hpp"
#include "error.hpp"
#include "precision.hpp"

namespace m3::gpu {

struct GpuTiming {
  double forward_ms = 0;           // median over repeats
  double forward_backward_ms = 0;  // median over repeats
  int repeats = 0;
  // With profile: ms per stage of one extra forward+backward after the timed ones (events
  // between stages; stage names as GpuBackbone::stage_times()).
  std::vector<std::pair<std::string, double>> stages;
  // Device memory (gpu/device.hpp's count of the GPU path's own allocations): the most held
  // at any time from the backbone's construction through the last timed pass, and the
  // backbone's bytes by role; device_total: the device's global memory.
  std::size_t peak_bytes = 0;
  std::size_t device_total = 0;
  BackboneMemory memory;
};

// With graph, the timed forward and forward+backward are replays of CUDA graphs recorded once
// after the warm-up (gpu/graph.hpp: the same kernels, no host work per launch); else each pass
// launches its kernels on the stream. The profile always launches on the stream (it needs
// events between the stages). cluster_tail: GpuBackbone::set_cluster_tail (B6's tail inside
// B3; off, the library's default: the standalone tail).
GpuTiming bench_gpu(GpuContext& ctx, const Config& cfg, Idx B, Idx T, ScanMode mode,
                    int warmup, int repeats, bool profile = false,
                    Precision storage = Precision::F32, bool graph = false,
                    Recompute rc = kDefaultRecompute, bool cluster_tail = false);

// What measure_ceilings times: a copy of copy_bytes between two device buffers
// (cudaMemcpyAsync device to device), and n×n×n GEMMs through the context's cuBLAS handle in
// the configuration of gpu/stages/gemm.cu: bf16 and f16 (A, B, C typed, f32 compute, tensor cores
// allowed) and f32 (CUBLAS_COMPUTE_32F_PEDANTIC: no TF32). Inputs are seeded uniform values in
// (−1, 1), never zero. Each is timed alone with CUDA events, `warmup` untimed runs first, the
// median of `repeats` reported. When the device lacks the memory for the two copy buffers,
// their size is halved until it fits (Ceilings::copy_bytes says what was used).
struct CeilingSpec {
  std::size_t copy_bytes = std::size_t(2) << 30;  // per buffer (2 GiB)
  int gemm_n = 8192;
  int warmup = 2;
  int repeats = 10;
};

struct GemmCeiling {
  Precision type = Precision::F32;  // of A, B and C
  double ms = 0;                    // median of one GEMM
  double flops_per_s = 0;           // 2·n³ / ms
  // Spot check of a few elements of C against a double dot product of the same inputs:
  // max |c − Σ a·b| / Σ |a·b| (a GEMM fails the check, and measure_ceilings throws, above
  // 2⁻⁸·|Σ a·b| / Σ |a·b| + 1e-4).
  double check_err = 0;
};

struct Ceilings {
  std::size_t copy_bytes = 0;  // per buffer
  int gemm_n = 0, warmup = 0, repeats = 0;
  double copy_ms = 0;           // median of one copy
  double copy_bytes_per_s = 0;  // (bytes read + bytes written) / time = 2·copy_bytes / copy_ms
  GemmCeiling bf16, f16, f32;
  // The GEMM ceiling of a storage precision (f32, bf16 or f16).
  const GemmCeiling& gemm(Precision storage) const {
    switch (storage) {
      case Precision::F32: return f32;
      case Precision::BF16: return bf16;
      case Precision::F16: return f16;
      case Precision::F64: break;
    }
    throw Error("Ceilings::gemm", "f64 is not a GPU storage precision", "f32, bf16 or f16");
  }
};

// Throws m3::Error on any CUDA or cuBLAS failure, or when a copy or a GEMM spot check is wrong.
Ceilings measure_ceilings(GpuContext& ctx, const CeilingSpec& spec = {});

}  // namespace m3::gpu
