// m3h dump (see dump.hpp for the file layout): the judged cells' key groups, made from the
// host values of each row (the captures run_comparison judged, or the device comparison's host
// copies) and written by one writer, so that both oracles give the same file.
#include "dump.hpp"

#include <functional>
#include <map>

#include "error.hpp"
#include "golden.hpp"
#include "h5store.hpp"
#include "metrics.hpp"
#include "position.hpp"

namespace m3::harness {

namespace {

const char* sym_name(Sym s) {
  switch (s) {
    case Sym::B: return "B";
    case Sym::T: return "T";
    case Sym::BT: return "BT";
    case Sym::Tp1: return "T+1";
    case Sym::DM: return "DM";
    case Sym::DI: return "DI";
    case Sym::IP: return "IP";
    case Sym::NH: return "NH";
    case Sym::HD: return "HD";
    case Sym::DS: return "DS";
    case Sym::NG: return "NG";
    case Sym::NA: return "NA";
    case Sym::NC: return "NC";
    case Sym::CS: return "CS";
    case Sym::IN: return "IN";
    case Sym::V: return "V";
  }
  return "?";
}

template <class T, class F>
std::string join(const std::vector<T>& v, F&& f) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ",") + std::string(f(x));
  return s;
}

void write_meta(h5::Writer& w, const RunSpec& spec, const Problem& pb, const std::string& oracle,
                const std::vector<Precision>& precisions) {
  const Config& c = pb.cfg;
  const std::string m = "/meta";
  w.group(m);
  w.attr(m, "kind", "dump");
  w.attr(m, "dump_schema_version", kDumpSchemaVersion);
  w.attr(m, "generator", golden::kGenerator);
  w.attr(m, "generator_version", golden::kGeneratorVersion);
  w.attr(m, "git_revision", golden::git_revision());
  golden::write_run_attrs(w, m, c, pb.B, pb.T, pb.seed);
  w.attr(m, "scan_modes", join(spec.modes, scan_mode_name));
  w.attr(m, "precision", precision_name(Precision::F64));
  w.attr(m, "source", spec.source);
  w.attr(m, "stage_pattern", spec.filter);
  w.attr(m, "oracle", oracle);
  w.attr(m, "precisions", join(precisions, precision_name));
  w.attr(m, "entering_states", spec.random_states ? "random" : "zero");
}

Tensor difference(const Tensor& subject, const Tensor& oracle, bool circular) {
  Tensor d;
  d.shape = oracle.shape;
  d.data.resize(oracle.data.size());
  for (size_t i = 0; i < d.data.size(); ++i)
    d.data[i] = circular ? circular_diff(subject.data[i], oracle.data[i])
                         : subject.data[i] - oracle.data[i];
  return d;
}

// "/dump/<mode>/<precision>/<key>".
std::string group_of(ScanMode mode, Precision p, const std::string& key) {
  return std::string("/dump/") + scan_mode_name(mode) + "/" + precision_name(p) + "/" + key;
}

bool positional(const TensorResult& r) {
  return !r.is_param && r.syms && has_position_axis(*r.syms);
}

// The dump's spec: end to end (a dump holds end-to-end arrays), and the error against position
// of every [B·T, …] row it writes (TensorResult::by_position, computed where the judge measures).
RunSpec dump_spec(const RunSpec& in) {
  RunSpec spec = in;
  spec.compare_modes = {CompareMode::EndToEnd};
  spec.by_position = spec.filter;
  return spec;
}

// Before any run: spec.filter names at least one key that `provided` accepts, and with
// profiles_only a [B·T, …] one; `of` says which keys ("of this run", …).
void check_pattern(const RunSpec& spec, const DumpOptions& dopt,
                   const std::function<bool(const std::string&)>& provided, const std::string& of) {
  M3_REQUIRE(!spec.filter.empty(), "dump", "no --stage pattern", "say which keys to dump ('*' for all)");
  M3_REQUIRE(!spec.modes.empty(), "dump", "nothing to dump", "no scan mode");
  bool any = false, any_profile = false;
  for (ScanMode mode : spec.modes) {
    for (const auto& k : expected_keys(spec.cfg, spec.B, spec.T, mode))
      any = any || (key_matches(k, spec.filter) && provided(k));
    for (const KeyedSpec& ks : expected_stage_keys(spec.cfg, spec.B, spec.T, mode))
      any_profile = any_profile || (has_position_axis(ks.spec->shape) &&
                                    key_matches(ks.key, spec.filter) && provided(ks.key));
  }
  M3_REQUIRE(any, "dump", "--stage '" + spec.filter + "' matches no tensor " + of, "");
  M3_REQUIRE(!dopt.profiles_only || any_profile, "dump",
             "--profiles-only: --stage '" + spec.filter + "' matches no [B*T, ...] tensor " + of,
             "only those have an error-against-position profile");
}

// One key group of the file: its row of the cell, its arrays and its profile.
struct Entry {
  size_t row = 0;  // index into its cell's rows
  Tensor oracle, subject, diff, baseline;
  bool has_oracle = false, has_subject = false, has_baseline = false;
  PositionProfile by_position;  // [B·T, …] tensors: the error against t (position.hpp)
};

// The key groups of one judged cell, in its row order.
struct CellEntries {
  const CompareResult* cell = nullptr;
  std::vector<Entry> entries;
};

// The key groups of `cell`: every row (with profiles_only: every [B·T, …] row), each with the
// values `find` gives for it on the host (null: not there) — the oracle's, the subject's and
// the baseline's — the arrays only without profiles_only, the subject and its difference only
// at the oracle's shape, the baseline too; the profile is the row's.
using FindValues = std::function<const Tensor*(const std::string& key, CopyOf what)>;
CellEntries cell_entries(const CompareResult& cell, const FindValues& find, const DumpOptions& dopt) {
  CellEntries out;
  out.cell = &cell;
  for (size_t ri = 0; ri < cell.rows.size(); ++ri) {
    const TensorResult& r = cell.rows[ri];
    if (dopt.profiles_only && !positional(r)) continue;
    Entry& e = out.entries.emplace_back();
    e.row = ri;
    e.by_position = r.by_position;
    if (dopt.profiles_only) continue;
    const Tensor* ot = find(r.key, CopyOf::Oracle);
    if (!ot) continue;
    e.oracle = *ot;
    e.has_oracle = true;
    const Tensor* st = find(r.key, CopyOf::Subject);
    if (st && st->shape == ot->shape) {
      e.subject = *st;
      e.diff = difference(*st, *ot, r.circular);
      e.has_subject = true;
    }
    const Tensor* bt = find(r.key, CopyOf::Baseline);
    if (bt && bt->shape == ot->shape) {
      e.baseline = *bt;
      e.has_baseline = true;
    }
  }
  return out;
}

// The file (atomically: h5::Writer) from the judged cells' key groups.
DumpResult write_file(const std::string& path, bool force, const RunSpec& spec, const Problem& pb,
                      const std::string& oracle, const std::vector<Precision>& precisions,
                      const DumpOptions& dopt, const std::vector<CellEntries>& cells) {
  DumpResult res;
  h5::Writer w(path, force);
  write_meta(w, spec, pb, oracle, precisions);
  w.attr("/meta", "profiles_only", dopt.profiles_only ? 1 : 0);
  const auto nf = h5::NonFinite::Allow;
  for (const CellEntries& ce : cells) {
    for (const Entry& e : ce.entries) {
      const TensorResult& r = ce.cell->rows[e.row];
      const std::string g = group_of(ce.cell->mode, ce.cell->precision, r.key);
      w.group(g);
      if (e.has_oracle) {
        w.write(g + "/oracle", e.oracle, h5::DType::F64, nf);
        ++res.n_datasets;
      }
      if (e.has_subject) {
        w.write(g + "/subject", e.subject, h5::DType::F64, nf);
        w.write(g + "/diff", e.diff, h5::DType::F64, nf);
        res.n_datasets += 2;
      }
      if (e.has_baseline) {
        w.write(g + "/baseline", e.baseline, h5::DType::F64, nf);
        ++res.n_datasets;
      }
      if (!e.by_position.empty()) {  // the error against t, [T] each
        const std::vector<Idx> shape_t = {spec.T};
        w.group(g + "/by_position");
        w.write(g + "/by_position/max_abs", Tensor{shape_t, e.by_position.max_abs},
                h5::DType::F64, nf);
        w.write(g + "/by_position/rel_l2", Tensor{shape_t, e.by_position.rel_l2},
                h5::DType::F64, nf);
        res.n_datasets += 2;
      }
      w.attr(g, "axes", r.syms ? axes_name(*r.syms) : std::string());
      w.attr(g, "circular", r.circular ? 1 : 0);
      w.attr(g, "status", status_name(r.status));
      w.attr(g, "rel_l2", r.subject.rel_l2);
      w.attr(g, "max_abs", r.subject.max_abs);
      w.attr(g, "p95_rel", r.subject.p95_rel);
      w.attr(g, "cosine", r.subject.cosine);
      w.attr(g, "pct", r.verdict.pct());
      w.attr(g, "worst_coords", r.worst_coords);
      ++res.n_keys;
    }
  }
  w.commit();
  return res;
}

}  // namespace

std::string axes_name(const std::vector<Sym>& syms) { return join(syms, sym_name); }

DumpResult write_dump(const std::string& path, bool force, const RunSpec& spec_in,
                      const Problem& pb, const Implementation& oracle,
                      const std::vector<Lineup>& lineups, const DumpOptions& dopt) {
  const RunSpec spec = dump_spec(spec_in);
  M3_REQUIRE(!lineups.empty(), "dump", "nothing to dump", "no precision");
  check_pattern(spec, dopt, [](const std::string&) { return true; }, "of this run");

  // Everything is computed first and the file created only at the end, so that an interrupted
  // or failing run leaves no temporary file behind while it computes (the writer's temporary
  // is removed on SIGINT / SIGTERM too, golden/temp_files.hpp). The verdicts are
  // run_comparison's, on the captures it judged (its CellObserver).
  std::vector<CellEntries> observed;  // per cell, in run order
  auto observe = [&](const CompareResult& cell, const Capture& o, const Capture& s,
                     const Capture* b) {
    const FindValues find = [&](const std::string& key, CopyOf what) -> const Tensor* {
      switch (what) {
        case CopyOf::Oracle: return o.find(key);
        case CopyOf::Subject: return s.find(key);
        case CopyOf::Baseline: return b ? b->find(key) : nullptr;
      }
      return nullptr;
    };
    observed.push_back(cell_entries(cell, find, dopt));
  };
  const Comparison c = run_comparison(spec, pb, oracle, lineups, observe);
  // run order (mode outermost, then lineup) -> the comparison's precision-major cells
  const size_t np = lineups.size(), nm = spec.modes.size();
  M3_REQUIRE(np * nm == observed.size(), "dump", "internal: cells and captures differ",
             np * nm, " cells, ", observed.size(), " observed");
  for (size_t m = 0; m < nm; ++m)
    for (size_t p = 0; p < np; ++p) observed[m * np + p].cell = &c.cells[p * nm + m];

  std::vector<Precision> precisions;
  for (const Lineup& l : lineups) precisions.push_back(l.precision);
  DumpResult res = write_file(path, force, spec, pb, oracle.name, precisions, dopt, observed);
  res.cells = c.cells;  // precision-major, as run_comparison's
  return res;
}

DumpResult write_device_dump(const std::string& path, bool force, const RunSpec& spec_in,
                             const Problem& pb, const std::vector<Precision>& precisions,
                             const DumpOptions& dopt, const CellProgress& progress) {
  const RunSpec spec = dump_spec(spec_in);
  const std::map<std::string, std::vector<Idx>> provided =
      device_compared_shapes(spec.cfg, spec.B, spec.T);
  check_pattern(spec, dopt, [&provided](const std::string& k) { return provided.count(k) > 0; },
                "that the GPU oracle provides");
  check_device_comparison(spec, precisions, "dump --oracle gpu");

  // The judged rows' values as the run hands them over (none with profiles_only: the profiles
  // come with the rows), by group; each leaves the map when its key group takes it.
  struct Values {
    Tensor t[3];  // by CopyOf
    bool has[3] = {false, false, false};
  };
  std::map<std::string, Values> host;
  const HostCopy copy = [&host](Precision p, ScanMode mode, CopyOf what, const std::string& key,
                                Tensor&& t) {
    Values& v = host[group_of(mode, p, key)];
    v.t[static_cast<int>(what)] = std::move(t);
    v.has[static_cast<int>(what)] = true;
  };
  DeviceCompareCost cost;
  const Comparison c = run_device_comparison(spec, pb, precisions, gpu::Fault::None, &cost,
                                             progress, dopt.profiles_only ? HostCopy{} : copy);
  std::vector<CellEntries> cells;  // precision-major, the run's order
  for (const CompareResult& cell : c.cells) {
    const FindValues find = [&](const std::string& key, CopyOf what) -> const Tensor* {
      auto it = host.find(group_of(cell.mode, cell.precision, key));
      if (it == host.end() || !it->second.has[static_cast<int>(what)]) return nullptr;
      return &it->second.t[static_cast<int>(what)];
    };
    cells.push_back(cell_entries(cell, find, dopt));
    for (const TensorResult& r : cell.rows) host.erase(group_of(cell.mode, cell.precision, r.key));
  }
  DumpResult res = write_file(path, force, spec, pb, c.oracle_name, precisions, dopt, cells);
  res.cells = c.cells;
  res.device_cost = device_cost_line(cost) + "\n" + device_time_line(cost);
  return res;
}

}  // namespace m3::harness
