// m3h bench: timing.
//   --reference   the Eigen reference (double and float, both scan modes) on one shape
//   default       the GPU path per bench shape (--shapes): forward and forward+backward per
//                 layer with CUDA events after warm-up (median of --repeats), tokens/s, both
//                 scan modes, and the float reference's time for the same shape (one pass,
//                 chunked; --no-reference skips it). Without a GPU: one line saying so, then
//                 the reference rows.
//   --ceilings    only the device's ceilings (gpu::measure_ceilings): D2D copy bandwidth (bytes
//                 read + written) and the bf16, f16, f32 (pedantic) cuBLAS GEMM rates.
//   --graph       the GPU rows time replays of CUDA graphs (gpu/graph.hpp) of the forward and
//                 the forward+backward, recorded once after the warm-up: the same kernels
//                 without the host's launch work and with shorter gaps between them
//   --memory-plan per shape, dtype, scan mode and recompute policy, what one further layer keeps
//                 from its forward for its backward: the saved tensors by the registry's count
//                 (registry.hpp layer_tensor_bytes), largest first; runs nothing, no device.
//   --profile     the ceilings first (once), then after each GPU row a table of the stages of
//                 one forward+backward: ms, share, the minimum bytes and FLOPs of the stage
//                 (harness/roofline.hpp), achieved GB/s and TFLOP/s as % of the ceilings, the
//                 floor max(bytes/copy, FLOPs/ceiling), time over floor, and the closer bound.
// Bench shapes: default = the default config at B = 2, T = 256 (4 layers); official = d_model
// 1024, headdim 64, d_state 128, ngroups 1, expand 2, B = 8, T = 4096, 1 layer (the official
// Mamba-3 defaults; the sequential reference is not timed there: its h_saved alone would need
// B·(T+1)·d_state·d_inner·4 B = 34 GB); official2 = the same with 2 layers. With both official
// and official2, a "marginal layer" line per dtype and scan mode gives the second layer's time
// (2 layers − 1 layer): a layer without the backbone-level input_proj and norm_f, the figure
// to hold against a single block.
// Memory: every GPU row gives the peak device bytes of the run (the GPU path's own
// allocations, gpu/device.hpp: construction through the last timed pass); the marginal line
// gives the bytes per further layer (official2 − official), per token and layer, and the most
// layers that fit in the device's memory at that shape ((total − the one-layer run's bytes
// that are not the layer's) / bytes per layer). --recompute picks the production recompute
// policies to run (registry.hpp Recompute). --against FILE sets another implementation's
// figures, read from FILE (harness/against.hpp; docs/data/ keeps the official block's), beside
// the marginal layers of FILE's precision, with the ratios.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>

#include "bench.hpp"
#include "backbone_gpu.hpp"
#include "bench_gpu.hpp"
#include "capture.hpp"  // shape_str
#include "cli.hpp"
#include "commands.hpp"
#include "context.hpp"
#include "device.hpp"
#include "gpu_lineup.hpp"
#include "presets.hpp"
#include "registry.hpp"
#include "report.hpp"
#include "roofline.hpp"
#include "against.hpp"

namespace m3::tools {

namespace {

const char* kSummary =
    "Without --reference: times the GPU path per shape of --shapes (default, official): forward\n"
    "and forward+backward per layer (CUDA events, median of --repeats after --warmup), tokens/s,\n"
    "both scan modes, plus one pass of the float reference (chunked) on the same shape.\n"
    "--reference: times the Eigen reference forward and backward in double and float on the\n"
    "problem options' shape (default preset: B=2, T=256), both scan modes.\n"
    "--ceilings: measures the device's ceilings only: device-to-device copy bandwidth (bytes\n"
    "read + written, 2 GiB buffers) and cuBLAS GEMM rates (8192^3; bf16 and f16 with f32\n"
    "compute, f32 pedantic without TF32); CUDA events, median of 10 after 2 warm-up.\n"
    "--graph: the GPU rows time replays of CUDA graphs of the forward and forward+backward,\n"
    "recorded once after the warm-up, instead of stream launches.\n"
    "--profile: measures the ceilings once, then after each GPU row one line per stage of one\n"
    "forward+backward: time, the stage's minimum bytes and FLOPs, achieved GB/s and TFLOP/s\n"
    "against the ceilings, the floor, time over floor, and whether memory or compute bounds it.";

struct Shape {
  std::string name;
  Config cfg;
  Idx B, T;
};

Shape bench_shape(const std::string& name) {
  Shape s{name, Config{}, 2, 256};
  if (name == "default") return s;
  if (name == "official" || name == "official2") {
    s.cfg = harness::official_config();
    if (name == "official2") s.cfg.n_layers = 2;
    s.B = 8;
    s.T = 4096;
    return s;
  }
  throw UsageError("--shapes: unknown bench shape '" + name +
                   "' (default, official, official2)");
}

std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

void print_ceilings(const gpu::Ceilings& c) {
  char what[96], b[200];
  std::cout << "ceilings: CUDA events, median of " << c.repeats << " after " << c.warmup
            << " warm-up\n";
  std::snprintf(what, sizeof what, "copy  D2D cudaMemcpyAsync, %.2f GiB",
                static_cast<double>(c.copy_bytes) / (1 << 30));
  std::snprintf(b, sizeof b, "  %-40s %9.3f ms %9.1f GB/s (bytes read + written)\n", what,
                c.copy_ms, c.copy_bytes_per_s * 1e-9);
  std::cout << b;
  for (const gpu::GemmCeiling* g : {&c.bf16, &c.f16, &c.f32}) {
    std::snprintf(what, sizeof what, "gemm  %-4s %d^3, %s", precision_name(g->type), c.gemm_n,
                  g->type == Precision::F32 ? "f32 pedantic (no TF32)" : "f32 compute");
    std::snprintf(b, sizeof b, "  %-40s %9.3f ms %9.1f TFLOP/s (spot check %.1e)\n", what,
                  g->ms, g->flops_per_s * 1e-12, g->check_err);
    std::cout << b;
  }
}

// One line per stage of t.stages against the work model of (shape, mode, p) and the ceilings.
void print_profile(const gpu::GpuTiming& t, const Config& cfg, Idx B, Idx T, ScanMode mode,
                   Precision p, const gpu::Ceilings& c) {
  harness::Roof roof;
  roof.bytes_per_s = c.copy_bytes_per_s;
  roof.matrix_flops_per_s = c.gemm(p).flops_per_s;
  roof.fma32_flops_per_s = c.f32.flops_per_s;
  const auto work = harness::stage_work(cfg, B, T, mode, p);
  const auto rows = harness::roofline_rows(t.stages, work, roof);
  char b[256];
  std::snprintf(b, sizeof b,
                "    stage profile, one forward+backward, all layers; gemm = %s GEMM %.1f TFLOP/s, "
                "fma32 = f32 GEMM %.1f TFLOP/s, copy %.0f GB/s\n",
                precision_name(p), roof.matrix_flops_per_s * 1e-12,
                roof.fma32_flops_per_s * 1e-12, roof.bytes_per_s * 1e-9);
  std::cout << b;
  std::snprintf(b, sizeof b, "    %-16s %9s %6s %10s %8s %6s %10s %8s %6s %-5s %9s %7s  %s\n",
                "stage", "ms", "%tot", "MB", "GB/s", "%copy", "GFLOP", "TFLOP/s", "%peak", "unit",
                "floor_ms", "x_floor", "bound");
  std::cout << b;
  auto line = [&](const harness::RooflineRow& r) {
    if (!r.modeled) {
      std::snprintf(b, sizeof b, "    %-16s %9.3f %6.1f %10s\n", r.stage.c_str(), r.ms,
                    100 * r.share, "(no model)");
      std::cout << b;
      return;
    }
    char flops[64] = "", floor[48] = "";
    if (r.flops > 0) {
      std::snprintf(flops, sizeof flops, "%10.3f %8.2f %6.1f %-5s", r.flops * 1e-9,
                    r.flops_per_s * 1e-12, 100 * r.flop_fraction,
                    r.stage == "total" ? "" : harness::flop_unit_name(r.unit));
    } else {
      std::snprintf(flops, sizeof flops, "%10s %8s %6s %-5s", "-", "-", "-", "");
    }
    if (r.floor_ms > 0) {
      std::snprintf(floor, sizeof floor, "%9.3f %7.1f", r.floor_ms, r.ms / r.floor_ms);
    } else {
      std::snprintf(floor, sizeof floor, "%9s %7s", "-", "-");
    }
    std::snprintf(b, sizeof b, "    %-16s %9.3f %6.1f %10.2f %8.1f %6.1f %s %s  %s\n",
                  r.stage.c_str(), r.ms, 100 * r.share, r.bytes * 1e-6, r.bytes_per_s * 1e-9,
                  100 * r.bw_fraction, flops, floor, r.bound());
    std::cout << b;
  };
  for (const auto& r : rows) line(r);
  line(harness::roofline_total(rows));
}

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// The marginal layer of two runs of one shape with 1 and 2 layers: their differences.
harness::MarginalLayer marginal_layer(const std::string& label, const gpu::GpuTiming& one,
                                      const gpu::GpuTiming& two) {
  return {label, two.forward_ms - one.forward_ms,
          two.forward_backward_ms - one.forward_backward_ms,
          (static_cast<double>(two.peak_bytes) - static_cast<double>(one.peak_bytes)) / kGiB};
}

// Where a row's bytes are (GpuBackbone::memory(), production layout): per layer (the last
// layer's; layer 0 also holds H⁰ in f32), the shared workspace, the parameter arenas, the
// states, the scratch and a token model's buffers.
void print_memory(const gpu::GpuTiming& t) {
  const gpu::BackboneMemory& m = t.memory;
  const double per_layer = m.layers.empty() ? 0.0 : static_cast<double>(m.layers.back());
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "  bytes: %.3f GiB per layer, workspace %.3f, backbone %.3f, parameters %.3f, "
                "states %.3f, scratch %.3f, tokens %.3f GiB",
                per_layer / kGiB, m.workspace / kGiB, m.backbone / kGiB, m.params / kGiB,
                m.states / kGiB, m.scratch / kGiB, m.tokens / kGiB);
  std::cout << buf << "\n";
}

void bench_gpu_shapes(const std::vector<Shape>& shapes, const std::vector<ScanMode>& modes,
                      const std::vector<Precision>& precisions,
                      const std::vector<Recompute>& recomputes, int warmup, int repeats,
                      bool with_reference, bool profile, bool graph, bool cluster_tail,
                      const std::optional<harness::OtherFigures>& against) {
  gpu::GpuContext ctx(0);
  std::cout << "m3h bench: GPU path, CUDA events, median of " << repeats
            << " after " << warmup << " warm-up, "
            << (graph ? "CUDA graph replays (recorded after the warm-up)" : "stream launches")
            << (cluster_tail ? ", B6's tail inside B3 (--cluster-tail)" : "") << "\n"
            << "gpu: " << gpu::describe(gpu::query_device()) << "\n\n";
  gpu::Ceilings ceilings;
  if (profile) {  // once per process, before any backbone holds device memory
    ceilings = gpu::measure_ceilings(ctx);
    print_ceilings(ceilings);
    std::cout << "\n";
  }
  char buf[256];
  std::snprintf(buf, sizeof buf, "%-9s %-5s %-8s %-4s %7s %6s %12s %14s %14s %12s %9s %14s",
                "shape", "dtype", "scan", "rc", "layers", "B*T", "fwd_ms", "fwd_ms/layer",
                "fwdbwd_ms/lyr", "Mtok/s/lyr", "peak_GiB", "ref_fb_ms/lyr");
  std::cout << buf << "\n" << std::string(std::char_traits<char>::length(buf), '-') << "\n";
  std::map<std::string, gpu::GpuTiming> official[2];  // (dtype scan) → timing, 1 and 2 layers
  for (const auto& sh : shapes) {
    for (Precision p : precisions) {
    for (ScanMode m : modes) {
    for (Recompute rc : recomputes) {
      // The recompute policy only changes the chunked mode: one sequential row.
      if (m == ScanMode::Sequential && rc != recomputes.front()) continue;
      const gpu::GpuTiming t =
          gpu::bench_gpu(ctx, sh.cfg, sh.B, sh.T, m, warmup, repeats, profile, p, graph, rc,
                         cluster_tail);
      const double L = static_cast<double>(sh.cfg.n_layers);
      const double tok = static_cast<double>(sh.B * sh.T);
      std::string ref = "-";
      const bool seq_too_big = m == ScanMode::Sequential && sh.name.rfind("official", 0) == 0;
      if (sh.name == "official" || sh.name == "official2")
        official[sh.name == "official2"][std::string(precision_name(p)) + " " +
                                         scan_mode_name(m) + " rc=" + recompute_name(rc)] = t;
      if (with_reference && !seq_too_big && p == Precision::F32) {
        harness::BenchSpec spec;
        spec.cfg = sh.cfg;
        spec.B = sh.B;
        spec.T = sh.T;
        spec.repeats = 1;
        spec.warmup = 0;
        spec.modes = {m};
        const auto rows = harness::bench_reference_float(spec);
        std::snprintf(buf, sizeof buf, "%.1f", (rows.front().forward_ms + rows.front().backward_ms) / L);
        ref = buf;
      } else if (seq_too_big) {
        ref = "n/a (34 GB)";
      }
      std::snprintf(buf, sizeof buf,
                    "%-9s %-5s %-8s %-4s %7lld %6lld %12.3f %14.3f %14.3f %12.3f %9.2f %14s",
                    sh.name.c_str(), precision_name(p), scan_mode_name(m),
                    m == ScanMode::Chunked ? recompute_name(rc) : "-",
                    static_cast<long long>(sh.cfg.n_layers), static_cast<long long>(sh.B * sh.T),
                    t.forward_ms, t.forward_ms / L, t.forward_backward_ms / L,
                    tok / (t.forward_backward_ms / L) * 1e-3, t.peak_bytes / kGiB, ref.c_str());
      std::cout << buf << std::endl;
      print_memory(t);
      if (profile) print_profile(t, sh.cfg, sh.B, sh.T, m, p, ceilings);
    }
    }
    }
  }
  const Shape off = bench_shape("official");
  for (const auto& [key, one] : official[0]) {
    const auto two = official[1].find(key);
    if (two == official[1].end()) continue;
    const harness::MarginalLayer mt = marginal_layer(key, one, two->second);
    std::snprintf(buf, sizeof buf,
                  "marginal layer (official2 - official), %-20s: fwd %.3f ms, fwd+bwd %.3f ms, "
                  "%.3f Mtok/s",
                  key.c_str(), mt.fwd_ms, mt.fwdbwd_ms,
                  static_cast<double>(off.B * off.T) / mt.fwdbwd_ms * 1e-3);
    std::cout << buf << "\n";
    const double per_layer = static_cast<double>(two->second.peak_bytes) -
                             static_cast<double>(one.peak_bytes);
    const double fixed = static_cast<double>(one.peak_bytes) - per_layer;
    const double fits =
        per_layer > 0 ? std::floor((static_cast<double>(one.device_total) - fixed) / per_layer) : 0;
    std::snprintf(buf, sizeof buf,
                  "  memory: %.3f GiB per further layer, %.0f bytes per token per layer, peak %.2f "
                  "GiB (1 layer) / %.2f GiB (2); %.0f layers fit in the device's %.1f GiB",
                  per_layer / kGiB, per_layer / static_cast<double>(off.B * off.T),
                  one.peak_bytes / kGiB, two->second.peak_bytes / kGiB, fits,
                  one.device_total / kGiB);
    std::cout << buf << "\n";
  }
  if (against) {
    std::vector<harness::MarginalLayer> ours;
    for (const auto& [key, one] : official[0]) {
      const auto two = official[1].find(key);
      if (two == official[1].end() || key.rfind(precision_name(against->dtype), 0) != 0 ||
          key.find("chunked") == std::string::npos)
        continue;
      ours.push_back(marginal_layer(key.substr(key.find(' ') + 1), one, two->second));
    }
    std::cout << "\n";
    if (ours.empty()) {
      std::cout << "beside: no " << precision_name(against->dtype)
                << " chunked marginal layer was measured (--against needs --shapes "
                   "official,official2 and that dtype)\n";
    } else {
      for (const std::string& l : harness::against_lines(*against, ours)) std::cout << l << "\n";
    }
  }
  std::cout << "\nMtok/s/lyr: training throughput per layer = B*T / (forward+backward time per "
               "layer); ref_fb_ms/lyr: float reference, one forward+backward pass, per layer\n";
  if (profile)
    std::cout << "profile: one extra forward+backward, events between stages (its total can differ "
                 "from fwdbwd_ms);\n"
                 "  MB, GFLOP: the stage's minimum work (each tensor read once and written once at "
                 "its storage size;\n"
                 "  FLOPs of the GEMMs and scans only; see harness/roofline.hpp);\n"
                 "  %copy, %peak: achieved rate over the ceiling (peak: gemm or fma32, the unit "
                 "column);\n"
                 "  floor_ms = max(bytes / copy, FLOPs / peak); x_floor = ms / floor_ms; bound: the "
                 "larger floor term\n";
}

// --memory-plan: one block per (shape, precision, scan mode, recompute policy): the bytes of
// each lifetime per layer, then the saved tensors from the largest, each at least 2 % of the
// saved total, the rest summed in one line.
void print_memory_plan(const Shape& sh, Precision p, ScanMode mode, Recompute rc) {
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0, kShown = 0.02;
  const auto tensors = layer_tensor_bytes(sh.cfg, sh.B, sh.T, mode, p, rc);
  const LayerBytes lb = layer_bytes(sh.cfg, sh.B, sh.T, mode, p, rc);
  std::vector<LayerTensorBytes> saved;
  for (const LayerTensorBytes& t : tensors)
    if (t.life == Life::Saved) saved.push_back(t);
  std::stable_sort(saved.begin(), saved.end(), [](const LayerTensorBytes& a,
                                                  const LayerTensorBytes& b) {
    return a.bytes > b.bytes;
  });
  char line[200];
  std::cout << sh.name << " (B " << sh.B << ", T " << sh.T << ", d_model "
            << sh.cfg.d_model << ", headdim " << sh.cfg.headdim << ", d_state " << sh.cfg.d_state
            << "): " << precision_name(p) << " " << scan_mode_name(mode);
  if (mode == ScanMode::Chunked) std::cout << ", recompute " << recompute_name(rc);
  std::snprintf(line, sizeof line,
                "\n  saved per further layer %.3f GiB (%.1f kB per token); workspace %.3f GiB (one "
                "set)\n",
                lb.saved / kGiB, lb.saved / 1e3 / static_cast<double>(sh.B * sh.T),
                lb.workspace / kGiB);
  std::cout << line;
  std::size_t rest = 0;
  int n_rest = 0;
  for (const LayerTensorBytes& t : saved) {
    const double share = lb.saved ? static_cast<double>(t.bytes) / lb.saved : 0;
    if (share < kShown) {
      rest += t.bytes;
      ++n_rest;
      continue;
    }
    const std::string key = std::string(t.spec->stage) + "/" + t.spec->tensor;
    const std::string shape = shape_str(resolve_shape(t.spec->shape, sh.cfg, sh.B, sh.T));
    std::snprintf(line, sizeof line, "  %-26s %-5s %-22s %7.3f GiB %5.1f %%\n", key.c_str(),
                  t.spec->typed ? precision_name(p) : "f32", shape.c_str(), t.bytes / kGiB,
                  100 * share);
    std::cout << line;
  }
  if (n_rest > 0) {
    std::snprintf(line, sizeof line, "  %-55s %7.3f GiB %5.1f %%\n",
                  (std::to_string(n_rest) + " smaller tensors").c_str(), rest / kGiB,
                  lb.saved ? 100.0 * rest / lb.saved : 0.0);
    std::cout << line;
  }
}

}  // namespace

int cmd_bench(const std::vector<std::string>& args) {
  po::options_description run("Benchmark");
  // clang-format off
  run.add_options()
    ("help,h", "this help")
    ("reference", po::bool_switch(), "time the Eigen CPU reference only (double and float)")
    ("shapes", po::value<std::string>()->default_value("default,official"), "GPU bench shapes (comma list of default, official, official2)")
    ("no-reference", po::bool_switch(), "GPU rows without the reference time of the same shape")
    ("profile", po::bool_switch(), "measure the ceilings, then after each GPU row a table of its stages against them")
    ("graph", po::bool_switch(), "time replays of CUDA graphs of the forward and the forward+backward (recorded once after the warm-up) instead of stream launches")
    ("ceilings", po::bool_switch(), "measure and print the device's ceilings only")
    ("memory-plan", po::bool_switch(), "per shape, dtype, scan mode and recompute policy: what one further layer keeps for its backward, by tensor (the registry's count); runs nothing, needs no device")
    ("cluster-tail", po::bool_switch(), "the chunked GPU rows with B6's tail inside B3 in clusters of heads (GpuBackbone::set_cluster_tail; default: the standalone tail kernel)")
    ("recompute", po::value<std::string>()->default_value("none,scan"), "production recompute policies of the chunked GPU rows (comma list of none, scan; the library's default is none)")
    ("dtype", po::value<std::string>()->default_value("f32,bf16"), "GPU storage precisions (comma list of f32, bf16, f16); the reference time is shown on the f32 rows")
    ("repeats", po::value<int>()->default_value(5), "timed repeats (the median is reported)")
    ("warmup", po::value<int>()->default_value(1), "untimed warm-up passes")
    ("scan", po::value<std::string>()->default_value("seq,chunked"), "scan modes: seq, chunked, or both (comma list)")
    ("against", po::value<std::string>(), "FILE: another implementation's figures (docs/data/official-block-h100.txt, written by scripts/official/time_block.py) beside the marginal layers of its dtype");
  // clang-format on
  po::options_description all;
  all.add(run).add(problem_options());
  const po::variables_map vm = parse_args(args, all, "bench");
  if (vm.count("help")) {
    print_command_help("bench", kSummary, all);
    return 0;
  }
  const int repeats = vm["repeats"].as<int>(), warmup = vm["warmup"].as<int>();
  if (repeats < 1) throw UsageError("--repeats must be >= 1");
  if (warmup < 0) throw UsageError("--warmup must be >= 0");
  const std::vector<ScanMode> modes = parse_scan_list(vm["scan"].as<std::string>());
  // Every argument is checked before anything runs, GPU or not.
  std::vector<Shape> shapes;
  for (const auto& n : split_commas(vm["shapes"].as<std::string>()))
    shapes.push_back(bench_shape(n));
  if (shapes.empty()) throw UsageError("--shapes: no shape given");
  const std::vector<Precision> precisions = parse_dtype_list(vm["dtype"].as<std::string>());
  std::vector<Recompute> recomputes;
  for (const auto& n : split_commas(vm["recompute"].as<std::string>())) {
    try {
      recomputes.push_back(parse_recompute(n));
    } catch (const Error&) {
      throw UsageError("--recompute: unknown policy '" + n + "' (expected none or scan)");
    }
  }
  if (recomputes.empty()) throw UsageError("--recompute: no policy given");
  std::optional<harness::OtherFigures> against;
  if (vm.count("against")) against = harness::read_other_figures(vm["against"].as<std::string>());

  bool reference_only = vm["reference"].as<bool>();
  const bool ceilings = vm["ceilings"].as<bool>();
  if (vm["memory-plan"].as<bool>()) {
    for (const char* timed :
         {"reference", "ceilings", "graph", "profile", "cluster-tail", "no-reference"})
      if (vm[timed].as<bool>())
        throw UsageError(std::string("--memory-plan runs nothing: not with --") + timed);
    if (against) throw UsageError("--memory-plan runs nothing: not with --against");
    bool first = true;
    for (const Shape& sh : shapes)
      for (Precision p : precisions)
        for (ScanMode mode : modes)
          for (Recompute rc : recomputes) {
            // The recompute policy acts on the chunked scan only: the sequential mode once.
            if (mode == ScanMode::Sequential && rc != recomputes.front()) continue;
            if (!first) std::cout << "\n";
            first = false;
            print_memory_plan(sh, p, mode, rc);
          }
    std::cout << "\nthe registry's count (registry.hpp layer_tensor_bytes); a further layer also "
                 "holds its parameters,\ntheir gradients and typed copies, and its state buffers "
                 "(m3h bench measures the whole)\n";
    return 0;
  }
  for (const char* gpu_only : {"graph", "profile"})
    if (vm[gpu_only].as<bool>() && (reference_only || ceilings))
      throw UsageError(std::string("--") + gpu_only + " applies to the GPU rows, not to " +
                       (reference_only ? "--reference" : "--ceilings"));
  if (ceilings) {
    if (reference_only) throw UsageError("--ceilings and --reference exclude each other");
    const std::string absent = harness::gpu_absent_reason();
    if (!absent.empty()) throw Error("m3h bench --ceilings", "no GPU", absent);
    gpu::GpuContext ctx(0);
    std::cout << "gpu: " << gpu::describe(gpu::query_device()) << "\n";
    print_ceilings(gpu::measure_ceilings(ctx));
    return 0;
  }
  if (!reference_only) {
    const std::string absent = harness::gpu_absent_reason();
    // What only the GPU rows do cannot fall back to the reference: asked for, it needs a GPU,
    // as --ceilings does.
    if (!absent.empty())
      for (const char* gpu_only : {"profile", "graph", "cluster-tail"})
        if (vm[gpu_only].as<bool>())
          throw Error(std::string("m3h bench --") + gpu_only, "no GPU", absent);
    if (absent.empty()) {
      bench_gpu_shapes(shapes, modes, precisions, recomputes, warmup, repeats,
                       !vm["no-reference"].as<bool>(),
                       vm["profile"].as<bool>(), vm["graph"].as<bool>(),
                       vm["cluster-tail"].as<bool>(), against);
      return 0;
    }
    std::cout << "m3h: no GPU (" << absent << "): timing the reference only\n";
    reference_only = true;
  }

  const harness::RunSpec p = problem_from(vm);
  harness::BenchSpec spec;
  spec.cfg = p.cfg;
  spec.B = p.B;
  spec.T = p.T;
  spec.seed = p.seed;
  spec.repeats = repeats;
  spec.warmup = warmup;
  spec.modes = modes;
  {
    harness::RunSpec guard = p;
    guard.modes = modes;
    check_host_memory(vm, guard);
  }
  const std::vector<harness::BenchRow> rows = harness::bench_reference(spec);
  harness::print_bench(std::cout, spec, rows);
  return 0;
}

}  // namespace m3::tools
