// The error against position (position.hpp).
#include "position.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "error.hpp"
#include "metrics.hpp"

namespace m3::harness {

bool has_position_axis(const std::vector<Sym>& shape) {
  return !shape.empty() && shape.front() == Sym::BT;
}

PositionProfile position_profile(const Tensor& subject, const Tensor& oracle, Idx B, Idx T,
                                 bool circular) {
  M3_REQUIRE(subject.shape == oracle.shape, "position_profile", "subject and oracle shapes differ",
             "");
  M3_REQUIRE(B >= 1 && T >= 1 && !oracle.shape.empty() && oracle.shape.front() == B * T,
             "position_profile", "the tensor has no B*T axis", "first dimension ",
             oracle.shape.empty() ? 0 : oracle.shape.front(), ", B*T ", B * T);
  const Idx row = oracle.numel() / (B * T);
  PositionProfile p;
  p.max_abs.assign(static_cast<size_t>(T), 0.0);
  p.rel_l2.assign(static_cast<size_t>(T), 0.0);
  std::vector<double> d2(static_cast<size_t>(T), 0.0), o2(static_cast<size_t>(T), 0.0);
  for (Idx b = 0; b < B; ++b)
    for (Idx t = 0; t < T; ++t) {
      const size_t base = static_cast<size_t>((b * T + t) * row);
      for (Idx i = 0; i < row; ++i) {
        const double o = oracle.data[base + static_cast<size_t>(i)];
        const double s = subject.data[base + static_cast<size_t>(i)];
        const double d = circular ? circular_diff(s, o) : s - o;
        p.max_abs[static_cast<size_t>(t)] = std::max(p.max_abs[static_cast<size_t>(t)], std::fabs(d));
        d2[static_cast<size_t>(t)] += d * d;
        o2[static_cast<size_t>(t)] += o * o;
      }
    }
  for (Idx t = 0; t < T; ++t) {
    const size_t i = static_cast<size_t>(t);
    p.rel_l2[i] = o2[i] > 0 ? std::sqrt(d2[i] / o2[i]) : std::sqrt(d2[i]);
  }
  return p;
}

void print_position_profile(std::ostream& os, const std::string& title, const PositionProfile& p,
                            Idx chunk_size) {
  const Idx T = static_cast<Idx>(p.max_abs.size());
  const Idx cs = std::max<Idx>(1, chunk_size);
  os << title << " — error against position, per chunk of " << cs << " (| = the chunk's first t)\n";
  char buf[200];
  double first_mean = 0;
  for (Idx t0 = 0; t0 < T; t0 += cs) {
    const Idx t1 = std::min(T, t0 + cs);
    Idx worst = t0;
    double max_rel = 0, mean_rel = 0;
    for (Idx t = t0; t < t1; ++t) {
      if (p.max_abs[static_cast<size_t>(t)] > p.max_abs[static_cast<size_t>(worst)]) worst = t;
      max_rel = std::max(max_rel, p.rel_l2[static_cast<size_t>(t)]);
      mean_rel += p.rel_l2[static_cast<size_t>(t)];
    }
    mean_rel /= static_cast<double>(t1 - t0);
    if (t0 == 0) first_mean = mean_rel;
    std::snprintf(buf, sizeof buf,
                  "  t %6lld-%-6lld max_abs %.3e (t %lld)  rel_l2 max %.3e mean %.3e  |t %lld: "
                  "max_abs %.3e rel_l2 %.3e  x%.2f",
                  static_cast<long long>(t0), static_cast<long long>(t1 - 1),
                  p.max_abs[static_cast<size_t>(worst)], static_cast<long long>(worst), max_rel,
                  mean_rel, static_cast<long long>(t0), p.max_abs[static_cast<size_t>(t0)],
                  p.rel_l2[static_cast<size_t>(t0)], first_mean > 0 ? mean_rel / first_mean : 0.0);
    os << buf << "\n";
  }
}

}  // namespace m3::harness
