// A random sweep over the supported config space (`m3h compare --sweep N --seed S`):
// fixed presets only find the bugs someone thought of, so the sweep draws N valid problems at
// random, runs each through the usual comparison (run.hpp: every precision of --dtype, every
// scan mode, e2e and/or isolated), and for every failing problem prints a one-line reproducer
// (`m3h compare --d-model … --seed …`, options that rebuild exactly that Problem), shrinks it
// toward the smallest problem that still fails the same way, and prints the shrunk reproducer.
//
// The generator (draw_problem; problem i of sweep seed S is drawn from its own stream
// Rng(sweep_stream(S, i)), so (S, i) reproduces it whatever N is). Every field of Config's
// supported space (Config::validate) is drawn, corners included; sizes stay small
// (SweepLimits) so that a thousand problems take minutes on a CPU:
//   headdim      uniform over {1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64} ∩ [1, max_headdim]
//   ngroups      1 (½), 2 (¼), 4 (¼);  heads per group 1 … 4;  nheads = ngroups·hpg ≤ max_heads
//   expand       uniform over {1, 2, 3} among those with d_model = nheads·headdim / expand an
//                integer in [1, max_d_model]
//   d_state      uniform over {1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64} ∩ [1, max_d_state]
//                (1, 2, 3 with rope 0.5 give num_rope_angles = 0)
//   rope_fraction 0.5 or 1.0 (½ each);  is_outproj_norm ½
//   n_layers     uniform 1 … max_layers;  B uniform 1 … max_B
//   chunk_size   uniform over {1, 2, 3, 4, 5, 7, 8, 12, 16, 32, 64} ∩ [1, max_T]
//   T            ⅓ each: T < chunk_size (1 … chunk−1; T = 1 when chunk = 1), a whole number of
//                chunks (chunk·m), a ragged last chunk (chunk·m + r, 0 < r < chunk); T ≤ max_T
//                (a class that does not fit redraws the class)
//   input        a token model with probability p_token (vocab_size uniform 2 … max_vocab,
//                input_dim = vocab_size); else input_proj the identity (¼; input_dim =
//                d_model), or a linear input_proj with input_dim = d_model (⅜) or uniform in
//                1 … max_input_dim (⅜)
//   entering states random (½) or zero (½);  seed uniform 32-bit;  preset "default" (no
//                adversarial adjustment), a_floor its default (no command-line option)
// A draw that breaks Config::validate or a limit is redrawn whole (the stream continues).
// The corners that no floor judges are drawn like the rest, and the rule judges them through
// the perturbed oracle and the ill-conditioned verdict (cell_judge.hpp):
//  * narrow norms: d_model < 4, d_state = 1, headdim < 4 with the gated norm. A single-value
//    RMSNorm is u·w/√(u² + ε) ≈ ±w, a step where u crosses ±√ε; an RMS of 2–3 values near
//    zero has a gain up to 1/√ε ≈ 316; and the norm's backward is then a cancellation,
//    w·g·ε/(u² + ε)^{3/2} from terms of size w·g/|u|.
//  * T = 1 with zero entering states and the gated norm: y is then a per-head multiple of x,
//    which the per-head gated RMSNorm divides out, so every gradient of the q·k, B, C, dt, D
//    path is zero but for ε's effect, ~1e-5 of its terms: rounding noise of sums of terms of
//    order one, which an f32 reduction of n cancelling terms makes ~√n times larger than the
//    perturbed oracle's one rounding per term.
// Values that are such cancellations are "ill-conditioned: not judged" where they alone exceed
// the limit; a tensor over its limit on its other values still fails.
//
// The baseline of the cells without a same-precision one (the CPU's, and the GPU's isolated
// cells): the perturbed oracle below, BaselineKind::Perturbed (budget.hpp: the rule's k).
//
// Shrinking (shrink_failure): candidates, tried in this order, each only when it gives a valid
// and different problem — n_layers 1, n_layers − 1; T 1, T/2, T − 1; B 1; zero entering states;
// no outproj norm; rope_fraction 0.5; the identity input_proj (or input_dim 1 … halved; a token
// model: vocab_size halved); nheads halved (fewer heads per group, then fewer groups); headdim
// halved; expand 1; d_state halved, d_state − 1; chunk_size halved — the first candidate that
// still fails `keeps` is taken and the list restarts; it stops when none does or after
// max_steps accepted steps. "Still fails": the cells that failed (precision × scan mode ×
// comparison mode) are re-run and the first failing tensor's stage/tensor (without its layer)
// fails again in one of them.
#pragma once

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <string>
#include <vector>

#include "perturbed.hpp"
#include "run.hpp"

namespace m3::harness {

// ---- the sweep ------------------------------------------------------------------------------

struct SweepLimits {
  Idx max_B = 2;
  Idx max_T = 100;
  Idx max_d_model = 64;
  Idx max_headdim = 64;
  Idx max_heads = 8;
  Idx max_d_state = 64;
  Idx max_layers = 3;
  Idx max_input_dim = 64;
  Idx max_vocab = 64;
  double p_token = 0.125;  // share of token models (vocab_size > 0)
};

// The stream of problem `index` of sweep `seed`.
std::uint64_t sweep_stream(std::uint64_t seed, std::uint64_t index);

// Problem `index` of sweep `seed`: a RunSpec with preset "default", the drawn cfg, B, T, seed
// and random_states (modes and comparison modes left at RunSpec's defaults). Always valid.
RunSpec draw_problem(std::uint64_t seed, std::uint64_t index, const SweepLimits& lim = {});

// What the sweep runs on each problem, and how it names the run in a reproducer.
struct SweepOptions {
  std::vector<Precision> precisions = {Precision::F32, Precision::BF16, Precision::F16};
  std::vector<ScanMode> modes = {ScanMode::Sequential, ScanMode::Chunked};
  std::vector<CompareMode> compare_modes = {CompareMode::EndToEnd, CompareMode::Isolated};
  std::string device = "cpu";  // for the reproducer (--device)
  std::string fault;           // for the reproducer (--fault), "" = none
  // The lineup of a run at the given precisions (cpu_lineups_perturbed, gpu_lineups, …).
  std::function<std::vector<Lineup>(const std::vector<Precision>&)> lineups;
  SweepLimits limits;
  bool shrink = true;
  int max_shrink_steps = 40;
  int progress_every = 50;  // a progress line every so many problems (0: none)
  int jobs = 1;             // problems run in parallel (threads); the output is the same
};

// The problem options of `m3h compare` that rebuild exactly spec's Problem: --d-model,
// --d-state, --headdim, --expand, --ngroups, --layers, --rope-fraction, --chunk-size,
// --input-dim or --vocab-size, [--input-proj-identity], [--outproj-norm], --B, --T, --seed,
// [--zero-states] (a preset other than default adds --preset). Each option and value is its
// own element.
std::vector<std::string> reproducer_args(const RunSpec& spec);
// "m3h compare --device D --dtype … --scan … --mode … [--fault F] <reproducer_args>".
std::string reproducer(const RunSpec& spec, const std::vector<Precision>& precisions,
                       const std::vector<ScanMode>& modes,
                       const std::vector<CompareMode>& compare_modes, const std::string& device,
                       const std::string& fault = "");

// One problem's comparison, reduced to what the sweep needs.
struct ProblemOutcome {
  bool pass = true;
  std::string error;        // an m3::Error (or other exception) of the run, "" when none
  std::string first_fail;   // "L1/B6/dQK_dot [f32 chunked e2e]: rel_l2 … > budget …"
  std::string fail_tensor;  // stage/tensor of the first failure without the layer ("B6/dQK_dot")
  int n_fail = 0;           // failing tensor checks over all cells
  std::vector<std::string> failing_tensors;  // stage/tensor of every failing check
  // Tensor checks left not judged as ill-conditioned (cell_judge.hpp), and the first of them
  // ("L1/B4c/d_b_raw [bf16 seq e2e]: ill-conditioned: …"), "" when none.
  int n_ill = 0;
  std::string first_ill;
  int n_checks = 0;  // tensor checks over all cells
  // The failing cells.
  std::vector<Precision> precisions;
  std::vector<ScanMode> modes;
  std::vector<CompareMode> compare_modes;
};

// Runs spec (its cfg, B, T, seed, states; modes and comparison modes from `opt`) against
// reference<double> with opt.lineups(precisions). Never throws: an error is a failure.
ProblemOutcome run_problem(const RunSpec& spec, const SweepOptions& opt,
                           const std::vector<Precision>& precisions);

// The shrinking candidates of `spec` (see the header comment), in order: valid ones within
// `lim` only (so that a shrink never leaves the space the sweep judges).
std::vector<RunSpec> shrink_candidates(const RunSpec& spec, const SweepLimits& lim = {});

// Shrinks `spec` while `fails` holds (spec itself must fail). Returns the smallest failing
// problem found; `steps` (optional) receives the number of accepted steps.
RunSpec shrink_failure(const RunSpec& spec, const std::function<bool(const RunSpec&)>& fails,
                       int max_steps, int* steps = nullptr, const SweepLimits& lim = {});

struct SweepFailure {
  std::uint64_t index = 0;
  RunSpec problem;             // as drawn
  ProblemOutcome outcome;      // of the drawn problem
  RunSpec shrunk;              // the smallest failing problem found (= problem without shrinking)
  ProblemOutcome shrunk_outcome;
  int shrink_steps = 0;
};

struct SweepResult {
  std::uint64_t seed = 0;
  std::uint64_t n = 0;
  std::uint64_t first = 0;  // problems first … n−1 ran
  std::vector<SweepFailure> failures;
  int n_ill = 0;           // ill-conditioned verdicts over the problems as drawn
  int problems_ill = 0;    // problems with at least one
  std::int64_t n_checks = 0;  // tensor checks over the problems as drawn
  double seconds = 0;
  bool pass() const { return failures.empty(); }
};

// Draws and runs problems first … n−1 of sweep `seed` (first = 0: all n), printing to `out`: a
// header line, one line per failing problem with its reproducer (and, when shrinking, a second
// line with the shrunk reproducer), one line per problem with ill-conditioned verdicts (its
// count, the first, its reproducer), a progress line every opt.progress_every problems, and
// the summary "sweep: N problems, F failed, I of C tensor checks ill-conditioned (not judged) in
// P problems (…)" —
// with first > 0 "sweep: M problems (first … n−1 of N), …". Problem i is the same whatever n and first (draw_problem), so a sweep
// split into runs over consecutive ranges judges the problems of the whole sweep (a device
// whose calls are shorter than the sweep).
SweepResult run_sweep(std::uint64_t seed, std::uint64_t n, const SweepOptions& opt,
                      std::ostream& out, std::uint64_t first = 0);

}  // namespace m3::harness
