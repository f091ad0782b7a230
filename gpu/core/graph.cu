// StreamGraph (see graph.hpp): cudaStreamBeginCapture in relaxed mode (the kernels' launchers
// may query the device and set kernel attributes while recording; those calls are not stream
// work and are not recorded), cudaStreamEndCapture, cudaGraphInstantiate; cudaGraphLaunch on
// the same stream to replay.
#include "graph.hpp"

#include "common.cuh"
#include "error.hpp"

namespace m3::gpu {

struct StreamGraph::Impl {
  cudaStream_t stream = nullptr;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ~Impl() {
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
  }
};

StreamGraph::StreamGraph(const GpuContext& ctx, const std::function<void()>& enqueue)
    : impl_(std::make_unique<Impl>()) {
  impl_->stream = stream_of(ctx);
  M3_CUDA_CHECK(cudaStreamBeginCapture(impl_->stream, cudaStreamCaptureModeRelaxed));
  try {
    enqueue();
  } catch (...) {  // end the capture (its partial graph is discarded), then report the failure
    cudaGraph_t partial = nullptr;
    cudaStreamEndCapture(impl_->stream, &partial);
    if (partial) cudaGraphDestroy(partial);
    cudaGetLastError();  // clear the error the aborted capture left behind
    throw;
  }
  M3_CUDA_CHECK(cudaStreamEndCapture(impl_->stream, &impl_->graph));
  M3_CUDA_CHECK(cudaGraphInstantiate(&impl_->exec, impl_->graph, 0));
}

StreamGraph::~StreamGraph() = default;

void StreamGraph::launch() const { M3_CUDA_CHECK(cudaGraphLaunch(impl_->exec, impl_->stream)); }

int StreamGraph::nodes() const {
  std::size_t n = 0;
  M3_CUDA_CHECK(cudaGraphGetNodes(impl_->graph, nullptr, &n));
  return static_cast<int>(n);
}

}  // namespace m3::gpu
