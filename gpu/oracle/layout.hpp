// Internal to gpu/oracle: where every buffer of the GPU oracle lives, planned before anything is
// allocated (plain C++, built in every build, so oracle_memory() answers without a device).
//
// One Alloc per device allocation, each with its role (OracleMemory's). Names:
//   layer tensors     the registry's tensor name ("x", "d_x", …) in Layout::layer[l]; with
//                     OracleKeep::Backward a tensor the layer's backward does not read maps to
//                     one allocation shared by every layer ("shared:<name>"); F1's residual is
//                     no allocation (layer 0 reads H⁰, layer l the output of layer l − 1), nor
//                     are states/* and d_states/* (slices of the state buffers below)
//   "h_ckpt"          a layer's scan checkpoints [S, B, nh, hd, ds]: h at each segment's start
//   backbone tensors  "<stage>/<tensor>" (norm_f's input is the last layer's output, no
//                     allocation); "d_out" [B·T, dm]; a token model's "tok", "tgt", "w",
//                     "embed_order" [B·T], "embed_starts" [V + 1]
//   workspace         "scan_h" [(K+1), B, nh, hd, ds] (a segment's states h_{t−1…}), "scan_g"
//                     [B, nh, hd, ds] (the adjoint G_t), "scan_colpart" [B, nh, NB, K, ds, 3],
//                     "scan_scalpart" [B, nh, NB, K, 3], "scan_dd" [B, di] (scan.cu says what
//                     they hold; NB = scan_row_blocks(hd)),
//                     "d_k", "d_q" [B·T, nh, ds], "theta_bar" [B·T, nh, na], "row_scratch"
//                     [B·T·max(nh, ng)] (a per-row value of a norm's backward), and with
//                     OracleKeep::Backward two d_temporal buffers that layers alternate between
//   "params", "grads" the arenas of param_layout(cfg)
//   states            "<which>/<state>" for which ∈ {entering, leaving, d_leaving, d_entering}
//                     and state ∈ {ssm, k, v, angle}, each [L][B][…] (MODEL.md §9)
#pragma once

#include <cstddef>
#include <map>
#include <string>
#include <vector>

#include "config.hpp"
#include "oracle_gpu.hpp"

namespace m3::gpu::oracle {

enum class Role { Layer, Workspace, Backbone, Params, States };

struct Alloc {
  std::string name;
  Idx n = 0;             // elements
  std::size_t elem = 8;  // bytes per element (8: double; 4: int32 tokens, float weights)
  Role role = Role::Layer;
  std::size_t bytes() const { return static_cast<std::size_t>(n) * elem; }
};

struct Layout {
  std::vector<Alloc> allocs;
  // Per layer: tensor name → index into allocs (shared ones appear in every layer).
  std::vector<std::map<std::string, int>> layer;
  std::map<std::string, int> other;  // backbone, workspace, arenas and states by name
  OracleMemory memory() const;
};

// The segment length K of the scan and the number of segments S = ⌈T/K⌉.
Idx segment_length(Idx T);
Idx segment_count(Idx T);
// The scan's backward walks a segment in blocks of kScanBlockRows rows (one warp each) of one
// (b, h): scan_row_blocks(hd) = ⌈hd / kScanBlockRows⌉ blocks per (b, h) (scan.cu).
constexpr Idx kScanBlockRows = 8;
Idx scan_row_blocks(Idx hd);

// Whether a layer's backward reads this forward tensor (kept per layer with
// OracleKeep::Backward).
bool read_by_backward(const std::string& tensor);

// The registry rows the oracle provides (scope Layer or Backbone, Modes::Both, existing in cfg).
bool provided(const TensorSpec& spec, const Config& cfg);

Layout plan(const Config& cfg, Idx B, Idx T, OracleKeep keep);

}  // namespace m3::gpu::oracle
