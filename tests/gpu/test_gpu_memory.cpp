// The production layout of the GPU backbone (reference/registry.hpp Life, Recompute) and its
// flat parameter arenas, on the device:
//  * a production pass (no Capture: saved tensors per layer, one workspace for all layers,
//    verification-only tensors nowhere) gives the bits of a run in the verification layout —
//    with every workspace buffer poisoned between forward and backward (so no value the
//    backward reads may live in the workspace), under both recompute policies, every dtype,
//    both scan modes;
//  * every saved tensor is read by the backward: NaN in one changes the gradients (so nothing
//    is kept that the backward does not need);
//  * the bytes follow the registry (column views of proj / d_proj have no bytes of their own):
//    each further layer holds exactly layer_bytes().saved plus
//    its state buffers, the process-wide count grows by exactly memory().total(), and a
//    production forward+backward allocates nothing;
//  * the arenas: set_params puts each parameter at its ParamLayout slot (gaps zero), grads()
//    reads the gradient arena by the same layout, and refresh_typed_copies() after a change of
//    the masters on the device gives the bits of set_params with the changed values.
// Skips itself, with the reason, when no CUDA device is present.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <utility>
#include <string>
#include <vector>

#include "backbone.hpp"
#include "backbone_gpu.hpp"
#include "device.hpp"
#include "error.hpp"
#include "gpu_test_util.hpp"
#include "params.hpp"
#include "problem.hpp"
#include "registry.hpp"

namespace {

using m3::Config;
using m3::Idx;
using m3::Precision;
using m3::Problem;
using m3::Recompute;
using m3::ScanMode;
using m3::gpu::GpuBackbone;

m3::gpu::GpuContext& ctx() {
  static m3::gpu::GpuContext c(0);
  return c;
}

Config small(Idx hd, Idx ds, Idx layers, bool outnorm, double rope, Idx ngroups, Idx cs) {
  Config c;
  c.headdim = hd;
  c.d_state = ds;
  c.d_model = 2 * hd;  // 4 heads
  c.expand = 2;
  c.ngroups = ngroups;
  c.n_layers = layers;
  c.rope_fraction = rope;
  c.is_outproj_norm = outnorm;
  c.input_dim = c.d_model + 3;
  c.chunk_size = cs;
  return c;
}

struct Case {
  std::string name;
  Config cfg;
  Idx B, T;
};

std::vector<Case> cases() {
  Config id = small(32, 16, 2, true, 1.0, 1, 16);
  id.input_proj_identity = true;
  id.input_dim = id.d_model;
  return {{"hd16_ds32_L3_outnorm_ng2_cs16", small(16, 32, 3, true, 0.5, 2, 16), 2, 45},
          {"hd32_ds64_L2_silu_rope1", small(32, 64, 2, false, 1.0, 1, 32), 1, 70},
          {"hd32_ds16_L2_identity", id, 2, 33},
          {"hd16_ds2_L2_na0", small(16, 2, 2, false, 0.5, 1, 8), 2, 20}};
}

struct Outcome {
  std::vector<float> out, dx;
  m3::Params<float> grads;
  m3::States<float> leaving, d_entering;
};

bool same(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Empty when a and b hold the same bits, else the first thing that differs.
std::string first_difference(const Outcome& a, const Outcome& b) {
  if (!same(a.out, b.out)) return "Out";
  if (!same(a.dx, b.dx)) return "d_x";
  const std::pair<const m3::States<float>*, const m3::States<float>*> pairs[] = {
      {&a.leaving, &b.leaving}, {&a.d_entering, &b.d_entering}};
  for (const auto& [s, t] : pairs) {
    const std::string what = s == &a.leaving ? "leaving " : "d_entering ";
    if (!same(s->ssm, t->ssm)) return what + "ssm";
    if (!same(s->k, t->k)) return what + "k";
    if (!same(s->v, t->v)) return what + "v";
    if (!same(s->angle, t->angle)) return what + "angle";
  }
  std::vector<const std::vector<float>*> rhs;
  m3::for_each_param(b.grads, [&](int, const char*, const std::vector<float>& v) {
    rhs.push_back(&v);
  });
  std::string diff;
  size_t i = 0;
  m3::for_each_param(a.grads, [&](int l, const char* name, const std::vector<float>& v) {
    if (diff.empty() && !same(v, *rhs[i])) diff = m3::param_key(l, name);
    ++i;
  });
  return diff;
}

// poison(net) runs between forward and backward.
template <class F>
Outcome run(GpuBackbone& net, const Problem& pb, bool capture, F&& poison) {
  m3::gpu::load_problem(net, pb);
  m3::Capture cap(pb.cfg, pb.B, pb.T);
  net.forward(capture ? &cap : nullptr);
  poison(net);
  net.backward(capture ? &cap : nullptr);
  net.synchronize();
  return {net.output(), net.d_x(), net.grads(), net.states(), net.d_entering()};
}
Outcome run(GpuBackbone& net, const Problem& pb, bool capture) {
  return run(net, pb, capture, [](GpuBackbone&) {});
}

constexpr Precision kDtypes[] = {Precision::F32, Precision::BF16, Precision::F16};
constexpr Recompute kPolicies[] = {Recompute::None, Recompute::Scan};

TEST(GpuMemory, ProductionLayoutGivesTheBitsOfTheVerificationLayout) {
  M3_SKIP_WITHOUT_GPU();
  for (const Case& c : cases()) {
    const Problem pb = m3::make_problem(c.cfg, c.B, c.T, 21, true);
    for (Precision p : kDtypes)
      for (ScanMode mode : {ScanMode::Sequential, ScanMode::Chunked}) {
        GpuBackbone full(ctx(), c.cfg, c.B, c.T, mode, p);
        const Outcome want = run(full, pb, true);
        ASSERT_TRUE(full.verification_layout());
        for (Recompute rc : kPolicies) {
          const std::string what = c.name + " " + m3::precision_name(p) + " " +
                                   m3::scan_mode_name(mode) + " rc=" + m3::recompute_name(rc);
          GpuBackbone net(ctx(), c.cfg, c.B, c.T, mode, p, rc);
          const Outcome plain = run(net, pb, false);
          ASSERT_FALSE(net.verification_layout()) << what;
          EXPECT_EQ(first_difference(want, plain), "") << what;
          // A second pass on the same net, the workspace full of NaN between forward and
          // backward: nothing the backward reads may be workspace.
          const Outcome poisoned = run(net, pb, false, [](GpuBackbone& n) {
            n.poison_for_testing(0, "*workspace*");
          });
          EXPECT_EQ(first_difference(want, poisoned), "")
              << what << ": workspace poisoned between forward and backward";
        }
      }
  }
}

// NaN in any one saved tensor of any layer, after the forward, must reach the backward's
// results: a tensor listed as saved that the backward never reads fails here.
TEST(GpuMemory, EverySavedTensorIsReadByTheBackward) {
  M3_SKIP_WITHOUT_GPU();
  const Case c = cases()[0];  // 3 layers, gated norm, 2 groups, several chunks
  const Problem pb = m3::make_problem(c.cfg, c.B, c.T, 23, true);
  int checked = 0;
  for (ScanMode mode : {ScanMode::Sequential, ScanMode::Chunked})
    for (Recompute rc : kPolicies) {
      if (mode == ScanMode::Sequential && rc == Recompute::Scan) continue;
      GpuBackbone net(ctx(), c.cfg, c.B, c.T, mode, Precision::BF16, rc);
      const Outcome clean = run(net, pb, false);
      for (const auto& spec : m3::stage_registry()) {
        if (spec.scope != m3::Scope::Layer || !m3::exists_in(spec, c.cfg, mode)) continue;
        const m3::Life life = m3::lifetime(spec, mode, rc);
        if (life != m3::Life::Saved && life != m3::Life::View) continue;
        for (int l = 0; l < static_cast<int>(c.cfg.n_layers); ++l) {
          if (life == m3::Life::View && l > 0) continue;  // no buffer of its own
          const Outcome hit = run(net, pb, false, [&](GpuBackbone& n) {
            n.poison_for_testing(l, spec.tensor);
          });
          EXPECT_NE(first_difference(clean, hit), "")
              << m3::scan_mode_name(mode) << " rc=" << m3::recompute_name(rc) << ": L" << l
              << "/" << spec.stage << "/" << spec.tensor
              << " is listed as saved, but the backward does not read it";
          ++checked;
        }
      }
    }
  EXPECT_GT(checked, 100);
}

std::size_t state_buffer_bytes(const Config& cfg, Idx B) {
  const m3::StateSizes z = m3::state_sizes(cfg);
  return 2 * 4 * static_cast<std::size_t>(B * (z.ssm + z.k + z.v + z.angle));
}

TEST(GpuMemory, LayerBytesFollowTheRegistryAndPassesAllocateNothing) {
  M3_SKIP_WITHOUT_GPU();
  for (const Case& c : cases())
    for (Precision p : kDtypes)
      for (ScanMode mode : {ScanMode::Sequential, ScanMode::Chunked})
        for (Recompute rc : kPolicies) {
          const std::string what = c.name + " " + m3::precision_name(p) + " " +
                                   m3::scan_mode_name(mode) + " rc=" + m3::recompute_name(rc);
          const Problem pb = m3::make_problem(c.cfg, c.B, c.T, 25, true);
          const std::size_t before = m3::gpu::device_bytes_live();
          GpuBackbone net(ctx(), c.cfg, c.B, c.T, mode, p, rc);
          const m3::gpu::BackboneMemory m = net.memory();
          EXPECT_EQ(m3::gpu::device_bytes_live() - before, m.total())
              << what << ": an allocation outside memory()'s roles";
          const m3::LayerBytes plan = m3::layer_bytes(c.cfg, c.B, c.T, mode, p, rc);
          const std::size_t extra = state_buffer_bytes(c.cfg, c.B);
          ASSERT_EQ(m.layers.size(), static_cast<size_t>(c.cfg.n_layers));
          EXPECT_EQ(m.layers[0], plan.saved + plan.view + extra) << what << ": layer 0";
          for (size_t l = 1; l < m.layers.size(); ++l)
            EXPECT_EQ(m.layers[l], plan.saved + extra) << what << ": layer " << l;
          // One workspace for all layers (the residual-stream gradient alternating with
          // norm_f's d_norm, so no layer count needs more).
          EXPECT_LE(m.workspace, plan.workspace) << what;
          EXPECT_GT(m.workspace, 0u) << what;
          // Production passes allocate nothing (and free nothing).
          m3::gpu::load_problem(net, pb);
          m3::gpu::reset_device_bytes_peak();
          const std::size_t live = m3::gpu::device_bytes_live();
          net.forward();
          net.backward();
          net.synchronize();
          EXPECT_EQ(m3::gpu::device_bytes_live(), live) << what;
          EXPECT_EQ(m3::gpu::device_bytes_peak(), live) << what << ": a pass allocated";
          // The verification layout: every tensor its own buffer in every layer.
          m3::Capture cap(c.cfg, c.B, c.T);
          net.forward(&cap);
          EXPECT_TRUE(net.verification_layout());
          const m3::gpu::BackboneMemory full = net.memory();
          for (size_t l = 0; l < full.layers.size(); ++l)
            EXPECT_EQ(full.layers[l],
                      plan.saved + plan.view + plan.columns + plan.workspace + plan.verify +
                          extra)
                << what << ": verification layout, layer " << l;
          EXPECT_EQ(full.workspace, 0u) << what;
        }
}

// Every device byte the backbone holds is in one of memory()'s roles, a token model's buffers
// and the entering-state copy of repeat_digests included; a production training step
// (tokens, targets, loss, backward) allocates nothing either.
TEST(GpuMemory, TokenModelBuffersAreCountedAndATrainingStepAllocatesNothing) {
  M3_SKIP_WITHOUT_GPU();
  Config cfg = small(16, 16, 2, false, 0.5, 1, 16);
  cfg.vocab_size = 19;
  cfg.input_dim = cfg.vocab_size;
  const Idx B = 2, T = 40;
  for (Precision p : kDtypes) {
    const std::size_t before = m3::gpu::device_bytes_live();
    GpuBackbone net(ctx(), cfg, B, T, ScanMode::Chunked, p);
    const m3::gpu::BackboneMemory m = net.memory();
    EXPECT_EQ(m3::gpu::device_bytes_live() - before, m.total()) << m3::precision_name(p);
    EXPECT_GT(m.tokens, 4u * static_cast<std::size_t>(B * T)) << m3::precision_name(p);
    EXPECT_EQ(m.digests, 0u);
    std::vector<std::int32_t> tok(static_cast<size_t>(B * T)), tgt(tok.size());
    for (size_t i = 0; i < tok.size(); ++i) {
      tok[i] = static_cast<std::int32_t>((7 * i + 3) % 19);
      tgt[i] = static_cast<std::int32_t>((5 * i + 1) % 19);
    }
    const Problem pb = m3::make_problem(cfg, B, T, 31, true);
    m3::gpu::load_problem(net, pb);
    net.set_tokens(tok);
    net.set_targets(tgt, std::vector<float>(tok.size(), 1.0f), static_cast<double>(tok.size()));
    net.synchronize();
    m3::gpu::reset_device_bytes_peak();
    const std::size_t live = m3::gpu::device_bytes_live();
    const double loss = net.forward_loss();
    net.backward_loss(1.0);
    net.synchronize();
    EXPECT_TRUE(std::isfinite(loss));
    EXPECT_EQ(m3::gpu::device_bytes_live(), live) << m3::precision_name(p);
    EXPECT_EQ(m3::gpu::device_bytes_peak(), live) << m3::precision_name(p) << ": a step allocated";
  }
}

// A capture must start at the forward: the production forward does not keep what a Capture of
// the backward compares.
TEST(GpuMemory, ACaptureOfTheBackwardAloneIsRefusedWithAMessage) {
  M3_SKIP_WITHOUT_GPU();
  const Case c = cases()[1];
  const Problem pb = m3::make_problem(c.cfg, c.B, c.T, 27, true);
  GpuBackbone net(ctx(), c.cfg, c.B, c.T, ScanMode::Chunked, Precision::BF16);
  m3::gpu::load_problem(net, pb);
  net.forward();
  m3::Capture cap(c.cfg, c.B, c.T);
  try {
    net.backward(&cap);
    FAIL() << "backward(Capture) after a production forward did not throw";
  } catch (const m3::Error& e) {
    EXPECT_NE(std::string(e.what()).find("verification layout"), std::string::npos) << e.what();
  }
}

// Host copies of the arenas on the legacy stream, ordered with the backbone's own stream
// (a non-blocking one) by a full synchronisation on each side.
std::vector<float> download(GpuBackbone& net, const float* dev, Idx n) {
  std::vector<float> h(static_cast<size_t>(n));
  net.synchronize();
  EXPECT_EQ(cudaMemcpy(h.data(), dev, h.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  return h;
}
void upload(GpuBackbone& net, float* dev, const std::vector<float>& h) {
  net.synchronize();
  ASSERT_EQ(cudaMemcpy(dev, h.data(), h.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

TEST(GpuMemory, ArenasFollowTheParamLayoutAndOneRefreshUpdatesTheTypedCopies) {
  M3_SKIP_WITHOUT_GPU();
  for (const Case& c : {cases()[0], cases()[2]}) {
    const Problem pb = m3::make_problem(c.cfg, c.B, c.T, 29, true);
    for (Precision p : kDtypes) {
      const std::string what = c.name + " " + m3::precision_name(p);
      GpuBackbone net(ctx(), c.cfg, c.B, c.T, ScanMode::Chunked, p);
      m3::gpu::load_problem(net, pb);
      const m3::ParamLayout& lay = net.param_layout();
      const std::vector<float> arena = download(net, net.param_arena(), lay.total);
      // Each parameter at its slot, the gaps zero.
      const m3::Params<float> params = m3::cast_params<float>(pb.params);
      std::vector<char> covered(arena.size(), 0);
      m3::Params<float> pc = params;
      m3::for_each_param(pc, [&](int l, const char* name, std::vector<float>& v) {
        if (v.empty()) return;
        const m3::ParamSlot& s = lay.at(l, name);
        ASSERT_EQ(static_cast<Idx>(v.size()), s.size) << what << " " << s.name;
        EXPECT_TRUE(std::memcmp(v.data(), arena.data() + s.offset, v.size() * 4) == 0)
            << what << ": " << s.name << " is not at its slot";
        std::fill(covered.begin() + s.offset, covered.begin() + s.offset + s.size, 1);
      });
      for (size_t i = 0; i < arena.size(); ++i) {
        if (covered[i]) continue;
        ASSERT_EQ(arena[i], 0.0f) << what << ": gap element " << i;
      }
      // grads() reads the gradient arena by the layout.
      std::vector<float> g(static_cast<size_t>(lay.total));
      for (size_t i = 0; i < g.size(); ++i) g[i] = static_cast<float>(i % 977) * 0.5f;
      upload(net, net.grad_arena(), g);
      m3::Params<float> got = net.grads();
      m3::for_each_param(got, [&](int l, const char* name, std::vector<float>& v) {
        if (v.empty()) return;
        const m3::ParamSlot& s = lay.at(l, name);
        EXPECT_TRUE(std::memcmp(v.data(), g.data() + s.offset, v.size() * 4) == 0)
            << what << ": grads() of " << s.name;
      });
      // Masters changed on the device (every in_proj_w and out_proj_w element × 1.5, exact in
      // f32), one refresh: the forward gives the bits of a net given the changed masters.
      m3::Params<float> changed = params;
      for (auto& L : changed.layers) {
        for (float& v : L.in_proj_w) v *= 1.5f;
        for (float& v : L.out_proj_w) v *= 1.5f;
      }
      std::vector<float> host = arena;
      for (int l = 0; l < static_cast<int>(c.cfg.n_layers); ++l)
        for (const char* name : {"in_proj_w", "out_proj_w"}) {
          const m3::ParamSlot& s = lay.at(l, name);
          for (Idx i = 0; i < s.size; ++i) host[s.offset + i] *= 1.5f;
        }
      upload(net, net.param_arena(), host);
      net.refresh_typed_copies();
      net.forward();
      const std::vector<float> out = net.output();
      GpuBackbone ref(ctx(), c.cfg, c.B, c.T, ScanMode::Chunked, p);
      m3::gpu::load_problem(ref, pb);
      ref.set_params(changed);
      ref.forward();
      EXPECT_TRUE(same(out, ref.output())) << what << ": refresh_typed_copies";
      std::vector<float> unchanged_out;
      {
        GpuBackbone base(ctx(), c.cfg, c.B, c.T, ScanMode::Chunked, p);
        m3::gpu::load_problem(base, pb);
        base.forward();
        unchanged_out = base.output();
      }
      EXPECT_FALSE(same(out, unchanged_out)) << what << ": the change did not reach the forward";
    }
  }
}

// For compute-sanitizer (scripts/gpu-check.sh runs GpuSanitizer.* under memcheck and
// racecheck): the production layout's passes, the scan recomputed or not, f32 and bf16 (the
// tiled and the tensor-core kernels), both scan modes, against the verification layout.
TEST(GpuSanitizer, ProductionLayoutBothModesBothPolicies) {
  M3_SKIP_WITHOUT_GPU();
  const Case c = cases()[0];
  const Problem pb = m3::make_problem(c.cfg, c.B, c.T, 31, true);
  for (Precision p : {Precision::F32, Precision::BF16})
    for (ScanMode mode : {ScanMode::Sequential, ScanMode::Chunked}) {
      GpuBackbone full(ctx(), c.cfg, c.B, c.T, mode, p);
      const Outcome want = run(full, pb, true);
      for (Recompute rc : kPolicies) {
        GpuBackbone net(ctx(), c.cfg, c.B, c.T, mode, p, rc);
        EXPECT_EQ(first_difference(want, run(net, pb, false)), "")
            << m3::precision_name(p) << " " << m3::scan_mode_name(mode)
            << " rc=" << m3::recompute_name(rc);
      }
    }
}

// The registry's stage table lists what each stage reads (reference/registry.hpp
// stage_table). The isolated run with every registry tensor that a stage neither reads nor
// writes poisoned while it runs must give the bits of the plain isolated run: a read the table
// lacks would turn an output into NaN (or change it) and name the stage's tensor here.
TEST(GpuStageTable, EveryStageReadsOnlyWhatTheTableLists) {
  M3_SKIP_WITHOUT_GPU();
  for (const Case& c : cases()) {
    const Problem pb = m3::make_problem(c.cfg, c.B, c.T, 33, true);
    for (ScanMode mode : {ScanMode::Sequential, ScanMode::Chunked}) {
      const m3::Capture oracle = m3::run_reference<double>(pb, mode);
      for (Precision p : kDtypes) {
        const std::string what =
            c.name + " " + m3::precision_name(p) + " " + m3::scan_mode_name(mode);
        GpuBackbone net(ctx(), c.cfg, c.B, c.T, mode, p);
        m3::gpu::load_problem(net, pb);
        const m3::Capture plain = net.run_isolated(oracle);
        const m3::Capture strict = net.run_isolated_poisoned_for_testing(oracle);
        ASSERT_EQ(plain.keys(), strict.keys()) << what;
        EXPECT_EQ(first_bit_difference(plain, strict), "")
            << what << ": this tensor changes when the tensors its stage does not list as "
                       "reads are poisoned";
      }
    }
  }
}

}  // namespace
