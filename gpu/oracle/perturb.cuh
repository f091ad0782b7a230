// Internal to gpu/oracle: the perturbed mode's rounding model (GpuOracle::set_perturbation) —
// one random rounding applied to a stored tensor in place, on a counter-based random stream.
//
//   v[i] ← v[i] + ρ_i·max(u·|v[i]|, tiny),   ρ_i uniform in [−1, 1) with 53-bit resolution
//
// (harness/perturbed.cpp's PerturbedRun::perturb, elementwise: relative u, or absolutely `tiny`
// where that is larger; a NaN stays NaN). ρ_i depends only on (stream, i):
//   stream  = tensor_stream(seed, key): the splitmix64 finaliser of the seed's mix and the
//             FNV-1a hash of the tensor's key ("L0/F6/y", "norm_f/Out", "L1/B8/delta_typed")
//   z_i     = mix64(stream + (i + 1)·0x9e3779b97f4a7c15)   (the i-th output of splitmix64)
//   ρ_i     = ⌊z_i / 2¹¹⌋·2⁻⁵² − 1                          (exact in double)
// so a value's draw is independent of the launch geometry and of the order of the passes, the
// same seed gives the same bits and a tensor's draws are independent of every other tensor's.
//
// BCNorm's bias add (MODEL.md §4 F4): b_biased[r, h, n] = b_normed[r, g(h), n] + bias[h, n] reads
// b_normed from its typed storage, so where the add cancels (|b_normed| ≥ 4·|b_biased|, after
// b_biased's own rounding) b_biased also carries b_normed's rounding — the same ρ that b_normed's
// own pass draws (c alike; harness/perturbed.cpp's carry_into_bias_add, same threshold).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "config.hpp"
#include "stages.cuh"  // Dims

namespace m3::gpu::oracle {

// The threshold of harness/perturbed.cpp (kCancelledBiasAdd): |normed| ≥ 4·|biased|.
constexpr double kCancelledBiasAdd = 4;

// The random stream of one tensor of a perturbed pass (host side).
std::uint64_t tensor_stream(std::uint64_t seed, const std::string& key);

// v[i] += ρ_i·max(u·|v[i]|, tiny) for i < n; nothing when u = 0 (as the CPU's perturb). With
// `exact`, v[i] ← v[i] rounded to the format whose unit roundoff u is (bf16 2^-8, f16 2^-11,
// f32 2^-24; round to nearest even; another u keeps the random draw) instead.
// With `coherent`, ρ of a nonzero value is keyed by its bits instead of its index (equal values
// of the tensor move alike; OraclePerturbation::coherent).
void perturb(cudaStream_t s, Idx n, double* v, double u, double tiny, std::uint64_t stream,
             bool exact = false, bool coherent = false);

// dst = src perturbed (the staged typed copy of δ that feeds a GEMM): dst[i] = src[i] +
// ρ_i·max(u·|src[i]|, tiny); a plain copy when u = 0.
void perturbed_copy(cudaStream_t s, Idx n, const double* src, double* dst, double u, double tiny,
                    std::uint64_t stream, bool exact = false, bool coherent = false);

// b_biased [BT, nh, ds] perturbed with its own rounding (u_biased, biased_stream), then, where
// the bias add cancels, plus b_normed's [BT, ng, ds] rounding (u_normed, normed_stream), read
// from `normed` BEFORE normed's own pass: queue this first, then perturb(normed, …, u_normed,
// …, normed_stream). With `exact`, b_biased is what the production stores: the bias added to
// b_normed rounded to its format, then rounded to its own (every value, not only where the add
// cancels).
void perturb_bias_add(cudaStream_t s, const Dims& d, const double* normed, double* biased,
                      double u_normed, double u_biased, double tiny, std::uint64_t normed_stream,
                      std::uint64_t biased_stream, bool exact = false, bool coherent = false);

// out [rows, m] = x [rows, n] · w [n, m] (row-major) gets a float GEMM's accumulation error at a
// random walk's size: out[r, j] += ρ·u·√(n/2)·sqrt(Σ_k x[r, k]²·w[k, j]²), ρ keyed by
// out[r, j]'s bits (coherent). One thread per output, a loop over k (the operands' squares are
// never stored).
void accumulation(cudaStream_t s, Idx rows, Idx n, Idx m, const double* x, const double* w,
                  double* out, double u, std::uint64_t stream);

}  // namespace m3::gpu::oracle
