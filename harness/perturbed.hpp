// The perturbed oracle (docs/HARNESS.md §4): the double reference with a random error of one
// rounding wherever a float implementation at precision p stores a value, so that the spread
// of its draws around the unperturbed double run measures the error a correct implementation
// at p cannot avoid, given the problem's conditioning. It is the baseline of the cells without
// a same-precision one (the CPU's, and the GPU's isolated cells), budget.hpp's
// BaselineKind::Perturbed, and the conditioning term of the others.
//
// The run is an executor of the stage chain (reference/chain.hpp): the reference's stage
// functions, with every tensor a stage writes perturbed right after the stage; with a teacher
// (the oracle's Capture) every stage is instead fed the teacher's values, perturbed as a load
// (the isolated runner's rounding of the oracle's inputs, isolated.hpp), and captures only its
// own outputs.
#pragma once

#include <cstdint>

#include "run.hpp"

namespace m3::harness {

// The splitmix64 finaliser: the mixer of the perturbation and sweep seed streams.
std::uint64_t mix64(std::uint64_t z);

// The perturbed oracle of a cell of precision p: the double reference with a random error of
// the size of one rounding wherever a float implementation at p rounds a stored value —
// relative u_typed = unit_roundoff(p) where MODEL.md §8 stores a tensor typed (the registry's
// typed tensors, the GEMM weights' compute copies, X, the staged typed copy of δ that feeds a
// GEMM), relative u_f32 = 2^-24 everywhere else (f32 tensors, the other parameters, dOut, the
// entering states); in an f16 cell every stage output also absolutely, by up to half f16's
// smallest subnormal (2^-25), where that is larger (see `tiny`). f32: all at 2^-24.
struct Perturbation {
  double u_typed = 0, u_f32 = 0;
  // The absolute floor of every value's error, stage outputs f32 or typed: in an f16 cell a
  // value below f16's normal range has passed through (or was computed from) f16 storage,
  // whose rounding there is absolute, 2^-25 (half the smallest subnormal); 0 for f32, bf16.
  double tiny = 0;
  // Coherent draws. Equal values drawn alike: within each tensor a stage writes, r is a
  // function of the value (a hash of the value's bits and a salt drawn per tensor) instead of
  // one draw per element. A deterministic float computation rounds equal inputs equally, so
  // where the same values recur (layer 0's rows of a token model are functions of the token
  // alone) its errors add coherently along a sum over positions (F5's angles, the states),
  // which independent draws, growing as √n, understate. And the forward GEMMs' f32
  // accumulation: F2's proj and F8's out_flat (out = x·w over n terms) also get
  // r·u_f32·√(n/2)·‖x_k·w_k‖₂ (the size of a random walk of n roundings), r keyed by the value,
  // before their storage rounding: a float GEMM errs by that much whatever it stores, and
  // coherently where its rows recur. Zeros, the problem's arrays and the staged copies keep
  // the positional draws. Measured: docs/HARNESS.md §11.
  bool coherent = false;
};
Perturbation perturbation_of(Precision p);

// `pb` with every parameter, X, dOut and entering state multiplied by (1 + u·r), r uniform in
// [−1, 1) from Rng(perturbation_seed(pb.seed, pt.u_typed, draw, 0)), in the flat order of
// for_each_param (GEMM weights at u_typed, the others at u_f32), then x, d_out, the states ssm,
// k, v, angle; tokens, targets and loss weights of a token model are kept (integers and 0/1).
Problem perturbed_problem(const Problem& pb, const Perturbation& pt, int draw);
// `pb` with every parameter, X, dOut and entering state rounded to where the production path
// stores it (the same choice of u_typed or u_f32 per array as perturbed_problem): round to
// nearest even to p's format (GEMM weights, and X where input_proj's inputs are typed) or to
// f32 (the rest). The problem of the exact-rounding draw (gpu::OraclePerturbation::exact).
Problem rounded_problem(const Problem& pb, Precision p);
// The same, written into `q`, which holds pb's arrays at their sizes (a copy of pb or of an earlier
// draw's problem): no allocation, the values computed in parallel pieces on up to `threads`
// threads (0: the machine's), equal bit for bit to the functions above for any thread count.
// Throws m3::Error when an array of q differs in size from pb's.
void perturbed_problem_into(Problem& q, const Problem& pb, const Perturbation& pt, int draw,
                            int threads = 0);
void rounded_problem_into(Problem& q, const Problem& pb, Precision p, int threads = 0);
// The stream of (problem seed, u, draw, role): role 0 the problem's perturbation, 1 the stages'.
std::uint64_t perturbation_seed(std::uint64_t problem_seed, double u, int draw, int role);
// The double reference on perturbed_problem(pb, pt, draw), run stage by stage in the registry's
// stage table by the chain driver, as Backbone<double> runs it, with EVERY tensor a stage
// writes (activations, saved tensors, states, gradients) perturbed as above right after the
// stage (stream role 1). Same keys as run_reference<double>; with a zero Perturbation equal to
// it bit for bit. With a `sink` the Capture streams (capture.hpp).
Capture run_perturbed_reference(const Problem& pb, ScanMode mode, const Perturbation& pt,
                                int draw, const TensorSink& sink = {});
// The isolated counterpart (HARNESS.md §2): every stage of run_perturbed_reference fed the
// ORACLE's values of its inputs, each perturbed as one rounding at its storage (the isolated
// runner rounds the oracle's inputs so, isolated.hpp), its outputs perturbed and captured
// (stream role 2): the error one stage cannot avoid at p, given its conditioning.
Capture run_perturbed_isolated(const Problem& pb, ScanMode mode, const Capture& oracle,
                               const Perturbation& pt, int draw, const TensorSink& sink = {});
// run_perturbed_reference at unit_roundoff(p), and run_perturbed_isolated as its isolated
// runner (a lineup's isolated baseline); named "reference<double>~u(p)[#draw][ (coherent)]".
Implementation perturbed_oracle(Precision p, int draw, bool coherent = false);
// Gives every lineup `draws` draws of perturbed_oracle as its isolated baselines (the
// GPU lineups too: their isolated cells have no same-precision baseline either), measured
// against the unperturbed teacher-forced double run (isolated_baseline_reference); and every
// lineup with a same-precision end-to-end baseline `draws` draws of perturbed_oracle as its
// conditioning term (Lineup::conditioning, budget.hpp), measured against
// run_reference<double> (conditioning_reference). The unperturbed runs are computed once per
// problem and scan mode for all the lineups.
void add_perturbed_baselines(std::vector<Lineup>& lineups, int draws = kPerturbationDraws);
// The CPU lineup of m3h compare: subject = reference_emulation(p), baseline = the perturbed
// oracle at p (BaselineKind::Perturbed), `draws` draws (≥ 1): draw 0 as the baseline, the
// others as more_baselines, then kCoherentDraws coherent draws (Perturbation::coherent, draws
// `draws` … ) as coherent_baselines (run for a token model only, budget.hpp), measured
// against run_reference<double> (baseline_reference: so that a stored oracle's own deviation is
// never taken for precision-forced error; computed once per problem and scan mode for all the
// lineups); and add_perturbed_baselines(…, draws).
std::vector<Lineup> cpu_lineups_perturbed(const std::vector<Precision>& precisions,
                                          int draws = kPerturbationDraws);

}  // namespace m3::harness
