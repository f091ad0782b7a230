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

namespace {

// a·b, or an m3::Error naming the product when it leaves [0, kMaxElements]: every size the
// project derives is a product of the config's dimensions, and a wrapped product would size a
// buffer wrongly (or to zero) instead of failing.
constexpr Idx kMaxElements = Idx(1) << 62;
Idx checked_mul(Idx a, Idx b, const char* where, const char* what) {
  Idx r = 0;
  M3_REQUIRE(a >= 0 && b >= 0 && !__builtin_mul_overflow(a, b, &r) && r <= kMaxElements, where,
             std::string(what) + " is too large", a, " x ", b, " exceeds 2^62");
  return r;
}
Idx checked_add(Idx a, Idx b, const char* where, const char* what) {
  Idx r = 0;
  M3_REQUIRE(!__builtin_add_overflow(a, b, &r) && r <= kMaxElements, where,
             std::string(what) + " is too large", a, " + ", b, " exceeds 2^62");
  return r;
}

}  // namespace

void Config::validate() const {
  const char* where = "config";
  M3_REQUIRE(d_model >= 1, where, "d_model must be >= 1", "d_model=", d_model);
  M3_REQUIRE(expand >= 1, where, "expand must be >= 1", "expand=", expand);
  M3_REQUIRE(headdim >= 1, where, "headdim must be >= 1", "headdim=", headdim);
  M3_REQUIRE(d_state >= 1, where, "d_state must be >= 1", "d_state=", d_state);
  M3_REQUIRE(n_layers >= 1, where, "n_layers must be >= 1", "n_layers=", n_layers);
  M3_REQUIRE(ngroups >= 1, where, "ngroups must be >= 1", "ngroups=", ngroups);
  M3_REQUIRE(input_dim >= 1, where, "input_dim must be >= 1", "input_dim=", input_dim);
  // Every derived width without wrap-around (in_proj_dim is the widest: 2·d_inner + …).
  const Idx di = checked_mul(expand, d_model, where, "d_inner = expand*d_model");
  const Idx bc = checked_mul(2, checked_mul(ngroups, d_state, where, "ngroups*d_state"), where,
                             "2*ngroups*d_state");
  const Idx rest = checked_add(checked_mul(3, di / headdim, where, "3*nheads"), d_state, where,
                               "3*nheads + num_rope_angles");
  checked_add(checked_add(checked_mul(2, di, where, "2*d_inner"), bc, where, "in_proj_dim"), rest,
              where, "in_proj_dim");
  checked_mul(input_dim, d_model, where, "input_proj_w (input_dim*d_model)");
  checked_mul(di, d_model, where, "out_proj_w (d_inner*d_model)");
  M3_REQUIRE(d_inner() % headdim == 0, where, "d_inner must be a multiple of headdim",
             "d_inner=expand*d_model=", d_inner(), ", headdim=", headdim);
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
  M3_REQUIRE(!input_proj_identity || input_dim == d_model, where,
             "input_dim must equal d_model when input_proj_identity is set",
             "input_dim=", input_dim, ", d_model=", d_model);
  M3_REQUIRE(vocab_size >= 0, where, "vocab_size must be >= 0", "vocab_size=", vocab_size);
  if (vocab_size > 0) {
    M3_REQUIRE(!input_proj_identity, where,
               "a token model (vocab_size > 0) embeds through input_proj: it cannot be the identity",
               "vocab_size=", vocab_size);
    M3_REQUIRE(input_dim == vocab_size, where,
               "input_dim must equal vocab_size in a token model (the embedding is input_proj on a one-hot)",
               "input_dim=", input_dim, ", vocab_size=", vocab_size);
    checked_mul(d_model, vocab_size, where, "head_w (d_model*vocab_size)");
  }
}

std::string Config::describe() const {
  std::ostringstream os;
  os << "d_model=" << d_model << " d_state=" << d_state << " expand=" << expand
     << " headdim=" << headdim << " ngroups=" << ngroups << " n_layers=" << n_layers
     << " rope_fraction=" << rope_fraction << " a_floor=" << a_floor
     << " is_outproj_norm=" << (is_outproj_norm ? 1 : 0) << " input_dim=" << input_dim
     << " input_proj_identity=" << (input_proj_identity ? 1 : 0) << " chunk_size=" << chunk_size;
  if (vocab_size > 0) os << " vocab_size=" << vocab_size;
  os
     << " (d_inner=" << d_inner() << " nheads=" << nheads() << " num_rope_angles="
     << num_rope_angles() << " in_proj_dim=" << in_proj_dim() << ")";
  return os.str();
}

void validate_run(const Config& cfg, Idx B, Idx T) {
  cfg.validate();
  const char* where = "run shape";
  M3_REQUIRE(B >= 1, where, "batch B must be >= 1", "B=", B);
  M3_REQUIRE(T >= 1, where, "sequence length T must be >= 1", "T=", T);
  // The largest tensors of a run: [B·T, in_proj_dim], [B·T, nh, ds] (k, q, their gradients),
  // [B, T + 1, ds, d_inner] (h_saved), [B, nc, nh, hd, ds] (the chunk states), [B·T, input_dim].
  const Idx bt = checked_mul(B, T, where, "B*T");
  checked_add(T, cfg.chunk_size, where, "T + chunk_size");  // n_chunks = ⌈T / chunk_size⌉
  checked_mul(bt, cfg.in_proj_dim(), where, "B*T*in_proj_dim");
  checked_mul(bt, checked_mul(cfg.nheads(), cfg.d_state, where, "nheads*d_state"), where,
              "B*T*nheads*d_state");
  checked_mul(checked_mul(B, checked_add(T, 1, where, "T+1"), where, "B*(T+1)"),
              checked_mul(cfg.d_state, cfg.d_inner(), where, "d_state*d_inner"), where,
              "h_saved (B*(T+1)*d_state*d_inner)");
  checked_mul(checked_mul(B, cfg.n_chunks(T), where, "B*n_chunks"),
              checked_mul(cfg.d_inner(), cfg.d_state, where, "d_inner*d_state"), where,
              "the chunk states (B*n_chunks*d_inner*d_state)");
  checked_mul(bt, cfg.input_dim, where, "B*T*input_dim");
}

}  // namespace m3
