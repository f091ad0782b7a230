// The GPU oracle's perturbed mode (perturb.cuh): one random rounding per stored value,
//   v ← v + ρ·max(u·|v|, tiny),   ρ = ⌊mix64(stream + (i + 1)·γ) / 2¹¹⌋·2⁻⁵² − 1 ∈ [−1, 1),
// one thread per element, in place; the carry of b_normed's rounding into BCNorm's cancelling
// bias add. Cost: one read and one write of the tensor (16 bytes per element).
#include "perturb.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.cuh"

namespace m3::gpu::oracle {

namespace {

constexpr std::uint64_t kGolden = 0x9e3779b97f4a7c15ULL;  // splitmix64's increment

// The splitmix64 finaliser (a bijection of 64-bit words).
__host__ __device__ inline std::uint64_t mix64(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// ρ_i of a stream: the i-th splitmix64 output's top 53 bits, on [−1, 1) in steps of 2⁻⁵².
__device__ inline double rho(std::uint64_t stream, Idx i) {
  const std::uint64_t z = mix64(stream + (static_cast<std::uint64_t>(i) + 1) * kGolden);
  return static_cast<double>(z >> 11) * 0x1p-52 - 1.0;
}

// ρ of the value v of a stream, coherent: a hash of the stream and v's bits (a zero or NaN
// keeps its index's draw), so equal values of a tensor draw alike.
__device__ inline double rho_of(std::uint64_t stream, Idx i, double v, bool coherent) {
  if (!coherent || v == 0.0 || isnan(v)) return rho(stream, i);
  const auto bits = static_cast<std::uint64_t>(__double_as_longlong(v));
  const std::uint64_t z = mix64(stream ^ mix64(bits));
  return static_cast<double>(z >> 11) * 0x1p-52 - 1.0;
}

// One rounding's error bound at v: max(u·|v|, tiny), NaN for a NaN v (as std::max(u·|v|, tiny)
// in the CPU's perturb, whose NaN argument comes first).
__device__ inline double bound(double v, double u, double tiny) {
  const double rel = u * fabs(v);
  return rel < tiny ? tiny : rel;
}

// One rounding of v: the draw ρ·max(u·|v|, tiny), or with `exact` the error of rounding v to
// the format of unit roundoff u (round to nearest even; the double → float conversion rounds
// once, and bf16/f16 convert from the double directly, so no value is rounded twice). A value
// past the format's range keeps the random draw: the oracle never makes an Inf of its own.
__device__ inline double rounding(double v, double u, double tiny, std::uint64_t stream, Idx i,
                                  bool exact, bool coherent = false) {
  if (exact && isfinite(v)) {
    double r = NAN;
    if (u == 0x1p-24) r = static_cast<double>(static_cast<float>(v));
    if (u == 0x1p-8) r = static_cast<double>(__bfloat162float(__double2bfloat16(v)));
    if (u == 0x1p-11) r = static_cast<double>(__half2float(__double2half(v)));
    if (isfinite(r)) return r - v;  // past the format's range: the random draw, not an Inf
  }
  return rho_of(stream, i, v, coherent) * bound(v, u, tiny);
}

}  // namespace

std::uint64_t tensor_stream(std::uint64_t seed, const std::string& key) {
  std::uint64_t h = 0xcbf29ce484222325ULL;  // FNV-1a, 64 bits
  for (const unsigned char c : key) {
    h ^= c;
    h *= 0x100000001b3ULL;
  }
  return mix64(mix64(seed + kGolden) ^ h);
}

void perturb(cudaStream_t s, Idx n, double* v, double u, double tiny, std::uint64_t stream,
             bool exact, bool coherent) {
  if (u == 0) return;
  each(s, n, [=] __device__(Idx i) { v[i] += rounding(v[i], u, tiny, stream, i, exact, coherent); });
}

void perturbed_copy(cudaStream_t s, Idx n, const double* src, double* dst, double u, double tiny,
                    std::uint64_t stream, bool exact, bool coherent) {
  if (u == 0) {
    if (n > 0)
      M3_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(n) * sizeof(double),
                                    cudaMemcpyDeviceToDevice, s));
    return;
  }
  each(s, n, [=] __device__(Idx i) {
    dst[i] = src[i] + rounding(src[i], u, tiny, stream, i, exact, coherent);
  });
}

void perturb_bias_add(cudaStream_t s, const Dims& d, const double* normed, double* biased,
                      double u_normed, double u_biased, double tiny, std::uint64_t normed_stream,
                      std::uint64_t biased_stream, bool exact, bool coherent) {
  const Idx nh = d.nh, ds = d.ds, ng = d.ng, hpg = d.hpg;
  each(s, d.BT * nh * ds, [=] __device__(Idx e) {
    const Idx n = e % ds, h = (e / ds) % nh, r = e / (ds * nh);
    if (exact) {  // as the production: the bias added to the stored normed value, then stored
      const Idx src = (r * ng + h / hpg) * ds + n;
      const double before = normed[src];
      double b = biased[e];
      if (u_normed != 0) b += rounding(before, u_normed, tiny, normed_stream, src, true);
      if (u_biased != 0) b += rounding(b, u_biased, tiny, biased_stream, e, true);
      biased[e] = b;
      return;
    }
    double b = biased[e];
    if (u_biased != 0) b += rounding(b, u_biased, tiny, biased_stream, e, exact, coherent);
    const Idx src = (r * ng + h / hpg) * ds + n;
    const double before = normed[src];
    if (u_normed != 0 && fabs(before) >= kCancelledBiasAdd * fabs(b)) {
      const double after =
          before + rounding(before, u_normed, tiny, normed_stream, src, exact, coherent);
      b += after - before;
    }
    biased[e] = b;
  });
}

void accumulation(cudaStream_t s, Idx rows, Idx n, Idx m, const double* x, const double* w,
                  double* out, double u, std::uint64_t stream) {
  if (u == 0) return;
  const double scale = u * sqrt(0.5 * static_cast<double>(n));
  each(s, rows * m, [=] __device__(Idx e) {
    const Idx r = e / m, j = e % m;
    double ss = 0;
    for (Idx k = 0; k < n; ++k) {
      const double t = x[r * n + k] * w[k * m + j];
      ss += t * t;
    }
    out[e] += rho_of(stream, e, out[e], true) * scale * sqrt(ss);
  });
}

}  // namespace m3::gpu::oracle
