#include "targets.hpp"

#include <cmath>
#include <cstdio>
#include <string>

#include "error.hpp"

namespace m3::harness {

namespace {

void check(const MarginalTimes& t, const char* what) {
  for (double v : {t.fwd_ms, t.fwdbwd_ms})
    if (!(std::isfinite(v) && v > 0))
      throw Error("harness::target_lines", "bad marginal layer time",
                  std::string(what) + ": " + std::to_string(v) + " ms");
}

// "met", or "not met, <amount><unit> over", for value against an upper bound.
std::string verdict(double value, double bound, const char* unit) {
  if (value <= bound) return "met";
  char b[64];
  std::snprintf(b, sizeof b, "not met, %.3f%s over", value - bound, unit);
  return b;
}

}  // namespace

std::vector<std::string> target_lines(const std::optional<MarginalTimes>& bf16,
                                      const std::optional<MarginalTimes>& f16) {
  std::vector<std::string> out;
  if (!bf16) return out;
  check(*bf16, "bf16");
  char b[256];
  std::snprintf(b, sizeof b,
                "issue 18 target, bf16 marginal layer: fwd+bwd %.3f ms against <= %.2f ms (2x the "
                "official block's %.2f): %s",
                bf16->fwdbwd_ms, kTargetFwdBwdMs, kOfficialBlockFwdBwdMs,
                verdict(bf16->fwdbwd_ms, kTargetFwdBwdMs, " ms").c_str());
  out.emplace_back(b);
  std::snprintf(b, sizeof b,
                "issue 18 target, bf16 marginal layer: fwd %.3f ms against <= %.2f ms: %s",
                bf16->fwd_ms, kTargetFwdMs, verdict(bf16->fwd_ms, kTargetFwdMs, " ms").c_str());
  out.emplace_back(b);
  if (f16) {
    check(*f16, "f16");
    const double ratio = f16->fwdbwd_ms / bf16->fwdbwd_ms;
    std::snprintf(b, sizeof b,
                  "issue 18 target, f16 marginal layer: fwd+bwd %.3f ms = %.3fx bf16's against <= "
                  "%.2fx: %s",
                  f16->fwdbwd_ms, ratio, kTargetF16OverBf16,
                  verdict(ratio, kTargetF16OverBf16, "x").c_str());
    out.emplace_back(b);
  }
  return out;
}

}  // namespace m3::harness
