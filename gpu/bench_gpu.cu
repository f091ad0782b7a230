// bench_gpu (see bench_gpu.hpp): CUDA events on the context's stream around forward() and
// forward() + backward(); `warmup` untimed iterations first; medians of `repeats`.
#include <algorithm>
#include <vector>

#include "backbone_gpu.hpp"
#include "bench_gpu.hpp"
#include "common.cuh"
#include "problem.hpp"

namespace m3::gpu {

namespace {
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

struct Events {
  cudaEvent_t a = nullptr, b = nullptr;
  Events() {
    M3_CUDA_CHECK(cudaEventCreate(&a));
    M3_CUDA_CHECK(cudaEventCreate(&b));
  }
  ~Events() {
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  }
  double ms() const {
    float t = 0;
    M3_CUDA_CHECK(cudaEventSynchronize(b));
    M3_CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
    return t;
  }
};
}  // namespace

GpuTiming bench_gpu(GpuContext& ctx, const Config& cfg, Idx B, Idx T, ScanMode mode, int warmup,
                    int repeats, bool profile, Precision storage) {
  const Problem pb = make_problem(cfg, B, T, 1234, true);
  GpuBackbone net(ctx, cfg, B, T, mode, storage);
  net.set_params(cast_params<float>(pb.params));
  net.set_input(std::vector<float>(pb.x.begin(), pb.x.end()));
  const States<float> st = cast_states<float>(pb.states);
  net.set_dout(std::vector<float>(pb.d_out.begin(), pb.d_out.end()));
  net.set_leaving_grads(nullptr);
  cudaStream_t s = stream_of(ctx);
  Events ev;
  std::vector<double> fwd, fb;
  for (int i = 0; i < warmup + repeats; ++i) {
    net.set_states(st);  // every iteration starts from the same entering states
    M3_CUDA_CHECK(cudaEventRecord(ev.a, s));
    net.forward();
    M3_CUDA_CHECK(cudaEventRecord(ev.b, s));
    const double f = ev.ms();
    net.set_states(st);
    M3_CUDA_CHECK(cudaEventRecord(ev.a, s));
    net.forward();
    net.backward();
    M3_CUDA_CHECK(cudaEventRecord(ev.b, s));
    const double fbms = ev.ms();
    if (i >= warmup) {
      fwd.push_back(f);
      fb.push_back(fbms);
    }
  }
  GpuTiming out{median(fwd), median(fb), repeats, {}};
  if (profile) {
    net.set_states(st);
    net.set_profiling(true);
    net.forward();
    net.backward();
    net.synchronize();
    out.stages = net.stage_times();
  }
  return out;
}

}  // namespace m3::gpu
