// The random sweep over the config space (see sweep.hpp).
#include "sweep.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <ostream>
#include <set>
#include <sstream>
#include <system_error>
#include <thread>

#include "backbone.hpp"  // capture_grads
#include "error.hpp"
#include "lm.hpp"  // ref::embed_*, loss_*
#include "params.hpp"  // Rng
#include "registry.hpp"
#include "stages.hpp"

namespace m3::harness {

namespace {

// Uniform integer in [lo, hi].
Idx uniform_int(Rng& rng, Idx lo, Idx hi) {
  if (hi <= lo) return lo;
  const auto span = static_cast<std::uint64_t>(hi - lo + 1);
  return lo + static_cast<Idx>(rng.next() % span);
}

// Uniform over the entries of `values` that are ≤ limit (values ascending; the first if none).
Idx pick(Rng& rng, const std::vector<Idx>& values, Idx limit) {
  std::vector<Idx> ok;
  for (Idx v : values)
    if (v <= limit) ok.push_back(v);
  if (ok.empty()) return values.front();
  return ok[static_cast<size_t>(rng.next() % ok.size())];
}

bool coin(Rng& rng, double p) { return rng.uniform() < p; }

bool within(const Config& c, Idx B, Idx T, const SweepLimits& lim) {
  if (B > lim.max_B || T > lim.max_T || c.n_layers > lim.max_layers) return false;
  if (c.d_model > lim.max_d_model || c.headdim > lim.max_headdim || c.nheads() > lim.max_heads)
    return false;
  if (c.d_state > lim.max_d_state) return false;
  if (c.vocab_size > 0 ? c.vocab_size > lim.max_vocab
                       : (c.input_dim > std::max(lim.max_input_dim, c.d_model)))
    return false;
  try {
    validate_run(c, B, T);
  } catch (const Error&) {
    return false;
  }
  return true;
}

bool try_draw(Rng& rng, const SweepLimits& lim, RunSpec& s) {
  static const std::vector<Idx> kHeaddims = {1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64};
  static const std::vector<Idx> kStates = {1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64};
  static const std::vector<Idx> kChunks = {1, 2, 3, 4, 5, 7, 8, 12, 16, 32, 64};
  Config c;
  c.headdim = pick(rng, kHeaddims, lim.max_headdim);
  const double g = rng.uniform();
  c.ngroups = g < 0.5 ? 1 : g < 0.75 ? 2 : 4;
  const Idx hpg = uniform_int(rng, 1, 4);
  const Idx nheads = c.ngroups * hpg;
  const Idx d_inner = nheads * c.headdim;
  std::vector<Idx> expands;
  for (Idx e : {1, 2, 3})
    if (d_inner % e == 0 && d_inner / e >= 1 && d_inner / e <= lim.max_d_model) expands.push_back(e);
  if (expands.empty()) return false;
  c.expand = expands[static_cast<size_t>(rng.next() % expands.size())];
  c.d_model = d_inner / c.expand;
  c.d_state = pick(rng, kStates, lim.max_d_state);
  c.rope_fraction = coin(rng, 0.5) ? 0.5 : 1.0;
  c.is_outproj_norm = coin(rng, 0.5);
  c.n_layers = uniform_int(rng, 1, lim.max_layers);
  const Idx B = uniform_int(rng, 1, lim.max_B);
  c.chunk_size = pick(rng, kChunks, lim.max_T);
  const Idx cs = c.chunk_size;
  Idx T = 0;
  for (int tries = 0; tries < 8 && T == 0; ++tries) {
    const Idx cls = uniform_int(rng, 0, 2);
    if (cls == 0) {  // shorter than one chunk
      T = cs == 1 ? 1 : uniform_int(rng, 1, cs - 1);
    } else if (cls == 1) {  // whole chunks
      const Idx m_max = lim.max_T / cs;
      if (m_max >= 1) T = cs * uniform_int(rng, 1, m_max);
    } else {  // a ragged last chunk
      if (cs == 1) continue;
      const Idx m_max = (lim.max_T - 1) / cs;
      if (m_max < 1) continue;
      const Idx m = uniform_int(rng, 1, m_max);
      const Idx r_max = std::min(cs - 1, lim.max_T - cs * m);
      if (r_max >= 1) T = cs * m + uniform_int(rng, 1, r_max);
    }
  }
  if (T == 0) return false;
  if (coin(rng, lim.p_token)) {
    c.vocab_size = uniform_int(rng, 2, std::max<Idx>(2, lim.max_vocab));
    c.input_dim = c.vocab_size;
  } else {
    const double in = rng.uniform();
    if (in < 0.25) {
      c.input_proj_identity = true;
      c.input_dim = c.d_model;
    } else if (in < 0.625) {
      c.input_dim = c.d_model;
    } else {
      c.input_dim = uniform_int(rng, 1, lim.max_input_dim);
    }
  }
  const bool random_states = coin(rng, 0.5);
  const std::uint64_t seed = rng.next() & 0xffffffffULL;
  if (!within(c, B, T, lim)) return false;
  s = RunSpec{};
  s.preset = "default";
  s.cfg = c;
  s.B = B;
  s.T = T;
  s.seed = seed;
  s.random_states = random_states;
  return true;
}

std::string join(const std::vector<std::string>& items, const char* sep) {
  std::string s;
  for (const auto& i : items) s += (s.empty() ? "" : sep) + i;
  return s;
}

std::string precision_list(const std::vector<Precision>& ps) {
  std::vector<std::string> v;
  for (Precision p : ps) v.emplace_back(precision_name(p));
  return join(v, ",");
}
std::string mode_list(const std::vector<ScanMode>& ms) {
  std::vector<std::string> v;
  for (ScanMode m : ms) v.emplace_back(scan_mode_name(m));
  return join(v, ",");
}
std::string compare_mode_list(const std::vector<CompareMode>& cms) {
  if (cms.size() == 2) return "both";
  return cms.empty() ? "e2e" : compare_mode_name(cms.front());
}

template <class T>
void add_unique(std::vector<T>& v, T x) {
  if (std::find(v.begin(), v.end(), x) == v.end()) v.push_back(x);
}

// Keeps the order of `order` for the members of `v`.
template <class T>
std::vector<T> ordered(const std::vector<T>& v, const std::vector<T>& order) {
  std::vector<T> out;
  for (const T& x : order)
    if (std::find(v.begin(), v.end(), x) != v.end()) out.push_back(x);
  return out;
}

}  // namespace

std::uint64_t sweep_stream(std::uint64_t seed, std::uint64_t index) {
  return mix64(mix64(seed ^ 0x5eed5eed5eed5eedULL) + index * 0x9e3779b97f4a7c15ULL);
}

RunSpec draw_problem(std::uint64_t seed, std::uint64_t index, const SweepLimits& lim) {
  Rng rng(sweep_stream(seed, index));
  RunSpec s;
  for (int tries = 0; tries < 10000; ++tries)
    if (try_draw(rng, lim, s)) {
      s.source = "sweep seed " + std::to_string(seed) + " problem " + std::to_string(index);
      return s;
    }
  throw Error("sweep", "no valid problem within the limits",
              "seed " + std::to_string(seed) + " index " + std::to_string(index));
}

std::vector<std::string> reproducer_args(const RunSpec& spec) {
  const Config& c = spec.cfg;
  std::vector<std::string> a;
  auto opt = [&](const char* name, const std::string& value) {
    a.emplace_back(name);
    a.push_back(value);
  };
  auto num = [](Idx v) { return std::to_string(v); };
  if (!spec.preset.empty() && spec.preset != "default") opt("--preset", spec.preset);
  opt("--d-model", num(c.d_model));
  opt("--d-state", num(c.d_state));
  opt("--headdim", num(c.headdim));
  opt("--expand", num(c.expand));
  opt("--ngroups", num(c.ngroups));
  opt("--layers", num(c.n_layers));
  opt("--rope-fraction", c.rope_fraction == 1.0 ? "1.0" : "0.5");
  opt("--chunk-size", num(c.chunk_size));
  if (c.vocab_size > 0) {
    opt("--vocab-size", num(c.vocab_size));
  } else {
    opt("--input-dim", num(c.input_dim));
    if (c.input_proj_identity) a.emplace_back("--input-proj-identity");
  }
  if (c.is_outproj_norm) a.emplace_back("--outproj-norm");
  opt("--B", num(spec.B));
  opt("--T", num(spec.T));
  opt("--seed", std::to_string(spec.seed));
  if (!spec.random_states) a.emplace_back("--zero-states");
  return a;
}

std::string reproducer(const RunSpec& spec, const std::vector<Precision>& precisions,
                       const std::vector<ScanMode>& modes,
                       const std::vector<CompareMode>& compare_modes, const std::string& device,
                       const std::string& fault) {
  std::vector<std::string> a = {"m3h", "compare", "--device", device, "--dtype",
                                precision_list(precisions), "--scan", mode_list(modes),
                                "--mode", compare_mode_list(compare_modes)};
  if (!fault.empty() && fault != "none") {
    a.emplace_back("--fault");
    a.push_back(fault);
  }
  for (auto& s : reproducer_args(spec)) a.push_back(s);
  return join(a, " ");
}

ProblemOutcome run_problem(const RunSpec& spec_in, const SweepOptions& opt,
                           const std::vector<Precision>& precisions) {
  ProblemOutcome out;
  try {
    RunSpec spec = spec_in;
    spec.modes = opt.modes;
    spec.compare_modes = opt.compare_modes;
    M3_REQUIRE(static_cast<bool>(opt.lineups), "sweep", "no lineup factory", "");
    const Problem pb = build_problem(spec);
    const Comparison c = run_comparison(spec, pb, reference_oracle(), opt.lineups(precisions));
    std::set<std::string> tensors;
    for (const CompareResult& cell : c.cells) {
      out.n_checks += static_cast<int>(cell.rows.size());
      for (const TensorResult& r : cell.rows) {
        if (r.status != Status::IllConditioned) continue;
        if (out.first_ill.empty())
          out.first_ill = r.key + " [" + precision_name(cell.precision) + " " +
                          scan_mode_name(cell.mode) + " " + compare_mode_name(cell.compare_mode) +
                          "]: " + r.note;
        ++out.n_ill;
      }
      if (cell.pass()) continue;
      out.pass = false;
      out.n_fail += cell.n_fail();
      add_unique(out.precisions, cell.precision);
      add_unique(out.modes, cell.mode);
      add_unique(out.compare_modes, cell.compare_mode);
      for (const TensorResult& r : cell.rows)
        if (!r.pass()) out.failing_tensors.push_back(r.stage + "/" + r.tensor);
      if (out.first_fail.empty()) {
        const TensorResult& r = cell.rows[static_cast<size_t>(cell.first_fail)];
        std::ostringstream os;
        os << r.key << " [" << precision_name(cell.precision) << " " << scan_mode_name(cell.mode)
           << " " << compare_mode_name(cell.compare_mode) << "] " << status_name(r.status) << ": "
           << r.note;
        out.first_fail = os.str();
        out.fail_tensor = r.stage + "/" + r.tensor;
      }
    }
    out.precisions = ordered(out.precisions, precisions);
    out.modes = ordered(out.modes, opt.modes);
    out.compare_modes = ordered(out.compare_modes, opt.compare_modes);
  } catch (const std::exception& e) {
    out.pass = false;
    out.error = e.what();
    out.first_fail = std::string("error: ") + e.what();
    out.precisions = precisions;
    out.modes = opt.modes;
    out.compare_modes = opt.compare_modes;
  }
  return out;
}

std::vector<RunSpec> shrink_candidates(const RunSpec& s, const SweepLimits& lim) {
  std::vector<RunSpec> out;
  std::set<std::string> seen;
  auto key = [](const RunSpec& r) {
    return r.cfg.describe() + " B=" + std::to_string(r.B) + " T=" + std::to_string(r.T) +
           " rs=" + std::to_string(r.random_states);
  };
  seen.insert(key(s));
  auto add = [&](RunSpec r) {
    Config& c = r.cfg;
    if (c.input_proj_identity) c.input_dim = c.d_model;
    if (c.vocab_size > 0) c.input_dim = c.vocab_size;
    if (!within(c, r.B, r.T, lim)) return;  // validates too
    if (seen.insert(key(r)).second) out.push_back(std::move(r));
  };
  auto with = [&](auto&& change) {
    RunSpec r = s;
    change(r);
    add(std::move(r));
  };
  with([](RunSpec& r) { r.cfg.n_layers = 1; });
  with([](RunSpec& r) { r.cfg.n_layers -= 1; });
  with([](RunSpec& r) { r.T = 1; });
  with([](RunSpec& r) { r.T /= 2; });
  with([](RunSpec& r) { r.T -= 1; });
  with([](RunSpec& r) { r.B = 1; });
  with([](RunSpec& r) { r.random_states = false; });
  with([](RunSpec& r) { r.cfg.is_outproj_norm = false; });
  with([](RunSpec& r) { r.cfg.rope_fraction = 0.5; });
  if (s.cfg.vocab_size > 0) {
    with([](RunSpec& r) { r.cfg.vocab_size = std::max<Idx>(1, r.cfg.vocab_size / 2); });
  } else {
    with([](RunSpec& r) { r.cfg.input_proj_identity = true; });
    with([](RunSpec& r) { r.cfg.input_dim = 1; });
    with([](RunSpec& r) { r.cfg.input_dim /= 2; });
  }
  // Fewer heads: fewer heads per group first, then fewer groups (d_model follows d_inner).
  auto heads = [&](Idx ngroups, Idx hpg) {
    with([&](RunSpec& r) {
      Config& c = r.cfg;
      const Idx di = ngroups * hpg * c.headdim;
      if (di % c.expand != 0) {
        c.d_model = 0;  // invalid: dropped by add()
        return;
      }
      const bool follow = !c.input_proj_identity && c.vocab_size == 0 && c.input_dim == c.d_model;
      c.ngroups = ngroups;
      c.d_model = di / c.expand;
      if (follow) c.input_dim = c.d_model;
    });
  };
  const Idx hpg = s.cfg.heads_per_group();
  if (hpg > 1) heads(s.cfg.ngroups, hpg / 2);
  if (s.cfg.ngroups > 1) heads(s.cfg.ngroups / 2, hpg);
  // headdim halved and expand 1, keeping the number of heads.
  auto width = [&](Idx headdim, Idx expand) {
    with([&](RunSpec& r) {
      Config& c = r.cfg;
      const Idx di = c.nheads() * headdim;
      if (headdim < 1 || di % expand != 0) {
        c.d_model = 0;
        return;
      }
      const bool follow = !c.input_proj_identity && c.vocab_size == 0 && c.input_dim == c.d_model;
      c.headdim = headdim;
      c.expand = expand;
      c.d_model = di / expand;
      if (follow) c.input_dim = c.d_model;
    });
  };
  if (s.cfg.headdim > 1) width(s.cfg.headdim / 2, s.cfg.expand);
  if (s.cfg.expand > 1) width(s.cfg.headdim, 1);
  with([](RunSpec& r) { r.cfg.d_state = std::max<Idx>(1, r.cfg.d_state / 2); });
  with([](RunSpec& r) { r.cfg.d_state -= 1; });
  with([](RunSpec& r) { r.cfg.chunk_size = std::max<Idx>(1, r.cfg.chunk_size / 2); });
  return out;
}

RunSpec shrink_failure(const RunSpec& spec, const std::function<bool(const RunSpec&)>& fails,
                       int max_steps, int* steps, const SweepLimits& lim) {
  RunSpec cur = spec;
  int n = 0;
  while (n < max_steps) {
    bool moved = false;
    for (RunSpec& cand : shrink_candidates(cur, lim)) {
      if (fails(cand)) {
        cur = std::move(cand);
        ++n;
        moved = true;
        break;
      }
    }
    if (!moved) break;
  }
  if (steps) *steps = n;
  return cur;
}

namespace {

// One problem of a sweep: drawn, run and, when it fails, shrunk.
SweepFailure evaluate(std::uint64_t seed, std::uint64_t i, const SweepOptions& opt, bool* pass) {
  SweepFailure f;
  f.index = i;
  f.problem = draw_problem(seed, i, opt.limits);
  f.outcome = run_problem(f.problem, opt, opt.precisions);
  f.shrunk = f.problem;
  f.shrunk_outcome = f.outcome;
  *pass = f.outcome.pass;
  if (f.outcome.pass || !opt.shrink) return f;
  const ProblemOutcome& o = f.outcome;
  SweepOptions sub = opt;  // only the cells that failed
  sub.modes = o.modes;
  sub.compare_modes = o.compare_modes;
  ProblemOutcome last = o;
  auto fails = [&](const RunSpec& cand) {
    ProblemOutcome r = run_problem(cand, sub, o.precisions);
    if (r.pass) return false;
    const bool same = !o.error.empty()
                          ? !r.error.empty()
                          : std::find(r.failing_tensors.begin(), r.failing_tensors.end(),
                                      o.fail_tensor) != r.failing_tensors.end();
    if (same) last = std::move(r);
    return same;
  };
  f.shrunk = shrink_failure(f.problem, fails, opt.max_shrink_steps, &f.shrink_steps, opt.limits);
  if (f.shrink_steps > 0) f.shrunk_outcome = last;
  return f;
}

void print_failure(std::ostream& out, const SweepFailure& f, const SweepOptions& opt) {
  out << "FAIL problem " << f.index << ": " << f.outcome.first_fail << "\n  reproduce: "
      << reproducer(f.problem, opt.precisions, opt.modes, opt.compare_modes, opt.device, opt.fault)
      << "\n";
  if (opt.shrink)
    out << "  shrunk (" << f.shrink_steps << " steps): " << f.shrunk_outcome.first_fail
        << "\n  reproduce: "
        << reproducer(f.shrunk, f.shrunk_outcome.precisions, f.shrunk_outcome.modes,
                      f.shrunk_outcome.compare_modes, opt.device, opt.fault)
        << "\n";
  out << std::flush;
}

}  // namespace

SweepResult run_sweep(std::uint64_t seed, std::uint64_t n, const SweepOptions& opt,
                      std::ostream& out, std::uint64_t first) {
  M3_REQUIRE(first < n, "harness::run_sweep", "the first problem is past the sweep's end",
             "first=", first, " n=", n);
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  auto elapsed = [&] {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.1f s", std::chrono::duration<double>(Clock::now() - t0).count());
    return std::string(buf);
  };
  SweepResult res;
  res.seed = seed;
  res.n = n;
  res.first = first;
  const std::string range = std::to_string(first) + " … " + std::to_string(n - 1) + " of " +
                            std::to_string(n);
  out << "sweep: seed " << seed << ", "
      << (first == 0 ? std::to_string(n) + " problems" : "problems " + range) << " on the "
      << opt.device << ", dtype "
      << precision_list(opt.precisions) << ", scan " << mode_list(opt.modes) << ", mode "
      << compare_mode_list(opt.compare_modes) << (opt.fault.empty() ? "" : ", fault " + opt.fault)
      << (opt.jobs > 1 ? ", " + std::to_string(opt.jobs) + " jobs" : std::string()) << "\n"
      << std::flush;
  // Problems run on opt.jobs threads (each its own problem: the reference keeps no shared
  // mutable state); the results are printed in index order, as a single thread would.
  struct Slot {
    bool done = false, pass = true;
    SweepFailure f;
  };
  std::vector<Slot> slots(static_cast<size_t>(n - first));  // slot k: problem first + k
  std::mutex mu;
  std::condition_variable cv;
  std::atomic<std::uint64_t> next{first};
  auto worker = [&] {
    for (std::uint64_t i; (i = next++) < n;) {
      bool pass = true;
      SweepFailure f = evaluate(seed, i, opt, &pass);
      std::lock_guard<std::mutex> lock(mu);
      Slot& s = slots[static_cast<size_t>(i - first)];
      s.f = std::move(f);
      s.pass = pass;
      s.done = true;
      cv.notify_all();
    }
  };
  std::vector<std::thread> threads;
  // More threads than problems would only wait: at most one per problem of the range.
  const int jobs = static_cast<int>(std::min<std::uint64_t>(
      static_cast<std::uint64_t>(std::max(1, opt.jobs)), n - first));
  if (jobs > 1) {
    try {
      for (int j = 0; j < jobs; ++j) threads.emplace_back(worker);
    } catch (const std::system_error& e) {
      // The machine gave fewer threads: the started ones finish the range's problems
      // (they take them in turn), nothing is lost; with none started the loop below runs
      // them itself.
      if (threads.empty())
        throw Error("sweep", "cannot start a thread for --jobs " + std::to_string(opt.jobs), e.what());
    }
  }
  for (std::uint64_t i = first; i < n; ++i) {
    Slot slot;
    if (!threads.empty()) {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return slots[static_cast<size_t>(i - first)].done; });
      slot = std::move(slots[static_cast<size_t>(i - first)]);
    } else {
      slot.f = evaluate(seed, i, opt, &slot.pass);
    }
    res.n_checks += slot.f.outcome.n_checks;
    if (slot.f.outcome.n_ill > 0) {
      res.n_ill += slot.f.outcome.n_ill;
      ++res.problems_ill;
      out << "ill-conditioned problem " << slot.f.index << ": " << slot.f.outcome.n_ill
          << " tensor check(s) not judged, first " << slot.f.outcome.first_ill
          << "\n  reproduce: "
          << reproducer(slot.f.problem, opt.precisions, opt.modes, opt.compare_modes, opt.device,
                        opt.fault)
          << "\n" << std::flush;
    }
    if (!slot.pass) {
      print_failure(out, slot.f, opt);
      res.failures.push_back(std::move(slot.f));
    }
    if (opt.progress_every > 0 && (i + 1) % static_cast<std::uint64_t>(opt.progress_every) == 0 &&
        i + 1 < n)
      out << "progress: " << (i + 1) << "/" << n << " problems, " << res.failures.size()
          << " failed, " << elapsed() << "\n"
          << std::flush;
  }
  for (auto& t : threads) t.join();
  res.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  out << "sweep: " << (n - first) << " problems"
      << (first == 0 ? std::string() : " (" + range + ")") << ", " << res.failures.size()
      << " failed, " << res.n_ill << " of " << res.n_checks
      << " tensor checks ill-conditioned (not judged) in " << res.problems_ill
      << " problem(s) (seed " << seed << ", " << elapsed() << ")\n";
  return res;
}

}  // namespace m3::harness
