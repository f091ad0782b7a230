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

// Timed points on a context's stream (CUDA events with timing), for the parts of a training
// step (m3h train --step-times). mark(i) records point i after the work queued so far (no
// synchronisation; a point marked again moves); ready(i) says, without waiting, whether the
// device has passed point i; ms(a, b) gives the device time from point a to point b (of this
// set or another of the same context), both of which the device must have passed (a
// synchronize() first, or ready()): m3::Error otherwise, as for a point never marked.
class StreamMarks {
 public:
  explicit StreamMarks(const GpuContext& ctx);
  ~StreamMarks();
  StreamMarks(const StreamMarks&) = delete;
  StreamMarks& operator=(const StreamMarks&) = delete;

  void mark(int i);
  bool marked(int i) const;
  bool ready(int i) const;
  double ms(int a, int b) const;                          // this set's points
  double ms(int a, const StreamMarks& other, int b) const;  // a here, b in `other`

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace m3::gpu
