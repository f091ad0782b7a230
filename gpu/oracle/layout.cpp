// The GPU oracle's buffer plan (layout.hpp) and the parts of its API that need no device:
// oracle_stage_keys, oracle_memory, oracle_segment. Plain C++, in every build.
//
// Segment length: K = ⌈√T⌉ balances the S = ⌈T/K⌉ checkpoints kept per layer against the
// K + 1 states of the segment being recomputed (about 2·√T + 1 states per (b, h) instead of the
// T + 1 a stored scan would keep).
#include "layout.hpp"

#include <algorithm>
#include <cmath>
#include <set>

#include "error.hpp"

namespace m3::gpu::oracle {

Idx segment_length(Idx T) {
  Idx k = static_cast<Idx>(std::sqrt(static_cast<double>(T)));
  while (k * k < T) ++k;  // ⌈√T⌉, exact for every T (no rounding of the square root)
  while (k > 1 && (k - 1) * (k - 1) >= T) --k;
  return std::max<Idx>(k, 1);
}

Idx scan_row_blocks(Idx hd) { return (hd + kScanBlockRows - 1) / kScanBlockRows; }

Idx segment_count(Idx T) {
  const Idx k = segment_length(T);
  return (T + k - 1) / k;
}

bool read_by_backward(const std::string& t) {
  // B1: rms_vals (and the residual, the previous layer's output); B2: post_norm; B4: b/c_raw,
  // b/c_rms; B5a: angles_raw, dt; B5b: dd_dt_raw, dd_a_raw, dt, a_val, trap; B6: x, k, q, α,
  // β, γ, dt, trap, angle_cumsum (the RoPE tail); B7: y, z, gated_rms_vals; B8: gated; the
  // next layer's B1: layer_output.
  static const std::set<std::string> kept = {
      "rms_vals",       "post_norm",  "z",           "x",     "b_raw", "c_raw", "dd_dt_raw",
      "dd_a_raw",       "angles_raw", "dt",          "a_val", "trap",  "b_rms", "c_rms",
      "angle_cumsum",   "k",          "q",           "alpha", "beta",  "gamma", "y",
      "gated_rms_vals", "gated",      "layer_output"};
  return kept.count(t) != 0;
}

bool provided(const TensorSpec& spec, const Config& cfg) {
  return spec.modes == Modes::Both && exists_in(spec, cfg, ScanMode::Sequential);
}

namespace {

// A layer tensor that is no allocation of its own: the residual (a view of the layer input)
// and the state slices.
bool layer_view(const TensorSpec& s) {
  const std::string st = s.stage;
  return (st == "F1" && std::string(s.tensor) == "residual") || st == "states" || st == "d_states";
}

}  // namespace

Layout plan(const Config& cfg, Idx B, Idx T, OracleKeep keep) {
  cfg.validate();
  validate_run(cfg, B, T);
  Layout out;
  const Idx L = cfg.n_layers, BT = B * T, nh = cfg.nheads(), hd = cfg.headdim, ds = cfg.d_state,
            na = cfg.num_rope_angles(), di = cfg.d_inner();
  const Idx E = B * nh * hd * ds, K = segment_length(T), S = segment_count(T);
  auto add = [&](const std::string& name, Idx n, Role role, std::size_t elem = 8) {
    out.allocs.push_back({name, n, elem, role});
    return static_cast<int>(out.allocs.size()) - 1;
  };
  const bool lean = keep == OracleKeep::Backward;

  // Backbone tensors (norm_f's input is a view of the last layer's output).
  for (const TensorSpec& s : stage_registry()) {
    if (s.scope != Scope::Backbone || !provided(s, cfg)) continue;
    if (std::string(s.stage) == "norm_f" && std::string(s.tensor) == "norm_f_input") continue;
    const std::string name = std::string(s.stage) + "/" + s.tensor;
    out.other[name] = add(name, shape_numel(resolve_shape(s.shape, cfg, B, T)), Role::Backbone);
  }
  out.other["d_out"] = add("d_out", BT * cfg.d_model, Role::Backbone);
  if (cfg.vocab_size > 0) {
    out.other["tok"] = add("tok", BT, Role::Backbone, 4);
    out.other["tgt"] = add("tgt", BT, Role::Backbone, 4);
    out.other["w"] = add("w", BT, Role::Backbone, 4);
    out.other["embed_order"] = add("embed_order", BT, Role::Backbone);
    out.other["embed_starts"] = add("embed_starts", cfg.vocab_size + 1, Role::Backbone);
  }

  // Layer tensors: own per layer, or (lean) one shared allocation for those no backward reads.
  out.layer.resize(static_cast<size_t>(L));
  std::map<std::string, int> shared;
  for (Idx l = 0; l < L; ++l) {
    auto& m = out.layer[static_cast<size_t>(l)];
    for (const TensorSpec& s : stage_registry()) {
      if (s.scope != Scope::Layer || !provided(s, cfg) || layer_view(s)) continue;
      const std::string t = s.tensor;
      const Idx n = shape_numel(resolve_shape(s.shape, cfg, B, T));
      const bool own = !lean || (s.dir == Dir::Forward && read_by_backward(t));
      if (own) {
        m[t] = add("L" + std::to_string(l) + "/" + s.stage + "/" + t, n, Role::Layer);
      } else if (lean && t == "d_temporal") {
        // Layer l's B1 reads layer l + 1's d_temporal (δ) while writing its own: two buffers.
        const std::string key = "shared:d_temporal#" + std::to_string(l % 2);
        if (!shared.count(key)) shared[key] = add(key, n, Role::Workspace);
        m[t] = shared[key];
      } else {
        const std::string key = "shared:" + t;
        if (!shared.count(key)) shared[key] = add(key, n, Role::Workspace);
        m[t] = shared[key];
      }
    }
    m["h_ckpt"] = add("L" + std::to_string(l) + "/h_ckpt", S * E, Role::Layer);
  }

  // The scan's and the stages' workspace.
  out.other["scan_h"] = add("scan_h", (K + 1) * E, Role::Workspace);
  out.other["scan_g"] = add("scan_g", E, Role::Workspace);
  const Idx NB = scan_row_blocks(hd);
  out.other["scan_colpart"] = add("scan_colpart", B * nh * NB * K * ds * 3, Role::Workspace);
  out.other["scan_scalpart"] = add("scan_scalpart", B * nh * NB * K * 3, Role::Workspace);
  out.other["scan_dd"] = add("scan_dd", B * di, Role::Workspace);
  out.other["d_k"] = add("d_k", BT * nh * ds, Role::Workspace);
  out.other["d_q"] = add("d_q", BT * nh * ds, Role::Workspace);
  out.other["theta_bar"] = add("theta_bar", BT * nh * na, Role::Workspace);
  out.other["row_scratch"] = add("row_scratch", BT * std::max(nh, cfg.ngroups), Role::Workspace);

  // Arenas and states.
  const ParamLayout pl = param_layout(cfg);
  out.other["params"] = add("params", pl.total, Role::Params);
  out.other["grads"] = add("grads", pl.total, Role::Params);
  const StateSizes z = state_sizes(cfg);
  for (const char* which : {"entering", "leaving", "d_leaving", "d_entering"}) {
    const std::string w = which;
    out.other[w + "/ssm"] = add(w + "/ssm", L * B * z.ssm, Role::States);
    out.other[w + "/k"] = add(w + "/k", L * B * z.k, Role::States);
    out.other[w + "/v"] = add(w + "/v", L * B * z.v, Role::States);
    out.other[w + "/angle"] = add(w + "/angle", L * B * z.angle, Role::States);
  }
  return out;
}

OracleMemory Layout::memory() const {
  OracleMemory m;
  for (const Alloc& a : allocs) {
    switch (a.role) {
      case Role::Layer:
        m.layers += a.bytes();
        break;
      case Role::Workspace:
        m.workspace += a.bytes();
        break;
      case Role::Backbone:
        m.backbone += a.bytes();
        break;
      case Role::Params:
        m.params += a.bytes();
        break;
      case Role::States:
        m.states += a.bytes();
        break;
    }
  }
  return m;
}

}  // namespace m3::gpu::oracle

namespace m3::gpu {

std::vector<KeyedSpec> oracle_stage_keys(const Config& cfg, Idx B, Idx T) {
  std::vector<KeyedSpec> out;
  for (KeyedSpec& k : expected_stage_keys(cfg, B, T, ScanMode::Sequential))
    if (oracle::provided(*k.spec, cfg)) out.push_back(std::move(k));
  return out;
}

OracleMemory oracle_memory(const Config& cfg, Idx B, Idx T, OracleKeep keep) {
  return oracle::plan(cfg, B, T, keep).memory();
}

Idx oracle_segment(Idx T) {
  M3_REQUIRE(T >= 1, "oracle_segment", "T must be at least 1", "T=", T);
  return oracle::segment_length(T);
}

}  // namespace m3::gpu
