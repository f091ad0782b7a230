// Config validation, MODEL.md §1.3 amended by §12.7 (see config.hpp).
#include "config.hpp"

#include <cmath>
#include <sstream>

#include "error.hpp"

namespace m3 {

const char* scan_mode_name(ScanMode m) { return m == ScanMode::Sequential ? "seq" : "chunked"; }

ScanMode parse_scan_mode(const std::string& s) {
  if (s == "seq" || s == "sequential") return ScanMode::Sequential;
  if (s == "chunked" || s == "chunk") return ScanMode::Chunked;
  throw Error("scan mode", "unknown scan mode '" + s + "'", "expected seq or chunked");
}

Idx Config::num_rope_angles() const {
  const Idx rotated = static_cast<Idx>(std::floor(static_cast<double>(d_state) * rope_fraction));
  return rotated / 2;
}

void Config::validate() const {
  const char* where = "config";
  M3_REQUIRE(d_model >= 1, where, "d_model must be >= 1", "d_model=", d_model);
  M3_REQUIRE(expand >= 1, where, "expand must be >= 1", "expand=", expand);
  M3_REQUIRE(headdim >= 1, where, "headdim must be >= 1", "headdim=", headdim);
  M3_REQUIRE(d_state >= 1, where, "d_state must be >= 1", "d_state=", d_state);
  M3_REQUIRE(n_layers >= 1, where, "n_layers must be >= 1", "n_layers=", n_layers);
  M3_REQUIRE(d_inner() % headdim == 0, where, "d_inner must be a multiple of headdim",
             "d_inner=expand*d_model=", d_inner(), ", headdim=", headdim);
  M3_REQUIRE(ngroups >= 1, where, "ngroups must be >= 1", "ngroups=", ngroups);
  M3_REQUIRE(nheads() % ngroups == 0, where, "ngroups must divide nheads", "nheads=", nheads(),
             ", ngroups=", ngroups);
  M3_REQUIRE(rope_fraction == 0.5 || rope_fraction == 1.0, where,
             "rope_fraction must be 0.5 or 1.0", "rope_fraction=", rope_fraction);
  M3_REQUIRE(2 * num_rope_angles() <= d_state, where,
             "2*num_rope_angles must not exceed d_state", "num_rope_angles=", num_rope_angles(),
             ", d_state=", d_state);
  M3_REQUIRE(std::isfinite(a_floor) && a_floor > 0, where, "a_floor must be finite and > 0",
             "a_floor=", a_floor);
  M3_REQUIRE(chunk_size >= 1, where, "chunk_size must be >= 1", "chunk_size=", chunk_size);
  M3_REQUIRE(input_dim >= 1, where, "input_dim must be >= 1", "input_dim=", input_dim);
  M3_REQUIRE(!input_proj_identity || input_dim == d_model, where,
             "input_dim must equal d_model when input_proj_identity is set",
             "input_dim=", input_dim, ", d_model=", d_model);
}

std::string Config::describe() const {
  std::ostringstream os;
  os << "d_model=" << d_model << " d_state=" << d_state << " expand=" << expand
     << " headdim=" << headdim << " ngroups=" << ngroups << " n_layers=" << n_layers
     << " rope_fraction=" << rope_fraction << " a_floor=" << a_floor
     << " is_outproj_norm=" << (is_outproj_norm ? 1 : 0) << " input_dim=" << input_dim
     << " input_proj_identity=" << (input_proj_identity ? 1 : 0) << " chunk_size=" << chunk_size
     << " (d_inner=" << d_inner() << " nheads=" << nheads() << " num_rope_angles="
     << num_rope_angles() << " in_proj_dim=" << in_proj_dim() << ")";
  return os.str();
}

void validate_run(const Config& cfg, Idx B, Idx T) {
  cfg.validate();
  M3_REQUIRE(B >= 1, "run shape", "batch B must be >= 1", "B=", B);
  M3_REQUIRE(T >= 1, "run shape", "sequence length T must be >= 1", "T=", T);
}

}  // namespace m3
