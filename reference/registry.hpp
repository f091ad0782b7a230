// The stage registry: the single source of every stage/tensor name (MODEL.md §10), its shape,
// which scan mode produces it, under which config it exists, whether it is stored typed
// (MODEL.md §8) and how long it lives in the GPU's production pass (Life, Recompute); the
// stage table (the chain of stages in order with what each reads); and the flat parameter
// layout (ParamLayout). The reference capture, the harness report, the dump paths, the
// parameterised tests, the GPU backbone's allocation and stage order, both isolated runners
// and the roofline all read these tables.
//
// A capture key is "<stage>/<tensor>" for backbone tensors and "L<ℓ>/<stage>/<tensor>" for
// per-layer tensors; parameter gradients are "grad/<param>" and "grad/L<ℓ>/<param>".
// Entries are listed in execution order: backbone forward, layers forward (F1…F8, states),
// norm_f, then norm_f backward, layers backward (B8…B1, entering-state gradients) from the
// last layer to the first, input_proj backward. Per-row partials that exist only for the
// GPU's reduction order (MODEL.md §10.3 "partials", contrib_angles, contrib_dt) are exempt.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "config.hpp"
#include "precision.hpp"
#include "stage_ids.hpp"

namespace m3 {

// Symbolic dimensions of MODEL.md §0; shapes in the registry are lists of these.
enum class Sym { B, T, BT, Tp1, DM, DI, IP, NH, HD, DS, NG, NA, NC, CS, IN, V };

enum class Modes { Both, Seq, Chunked };
// When the tensor exists: always, only with is_outproj_norm, only when num_rope_angles > 0,
// only in a token model (vocab_size > 0: the LM ends of TRAINING.md §1).
enum class When { Always, OutprojNorm, HasAngles, Lm };

// How long a layer tensor lives in the production pass (the GPU's fused path, no Capture, not
// isolated). A Capture, the isolated mode or set_fusion(false) give every tensor its own buffer
// in every layer instead (the verification layout), so the harness sees every tensor as before.
//   Saved      written by a layer's forward and read by the same layer's backward: one buffer
//              per layer, alive from forward to backward.
//   View       the value of a saved tensor of another layer (a layer's input `residual` is the
//              previous layer's `layer_output`): no storage of its own (layer 0's residual,
//              H⁰ widened to f32, has one).
//   Columns    a block of columns of another tensor of the same layer (column_view: z, x,
//              b_raw, c_raw are proj's typed columns, their gradients d_proj's), read and
//              written in place with that tensor's row stride: no storage of its own, and no
//              copy (F3 and B3 move only the f32 parts). The kernels take the row stride (ldx,
//              ldz, ldr).
//   Workspace  alive within one stage or one layer's pass (or handed on to the next layer's
//              pass, e.g. out_flat to the next norm): one buffer serves every layer.
//   Verify     not written in production (a fused kernel keeps it in registers, or nothing
//              reads it): allocated only for a Capture or the isolated mode.
enum class Life { Saved, View, Columns, Workspace, Verify };
// The lifetime of one layer tensor in each scan mode; `scan`: a saved chunked tensor that
// Recompute::Scan makes workspace instead. Unlisted tensors are workspace in both.
struct LifeRule {
  Life seq = Life::Workspace, chunked = Life::Workspace;
  bool scan = false;
};
const char* life_name(Life l);  // "saved" | "view" | "columns" | "workspace" | "verify"

// The production path's recompute policy. None: every tensor the backward reads is saved by
// the forward. Scan (the chunked mode only): the chunked scan's prep outputs (q, Ks, qk·γ,
// scale, γ) and its per-chunk entering states (with Λ's cumsums) are not saved but recomputed
// at the start of the layer's backward by the same kernels, bit for bit (they become
// workspace): 1.0 GiB less per layer at the official shape, for one prep and one state pass
// more per layer.
enum class Recompute { None, Scan };
const char* recompute_name(Recompute r);       // "none" | "scan"
Recompute parse_recompute(const std::string& s);  // throws m3::Error on anything else

struct TensorSpec {
  Scope scope;
  Dir dir;
  Modes modes;
  When when;
  const char* stage;
  const char* tensor;
  std::vector<Sym> shape;
  bool circular;  // an angle in [0, 2π): compare by circular distance (MODEL.md §12.3)
  // Stored in the run's typed format (bf16/f16) by the mixed-precision policy of MODEL.md §8
  // ("activations at kernel I/O" and "activation grads crossing typed kernels"); every other
  // tensor is f32 in every mode. The reference emulation rounds exactly these.
  bool typed = false;
  // A layer tensor's production lifetime (lifetime() reads it; the reasons are beside the rows
  // in registry.cpp).
  LifeRule life = {};
};

// Every stage tensor, in execution order within each scope (see the file comment).
const std::vector<TensorSpec>& stage_registry();

// ---- the stage table: the chain of stages in execution order, what each reads ----------------
// What a stage writes is the registry rows of its stage (writing_stage says which entry runs
// each); what it reads is listed here, per entry, as the launchers of the stage-by-stage path
// (the isolated mode's; gpu/backbone/backbone_gpu.cu) read them. The GPU backbone runs its
// stages in this order, the roofline counts their bytes from it, and a GPU test runs each
// stage with every other registry tensor poisoned, so a read missing here fails it.
enum class ReadKind {
  Tensor,           // a registry tensor at its storage size
  TensorAtStorage,  // a registry f32 tensor read as its typed staged copy (δ into a GEMM)
  Param,            // an f32 parameter (master)
  GemmWeight,       // a GEMM weight: the typed compute copy (f32 when the storage is f32)
  Grad,             // a parameter gradient, accumulated: read + written, f32
};
struct StageRead {
  ReadKind kind;
  const char* stage;  // registry stage (tensors); "" for parameters
  const char* name;   // registry tensor or parameter name
  bool outproj_norm_only = false;  // a parameter used only with is_outproj_norm
  // A shape proxy: the tensor stands for a buffer of its shape that is no registry tensor of
  // this layer (the entering states, the gradients wrt the leaving states, δ, dOut).
  bool proxy = false;
};
struct StageEntry {
  std::string name;   // as the stage profile names it: "F1", "norm_f", "norm_f (bwd)", …
  std::string stage;  // the registry stage: the name without " (bwd)"
  StageId id;         // the stage of `stage`
  Scope scope;        // Layer: runs once per layer
  Dir dir;
  std::vector<StageRead> reads;
};
// Every stage of one forward + backward of (cfg, mode), in execution order: input_proj, the
// layer's F1 … F8, states, norm_f, norm_f (bwd), the layer's B8 … B1, d_states,
// input_proj (bwd).
std::vector<StageEntry> stage_table(const Config& cfg, ScanMode mode);
// The stage-table entry that writes registry tensor s, "" for the registry tensors that are
// copies of another stage's output (input_proj_inputs, F1/residual, norm_f_input), which count
// as reads where they are read. states/* are written by F6 (angle_state by F5), d_states/* by
// B6 (d_angle_state by B5a), B4c/* by B4b's launcher.
std::string writing_stage(const TensorSpec& s);

// The production lifetime of a tensor (Scope::Layer; backbone tensors exist once per run and
// are all allocated): its row's LifeRule (registry.cpp, with the reason for each).
Life lifetime(const TensorSpec& spec, ScanMode mode, Recompute rc);

// Where a Life::Columns tensor lives: columns [first, first + its width) of every row of the
// layer tensor stage/tensor (whose row is the split's full width, MODEL.md §2.1). Throws for a
// tensor that is not a column view.
struct ColumnView {
  const char* stage;
  const char* tensor;
  Idx first;
};
ColumnView column_view(const TensorSpec& spec, const Config& cfg);

// Bytes per layer of each lifetime for a run (every tensor of the layer that exists in the
// run; typed tensors at 2 bytes when storage is bf16/f16, else 4). `saved` is what each
// further layer costs in production; `workspace` is allocated once for all layers; `verify`
// is what the verification layout adds per layer (with `view` and `workspace`).
struct LayerBytes {
  std::size_t saved = 0, view = 0, columns = 0, workspace = 0, verify = 0;
};
LayerBytes layer_bytes(const Config& cfg, Idx B, Idx T, ScanMode mode, Precision storage,
                       Recompute rc);

// The same count per tensor: every layer tensor that exists in the run, in registry order, with
// its production lifetime and its bytes in one layer (what layer_bytes adds up).
struct LayerTensorBytes {
  const TensorSpec* spec;
  Life life;
  std::size_t bytes;
};
std::vector<LayerTensorBytes> layer_tensor_bytes(const Config& cfg, Idx B, Idx T, ScanMode mode,
                                                 Precision storage, Recompute rc);

struct ParamSpec {
  Scope scope;
  const char* name;
  std::vector<Sym> shape;
};
// Every parameter of MODEL.md §2 in the flat gradient order of §2.
const std::vector<ParamSpec>& param_registry();

Idx sym_value(Sym s, const Config& cfg, Idx B, Idx T);
std::vector<Idx> resolve_shape(const std::vector<Sym>& shape, const Config& cfg, Idx B, Idx T);
// Elements of a resolved shape (1 for a scalar's empty shape).
Idx shape_numel(const std::vector<Idx>& shape);

bool exists_in(const TensorSpec& spec, const Config& cfg, ScanMode mode);
// Input projection parameters exist only when input_proj is not the identity; head_w only in a
// token model (vocab_size > 0).
bool param_exists(const ParamSpec& spec, const Config& cfg);

const TensorSpec& find_spec(const std::string& stage, const std::string& tensor);

std::string stage_key(int layer, const char* stage, const char* tensor);  // layer < 0: backbone
std::string param_key(int layer, const char* name);                       // "grad/…"

// One resolved row of the registry: a concrete key with its shape.
struct KeyedSpec {
  std::string key;
  int layer;  // -1 for backbone
  const TensorSpec* spec;
  std::vector<Idx> shape;
};
// All stage tensors a run of (cfg, B, T, mode) produces, in execution order.
std::vector<KeyedSpec> expected_stage_keys(const Config& cfg, Idx B, Idx T, ScanMode mode);

struct KeyedParam {
  std::string key;  // "grad/…"
  int layer;
  const ParamSpec* spec;
  std::vector<Idx> shape;
};
std::vector<KeyedParam> expected_param_keys(const Config& cfg);

// The flat parameter layout, the one description of where each parameter lives in a flat
// buffer: the parameters of expected_param_keys (MODEL.md §2 order: input_proj_w,
// input_proj_b, { norm_weight … out_proj_w } × n_layers, norm_f_weight, then head_w in a token
// model, TRAINING.md §2), each at an offset
// that is a multiple of kParamAlign floats (256 bytes, so every kernel's vector loads find the
// alignment a buffer of its own would give), the gaps zero. The GPU's f32 masters and
// gradients (and the optimizer's moments) are each one buffer of `total` floats in this
// layout; appending a parameter to param_registry() appends it here.
constexpr Idx kParamAlign = 64;
struct ParamSlot {
  std::string name;  // the key without "grad/": "input_proj_w", "L3/in_proj_w", …
  int layer;         // −1 for backbone parameters
  const ParamSpec* spec;
  std::vector<Idx> shape;
  Idx offset, size;  // in floats
};
struct ParamLayout {
  std::vector<ParamSlot> slots;
  Idx total = 0;  // floats, a multiple of kParamAlign
  // Throws m3::Error naming the parameter when the run has no such parameter.
  const ParamSlot& at(int layer, const std::string& name) const;
};
ParamLayout param_layout(const Config& cfg);

}  // namespace m3
