#include "chain.hpp"

#include <cstring>

namespace m3 {

ChainPlan ChainPlan::of(const Config& cfg, ScanMode mode) {
  ChainPlan plan;
  plan.n_layers = static_cast<int>(cfg.n_layers);
  plan.lm = cfg.vocab_size > 0;
  for (const StageEntry& e : stage_table(cfg, mode)) {
    if (e.scope != Scope::Layer) continue;
    (e.dir == Dir::Forward ? plan.layer_fwd : plan.layer_bwd).push_back(e.id);
  }
  // A layer stage's tensors are the registry rows of its name (F1/residual, the layer input,
  // among them) and the pseudo-stage rows whose writer it is.
  plan.rows.resize(static_cast<size_t>(kStageCount));
  plan.writes.resize(static_cast<size_t>(kStageCount));
  for (const TensorSpec& spec : stage_registry()) {
    if (spec.scope != Scope::Layer || !exists_in(spec, cfg, mode)) continue;
    const StageId own = stage_id(spec.stage);
    const StageId by = is_pseudo(own) ? stage_id(writing_stage(spec)) : own;
    plan.rows[static_cast<size_t>(own)].push_back(&spec);
    plan.writes[static_cast<size_t>(by)].push_back(&spec);
  }
  return plan;
}

}  // namespace m3
