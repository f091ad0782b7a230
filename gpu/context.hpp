// GpuContext: what every GPU call needs, passed explicitly (no global handles): the device,
// one CUDA stream, one cuBLAS handle bound to that stream with a fixed workspace (MODEL.md
// §12.9: a fixed cuBLAS configuration gives bit-identical GEMMs run after run; f32 GEMMs ask
// for pedantic FP32 compute, i.e. no TF32). Plain C++ header: no CUDA types; gpu/core/common.cuh
// gives .cu files the raw handles.
#pragma once

#include <cstddef>
#include <memory>

namespace m3::gpu {

class GpuContext {
 public:
  // Throws m3::Error when no CUDA device is usable (or the build has no CUDA).
  explicit GpuContext(int device = 0);
  ~GpuContext();
  GpuContext(const GpuContext&) = delete;
  GpuContext& operator=(const GpuContext&) = delete;

  int device() const;
  void synchronize() const;  // waits for the stream; throws on an asynchronous error

  struct Impl;
  Impl& impl() const { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace m3::gpu
