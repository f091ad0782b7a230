// m3h dump (see dump.hpp for the file layout).
#include "dump.hpp"

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
                const std::vector<Lineup>& lineups) {
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
  w.attr(m, "precisions", join(lineups, [](const Lineup& l) { return precision_name(l.precision); }));
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

}  // namespace

std::string axes_name(const std::vector<Sym>& syms) { return join(syms, sym_name); }

DumpResult write_dump(const std::string& path, bool force, const RunSpec& spec_in,
                      const Problem& pb, const Implementation& oracle,
                      const std::vector<Lineup>& lineups, const DumpOptions& dopt) {
  RunSpec spec = spec_in;
  spec.compare_modes = {CompareMode::EndToEnd};  // a dump holds end-to-end arrays
  M3_REQUIRE(!spec.filter.empty(), "dump", "no --stage pattern", "say which keys to dump ('*' for all)");
  M3_REQUIRE(!lineups.empty() && !spec.modes.empty(), "dump", "nothing to dump",
             "no precision or no scan mode");
  bool any = false, any_profile = false;
  for (ScanMode mode : spec.modes) {
    for (const auto& k : expected_keys(spec.cfg, spec.B, spec.T, mode))
      any = any || key_matches(k, spec.filter);
    for (const KeyedSpec& ks : expected_stage_keys(spec.cfg, spec.B, spec.T, mode))
      any_profile = any_profile ||
                    (has_position_axis(ks.spec->shape) && key_matches(ks.key, spec.filter));
  }
  M3_REQUIRE(any, "dump", "--stage '" + spec.filter + "' matches no tensor of this run", "");
  M3_REQUIRE(!dopt.profiles_only || any_profile, "dump",
             "--profiles-only: --stage '" + spec.filter + "' matches no [B*T, ...] tensor",
             "only those have an error-against-position profile");

  // Everything is computed first and the file created only at the end, so that an interrupted
  // or failing run leaves no temporary file behind while it computes (the writer's temporary
  // is removed on SIGINT / SIGTERM too, golden/temp_files.hpp). The verdicts are
  // run_comparison's, on the captures it judged (its CellObserver).
  struct Entry {
    size_t row = 0;  // index into its cell's rows
    std::string group;
    Tensor oracle, subject, diff, baseline;
    bool has_oracle = false, has_subject = false, has_baseline = false;
    PositionProfile by_position;  // [B·T, …] tensors: the error against t (position.hpp)
  };
  std::vector<std::vector<Entry>> entries;  // per cell, in run order
  std::vector<const CompareResult*> run_order;
  const bool keep_arrays = !dopt.profiles_only;
  auto observe = [&](const CompareResult& cell, const Capture& o, const Capture& s,
                     const Capture* b) {
    std::vector<Entry>& out = entries.emplace_back();
    for (size_t ri = 0; ri < cell.rows.size(); ++ri) {
      const TensorResult& r = cell.rows[ri];
      const bool positional = !r.is_param && r.syms && has_position_axis(*r.syms);
      if (dopt.profiles_only && !positional) continue;
      Entry e;
      e.row = ri;
      e.group = std::string("/dump/") + scan_mode_name(cell.mode) + "/" +
                precision_name(cell.precision) + "/" + r.key;
      const Tensor* ot = o.find(r.key);
      const Tensor* st = s.find(r.key);
      const Tensor* bt = b ? b->find(r.key) : nullptr;
      if (ot && keep_arrays) {
        e.oracle = *ot;
        e.has_oracle = true;
      }
      if (ot && st && st->shape == ot->shape) {
        if (keep_arrays) {
          e.subject = *st;
          e.diff = difference(*st, *ot, r.circular);
          e.has_subject = true;
        }
        if (positional) e.by_position = position_profile(*st, *ot, spec.B, spec.T, r.circular);
      }
      if (ot && bt && bt->shape == ot->shape && keep_arrays) {
        e.baseline = *bt;
        e.has_baseline = true;
      }
      out.push_back(std::move(e));
    }
  };
  const Comparison c = run_comparison(spec, pb, oracle, lineups, observe);
  // run order (mode outermost, then lineup) -> the comparison's precision-major cells
  const size_t np = lineups.size(), nm = spec.modes.size();
  for (size_t m = 0; m < nm; ++m)
    for (size_t p = 0; p < np; ++p) run_order.push_back(&c.cells[p * nm + m]);
  M3_REQUIRE(run_order.size() == entries.size(), "dump", "internal: cells and captures differ",
             run_order.size(), " cells, ", entries.size(), " observed");

  DumpResult res;
  h5::Writer w(path, force);
  write_meta(w, spec, pb, oracle.name, lineups);
  w.attr("/meta", "profiles_only", dopt.profiles_only ? 1 : 0);
  const auto nf = h5::NonFinite::Allow;
  for (size_t ci = 0; ci < entries.size(); ++ci) {
    for (const Entry& e : entries[ci]) {
      const TensorResult& r = run_order[ci]->rows[e.row];
      const std::string& g = e.group;
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
  res.cells = c.cells;  // precision-major, as run_comparison's
  return res;
}

}  // namespace m3::harness
