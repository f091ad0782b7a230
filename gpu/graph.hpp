// StreamGraph: the work that one call enqueues on a context's stream, recorded once as a CUDA
// graph (stream capture) and replayed with launch(). A replay runs the same kernels with the
// same arguments on the same buffers in the same order as the recorded call, so it gives the
// same bits (GpuBackbone.GraphReplayGivesTheBitsOfStreamLaunches); what it saves is the host's
// work per launch and part of the gap between dependent kernels.
// What may be recorded: device work only, on the context's stream — kernels, cuBLAS calls
// (the context gives cuBLAS a fixed workspace, so it allocates nothing), async copies and
// memsets. A call that synchronizes, allocates or copies to the host cannot be recorded: the
// capture fails and the constructor throws m3::Error naming the CUDA error. Host work inside
// the call (argument set-up, shape checks) runs once, at recording; values that it reads from
// host memory are frozen into the graph, so a replay only makes sense while the buffers,
// shapes and host-side settings of the recorded call stay as they were.
// Plain C++ header (the CUDA types stay in graph.cu); CUDA builds only.
#pragma once

#include <functional>
#include <memory>

#include "context.hpp"

namespace m3::gpu {

class StreamGraph {
 public:
  // Records what enqueue() puts on ctx's stream (nothing runs); the stream must be idle of
  // other captures. Throws m3::Error when the recording or the instantiation fails; the stream
  // is then no longer capturing.
  StreamGraph(const GpuContext& ctx, const std::function<void()>& enqueue);
  ~StreamGraph();
  StreamGraph(const StreamGraph&) = delete;
  StreamGraph& operator=(const StreamGraph&) = delete;

  void launch() const;  // enqueues one replay on the context's stream
  int nodes() const;    // kernels, copies and memsets recorded

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace m3::gpu
