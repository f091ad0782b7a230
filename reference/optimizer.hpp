// The optimizer step of TRAINING.md §2, the host reference (double oracle, float baseline) whose
// per-element arithmetic the GPU step (gpu/optimizer_gpu.hpp) repeats in float, bit for bit.
//
// Over the flat f32 buffers of ParamLayout (registry.hpp; gaps zero and never touched), with t
// the step number starting at 1 and S the loss scale (1 unless f16):
//   g_norm = sqrt(Σ_i g_i²)                   f64, fixed blocks of kNormBlock, blocks in order;
//                                             of the unscaled gradient: grad_norm(raw) / S
//   c      = min(1, clip / (g_norm + 1e-6))   clip = 0: c = 1
//   g      = (c / S) · g_raw                  gscale = c / S, one factor on the raw gradient
//   m      ← β1 m + (1−β1) g
//   v      ← β2 v + (1−β2) g²
//   m̂ = m / (1−β1^t),  v̂ = v / (1−β2^t)
//   p      ← p − lr_t · (m̂ / (sqrt(v̂) + ε) + d · wd · p)      d = 1 only for in_proj_w,
//                                                               out_proj_w, head_w
//   lr_t   = lr·t/warmup (t ≤ warmup), then lr_min + (lr − lr_min)·½(1 + cos(π·u)),
//            u = (t − warmup)/(steps − warmup) clamped to [0, 1], lr_min = lr·min_lr_ratio
// This equals PyTorch's AdamW (p ← p(1 − lr·wd) − lr·m̂ / (sqrt(v̂) + ε)) up to rounding.
// f16 dynamic loss scaling (§2.6): S = 2^16 at first; a non-finite gradient skips the step
// (p, m, v and t unchanged) and halves S; 2000 applied steps in a row double it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config.hpp"
#include "precision.hpp"
#include "registry.hpp"

namespace m3 {

struct OptimConfig {
  double lr = 3e-4;          // peak learning rate
  Idx warmup = 0;            // linear warmup steps
  Idx steps = 1000;          // the cosine reaches lr·min_lr_ratio at t = steps
  double min_lr_ratio = 0.1;
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8, wd = 0.1;
  double clip = 1.0;  // global gradient-norm clip; 0 = off

  // Throws m3::Error naming the field and the rule: lr finite and > 0, 0 <= beta1, beta2 < 1,
  // eps finite and > 0, wd and clip finite and >= 0, steps >= 1, 0 <= warmup <= steps,
  // 0 <= min_lr_ratio <= 1.
  void validate() const;
};

// lr_t for step t >= 1 (see the file comment); t > steps gives the floor lr·min_lr_ratio.
double learning_rate(const OptimConfig& o, Idx t);

// Whether a parameter is weight-decayed: true only for in_proj_w, out_proj_w and head_w. The
// name is a registry name ("in_proj_w"); a layer prefix ("L3/in_proj_w") is ignored.
bool param_decays(const std::string& name);

// One flag per slot of layout.slots, in slot order: 1 = decayed.
std::vector<std::uint8_t> decay_flags(const ParamLayout& layout);

// The gradient norm's block: partial sums over consecutive blocks of this many elements.
constexpr Idx kNormBlock = 4096;

// sqrt(Σ g_i²) in double, in a fixed order: per block of kNormBlock consecutive elements a
// partial sum in index order (g_i widened to double, then squared), then the partials summed
// in block order. A pure function of the bits of g[0..n); a non-finite g_i gives a non-finite
// result. n = 0 gives 0.
// grad_norm's f64 partial sums of the blocks of kNormBlock elements that start in [begin, end)
// (begin a multiple of kNormBlock; the last block cut at end), each summed in index order: a
// shard's share of the global norm (ZeRO-1, TRAINING.md §8). The partials of contiguous
// block-aligned shards, in shard order, are grad_norm's own, so norm_from_partials of them is
// grad_norm bit for bit.
template <class S>
std::vector<double> norm_partials(const S* g, Idx begin, Idx end);
double norm_from_partials(const std::vector<double>& partials);  // sqrt of their ordered sum

template <class S>
double grad_norm(const S* g, Idx n);

// clip == 0 → 1; else min(1, clip / (g_norm + 1e-6)). A NaN g_norm gives NaN (not 1).
double clip_coefficient(double g_norm, double clip);

// The per-step scalars, computed once in double on the host and shared by the CPU and the GPU
// steps: lr = learning_rate(o, t), gscale = clip_coef / loss_scale (the factor applied to the
// raw accumulated gradient), bc1 = 1 − beta1^t, bc2 = 1 − beta2^t; beta1, beta2, eps, wd from o.
struct AdamWScalars {
  double lr, gscale, beta1, beta2, eps, wd, bc1, bc2;
};
// Checks o, t >= 1, clip_coef in [0, 1], loss_scale finite and > 0.
AdamWScalars adamw_scalars(const OptimConfig& o, Idx t, double clip_coef, double loss_scale);

// One AdamW step over every slot of layout (the gaps untouched), in the arithmetic of S, per
// element i of a slot with decay flag d, exactly in this order (the GPU kernel does the same in
// float with round-to-nearest intrinsics; this file is compiled without FMA contraction):
//   S g = g_raw[i] * S(gscale);
//   m[i] = S(beta1) * m[i] + S(1 - beta1) * g;
//   v[i] = S(beta2) * v[i] + S(1 - beta2) * (g * g);
//   S mhat = m[i] / S(bc1);  S vhat = v[i] / S(bc2);
//   S upd = mhat / (std::sqrt(vhat) + S(eps)) + (d ? S(wd) : S(0)) * p[i];
//   p[i] = p[i] - S(lr) * upd;
// (1 − beta1) and (1 − beta2) are computed in double, then cast. p, m, v, g: layout.total
// elements each; decay: one flag per slot (decay_flags).
template <class S>
void adamw_step(const ParamLayout& layout, const std::vector<std::uint8_t>& decay,
                const AdamWScalars& a, S* p, S* m, S* v, const S* g);
// adamw_step restricted to the elements [begin, end) of the flat arena (a shard; slots may be
// cut): the same per-element arithmetic, so the shards' steps together are adamw_step bit for
// bit.
template <class S>
void adamw_step_range(const ParamLayout& layout, const std::vector<std::uint8_t>& decay,
                      const AdamWScalars& a, Idx begin, Idx end, S* p, S* m, S* v, const S* g);

// f16 dynamic loss scaling (TRAINING.md §2.6). For F16: dynamic, scale 2^16; a non-finite
// gradient (its norm non-finite) skips the step, halves the scale, counts the skip and resets
// the good-step count; kGrowthInterval applied steps in a row double the scale (the count then
// restarts). Every other precision: scale 1, never skips.
struct LossScaler {
  bool dynamic = false;
  double scale = 1.0;
  Idx good_steps = 0;  // applied steps since the last change of scale
  Idx skipped = 0;     // steps skipped so far
  static constexpr Idx kGrowthInterval = 2000;
  static constexpr double kInitialScale = 65536.0;  // 2^16

  static LossScaler for_precision(Precision p);  // dynamic only for F16
  // Given whether this step's gradient is finite: true when the step is to be applied. Updates
  // the state as above (a static scaler always returns true and never changes).
  bool update(bool finite);
};

}  // namespace m3
