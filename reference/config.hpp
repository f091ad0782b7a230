// Mamba-3 SISO configuration (MODEL.md §1.1), its derived dimensions (§1.2) and validation
// (§1.3 as amended by §12.7: the reference accepts any dimensions that the math defines).
//
//   d_inner          = expand · d_model
//   nheads           = d_inner / headdim
//   num_rope_angles  = floor( floor(d_state · rope_fraction) / 2 )
//   in_proj_dim      = 2·d_inner + 2·ngroups·d_state + 3·nheads + num_rope_angles
//   n_chunks(T)      = ceil(T / chunk_size)
//
// The backbone input is X [B*T, input_dim]; with input_proj_identity the input projection is
// the identity and input_dim must equal d_model (MODEL.md §2, backbone table). With
// vocab_size = V > 0 the input is tokens (TRAINING.md §1): input_dim = V, and head_w
// [d_model, V] is one more parameter.
#pragma once

#include <cstdint>
#include <string>

namespace m3 {

using Idx = std::int64_t;

enum class ScanMode { Sequential, Chunked };

const char* scan_mode_name(ScanMode m);                 // "seq" | "chunked"
ScanMode parse_scan_mode(const std::string& s);         // throws m3::Error on anything else

struct Config {
  Idx d_model = 128;
  Idx d_state = 16;
  Idx expand = 2;
  Idx headdim = 16;
  Idx ngroups = 1;
  Idx n_layers = 4;
  double rope_fraction = 0.5;
  double a_floor = 1e-4;
  bool is_outproj_norm = false;
  Idx input_dim = 128;              // width of the backbone input X
  bool input_proj_identity = false;  // true: H⁰ = X (requires input_dim == d_model)
  Idx chunk_size = 64;              // chunked scan only; any value ≥ 1 (MODEL.md §12.5)
  // The language-model ends (TRAINING.md §1): 0 = none (the backbone of MODEL.md alone);
  // V ≥ 1 = the input is tokens in 0 … V−1 (the embedding is input_proj on a one-hot, so
  // input_dim = V and input_proj is not the identity) and a head head_w [d_model, V] follows.
  Idx vocab_size = 0;

  Idx d_inner() const { return expand * d_model; }
  Idx nheads() const { return d_inner() / headdim; }
  Idx num_rope_angles() const;
  Idx in_proj_dim() const {
    return 2 * d_inner() + 2 * ngroups * d_state + 3 * nheads() + num_rope_angles();
  }
  Idx heads_per_group() const { return nheads() / ngroups; }
  Idx n_chunks(Idx T) const { return (T + chunk_size - 1) / chunk_size; }

  // Throws m3::Error naming the field and the rule it breaks.
  void validate() const;

  // One line, every field: "d_model=128 d_state=16 ...".
  std::string describe() const;
};

// Checks the run shape (B, T ≥ 1) together with the config.
void validate_run(const Config& cfg, Idx B, Idx T);

}  // namespace m3
