// The built-in golden cases (see golden.hpp): name → Config, run shape, seed, entering states,
// stored scan modes. Every property HARNESS.md §6 names is covered by at least one case:
//
//   default            Config{} widths (d_model 128, d_state 16, headdim 16, 16 heads), 1 layer
//   official_small     the official kernels' head shape: 4 heads of headdim 64, d_state 128
//   ngroups2           ngroups > 1 (2 groups of 2 heads)
//   rope_full          rope_fraction 1.0 (na = d_state/2)
//   no_rope            na = 0 (d_state 2, rope 0.5) and input_proj_identity
//   outproj_norm       is_outproj_norm (gated RMSNorm before out_proj)
//   entering_states    non-zero entering states, B = 2
//   ragged_chunks      T = 11 with chunk_size 4: three chunks, the last one short
//   deep_linear_input  3 layers, input_proj not the identity, input_dim 5 ≠ d_model
//   lm_step            a token model (TRAINING.md §1): one training step, tokens in, loss and
//                      every gradient out (embed, 2 layers, head, loss; ragged chunks)
//
// Size (SCHEMA.md "Size"): values are f64 and every parameter is stored twice per mode
// (weight + gradient), so a d_model-128 layer costs ~0.9 MB of weights plus 0.9 MB of
// gradients per mode whatever B and T are. Hence the two full-width cases have ONE layer and
// store the chunked mode only (Config{} as is, 4 layers and both modes, would be 15 MB), and
// official_small uses d_model 32 with expand 8 (d_inner 256 = 4 heads of 64): its per-head
// state tensors [NH, HD, DS] = 32768 values each are what the case is about, in_proj_w at
// d_model 128 would add 1.7 MB. The small cases are mostly HDF5 per-dataset overhead.
// lm_step (2 layers, both modes, ~370 oracle tensors) is kept at d_model 16 and B·T = 22 for
// the same reason: its ~220k values are 1.8 MiB.
// `m3h golden list` prints each file's size.
#include "golden.hpp"

#include "error.hpp"

namespace m3::golden {

namespace {

// The small shape most cases start from: d_model 8, expand 2 → d_inner 16, headdim 4 →
// 4 heads, d_state 8 → 2 rope angles, 1 layer, chunk 4, T 8 (two chunks).
CaseDef small(const std::string& name, const std::string& about) {
  CaseDef d;
  d.name = name;
  d.about = about;
  d.cfg.d_model = 8;
  d.cfg.expand = 2;
  d.cfg.headdim = 4;
  d.cfg.d_state = 8;
  d.cfg.ngroups = 1;
  d.cfg.n_layers = 1;
  d.cfg.rope_fraction = 0.5;
  d.cfg.is_outproj_norm = false;
  d.cfg.input_dim = 8;
  d.cfg.input_proj_identity = false;
  d.cfg.chunk_size = 4;
  d.B = 1;
  d.T = 8;
  d.random_states = false;
  return d;
}

std::vector<CaseDef> build_cases() {
  std::vector<CaseDef> v;
  {
    CaseDef d;
    d.name = "default";
    d.about = "Config{} widths (d_model 128, d_state 16, headdim 16, expand 2: 16 heads) with "
              "1 layer, B=1, T=4, random entering states, chunked only";
    d.cfg = Config{};
    d.cfg.n_layers = 1;
    d.B = 1;
    d.T = 4;
    d.seed = 1234;
    d.random_states = true;
    d.modes = {ScanMode::Chunked};
    v.push_back(d);
  }
  {
    CaseDef d;
    d.name = "official_small";
    d.about = "the official kernels' head shape: 4 heads of headdim 64, d_state 128 (d_model 32, "
              "expand 8, input_proj identity), 1 layer, T=2, chunked only";
    d.cfg = Config{};
    d.cfg.d_model = 32;
    d.cfg.expand = 8;
    d.cfg.headdim = 64;
    d.cfg.d_state = 128;
    d.cfg.n_layers = 1;
    d.cfg.input_dim = 32;
    d.cfg.input_proj_identity = true;
    d.B = 1;
    d.T = 2;
    d.seed = 2;
    d.modes = {ScanMode::Chunked};
    v.push_back(d);
  }
  {
    CaseDef d = small("ngroups2", "ngroups 2 (2 heads per group)");
    d.cfg.ngroups = 2;
    d.seed = 3;
    v.push_back(d);
  }
  {
    CaseDef d = small("rope_full", "rope_fraction 1.0 (4 angles for d_state 8)");
    d.cfg.rope_fraction = 1.0;
    d.seed = 4;
    v.push_back(d);
  }
  {
    CaseDef d = small("no_rope", "na = 0 (d_state 2, rope 0.5) and input_proj_identity");
    d.cfg.d_state = 2;
    d.cfg.input_proj_identity = true;
    d.seed = 5;
    v.push_back(d);
  }
  {
    CaseDef d = small("outproj_norm", "is_outproj_norm (gated RMSNorm before out_proj)");
    d.cfg.is_outproj_norm = true;
    d.seed = 6;
    v.push_back(d);
  }
  {
    CaseDef d = small("entering_states", "random non-zero entering states, B=2");
    d.B = 2;
    d.random_states = true;
    d.seed = 7;
    v.push_back(d);
  }
  {
    CaseDef d = small("ragged_chunks", "T=11, chunk_size 4: chunks of 4, 4, 3");
    d.T = 11;
    d.seed = 8;
    v.push_back(d);
  }
  {
    CaseDef d = small("deep_linear_input", "3 layers, input_proj linear, input_dim 5");
    d.cfg.n_layers = 3;
    d.cfg.input_dim = 5;
    d.T = 6;
    d.seed = 9;
    v.push_back(d);
  }
  {
    // d_model 16, expand 2 → d_inner 32 = 4 heads of 8, d_state 16 → 4 rope angles, vocab 24
    // (input_dim 24: the embedding is input_proj on a one-hot; V ≠ DM ≠ DI, so a transposed
    // head_w or embedding cannot pass), B=2, T=11 in chunks of 4, 4, 3; positions 6, 13, 20
    // unscored (make_problem: every 7th weight is 0). 1.8 MiB: the stage tensors of both
    // modes and layers (~90% of the values) grow with B·T and the widths; d_model 32,
    // headdim 16, vocab 32 and T 40 would be 7.6 MB.
    CaseDef d;
    d.name = "lm_step";
    d.about = "token model, one training step (embed, 2 layers, head, loss): vocab 24, "
              "d_model 16, d_state 16, 4 heads of 8, B=2, T=11 in chunks of 4, 4, 3, random "
              "entering states";
    d.cfg = Config{};
    d.cfg.d_model = 16;
    d.cfg.d_state = 16;
    d.cfg.expand = 2;
    d.cfg.headdim = 8;
    d.cfg.n_layers = 2;
    d.cfg.vocab_size = 24;
    d.cfg.input_dim = 24;
    d.cfg.input_proj_identity = false;
    d.cfg.chunk_size = 4;
    d.B = 2;
    d.T = 11;
    d.seed = 10;
    d.random_states = true;
    v.push_back(d);
  }
  for (const CaseDef& d : v) validate_run(d.cfg, d.B, d.T);
  return v;
}

}  // namespace

const std::vector<CaseDef>& builtin_cases() {
  static const std::vector<CaseDef> table = build_cases();
  return table;
}

const CaseDef& find_case(const std::string& name) {
  std::string known;
  for (const CaseDef& d : builtin_cases()) {
    if (d.name == name) return d;
    known += (known.empty() ? "" : ", ") + d.name;
  }
  throw Error("golden", "unknown case '" + name + "'", "known cases: " + known);
}

GoldenCase make_case(const CaseDef& def) {
  return compute_case(def.name, make_problem(def.cfg, def.B, def.T, def.seed, def.random_states),
                      def.modes);
}

}  // namespace m3::golden
