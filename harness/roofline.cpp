// The per-stage work model and the roofline rows (see roofline.hpp).
#include "roofline.hpp"

#include <algorithm>

#include "error.hpp"
#include "registry.hpp"

namespace m3::harness {

namespace {

const ParamSpec& find_param(const char* name) {
  for (const auto& ps : param_registry())
    if (std::string(ps.name) == name) return ps;
  throw Error("harness::stage_work", std::string("unknown parameter '") + name + "'",
              "every parameter the model reads must be listed in reference/registry.cpp");
}

double numel(const std::vector<Idx>& shape) {
  double n = 1;
  for (Idx v : shape) n *= static_cast<double>(v);
  return n;
}

// Bytes read (and, for a gradient, written) by one read of a stage, summed over its layers.
void add_io(const StageRead& io, const Config& cfg, Idx B, Idx T, ScanMode mode, Precision storage,
            StageWork& out) {
  const double L = static_cast<double>(cfg.n_layers);
  if (io.kind == ReadKind::Tensor || io.kind == ReadKind::TensorAtStorage) {
    const TensorSpec& spec = find_spec(io.stage, io.name);
    if (!exists_in(spec, cfg, mode)) return;
    const bool as_typed = spec.typed || io.kind == ReadKind::TensorAtStorage;
    const double layers = spec.scope == Scope::Layer ? L : 1.0;
    out.read_bytes +=
        layers * numel(resolve_shape(spec.shape, cfg, B, T)) * element_bytes(as_typed, storage);
    return;
  }
  if (io.outproj_norm_only && !cfg.is_outproj_norm) return;
  const ParamSpec& ps = find_param(io.name);
  if (!param_exists(ps, cfg)) return;
  const double layers = ps.scope == Scope::Layer ? L : 1.0;
  const double n = layers * numel(resolve_shape(ps.shape, cfg, B, T));
  switch (io.kind) {
    case ReadKind::Param: out.read_bytes += n * 4; break;
    case ReadKind::GemmWeight: out.read_bytes += n * element_bytes(true, storage); break;
    case ReadKind::Grad:
      out.read_bytes += n * 4;
      out.write_bytes += n * 4;
      break;
    default: break;
  }
}

// FLOPs of one stage (see roofline.hpp), summed over the layers.
void add_flops(const Config& cfg, Idx B, Idx T, ScanMode mode, Precision storage,
               StageWork& s) {
  const double L = static_cast<double>(cfg.n_layers);
  const double BT = static_cast<double>(B * T);
  const double dm = static_cast<double>(cfg.d_model), ip = static_cast<double>(cfg.in_proj_dim());
  const double di = static_cast<double>(cfg.d_inner()), in = static_cast<double>(cfg.input_dim);
  const double nh = static_cast<double>(cfg.nheads()), hd = static_cast<double>(cfg.headdim);
  const double ds = static_cast<double>(cfg.d_state), cs = static_cast<double>(cfg.chunk_size);
  // Σ over the chunks of one sample of L_c and of L_c² (the last chunk may be short).
  const double full = static_cast<double>(T / cfg.chunk_size);
  const double rest = static_cast<double>(T % cfg.chunk_size);
  const double sum_l = static_cast<double>(T), sum_l2 = full * cs * cs + rest * rest;
  const double per_bh = static_cast<double>(B) * nh;
  const bool seq = mode == ScanMode::Sequential;
  const std::string& n = s.stage;
  auto matrix = [&](double f) {
    s.flops = f;
    s.unit = f > 0 ? FlopUnit::Matrix : FlopUnit::None;
  };
  auto fma32 = [&](double f) {
    s.flops = f;
    s.unit = FlopUnit::Fma32;
  };
  if (n == "input_proj") {
    matrix(cfg.input_proj_identity ? 0.0 : 2 * BT * in * dm);
  } else if (n == "input_proj (bwd)") {
    matrix(cfg.input_proj_identity ? 0.0 : 4 * BT * in * dm);
  } else if (n == "F2") {
    matrix(L * 2 * BT * dm * ip);
  } else if (n == "F8") {
    matrix(L * 2 * BT * di * dm);
  } else if (n == "B8") {
    matrix(L * 4 * BT * di * dm);
  } else if (n == "B2") {
    matrix(L * 4 * BT * dm * ip);
  } else if (n == "F6" || n == "B6") {
    const bool fwd = n == "F6";
    const double f =
        seq ? L * per_bh * static_cast<double>(T) * (fwd ? 7 : 15) * hd * ds
        : fwd ? L * per_bh * 2 * (sum_l2 * (ds + hd) + 2 * sum_l * hd * ds)
              : L * per_bh * 2 * (sum_l2 * (3 * ds + 2 * hd) + 4 * sum_l * hd * ds);
    // The chunked scan of typed runs forms its products on the tensor cores
    // (gpu/scan/chunked_*.cu, gpu/tc/tc_mma.cuh); the sequential scan and f32 runs use f32 FMA.
    if (!seq && storage != Precision::F32) {
      matrix(f);
    } else {
      fma32(f);
    }
  }
}

}  // namespace

const char* flop_unit_name(FlopUnit u) {
  switch (u) {
    case FlopUnit::None: return "-";
    case FlopUnit::Matrix: return "gemm";
    case FlopUnit::Fma32: return "fma32";
  }
  return "?";
}

double element_bytes(bool typed, Precision storage) {
  switch (storage) {
    case Precision::F32: return 4;
    case Precision::BF16:
    case Precision::F16: return typed ? 2 : 4;
    case Precision::F64: break;
  }
  throw Error("harness::element_bytes", "f64 is not a GPU storage precision",
              "the work model counts f32, bf16 or f16 storage");
}

std::vector<StageWork> stage_work(const Config& cfg, Idx B, Idx T, ScanMode mode,
                                  Precision storage) {
  validate_run(cfg, B, T);
  element_bytes(false, storage);  // rejects F64 up front
  const std::vector<StageEntry> defs = stage_table(cfg, mode);
  std::vector<StageWork> out;
  out.reserve(defs.size());
  for (const auto& d : defs) {
    StageWork s;
    s.stage = d.name;
    for (const StageRead& io : d.reads) add_io(io, cfg, B, T, mode, storage, s);
    add_flops(cfg, B, T, mode, storage, s);
    out.push_back(s);
  }
  // Writes: every registry tensor of the run, at the stage that writes it.
  const double L = static_cast<double>(cfg.n_layers);
  for (const auto& spec : stage_registry()) {
    if (!exists_in(spec, cfg, mode)) continue;
    const std::string stage = writing_stage(spec);
    if (stage.empty()) continue;
    auto it = std::find_if(out.begin(), out.end(),
                           [&](const StageWork& s) { return s.stage == stage; });
    M3_REQUIRE(it != out.end(), "harness::stage_work",
               "registry tensor " + std::string(spec.stage) + "/" + spec.tensor +
                   " has no profiled stage",
               "the stage table (reference/registry.cpp) lacks stage '", stage, "'");
    const double layers = spec.scope == Scope::Layer ? L : 1.0;
    it->write_bytes += layers * numel(resolve_shape(spec.shape, cfg, B, T)) *
                       element_bytes(spec.typed, storage);
  }
  return out;
}

double Roof::flops_per_s(FlopUnit u) const {
  switch (u) {
    case FlopUnit::None: return 0;
    case FlopUnit::Matrix: return matrix_flops_per_s;
    case FlopUnit::Fma32: return fma32_flops_per_s;
  }
  return 0;
}

const char* RooflineRow::bound() const {
  if (!modeled || (bytes_floor_ms <= 0 && flops_floor_ms <= 0)) return "-";
  return bytes_floor_ms >= flops_floor_ms ? "memory" : "compute";
}

std::vector<RooflineRow> roofline_rows(const std::vector<std::pair<std::string, double>>& times,
                                       const std::vector<StageWork>& work, const Roof& roof) {
  double total = 0;
  for (const auto& [name, ms] : times) total += ms;
  std::vector<RooflineRow> rows;
  for (const auto& [name, ms] : times) {
    RooflineRow r;
    r.stage = name;
    r.ms = ms;
    r.share = total > 0 ? ms / total : 0;
    auto it = std::find_if(work.begin(), work.end(),
                           [&](const StageWork& s) { return s.stage == name; });
    if (it != work.end()) {
      r.modeled = true;
      r.bytes = it->bytes();
      r.flops = it->flops;
      r.unit = it->unit;
      const double sec = ms * 1e-3;
      r.bytes_per_s = sec > 0 ? r.bytes / sec : 0;
      r.flops_per_s = sec > 0 ? r.flops / sec : 0;
      const double peak = roof.flops_per_s(r.unit);
      r.bw_fraction = roof.bytes_per_s > 0 ? r.bytes_per_s / roof.bytes_per_s : 0;
      r.flop_fraction = peak > 0 ? r.flops_per_s / peak : 0;
      r.bytes_floor_ms = roof.bytes_per_s > 0 ? 1e3 * r.bytes / roof.bytes_per_s : 0;
      r.flops_floor_ms = peak > 0 ? 1e3 * r.flops / peak : 0;
      r.floor_ms = std::max(r.bytes_floor_ms, r.flops_floor_ms);
    }
    rows.push_back(r);
  }
  return rows;
}

RooflineRow roofline_total(const std::vector<RooflineRow>& rows) {
  RooflineRow t;
  t.stage = "total";
  t.modeled = true;
  for (const auto& r : rows) {
    t.ms += r.ms;
    t.share += r.share;
    t.bytes += r.bytes;
    t.flops += r.flops;
    t.bytes_floor_ms += r.bytes_floor_ms;
    t.flops_floor_ms += r.flops_floor_ms;
    t.floor_ms += r.floor_ms;
  }
  const double sec = t.ms * 1e-3;
  t.bytes_per_s = sec > 0 ? t.bytes / sec : 0;
  t.flops_per_s = sec > 0 ? t.flops / sec : 0;
  t.bw_fraction = t.ms > 0 ? t.bytes_floor_ms / t.ms : 0;
  t.flop_fraction = t.ms > 0 ? t.flops_floor_ms / t.ms : 0;
  return t;
}

}  // namespace m3::harness
