// Error metrics and coordinate decoding (see metrics.hpp for the math).
#include "metrics.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <sstream>

#include "error.hpp"

namespace m3::harness {

namespace {
constexpr double kTwoPi = 6.283185307179586476925286766559;
constexpr double kInf = std::numeric_limits<double>::infinity();

// Which slice of the in_proj split (MODEL.md §2.1) column j falls in, with its own coordinates:
// z, x [nh, hd]; b_raw, c_raw [ng, ds]; dd_dt, dd_a, trap [nh]; angles [na].
std::string in_proj_column(const Config& cfg, Idx j) {
  const Idx di = cfg.d_inner(), nh = cfg.nheads(), gds = cfg.ngroups * cfg.d_state;
  const Idx hd = std::max<Idx>(cfg.headdim, 1), ds = std::max<Idx>(cfg.d_state, 1);
  struct Slice {
    const char* name;
    Idx width;
    Idx inner;  // size of the fastest axis; 0: one axis
    const char* outer_name;
    const char* inner_name;
  };
  const Slice slices[] = {
      {"z", di, hd, "h", "p"},         {"x", di, hd, "h", "p"},
      {"b_raw", gds, ds, "g", "n"},    {"c_raw", gds, ds, "g", "n"},
      {"dd_dt", nh, 0, "h", nullptr},  {"dd_a", nh, 0, "h", nullptr},
      {"trap", nh, 0, "h", nullptr},   {"angles", cfg.num_rope_angles(), 0, "a", nullptr},
  };
  std::ostringstream os;
  for (const Slice& s : slices) {
    if (j >= s.width) {
      j -= s.width;
      continue;
    }
    os << s.name << " " << s.outer_name << "=";
    if (s.inner > 0) os << j / s.inner << " " << s.inner_name << "=" << j % s.inner;
    else os << j;
    return os.str();
  }
  return "past the split";
}

// The k-th smallest (0-based) of n ≥ 1 finite non-negative doubles given as their bit
// patterns, which order them as the values do: exactly std::nth_element's value, found by a
// radix select on 16 bits at a time (a histogram pass, then only the matching bucket is kept),
// several times faster than nth_element's unpredictable partitions on a large tensor.
double kth_smallest(std::vector<std::uint64_t>& bits, size_t k) {
  std::vector<std::uint32_t> hist(1u << 16);
  for (int shift = 48; shift >= 0 && bits.size() > 64; shift -= 16) {
    std::fill(hist.begin(), hist.end(), 0u);
    for (std::uint64_t b : bits) ++hist[(b >> shift) & 0xffff];
    size_t below = 0, bucket = 0;
    while (below + hist[bucket] <= k) below += hist[bucket++];
    size_t n = 0;
    for (std::uint64_t b : bits)
      if (((b >> shift) & 0xffff) == bucket) bits[n++] = b;
    bits.resize(n);
    k -= below;
  }
  std::nth_element(bits.begin(), bits.begin() + static_cast<std::ptrdiff_t>(k), bits.end());
  double v = 0;
  std::memcpy(&v, &bits[k], sizeof v);
  return v;
}

}  // namespace

double circular_diff(double subject, double oracle) {
  return std::remainder(subject - oracle, kTwoPi);
}

namespace {

// One pass over the pairs: the pass rule's figures (max_abs, rel_l2 and what they need), and with
// kFull also the cosine, the relative errors (p95_rel, max_rel) and the ulps.
template <bool kFull>
Metrics measure(const char* what, const Tensor& oracle, const Tensor& subject, bool circular,
                Precision storage) {
  M3_REQUIRE(oracle.shape == subject.shape, what, "subject shape differs from oracle",
             "subject ", shape_str(subject.shape), ", oracle ", shape_str(oracle.shape));
  M3_REQUIRE(static_cast<Idx>(oracle.data.size()) == oracle.numel() &&
                 static_cast<Idx>(subject.data.size()) == subject.numel(),
             what, "tensor data size does not match its shape",
             "oracle ", oracle.data.size(), ", subject ", subject.data.size(), " for shape ",
             shape_str(oracle.shape));
  Metrics m;
  m.numel = oracle.numel();
  double d2 = 0, o2 = 0, s2 = 0, so = 0, ulp_sum = 0;
  Idx finite_pairs = 0;
  // |Δᵢ|/|oᵢ| over R, as bit patterns (kth_smallest).
  std::vector<std::uint64_t> rel(kFull ? static_cast<size_t>(m.numel) : 0);
  size_t n_rel = 0;
  const double* od = oracle.data.data();
  const double* sd = subject.data.data();
  for (Idx i = 0; i < m.numel; ++i) {
    const double o = od[i];
    const double s = sd[i];
    if (!std::isfinite(o)) {
      ++m.oracle_nonfinite;
      continue;
    }
    m.oracle_scale = std::max(m.oracle_scale, std::fabs(o));
    if (!std::isfinite(s)) {
      if (std::isnan(s)) ++m.nan_count; else ++m.inf_count;
      if (m.worst_index < 0 || std::isfinite(m.max_abs)) {
        m.max_abs = kInf;
        m.worst_index = i;
        m.worst_oracle = o;
        m.worst_subject = s;
      }
      continue;
    }
    const double d = circular ? circular_diff(s, o) : s - o;
    const double ad = std::fabs(d);
    ++finite_pairs;
    d2 += d * d;
    o2 += o * o;
    if (ad > m.max_abs || m.worst_index < 0) {
      m.max_abs = ad;
      m.worst_index = i;
      m.worst_oracle = o;
      m.worst_subject = s;
    }
    if constexpr (kFull) {
      const double sh = o + d;
      s2 += sh * sh;
      so += sh * o;
      if (std::fabs(o) >= kRelThreshold) {
        const double r = ad / std::fabs(o);
        m.max_rel = std::max(m.max_rel, r);
        std::memcpy(&rel[n_rel++], &r, sizeof r);
        const double u = ad / ulp_of(o, storage);
        m.max_ulps = std::max(m.max_ulps, u);
        ulp_sum += u;
      }
    }
  }
  m.diff_l2 = std::sqrt(d2);
  m.oracle_l2 = std::sqrt(o2);
  m.rel_l2_absolute = m.zero_oracle();
  if (m.rel_l2_absolute)
    m.rel_l2 = finite_pairs ? m.diff_l2 / std::sqrt(static_cast<double>(finite_pairs)) : 0.0;
  else
    m.rel_l2 = m.diff_l2 / m.oracle_l2;
  if constexpr (kFull) {
    const double sn = std::sqrt(s2);
    if (m.oracle_l2 > 0 && sn > 0) m.cosine = so / (sn * m.oracle_l2);
    else m.cosine = (m.oracle_l2 > 0 || sn > 0) ? 0.0 : 1.0;
    rel.resize(n_rel);
    m.rel_count = static_cast<Idx>(rel.size());
    m.mean_ulps = rel.empty() ? 0.0 : ulp_sum / static_cast<double>(rel.size());
    if (!rel.empty()) {
      const size_t k =
          static_cast<size_t>(std::ceil(0.95 * static_cast<double>(rel.size()))) - 1;
      m.p95_rel = kth_smallest(rel, k);
    }
  }
  if (m.nan_count + m.inf_count > 0) {
    m.rel_l2 = kInf;
    if constexpr (kFull) {
      m.p95_rel = m.max_rel = kInf;
      m.cosine = std::numeric_limits<double>::quiet_NaN();
    }
  }
  return m;
}

}  // namespace

Metrics compute_metrics(const Tensor& oracle, const Tensor& subject, bool circular,
                        Precision storage) {
  return measure<true>("compute_metrics", oracle, subject, circular, storage);
}

Metrics error_norms(const Tensor& oracle, const Tensor& subject, bool circular) {
  return measure<false>("error_norms", oracle, subject, circular, Precision::F64);
}

std::vector<Idx> unravel(Idx flat, const std::vector<Idx>& shape) {
  std::vector<Idx> idx(shape.size(), 0);
  for (size_t k = shape.size(); k-- > 0;) {
    const Idx n = shape[k] > 0 ? shape[k] : 1;
    idx[k] = flat % n;
    flat /= n;
  }
  return idx;
}

std::string decode_index(const std::vector<Sym>& syms, const std::vector<Idx>& shape, Idx flat,
                         const Config& cfg, Idx B, Idx T, int layer) {
  std::ostringstream os;
  const std::vector<Idx> idx = unravel(flat, shape);
  if (syms.size() != shape.size()) {
    os << "[";
    for (size_t k = 0; k < idx.size(); ++k) os << (k ? ", " : "") << idx[k];
    os << "]";
    return os.str();
  }
  const bool has_nc = std::find(syms.begin(), syms.end(), Sym::NC) != syms.end();
  Idx chunk = 0;
  const char* sep = "";
  auto put = [&](const char* name, Idx v) {
    os << sep << name << "=" << v;
    sep = " ";
  };
  if (layer >= 0) put("layer", layer);
  const Idx Tn = T > 0 ? T : 1;
  const Idx hd = cfg.headdim > 0 ? cfg.headdim : 1;
  for (size_t k = 0; k < syms.size(); ++k) {
    const Idx i = idx[k];
    switch (syms[k]) {
      case Sym::BT: put("b", i / Tn); put("t", i % Tn); break;
      case Sym::B: put("b", i); break;
      case Sym::T:
      case Sym::Tp1: put("t", i); break;
      case Sym::NC: chunk = i; put("c", i); break;
      case Sym::CS:
        put("tau", i);
        if (has_nc) {
          const Idx t = chunk * cfg.chunk_size + i;
          if (t < T) put("t", t);
          else os << sep << "(padding)";
        }
        break;
      case Sym::NH: put("h", i); break;
      case Sym::HD: put("p", i); break;
      case Sym::DS: put("n", i); break;
      case Sym::NG: put("g", i); break;
      case Sym::NA: put("a", i); break;
      case Sym::DI: put("d", i); put("h", i / hd); put("p", i % hd); break;
      case Sym::DM:
      case Sym::IN: put("i", i); break;
      case Sym::V: put("v", i); break;
      case Sym::IP: put("j", i); os << " (" << in_proj_column(cfg, i) << ")"; break;
    }
  }
  return os.str();
}

}  // namespace m3::harness
