// Figures of another implementation that `m3h bench --against FILE` sets beside its own
// marginal layers. The binary holds no such figure: they come from a text file that says what
// was measured, on which card and when (docs/data/ keeps the ones the project quotes), and the
// bench names the file on every line it prints from it.
//
// The file: `key = value` lines, `#` comments and blank lines; every key once:
//   name           what was measured ("official Mamba-3 block, PyTorch+Triton, …")
//   measured       card, date and command, as one line of text
//   dtype          the storage precision of the figures (f32, bf16, f16): the bench compares
//                  them with its own marginal layers of that precision
//   fwd_ms         forward of one layer at the bench's official shape, ms
//   fwdbwd_ms      forward + backward of one layer, ms
//   gib_per_layer  device memory each further layer costs, GiB
// A missing or repeated key, an unknown key, a malformed line or a figure that is not a
// positive finite number is refused with file:line.
#pragma once

#include <string>
#include <vector>

#include "precision.hpp"

namespace m3::harness {

struct OtherFigures {
  std::string file;  // where the figures were read from
  std::string name, measured;
  Precision dtype = Precision::BF16;
  double fwd_ms = 0, fwdbwd_ms = 0, gib_per_layer = 0;
};

// Reads and checks a figures file; throws m3::Error (one line, file:line) on anything above.
OtherFigures read_other_figures(const std::string& path);
// The same from text (`file` names it in messages).
OtherFigures parse_other_figures(const std::string& text, const std::string& file);

// One of our marginal layers (2 layers − 1 layer at the official shape).
struct MarginalLayer {
  std::string label;  // "bf16 chunked rc=none"
  double fwd_ms = 0, fwdbwd_ms = 0, gib_per_layer = 0;
};

// The lines the bench prints: the other figures with their source, then for each of `ours`
// our figures and the ratios (theirs / ours for time: how many times faster; ours / theirs
// for memory). Throws m3::Error on a non-positive or non-finite figure of ours.
std::vector<std::string> against_lines(const OtherFigures& other,
                                       const std::vector<MarginalLayer>& ours);

}  // namespace m3::harness
