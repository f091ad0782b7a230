// The error of a tensor against the position in the sequence (docs/HARNESS.md §5). A scan's error
// grows along t and jumps at chunk boundaries; a tensor-wide max or p95 hides where. For a
// tensor whose first axis is B·T (rows r = b·T + t), per position t over every b and every
// trailing index:
//   max_abs[t] = max |Δ|,   rel_l2[t] = ‖Δ_t‖₂ / ‖o_t‖₂   (‖Δ_t‖₂ when ‖o_t‖₂ = 0)
// with Δ = subject − oracle, or the circular distance remainder(s − o, 2π) for angles.
// print_position_profile writes it compactly: one line per chunk [t0, t1) with the largest
// max_abs (and its t) and rel_l2, the values at the chunk's first position (the boundary,
// marked |), and the growth from the first chunk's mean rel_l2.
#pragma once

#include <ostream>
#include <string>
#include <vector>

#include "capture.hpp"
#include "config.hpp"
#include "registry.hpp"

namespace m3::harness {

struct PositionProfile {
  std::vector<double> max_abs, rel_l2;  // [T] each; empty: no profile
  bool empty() const { return max_abs.empty(); }
};

// Whether a registry shape has the position axis (its first dimension is B·T).
bool has_position_axis(const std::vector<Sym>& shape);

// subject and oracle of shape [B·T, …] (same shape); throws m3::Error naming what is wrong.
PositionProfile position_profile(const Tensor& subject, const Tensor& oracle, Idx B, Idx T,
                                 bool circular);

void print_position_profile(std::ostream& os, const std::string& title, const PositionProfile& p,
                            Idx chunk_size);

}  // namespace m3::harness
