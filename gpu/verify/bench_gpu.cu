// bench_gpu (see bench_gpu.hpp): CUDA events on the context's stream around forward() and
// forward() + backward() (or their recorded graphs' replays); `warmup` untimed iterations
// first; medians of `repeats`.
// measure_ceilings: the same timing around one device-to-device copy and one cuBLAS GEMM per
// precision (the cublasGemmEx configuration of gemm.cu: f32 compute, pedantic for f32 inputs).
// Inputs are hashed uniform values (2u + 1 − 2²³)·2⁻²³, u a 23-bit hash of (seed, index): in
// (−1, 1), exact in every storage type's rounding range, never zero (the numerator is odd).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <type_traits>
#include <vector>

#include "backbone_gpu.hpp"
#include "bench_gpu.hpp"
#include "device.hpp"
#include "common.cuh"
#include "convert.cuh"
#include "graph.hpp"
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

// ---- ceilings -------------------------------------------------------------------------------
__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {  // splitmix64
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// out[i] = from_float<T>((2u + 1 − 2²³)·2⁻²³), u = 23 bits of a hash of (seed, i).
template <class T>
__global__ void fill_uniform_kernel(std::size_t n, unsigned long long seed, T* out) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const auto u = static_cast<int>(mix64(seed ^ (i * 0xD1B54A32D192ED03ull)) >> 41);
    out[i] = from_float<T>(static_cast<float>(2 * u + 1 - (1 << 23)) * 1.1920928955078125e-7f);
  }
}

template <class T>
void fill_uniform(cudaStream_t s, std::size_t n, unsigned long long seed, T* out) {
  if (n == 0) return;
  const auto blocks = static_cast<unsigned int>(std::min<std::size_t>((n + 255) / 256, 8192));
  fill_uniform_kernel<T><<<blocks, 256, 0, s>>>(n, seed, out);
  M3_LAUNCH_CHECK();
}

template <class T>
double host_value(T v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    std::uint16_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    return std::is_same_v<T, __nv_bfloat16> ? bf16_bits_to_float(bits) : f16_bits_to_float(bits);
  }
}

template <class T>
cudaDataType_t ceiling_type();
template <>
cudaDataType_t ceiling_type<float>() { return CUDA_R_32F; }
template <>
cudaDataType_t ceiling_type<__nv_bfloat16>() { return CUDA_R_16BF; }
template <>
cudaDataType_t ceiling_type<__half>() { return CUDA_R_16F; }

// Median time of `f` (enqueued on s) over spec.repeats after spec.warmup untimed runs.
template <class F>
double time_median(cudaStream_t s, const CeilingSpec& spec, F&& f) {
  Events ev;
  std::vector<double> t;
  for (int i = 0; i < spec.warmup + spec.repeats; ++i) {
    M3_CUDA_CHECK(cudaEventRecord(ev.a, s));
    f();
    M3_CUDA_CHECK(cudaEventRecord(ev.b, s));
    const double ms = ev.ms();
    if (i >= spec.warmup) t.push_back(ms);
  }
  return median(t);
}

// Copies of copy_bytes between two device buffers; checks the first and last MiB arrived.
void time_copy(GpuContext& ctx, const CeilingSpec& spec, Ceilings& out) {
  cudaStream_t s = stream_of(ctx);
  std::size_t bytes = spec.copy_bytes / 4 * 4;
  std::size_t free_b = 0, total_b = 0;
  M3_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  while (bytes > (std::size_t(64) << 20) && 2 * bytes > free_b / 10 * 8) bytes /= 2;
  M3_REQUIRE(bytes >= 4 && 2 * bytes <= free_b, "gpu::measure_ceilings",
             "not enough device memory for the copy buffers", "free ", free_b, " bytes, asked 2 x ",
             bytes);
  const Idx n = static_cast<Idx>(bytes / 4);
  DeviceArray<float> src(n), dst(n);
  fill_uniform(s, static_cast<std::size_t>(n), 1, src.data());
  fill_uniform(s, static_cast<std::size_t>(n), 2, dst.data());
  out.copy_bytes = bytes;
  out.copy_ms = time_median(s, spec, [&] {
    M3_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), bytes, cudaMemcpyDeviceToDevice, s));
  });
  out.copy_bytes_per_s =
      out.copy_ms > 0 ? 2.0 * static_cast<double>(bytes) / (out.copy_ms * 1e-3) : 0;
  const std::size_t m = std::min<std::size_t>(static_cast<std::size_t>(n), std::size_t(1) << 18);
  std::vector<float> hs(m), hd(m);
  for (std::size_t off : {std::size_t(0), static_cast<std::size_t>(n) - m}) {
    M3_CUDA_CHECK(cudaMemcpyAsync(hs.data(), src.data() + off, m * 4, cudaMemcpyDeviceToHost, s));
    M3_CUDA_CHECK(cudaMemcpyAsync(hd.data(), dst.data() + off, m * 4, cudaMemcpyDeviceToHost, s));
    M3_CUDA_CHECK(cudaStreamSynchronize(s));
    M3_REQUIRE(std::memcmp(hs.data(), hd.data(), m * 4) == 0, "gpu::measure_ceilings",
               "the timed device-to-device copy did not copy", "mismatch in the ", m,
               " floats from offset ", off);
  }
}

// C = A·B (n×n, column-major, all of type T) through cublasGemmEx; a few C elements checked
// against double dot products of the stored inputs.
template <class T>
GemmCeiling time_gemm(GpuContext& ctx, const CeilingSpec& spec, Precision type) {
  cudaStream_t s = stream_of(ctx);
  const Idx n = spec.gemm_n;
  DeviceArray<T> A(n * n), B(n * n), C(n * n);
  fill_uniform(s, static_cast<std::size_t>(n * n), 3, A.data());
  fill_uniform(s, static_cast<std::size_t>(n * n), 4, B.data());
  fill_uniform(s, static_cast<std::size_t>(n * n), 5, C.data());  // poison: never the answer
  const cudaDataType_t dt = ceiling_type<T>();
  const cublasComputeType_t compute =
      std::is_same_v<T, float> ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F;
  const float alpha = 1.0f, beta = 0.0f;
  const int ni = static_cast<int>(n);
  GemmCeiling g;
  g.type = type;
  g.ms = time_median(s, spec, [&] {
    M3_CUBLAS_CHECK(cublas().gemm_ex(cublas_of(ctx), CUBLAS_OP_N, CUBLAS_OP_N, ni, ni, ni, &alpha,
                                 A.data(), dt, ni, B.data(), dt, ni, &beta, C.data(), dt, ni,
                                 compute, CUBLAS_GEMM_DEFAULT));
  });
  const double nd = static_cast<double>(n);
  g.flops_per_s = g.ms > 0 ? 2.0 * nd * nd * nd / (g.ms * 1e-3) : 0;
  // Spot check: C[i, j] = Σ_k A[i + k·n]·B[k + j·n].
  const Idx picks[4][2] = {{0, 0}, {n - 1, n - 1}, {n / 3, 2 * n / 3}, {1234 % n, 4321 % n}};
  std::vector<T> row(static_cast<std::size_t>(n)), col(static_cast<std::size_t>(n));
  for (const auto& ij : picks) {
    const Idx i = ij[0], j = ij[1];
    T c;
    M3_CUDA_CHECK(cudaMemcpy2DAsync(row.data(), sizeof(T), A.data() + i, n * sizeof(T),
                                    sizeof(T), static_cast<std::size_t>(n),
                                    cudaMemcpyDeviceToHost, s));
    M3_CUDA_CHECK(cudaMemcpyAsync(col.data(), B.data() + j * n, n * sizeof(T),
                                  cudaMemcpyDeviceToHost, s));
    M3_CUDA_CHECK(cudaMemcpyAsync(&c, C.data() + i + j * n, sizeof(T), cudaMemcpyDeviceToHost, s));
    M3_CUDA_CHECK(cudaStreamSynchronize(s));
    double ref = 0, mag = 0;
    for (Idx k = 0; k < n; ++k) {
      const double p = host_value(row[k]) * host_value(col[k]);
      ref += p;
      mag += std::fabs(p);
    }
    const double err = std::fabs(host_value(c) - ref);
    const double tol = std::ldexp(std::fabs(ref), -8) + 1e-4 * mag;
    M3_REQUIRE(err <= tol && mag > 0, "gpu::measure_ceilings",
               std::string("the timed ") + precision_name(type) + " GEMM is wrong", "C[", i, ", ",
               j, "] = ", host_value(c), ", double reference ", ref, ", tolerance ", tol);
    g.check_err = std::max(g.check_err, err / mag);
  }
  return g;
}
}  // namespace

GpuTiming bench_gpu(GpuContext& ctx, const Config& cfg, Idx B, Idx T, ScanMode mode, int warmup,
                    int repeats, bool profile, Precision storage, bool graph, Recompute rc,
                    bool cluster_tail) {
  const Problem pb = make_problem(cfg, B, T, 1234, true);
  reset_device_bytes_peak();
  const std::size_t before = device_bytes_live();
  GpuBackbone net(ctx, cfg, B, T, mode, storage, rc);
  net.set_cluster_tail(cluster_tail);
  load_problem(net, pb);
  const States<float> st = cast_states<float>(pb.states);
  cudaStream_t s = stream_of(ctx);
  Events ev;
  std::vector<double> fwd, fb;
  // The two timed regions: stream launches, or (graph) replays recorded after the warm-up, whose
  // stream launches (at least one pass) have loaded every kernel and settled cuBLAS's choices.
  // Recording runs nothing.
  std::function<void()> run_fwd = [&] { net.forward(); };
  std::function<void()> run_fb = [&] {
    net.forward();
    net.backward();
  };
  std::unique_ptr<StreamGraph> g_fwd, g_fb;
  if (graph && warmup == 0) {
    net.set_states(st);
    run_fb();
  }
  for (int i = 0; i < warmup + repeats; ++i) {
    if (graph && i == warmup) {
      ctx.synchronize();
      g_fwd = std::make_unique<StreamGraph>(ctx, run_fwd);
      g_fb = std::make_unique<StreamGraph>(ctx, run_fb);
      run_fwd = [&] { g_fwd->launch(); };
      run_fb = [&] { g_fb->launch(); };
    }
    net.set_states(st);  // every iteration starts from the same entering states
    M3_CUDA_CHECK(cudaEventRecord(ev.a, s));
    run_fwd();
    M3_CUDA_CHECK(cudaEventRecord(ev.b, s));
    const double f = ev.ms();
    net.set_states(st);
    M3_CUDA_CHECK(cudaEventRecord(ev.a, s));
    run_fb();
    M3_CUDA_CHECK(cudaEventRecord(ev.b, s));
    const double fbms = ev.ms();
    if (i >= warmup) {
      fwd.push_back(f);
      fb.push_back(fbms);
    }
  }
  GpuTiming out{median(fwd), median(fb), repeats, {}};
  net.synchronize();
  out.peak_bytes = device_bytes_peak() - before;
  out.memory = net.memory();
  out.device_total = query_device().total_mem;
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

Ceilings measure_ceilings(GpuContext& ctx, const CeilingSpec& spec) {
  M3_REQUIRE(spec.gemm_n >= 1 && spec.gemm_n <= 32768, "gpu::measure_ceilings",
             "GEMM size out of range", "gemm_n ", spec.gemm_n, " (1 … 32768)");
  M3_REQUIRE(spec.repeats >= 1 && spec.warmup >= 0, "gpu::measure_ceilings",
             "bad repeat counts", "repeats ", spec.repeats, ", warmup ", spec.warmup);
  Ceilings out;
  out.gemm_n = spec.gemm_n;
  out.warmup = spec.warmup;
  out.repeats = spec.repeats;
  time_copy(ctx, spec, out);  // its buffers are freed before the GEMMs allocate theirs
  out.bf16 = time_gemm<__nv_bfloat16>(ctx, spec, Precision::BF16);
  out.f16 = time_gemm<__half>(ctx, spec, Precision::F16);
  out.f32 = time_gemm<float>(ctx, spec, Precision::F32);
  ctx.synchronize();
  return out;
}

}  // namespace m3::gpu
