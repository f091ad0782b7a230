// The stage registry: the single source of every stage/tensor name (MODEL.md §10), its shape,
// which scan mode produces it and under which config it exists. The reference capture, the
// harness report, the dump paths and the parameterised tests all read this one table.
//
// A capture key is "<stage>/<tensor>" for backbone tensors and "L<ℓ>/<stage>/<tensor>" for
// per-layer tensors; parameter gradients are "grad/<param>" and "grad/L<ℓ>/<param>".
// Entries are listed in execution order: backbone forward, layers forward (F1…F8, states),
// norm_f, then norm_f backward, layers backward (B8…B1, entering-state gradients) from the
// last layer to the first, input_proj backward. Per-row partials that exist only for the
// GPU's reduction order (MODEL.md §10.3 "partials", contrib_angles, contrib_dt) are exempt.
#pragma once

#include <string>
#include <vector>

#include "config.hpp"

namespace m3 {

// Symbolic dimensions of MODEL.md §0; shapes in the registry are lists of these.
enum class Sym { B, T, BT, Tp1, DM, DI, IP, NH, HD, DS, NG, NA, NC, CS, IN };

enum class Dir { Forward, Backward };
enum class Scope { Backbone, Layer };
enum class Modes { Both, Seq, Chunked };
// When the tensor exists: always, only with is_outproj_norm, only when num_rope_angles > 0.
enum class When { Always, OutprojNorm, HasAngles };

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
};

// Every stage tensor, in execution order within each scope (see the file comment).
const std::vector<TensorSpec>& stage_registry();

struct ParamSpec {
  Scope scope;
  const char* name;
  std::vector<Sym> shape;
};
// Every parameter of MODEL.md §2 in the flat gradient order of §2.
const std::vector<ParamSpec>& param_registry();

Idx sym_value(Sym s, const Config& cfg, Idx B, Idx T);
std::vector<Idx> resolve_shape(const std::vector<Sym>& shape, const Config& cfg, Idx B, Idx T);

bool exists_in(const TensorSpec& spec, const Config& cfg, ScanMode mode);
// Input projection parameters exist only when input_proj is not the identity.
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

}  // namespace m3
