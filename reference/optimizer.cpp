// The optimizer step of TRAINING.md §2 on the host (see optimizer.hpp for the math): the
// schedule, the decay rule, the fixed-order gradient norm, the clip, AdamW per element in the
// arithmetic of S, and f16's dynamic loss scale.
#include "optimizer.hpp"

#include <cmath>
#include <cstddef>

#include "error.hpp"

// adamw_step's float instantiation is the GPU kernel's twin bit for bit: every product and sum
// rounds on its own, so no multiply-add may be fused here (a -march with FMA would otherwise let
// the compiler contract m = β1·m + (1−β1)·g). After the includes, so only this file's functions
// carry the option.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace m3 {

void OptimConfig::validate() const {
  const char* where = "OptimConfig";
  M3_REQUIRE(std::isfinite(lr) && lr > 0, where, "lr must be finite and > 0", "lr=", lr);
  M3_REQUIRE(beta1 >= 0 && beta1 < 1, where, "beta1 must be in [0, 1)", "beta1=", beta1);
  M3_REQUIRE(beta2 >= 0 && beta2 < 1, where, "beta2 must be in [0, 1)", "beta2=", beta2);
  M3_REQUIRE(std::isfinite(eps) && eps > 0, where, "eps must be finite and > 0", "eps=", eps);
  M3_REQUIRE(std::isfinite(wd) && wd >= 0, where, "wd must be finite and >= 0", "wd=", wd);
  M3_REQUIRE(std::isfinite(clip) && clip >= 0, where, "clip must be finite and >= 0 (0 = off)",
             "clip=", clip);
  M3_REQUIRE(steps >= 1, where, "steps must be >= 1", "steps=", steps);
  M3_REQUIRE(warmup >= 0 && warmup <= steps, where, "warmup must be in [0, steps]",
             "warmup=", warmup, ", steps=", steps);
  M3_REQUIRE(min_lr_ratio >= 0 && min_lr_ratio <= 1, where, "min_lr_ratio must be in [0, 1]",
             "min_lr_ratio=", min_lr_ratio);
}

double learning_rate(const OptimConfig& o, Idx t) {
  o.validate();
  M3_REQUIRE(t >= 1, "learning_rate", "the step number t must be >= 1", "t=", t);
  if (t <= o.warmup) return o.lr * static_cast<double>(t) / static_cast<double>(o.warmup);
  const double floor = o.lr * o.min_lr_ratio;
  if (t >= o.steps) return floor;
  const double u =
      static_cast<double>(t - o.warmup) / static_cast<double>(o.steps - o.warmup);  // (0, 1)
  const double pi = std::acos(-1.0);
  return floor + (o.lr - floor) * 0.5 * (1.0 + std::cos(pi * u));
}

bool param_decays(const std::string& name) {
  const std::string::size_type slash = name.find_last_of('/');
  const std::string base = slash == std::string::npos ? name : name.substr(slash + 1);
  return base == "in_proj_w" || base == "out_proj_w" || base == "head_w";
}

std::vector<std::uint8_t> decay_flags(const ParamLayout& layout) {
  std::vector<std::uint8_t> flags;
  flags.reserve(layout.slots.size());
  for (const ParamSlot& s : layout.slots) flags.push_back(param_decays(s.spec->name) ? 1 : 0);
  return flags;
}

template <class S>
std::vector<double> norm_partials(const S* g, Idx begin, Idx end) {
  M3_REQUIRE(begin >= 0 && begin <= end, "norm_partials", "the range must be ordered",
             "begin=", begin, ", end=", end);
  M3_REQUIRE(begin % kNormBlock == 0, "norm_partials", "a range starts at a block boundary",
             "begin=", begin, " is not a multiple of kNormBlock=", kNormBlock);
  M3_REQUIRE(begin == end || g != nullptr, "norm_partials", "no gradient buffer", "");
  std::vector<double> out;
  for (Idx b = begin; b < end; b += kNormBlock) {
    const Idx e = b + kNormBlock < end ? b + kNormBlock : end;
    double partial = 0.0;
    for (Idx i = b; i < e; ++i) {
      const double x = static_cast<double>(g[i]);
      partial += x * x;
    }
    out.push_back(partial);
  }
  return out;
}

double norm_from_partials(const std::vector<double>& partials) {
  double total = 0.0;
  for (double p : partials) total += p;
  return std::sqrt(total);
}

template <class S>
double grad_norm(const S* g, Idx n) {
  M3_REQUIRE(n >= 0, "grad_norm", "the element count must be >= 0", "n=", n);
  M3_REQUIRE(n == 0 || g != nullptr, "grad_norm", "no gradient buffer", "n=", n);
  return norm_from_partials(norm_partials(g, 0, n));
}

double clip_coefficient(double g_norm, double clip) {
  M3_REQUIRE(std::isfinite(clip) && clip >= 0, "clip_coefficient",
             "clip must be finite and >= 0 (0 = off)", "clip=", clip);
  M3_REQUIRE(!(g_norm < 0), "clip_coefficient", "the gradient norm must be >= 0",
             "g_norm=", g_norm);
  if (clip == 0) return 1.0;
  const double c = clip / (g_norm + 1e-6);
  return std::isnan(c) || c < 1.0 ? c : 1.0;
}

AdamWScalars adamw_scalars(const OptimConfig& o, Idx t, double clip_coef, double loss_scale) {
  const char* where = "adamw_scalars";
  M3_REQUIRE(t >= 1, where, "the step number t must be >= 1", "t=", t);
  M3_REQUIRE(clip_coef >= 0 && clip_coef <= 1, where, "clip_coef must be in [0, 1]",
             "clip_coef=", clip_coef,
             " (a NaN comes from a non-finite gradient norm: skip the step or stop the run)");
  M3_REQUIRE(std::isfinite(loss_scale) && loss_scale > 0, where,
             "loss_scale must be finite and > 0", "loss_scale=", loss_scale);
  AdamWScalars a{};
  a.lr = learning_rate(o, t);  // validates o
  a.gscale = clip_coef / loss_scale;
  a.beta1 = o.beta1;
  a.beta2 = o.beta2;
  a.eps = o.eps;
  a.wd = o.wd;
  a.bc1 = 1.0 - std::pow(o.beta1, static_cast<double>(t));
  a.bc2 = 1.0 - std::pow(o.beta2, static_cast<double>(t));
  return a;
}

template <class S>
void adamw_step(const ParamLayout& layout, const std::vector<std::uint8_t>& decay,
                const AdamWScalars& a, S* p, S* m, S* v, const S* g) {
  adamw_step_range(layout, decay, a, 0, layout.total, p, m, v, g);
}

template <class S>
void adamw_step_range(const ParamLayout& layout, const std::vector<std::uint8_t>& decay,
                      const AdamWScalars& a, Idx begin, Idx end, S* p, S* m, S* v, const S* g) {
  const char* where = "adamw_step";
  M3_REQUIRE(begin >= 0 && begin <= end && end <= layout.total, where,
             "the range must lie in the layout", "begin=", begin, ", end=", end, ", total=",
             layout.total);
  M3_REQUIRE(decay.size() == layout.slots.size(), where, "one decay flag per slot",
             decay.size(), " flags for ", layout.slots.size(), " slots");
  M3_REQUIRE(layout.total == 0 || (p && m && v && g), where, "a null buffer",
             "p, m, v and g must each hold layout.total=", layout.total, " elements");
  M3_REQUIRE(a.bc1 > 0 && a.bc2 > 0, where, "the bias corrections must be > 0",
             "bc1=", a.bc1, ", bc2=", a.bc2, " (t >= 1 and beta < 1: adamw_scalars)");
  const S gscale = S(a.gscale), beta1 = S(a.beta1), beta2 = S(a.beta2);
  const S one_m_beta1 = S(1.0 - a.beta1), one_m_beta2 = S(1.0 - a.beta2);
  const S bc1 = S(a.bc1), bc2 = S(a.bc2), eps = S(a.eps), lr = S(a.lr);
  for (std::size_t s = 0; s < layout.slots.size(); ++s) {
    const ParamSlot& slot = layout.slots[s];
    const S wd = decay[s] ? S(a.wd) : S(0);
    const Idx lo = slot.offset > begin ? slot.offset : begin;
    const Idx hi = slot.offset + slot.size < end ? slot.offset + slot.size : end;
    for (Idx i = lo; i < hi; ++i) {
      const S gi = g[i] * gscale;
      m[i] = beta1 * m[i] + one_m_beta1 * gi;
      v[i] = beta2 * v[i] + one_m_beta2 * (gi * gi);
      const S mhat = m[i] / bc1;
      const S vhat = v[i] / bc2;
      const S upd = mhat / (std::sqrt(vhat) + eps) + wd * p[i];
      p[i] = p[i] - lr * upd;
    }
  }
}

LossScaler LossScaler::for_precision(Precision p) {
  LossScaler s;
  if (p == Precision::F16) {
    s.dynamic = true;
    s.scale = kInitialScale;
  }
  return s;
}

bool LossScaler::update(bool finite) {
  if (!dynamic) return true;
  if (!finite) {
    scale *= 0.5;
    good_steps = 0;
    ++skipped;
    return false;
  }
  if (++good_steps == kGrowthInterval) {
    scale *= 2.0;
    good_steps = 0;
  }
  return true;
}

#define M3_INSTANTIATE(S)                                                                  \
  template double grad_norm<S>(const S*, Idx);                                             \
  template std::vector<double> norm_partials<S>(const S*, Idx, Idx);                       \
  template void adamw_step_range<S>(const ParamLayout&, const std::vector<std::uint8_t>&,  \
                                    const AdamWScalars&, Idx, Idx, S*, S*, S*, const S*);  \
  template void adamw_step<S>(const ParamLayout&, const std::vector<std::uint8_t>&,        \
                              const AdamWScalars&, S*, S*, S*, const S*);
M3_INSTANTIATE(float)
M3_INSTANTIATE(double)
#undef M3_INSTANTIATE

}  // namespace m3
