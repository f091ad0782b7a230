// The minimum work of each profiled stage of one forward + backward (METHOD.md "two numbers
// first"), and the stage profile held against the device's two ceilings (m3h bench --profile).
//
// Bytes: every tensor a stage reads, read once, plus every tensor it writes, written once, at
// its storage size: 2 bytes where the registry marks it typed and the run stores bf16/f16, 4
// otherwise (MODEL.md §8). What a stage writes is taken from the stage registry
// (reference/registry.cpp): all tensors of that registry stage, with three attributions to the
// stage that actually runs them — states/* are written by F6 (angle_state by F5), d_states/* by
// B6 (d_angle_state by B5a), B4c/* by the B4b launcher. Two registry tensors are copies of the
// previous stage's output and count as reads, not writes: F1/residual (the layer input) and
// norm_f/norm_f_input (the last layer's output). What a stage reads is the registry's stage table
// (reference/registry.hpp stage_table: the launcher arguments of the stage-by-stage path), each
// read resolved through the registry for its shape and type, so a renamed or reshaped tensor
// changes (or breaks) the model with the code. The entering states and the gradients wrt the leaving states have the shapes of
// the registry's states/* and d_states/*. Parameters are f32 masters, except the GEMM weights,
// read as the typed compute copy; a parameter gradient is accumulated (read + write, f32). The
// residual-stream gradient δ [B·T, dm] is f32, read by the GEMMs as its typed staged copy.
// Copies the implementation adds between stages (the residual copy, the state slices, the typed
// δ) are not minimum work and are not counted; they show up as the gap.
//
// FLOPs (a multiply-add is 2):
//   GEMMs [rows, in]·[in, out]: 2·rows·in·out forward; backward dX and dW, 4·rows·in·out.
//     F2, B2 (in_proj), F8, B8 (out_proj), input_proj (unless the identity). Held against the
//     GEMM ceiling of the storage type.
//   F6/B6 chunked, per (b, h, chunk of length L), dense products (no causal halving), each
//     m×n×k product 2·m·n·k:
//       forward   Q·Ksᵀ (L·L·ds), masked·X (L·hd·L), Q·S (L·hd·ds), contribution Xᵀ·Ks (hd·ds·L)
//       backward  A = Q·Ksᵀ (L·L·ds), P = dO·Xᵀ (L·L·hd), dV = (M⊙A)ᵀ·dO (L·hd·L),
//                 Ks·dSᵀ (L·hd·ds), dK_mid = (M⊙P)ᵀ·Q (L·ds·L), X·dS (L·ds·hd),
//                 dQ_mid = (M⊙P)·Ks (L·ds·L), dO·S (L·ds·hd), dcontrib = dOᵀ·Q (hd·ds·L)
//     i.e. forward 2·(L²·(ds + hd) + 2·L·hd·ds), backward 2·(L²·(3·ds + 2·hd) + 4·L·hd·ds).
//   F6/B6 sequential, per step per (b, h), per state element (hd·ds of them):
//       forward   7: h = α·h + (β·v)·kᵀ + (γ·x)·Kᵀ (1 multiply + 2 FMA), y = h·Q (1 FMA)
//       backward 15: G += dy·Qᵀ, d_q = hᵀ·dy, dα = ⟨G, h_prev⟩, G·K, Gᵀ·x, G·k_prev, Gᵀ·v_prev
//                    (7 FMA), G ← α·G (1 multiply)
//     The scans run on f32 FMA units, so they are held against the f32 (pedantic, no TF32) GEMM
//     rate — except the chunked scan of bf16/f16 runs, whose products run on the tensor cores
//     (gpu/tc/tc_mma.cuh) and are held against the GEMM rate of the storage type.
//   Every other stage is elementwise or a row reduction: bytes only (FLOPs 0).
// All figures are summed over the layers, as the profile sums a stage's time over the layers.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "config.hpp"
#include "precision.hpp"

namespace m3::harness {

// Which FLOP ceiling a stage's arithmetic is held against.
enum class FlopUnit {
  None,    // elementwise: bytes only
  Matrix,  // cuBLAS GEMM at the run's storage type (tensor cores for bf16/f16; f32 pedantic)
  Fma32,   // f32 FMA on the CUDA cores (the scans), compared with the f32 pedantic GEMM rate
};
const char* flop_unit_name(FlopUnit u);  // "-" | "gemm" | "fma32"

struct StageWork {
  std::string stage;  // as GpuBackbone::stage_times() names it ("F2", "norm_f (bwd)", …)
  double read_bytes = 0;
  double write_bytes = 0;
  double flops = 0;
  FlopUnit unit = FlopUnit::None;
  double bytes() const { return read_bytes + write_bytes; }
};

// Bytes of one element stored as `typed` (bf16/f16 → 2 when typed) or f32 (4). Throws
// m3::Error for F64 (not a GPU storage).
double element_bytes(bool typed, Precision storage);

// The profiled stages of one forward + backward in execution order (input_proj, F1 … F8,
// states, norm_f, norm_f (bwd), B8 … B1, d_states, input_proj (bwd)), summed over the layers.
// Throws m3::Error on an invalid run shape, F64 storage, or a name the registry lacks.
std::vector<StageWork> stage_work(const Config& cfg, Idx B, Idx T, ScanMode mode,
                                  Precision storage);

// The device's ceilings, per second.
struct Roof {
  double bytes_per_s = 0;          // device-to-device copy, bytes read + written
  double matrix_flops_per_s = 0;   // GEMM at the run's storage type
  double fma32_flops_per_s = 0;    // f32 pedantic GEMM (the f32 FMA rate)
  double flops_per_s(FlopUnit u) const;  // 0 for None
};

// One stage's time held against its model and the roof.
struct RooflineRow {
  std::string stage;
  double ms = 0;
  double share = 0;              // of the profile's total time
  bool modeled = false;          // a stage_work entry of that name exists
  double bytes = 0, flops = 0;
  FlopUnit unit = FlopUnit::None;
  double bytes_per_s = 0;        // achieved: bytes / time
  double flops_per_s = 0;        // achieved: flops / time
  double bw_fraction = 0;        // achieved / copy ceiling
  double flop_fraction = 0;      // achieved / the unit's ceiling (0 without FLOPs)
  double bytes_floor_ms = 0;     // bytes at the copy ceiling
  double flops_floor_ms = 0;     // flops at the unit's ceiling
  double floor_ms = 0;           // the larger of the two (the total: Σ of the stages' floors)
  // "memory" when the byte floor is the larger (the closer bound), "compute" otherwise; "-"
  // when the stage has no model or no work.
  const char* bound() const;
};

// One row per profiled stage, in the profile's order; stages without a model keep only their
// time. Stages of the model absent from the profile are left out.
std::vector<RooflineRow> roofline_rows(const std::vector<std::pair<std::string, double>>& times,
                                       const std::vector<StageWork>& work, const Roof& roof);
// The sum of the rows: time, bytes, FLOPs, floors (floor_ms = Σ of each stage's floor);
// achieved rates over the total time; bw_fraction = Σ bytes_floor_ms / Σ ms and
// flop_fraction = Σ flops_floor_ms / Σ ms (each stage's FLOPs at its own unit's ceiling).
RooflineRow roofline_total(const std::vector<RooflineRow>& rows);

}  // namespace m3::harness
