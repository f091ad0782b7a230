// The device optimizer step (optimizer_gpu.hpp; TRAINING.md §2) over the flat f32 arenas:
//
//   norm_partials  grid (blocks b ∈ [b0, b1): all ceil(total / kNormBlock) for grad_norm, a
//                  shard's [begin/kNormBlock, ceil(end/kNormBlock)) for norm_partials),
//                  kNormThreads threads: block b = b0 + blockIdx.x sums g_i² (f64) over
//                  i ∈ [b·kNormBlock, (b+1)·kNormBlock) — thread j the elements
//                  b·kNormBlock + j + k·kNormThreads in k order, then the block's fixed
//                  butterfly/warp-order tree — into partials[b] (the global block index, so a
//                  block's partial is the same bits whichever launch computes it).
//   norm_total     one block: thread j sums partials j, j + kTotalThreads, … in order, then
//                  the same tree: Σ g_i², copied to the host, which takes the sqrt.
//   adamw          grid (blocks over the longest slot, slots): the slots are the layout's cut
//                  to the shard [begin, end); block (x, s) strides over slot s, element e of
//                  params/grads (full arenas) with m[e − begin], v[e − begin] (the shard's),
//                  per element reference adamw_step<float>'s formula in its order:
//                    g = graw·gscale
//                    m = β1·m + (1−β1)·g
//                    v = β2·v + (1−β2)·(g·g)
//                    upd = (m/bc1) / (sqrt(v/bc2) + ε) + (d ? wd : 0)·p
//                    p = p − lr·upd
//                  every operation a round-to-nearest intrinsic, so nvcc contracts nothing
//                  into an FMA and the result is the host float step's bit for bit. float4
//                  accesses over a slot's body when the arenas are 16-byte aligned (the
//                  layout's offsets are multiples of kParamAlign, begin one of kNormBlock, so
//                  a cut slot starts at a multiple of 4 in both indexings), scalar for its tail.
// No atomics; every sum in a fixed order (MODEL.md §7): run-to-run bit-identical.
#include "optimizer_gpu.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "common.cuh"

namespace m3::gpu {

namespace {

constexpr int kNormThreads = 256;
constexpr int kTotalThreads = 1024;
constexpr int kStepThreads = 256;
static_assert(kNormBlock % kNormThreads == 0, "a norm block is a whole number of thread rows");

struct AdamWSlot {
  Idx offset, size;  // in the full arena: [offset, offset + size) ⊂ [begin, end)
  int decay;
};

// The scalars of one step in float (cast once from AdamWScalars, as adamw_step<float> does).
struct AdamWArgs {
  float lr, gscale, beta1, one_m_beta1, beta2, one_m_beta2, bc1, bc2, eps, wd;
};

__device__ __forceinline__ double warp_sum_f64(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = __dadd_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// As block_sum (common.cuh) in f64: warp sums, then warp 0 sums the per-warp values in
// ascending warp order. shared holds >= 32 doubles; thread 0 gets the result.
__device__ __forceinline__ double block_sum_f64(double v, double* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nwarps = (blockDim.x + 31) >> 5;
  v = warp_sum_f64(v);
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  double t = 0.0;
  if (warp == 0) t = warp_sum_f64(lane < nwarps ? shared[lane] : 0.0);
  return t;
}

__global__ void __launch_bounds__(kNormThreads)
norm_partials_kernel(const float* __restrict__ g, Idx n, Idx block0,
                     double* __restrict__ partials) {
  __shared__ double shared[32];
  const Idx block = block0 + static_cast<Idx>(blockIdx.x);
  const Idx base = block * kNormBlock + threadIdx.x;
  double acc = 0.0;
#pragma unroll
  for (int k = 0; k < kNormBlock / kNormThreads; ++k) {
    const Idx i = base + static_cast<Idx>(k) * kNormThreads;
    if (i < n) {
      const double x = static_cast<double>(g[i]);
      acc = __dadd_rn(acc, __dmul_rn(x, x));
    }
  }
  const double s = block_sum_f64(acc, shared);
  if (threadIdx.x == 0) partials[block] = s;
}

__global__ void __launch_bounds__(kTotalThreads)
norm_total_kernel(const double* __restrict__ partials, Idx n_partials, double* __restrict__ out) {
  __shared__ double shared[32];
  double acc = 0.0;
  for (Idx i = threadIdx.x; i < n_partials; i += kTotalThreads) acc = __dadd_rn(acc, partials[i]);
  const double s = block_sum_f64(acc, shared);
  if (threadIdx.x == 0) out[0] = s;
}

__device__ __forceinline__ void adamw_element(const AdamWArgs& a, float wd, float& p, float& m,
                                              float& v, float graw) {
  const float g = __fmul_rn(graw, a.gscale);
  m = __fadd_rn(__fmul_rn(a.beta1, m), __fmul_rn(a.one_m_beta1, g));
  v = __fadd_rn(__fmul_rn(a.beta2, v), __fmul_rn(a.one_m_beta2, __fmul_rn(g, g)));
  const float mhat = __fdiv_rn(m, a.bc1);
  const float vhat = __fdiv_rn(v, a.bc2);
  const float upd =
      __fadd_rn(__fdiv_rn(mhat, __fadd_rn(__fsqrt_rn(vhat), a.eps)), __fmul_rn(wd, p));
  p = __fsub_rn(p, __fmul_rn(a.lr, upd));
}

__device__ __forceinline__ void adamw_element4(const AdamWArgs& a, float wd, float4& p, float4& m,
                                               float4& v, const float4& g) {
  adamw_element(a, wd, p.x, m.x, v.x, g.x);
  adamw_element(a, wd, p.y, m.y, v.y, g.y);
  adamw_element(a, wd, p.z, m.z, v.z, g.z);
  adamw_element(a, wd, p.w, m.w, v.w, g.w);
}

template <bool kVec4>
__global__ void __launch_bounds__(kStepThreads)
adamw_kernel(const AdamWSlot* __restrict__ slots, AdamWArgs a, float* __restrict__ p,
             float* __restrict__ m, float* __restrict__ v, Idx mv_base,
             const float* __restrict__ g) {
  const AdamWSlot s = slots[blockIdx.y];
  const Idx mv_offset = s.offset - mv_base;  // the slot's start in m and v
  const float wd = s.decay ? a.wd : 0.0f;
  const Idx stride = static_cast<Idx>(gridDim.x) * kStepThreads;
  const Idx first = static_cast<Idx>(blockIdx.x) * kStepThreads + threadIdx.x;
  Idx body = 0;  // elements of the slot done by the float4 loop
  if constexpr (kVec4) {
    const Idx n4 = s.size / 4;
    float4* p4 = reinterpret_cast<float4*>(p + s.offset);
    float4* m4 = reinterpret_cast<float4*>(m + mv_offset);
    float4* v4 = reinterpret_cast<float4*>(v + mv_offset);
    const float4* g4 = reinterpret_cast<const float4*>(g + s.offset);
    for (Idx i = first; i < n4; i += stride) {
      float4 pi = p4[i], mi = m4[i], vi = v4[i];
      adamw_element4(a, wd, pi, mi, vi, g4[i]);
      p4[i] = pi;
      m4[i] = mi;
      v4[i] = vi;
    }
    body = 4 * n4;
  }
  for (Idx i = body + first; i < s.size; i += stride) {
    const Idx e = s.offset + i, k = mv_offset + i;
    float pi = p[e], mi = m[k], vi = v[k];
    adamw_element(a, wd, pi, mi, vi, g[e]);
    p[e] = pi;
    m[k] = mi;
    v[k] = vi;
  }
}

bool aligned16(const void* ptr) { return reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0; }

}  // namespace

struct GpuOptimizer::Impl {
  GpuContext* ctx = nullptr;
  ParamLayout layout;
  Idx begin = 0, end = 0;       // the shard [begin, end) of the flat arena
  DeviceArray<float> m, v;      // end − begin floats each: element e at [e − begin]
  DeviceArray<AdamWSlot> slots;  // the layout's slots cut to the shard, the empty ones dropped
  int n_slots = 0;
  Idx max_size = 0;             // the longest cut slot
  bool offsets_vec4 = true;     // every cut slot's start a multiple of 4 floats in both arenas
  DeviceArray<double> partials;  // one per norm block of the whole arena
  DeviceArray<double> total;     // Σ g², one value

  cudaStream_t stream() const { return stream_of(*ctx); }
  Idx shard_size() const { return end - begin; }

  // partials[b] for the norm blocks b ∈ [block0, block1) of the full arena g.
  void launch_partials(const float* g, Idx block0, Idx block1) {
    if (block1 <= block0) return;
    norm_partials_kernel<<<static_cast<unsigned>(block1 - block0), kNormThreads, 0, stream()>>>(
        g, layout.total, block0, partials.data());
    M3_LAUNCH_CHECK();
  }
};

GpuOptimizer::GpuOptimizer(GpuContext& ctx, const ParamLayout& layout)
    : GpuOptimizer(ctx, layout, 0, layout.total) {}

GpuOptimizer::GpuOptimizer(GpuContext& ctx, const ParamLayout& layout, Idx begin, Idx end)
    : impl_(std::make_unique<Impl>()) {
  const char* where = "GpuOptimizer";
  Impl& im = *impl_;
  im.ctx = &ctx;
  im.layout = layout;
  M3_REQUIRE(layout.total >= 0, where, "the layout's total must be >= 0", "total=", layout.total);
  M3_REQUIRE(0 <= begin && begin <= end && end <= layout.total, where,
             "the shard must satisfy 0 <= begin <= end <= layout.total",
             "begin=", begin, ", end=", end, ", total=", layout.total);
  // begin == total: the empty shard shard_plan gives a rank past the last block.
  M3_REQUIRE(begin % kNormBlock == 0 || begin == layout.total, where,
             "the shard's begin must be a multiple of kNormBlock (or layout.total: empty)",
             "begin=", begin, ", kNormBlock=", kNormBlock);
  M3_REQUIRE(end % kNormBlock == 0 || end == layout.total, where,
             "the shard's end must be a multiple of kNormBlock or layout.total",
             "end=", end, ", kNormBlock=", kNormBlock, ", total=", layout.total);
  M3_REQUIRE(layout.slots.size() <= 65535, where, "too many parameter slots",
             layout.slots.size(), " slots (at most 65535: the grid's y dimension)");
  im.begin = begin;
  im.end = end;
  const std::vector<std::uint8_t> decay = decay_flags(layout);
  std::vector<AdamWSlot> table;
  table.reserve(layout.slots.size());
  for (std::size_t s = 0; s < layout.slots.size(); ++s) {
    const ParamSlot& slot = layout.slots[s];
    M3_REQUIRE(slot.offset >= 0 && slot.size >= 0 && slot.offset + slot.size <= layout.total,
               where, "slot '" + slot.name + "' outside the layout",
               "offset=", slot.offset, ", size=", slot.size, ", total=", layout.total);
    const Idx lo = std::max(slot.offset, begin);
    const Idx hi = std::min(slot.offset + slot.size, end);
    if (hi <= lo) continue;  // the slot lies outside the shard
    table.push_back({lo, hi - lo, decay[s]});
    im.max_size = std::max(im.max_size, hi - lo);
    im.offsets_vec4 = im.offsets_vec4 && lo % 4 == 0 && (lo - begin) % 4 == 0;
  }
  im.n_slots = static_cast<int>(table.size());
  const cudaStream_t s = im.stream();
  im.m.resize(im.shard_size());
  im.v.resize(im.shard_size());
  im.m.zero(s);
  im.v.zero(s);
  im.slots.resize(static_cast<Idx>(table.size()));
  im.slots.upload(table.data(), s);
  im.partials.resize((layout.total + kNormBlock - 1) / kNormBlock);
  im.total.resize(1);
  M3_CUDA_CHECK(cudaStreamSynchronize(s));  // the table's host copy dies with this scope
}

GpuOptimizer::~GpuOptimizer() = default;

const ParamLayout& GpuOptimizer::layout() const { return impl_->layout; }
Idx GpuOptimizer::begin() const { return impl_->begin; }
Idx GpuOptimizer::end() const { return impl_->end; }
Idx GpuOptimizer::norm_blocks() const { return impl_->partials.size(); }
double* GpuOptimizer::partials_device() { return impl_->partials.data(); }

double GpuOptimizer::grad_norm(const float* grads) {
  Impl& im = *impl_;
  const Idx n = im.layout.total;
  if (n == 0) return 0.0;
  M3_REQUIRE(grads != nullptr, "GpuOptimizer::grad_norm", "no gradient arena",
             "expected a device arena of ", n, " floats");
  im.launch_partials(grads, 0, im.partials.size());
  return norm_from_partials();
}

void GpuOptimizer::norm_partials(const float* grads) {
  Impl& im = *impl_;
  const Idx block0 = im.begin / kNormBlock;
  const Idx block1 = (im.end + kNormBlock - 1) / kNormBlock;
  if (block1 <= block0) return;  // an empty shard
  M3_REQUIRE(grads != nullptr, "GpuOptimizer::norm_partials", "no gradient arena",
             "expected a device arena of ", im.layout.total, " floats");
  im.launch_partials(grads, block0, block1);
}

double GpuOptimizer::norm_from_partials() {
  Impl& im = *impl_;
  const Idx blocks = im.partials.size();
  if (blocks == 0) return 0.0;
  const cudaStream_t s = im.stream();
  norm_total_kernel<<<1, kTotalThreads, 0, s>>>(im.partials.data(), blocks, im.total.data());
  M3_LAUNCH_CHECK();
  double sum_sq = 0.0;
  im.total.download(&sum_sq, s);
  M3_CUDA_CHECK(cudaStreamSynchronize(s));
  return std::sqrt(sum_sq);
}

void GpuOptimizer::step(const AdamWScalars& a, float* params, const float* grads) {
  const char* where = "GpuOptimizer::step";
  Impl& im = *impl_;
  if (im.n_slots == 0 || im.max_size == 0) return;
  M3_REQUIRE(params != nullptr && grads != nullptr, where, "a null arena",
             "params and grads must be device arenas of ", im.layout.total, " floats");
  M3_REQUIRE(a.bc1 > 0 && a.bc2 > 0, where, "the bias corrections must be > 0",
             "bc1=", a.bc1, ", bc2=", a.bc2, " (t >= 1 and beta < 1: adamw_scalars)");
  AdamWArgs args;
  args.lr = static_cast<float>(a.lr);
  args.gscale = static_cast<float>(a.gscale);
  args.beta1 = static_cast<float>(a.beta1);
  args.one_m_beta1 = static_cast<float>(1.0 - a.beta1);
  args.beta2 = static_cast<float>(a.beta2);
  args.one_m_beta2 = static_cast<float>(1.0 - a.beta2);
  args.bc1 = static_cast<float>(a.bc1);
  args.bc2 = static_cast<float>(a.bc2);
  args.eps = static_cast<float>(a.eps);
  args.wd = static_cast<float>(a.wd);
  const bool vec4 = im.offsets_vec4 && aligned16(params) && aligned16(grads) &&
                    aligned16(im.m.data()) && aligned16(im.v.data());
  // Enough blocks over the longest slot to fill the device, at most 1024 per slot.
  const Idx work = vec4 ? (im.max_size + 3) / 4 : im.max_size;
  const unsigned bx = std::min<unsigned>(blocks_for(work, kStepThreads), 1024u);
  const dim3 grid(bx, static_cast<unsigned>(im.n_slots));
  const cudaStream_t s = im.stream();
  if (vec4)
    adamw_kernel<true><<<grid, kStepThreads, 0, s>>>(im.slots.data(), args, params, im.m.data(),
                                                     im.v.data(), im.begin, grads);
  else
    adamw_kernel<false><<<grid, kStepThreads, 0, s>>>(im.slots.data(), args, params, im.m.data(),
                                                      im.v.data(), im.begin, grads);
  M3_LAUNCH_CHECK();
}

std::vector<float> GpuOptimizer::m() const {
  std::vector<float> h(static_cast<std::size_t>(impl_->shard_size()));
  impl_->m.download(h.data(), impl_->stream());
  M3_CUDA_CHECK(cudaStreamSynchronize(impl_->stream()));
  return h;
}

std::vector<float> GpuOptimizer::v() const {
  std::vector<float> h(static_cast<std::size_t>(impl_->shard_size()));
  impl_->v.download(h.data(), impl_->stream());
  M3_CUDA_CHECK(cudaStreamSynchronize(impl_->stream()));
  return h;
}

void GpuOptimizer::set_moments(const std::vector<float>& m, const std::vector<float>& v) {
  const Impl& im = *impl_;
  const Idx n = im.shard_size();
  M3_REQUIRE(static_cast<Idx>(m.size()) == n, "GpuOptimizer::set_moments",
             "m must hold the shard's end - begin floats", "m has ", m.size(), ", expected ", n,
             " (shard [", im.begin, ", ", im.end, "), total=", im.layout.total, ")");
  M3_REQUIRE(static_cast<Idx>(v.size()) == n, "GpuOptimizer::set_moments",
             "v must hold the shard's end - begin floats", "v has ", v.size(), ", expected ", n,
             " (shard [", im.begin, ", ", im.end, "), total=", im.layout.total, ")");
  impl_->m.upload(m.data(), impl_->stream());
  impl_->v.upload(v.data(), impl_->stream());
  M3_CUDA_CHECK(cudaStreamSynchronize(impl_->stream()));
}

}  // namespace m3::gpu
