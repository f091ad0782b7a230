// m3_oracle_bench: the GPU oracle's time and device memory at a shape (gpu/oracle_gpu.hpp) —
// what a verification at the production shape pays for its f64 reference. Per shape: the
// planned bytes (oracle_memory) and the device bytes in use after construction, then two
// forward + backward passes from zero entering states (the first includes cuBLAS's warm-up;
// the second is the figure), each timed on the host around a synchronised pass.
//
//   m3_oracle_bench                        the default list: B 8, T 4096, the official widths
//                                          (d_model 1024, d_state 128, headdim 64, expand 2),
//                                          2 layers, both keep policies; B 1, T 4096, 24 layers
//   m3_oracle_bench B T LAYERS KEEP         one shape at the official widths (KEEP: all or
//                                          backward)
// Prints one line per pass; asserts nothing (a benchmark, not a test).
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "oracle_gpu.hpp"
#include "params.hpp"

namespace {

using m3::Idx;
using m3::gpu::OracleKeep;

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

void run(Idx B, Idx T, Idx layers, OracleKeep keep) {
  m3::Config c;
  c.d_model = 1024;
  c.d_state = 128;
  c.headdim = 64;
  c.expand = 2;
  c.n_layers = layers;
  c.input_dim = 1024;
  const char* keep_name = keep == OracleKeep::All ? "all" : "backward";
  const m3::gpu::OracleMemory plan = m3::gpu::oracle_memory(c, B, T, keep);
  std::size_t free0 = 0, total = 0;
  cudaMemGetInfo(&free0, &total);
  auto t0 = std::chrono::steady_clock::now();
  m3::gpu::GpuOracle o(c, B, T, keep);
  o.set_params(m3::make_params<double>(c, 1));
  o.set_input(m3::make_input<double>(c, B, T, 2));
  o.set_dout(m3::make_dout<double>(c, B, T, 3));
  o.set_states(m3::zero_states<double>(c, B));
  const double setup_ms = ms_since(t0);
  std::size_t free1 = 0;
  cudaMemGetInfo(&free1, &total);
  std::printf(
      "oracle B %lld T %lld official widths, %lld layers, keep %s: planned %.2f GB, "
      "device in use +%.2f GB, setup %.0f ms (segment K %lld)\n",
      static_cast<long long>(B), static_cast<long long>(T), static_cast<long long>(layers),
      keep_name, plan.total() / 1e9,
      (static_cast<double>(free0) - static_cast<double>(free1)) / 1e9, setup_ms,
      static_cast<long long>(m3::gpu::oracle_segment(T)));
  for (int pass = 0; pass < 2; ++pass) {
    o.set_states(m3::zero_states<double>(c, B));
    o.zero_grads();
    t0 = std::chrono::steady_clock::now();
    o.forward();
    const double fwd = ms_since(t0);
    t0 = std::chrono::steady_clock::now();
    o.backward();
    const double bwd = ms_since(t0);
    std::printf("  pass %d: forward %.0f ms, backward %.0f ms\n", pass + 1, fwd, bwd);
  }
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string why = m3::gpu::oracle_unavailable();
    if (!why.empty()) {
      std::fprintf(stderr, "m3_oracle_bench: no GPU (%s)\n", why.c_str());
      return 2;
    }
    if (argc == 5) {
      const std::string keep = argv[4];
      if (keep != "all" && keep != "backward") {
        std::fprintf(stderr, "m3_oracle_bench: KEEP is all or backward, not '%s'\n", argv[4]);
        return 2;
      }
      run(std::atoll(argv[1]), std::atoll(argv[2]), std::atoll(argv[3]),
          keep == "all" ? OracleKeep::All : OracleKeep::Backward);
      return 0;
    }
    if (argc != 1) {
      std::fprintf(stderr, "usage: m3_oracle_bench [B T LAYERS all|backward]\n");
      return 2;
    }
    run(8, 4096, 2, OracleKeep::Backward);
    run(8, 4096, 2, OracleKeep::All);
    run(1, 4096, 24, OracleKeep::Backward);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "m3_oracle_bench: %s\n", e.what());
    return 1;
  }
}
