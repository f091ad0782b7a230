// The GEMMs (gpu/stages/gemm.cu: F2, input_proj with its f32 bias, B2 dX, dW; MODEL.md §12.9)
// in the bf16/f16 storage emulation against the float reference GEMM rounded where the
// reference stores: typed outputs within 2 ulps plus a 1e-5 floor with ≥ 95% bit-equal, dW by
// rel_l2 and max|Δ|/max (tests/gpu/stage_fixtures.cuh). A typed biased GEMM without its f32
// scratch is refused.
#include <gtest/gtest.h>

#include "context.hpp"

#include "../stage_fixtures.cuh"

namespace {

using namespace m3::stage_test;

// The GEMMs: F2 (post_norm·in_proj_w → proj), input_proj with its f32 bias (one rounding after
// the bias add), B2 dX (typed), and dW (f32, accumulated onto a non-zero start).
TYPED_TEST(TypedStages, GemmsMatchReference) {
  M3_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  m3::gpu::GpuContext ctx(0);
  const cudaStream_t s = m3::gpu::stream_of(ctx);
  for (const Case& c : kTypedCases) {
    SCOPED_TRACE(c.name);
    const Config cfg = typed_config(c, false);
    const Dims d = Dims::of(cfg, c.B, c.T, Storage<T>::kPrecision);
    const m3::Params<float> p = m3::make_params<float>(cfg, 3, m3::Init::Perturbed);
    Rng rng(21);
    const Idx BT = d.BT;
    Vec X(static_cast<size_t>(BT * d.dm)), Xin(static_cast<size_t>(BT * d.in)),
        dY(static_cast<size_t>(BT * d.ip)), dW0(static_cast<size_t>(d.dm * d.ip));
    for (auto& e : X) e = static_cast<float>(rng.normalish());
    for (auto& e : Xin) e = static_cast<float>(rng.normalish());
    fill(dY, rng, -1.0, 1.0);
    fill(dW0, rng, -1.0, 1.0);
    X = rounded<T>(X);
    Xin = rounded<T>(Xin);
    dY = rounded<T>(dY);
    const Vec W = rounded<T>(p.layers[0].in_proj_w), Win = rounded<T>(p.input_proj_w);
    Vec bias = p.input_proj_b;
    fill(bias, rng, -2.0, 2.0);
    // reference: float GEMM, then store_typed
    Vec Y(static_cast<size_t>(BT * d.ip)), H(static_cast<size_t>(BT * d.dm)),
        dX(static_cast<size_t>(BT * d.dm)), dW = dW0;
    m3::ref::linear_forward(BT, d.dm, d.ip, X.data(), W.data(), static_cast<const float*>(nullptr),
                            Y.data());
    m3::ref::store_typed(d, Y);
    m3::ref::linear_forward(BT, d.in, d.dm, Xin.data(), Win.data(), bias.data(), H.data());
    m3::ref::store_typed(d, H);
    m3::ref::linear_backward(BT, d.dm, d.ip, X.data(), W.data(), dY.data(), dX.data(), dW.data(),
                             static_cast<float*>(nullptr));
    m3::ref::store_typed(d, dX);
    ScratchBuf sc(d);
    const Named got = twice("gemm", [&] {
      auto dx_in = up_t<T>(X, s), dw_t = up_t<T>(W, s), dxin = up_t<T>(Xin, s),
           dwin = up_t<T>(Win, s), ddy = up_t<T>(dY, s);
      auto dbias = up(bias, s), ddw = up(dW0, s);
      DeviceArray<T> dy_out(BT * d.ip), dh(BT * d.dm), ddx(BT * d.dm);
      m3::gpu::gemm_forward<T>(ctx, BT, d.dm, d.ip, dx_in.data(), dw_t.data(), nullptr,
                               dy_out.data());
      m3::gpu::gemm_forward<T>(ctx, BT, d.in, d.dm, dxin.data(), dwin.data(), dbias.data(),
                               dh.data(), sc.get());
      m3::gpu::gemm_backward_dx<T>(ctx, BT, d.dm, d.ip, ddy.data(), dw_t.data(), ddx.data());
      m3::gpu::gemm_backward_dw<T>(ctx, BT, d.dm, d.ip, dx_in.data(), ddy.data(), ddw.data());
      return Named{{"Y", down_t(dy_out, s)}, {"H", down_t(dh, s)}, {"dX", down_t(ddx, s)},
                   {"dW", down(ddw, s)}};
    });
    expect_typed<T>("proj = X·W", got.at("Y"), Y, 1e-5, 0.95);
    expect_typed<T>("input_proj X·W + b", got.at("H"), H, 1e-5, 0.95);
    expect_typed<T>("dX = dY·Wᵀ", got.at("dX"), dX, 1e-5, 0.95);
    expect_close("dW += Xᵀ·dY", got.at("dW"), dW);
    // a typed biased GEMM without its f32 scratch is refused
    DeviceArray<T> a(BT * d.in), wgt(d.in * d.dm), out(BT * d.dm);
    DeviceArray<float> b(d.dm);
    EXPECT_THROW(m3::gpu::gemm_forward<T>(ctx, BT, d.in, d.dm, a.data(), wgt.data(), b.data(),
                                          out.data(), Scratch{}),
                 m3::Error);
  }
}

}  // namespace
