// The production GPU backbone (f32 storage): the same computation as the reference Backbone
// (reference/backbone.hpp, MODEL.md §3–§6) with every stage a CUDA kernel or a cuBLAS GEMM,
// both scan modes, entering states and their gradients, deterministic (§7, §12.9).
//
// Plain C++ header (no CUDA types), so the harness and the tools include it without nvcc.
// All device memory for (config, B, T, mode) is allocated in the constructor; forward() and
// backward() allocate nothing. Data stays on the device between calls: set_*() upload,
// output()/states()/grads()/… download. A Capture passed to forward()/backward() receives
// every registry tensor of every stage under the reference's names (a download per tensor,
// so only for verification runs).
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "capture.hpp"
#include "config.hpp"
#include "context.hpp"
#include "params.hpp"
#include "problem.hpp"

namespace m3::gpu {

class GpuBackbone {
 public:
  // Throws m3::Error when the config is invalid or the GPU path cannot run it (see unsupported).
  GpuBackbone(GpuContext& ctx, const Config& cfg, Idx B, Idx T, ScanMode mode);
  ~GpuBackbone();
  GpuBackbone(const GpuBackbone&) = delete;
  GpuBackbone& operator=(const GpuBackbone&) = delete;

  // Why the GPU path cannot run this shape ("" when it can).
  static std::string unsupported(const Config& cfg, Idx B, Idx T);

  void set_params(const Params<float>& p);        // master weights (f32)
  void set_input(const std::vector<float>& X);     // [B*T, input_dim]
  void set_states(const States<float>& s);        // entering states [L][B][…]
  void set_dout(const std::vector<float>& d_out);  // [B*T, d_model]
  void set_leaving_grads(const States<float>* d);  // nullptr: zero
  void zero_grads();

  // forward: reads the entering states set last; the leaving states replace them (so a second
  // forward continues the sequence, as chained windows do).
  void forward(Capture* cap = nullptr);
  // backward of the last forward; gradients accumulate into the weight-gradient buffers.
  void backward(Capture* cap = nullptr);

  std::vector<float> output() const;     // Out [B*T, d_model]
  States<float> states() const;          // current (leaving) states
  Params<float> grads() const;           // accumulated weight gradients
  std::vector<float> d_x() const;        // ∂L/∂X of the last backward
  States<float> d_entering() const;      // ∂L/∂(entering states) of the last backward

  void synchronize() const;

  // Stage profile (for m3h bench --profile): when on, a CUDA event is recorded after every
  // stage of forward()/backward() and stage_times() gives the milliseconds per stage name
  // ("F6", "B6", "norm_f", …; summed over layers), in first-seen order, since the last reset.
  // Events come from a pool made once; off, nothing is recorded.
  void set_profiling(bool on);
  std::vector<std::pair<std::string, double>> stage_times() const;
  void reset_stage_times();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// The GPU counterpart of run_reference<float>(pb, mode): forward + backward of pb.d_out with
// zero leaving-state gradients, capturing every stage tensor and every parameter gradient.
Capture run_gpu(GpuContext& ctx, const Problem& pb, ScanMode mode);

}  // namespace m3::gpu
