// Deterministic column sums, elementwise helpers of the backbone, and the scratch size of every
// launcher of stages.cuh (MODEL.md §7).
//
//   colsum:  out[c] (+)= Σ_{r < rows} in[r, c]      in [rows, cols], out [cols]
//            two stages with fixed row chunks, partials [chunks, cols] in Scratch, summed in
//            ascending chunk order (reduce.cuh colsum_rows states the exact order).
//   add:     out[i] = a[i] + b[i]                    a, out f32 [n]; b typed [n]
//   convert: out[i] = in[i] converted Tin → Tout     [n]  (to a 16-bit type: nearest even)
//   round_to: convert<float, T> of a master weight to its typed compute copy
//
// add and convert move V = 16 / sizeof(narrowest type) values per thread in 16-byte accesses
// (f32 in two) when every pointer is 16-byte aligned; the last n mod V values (all n, if not
// aligned) go one per thread.
//
// scratch_floats(d) is the most any launcher needs for dims d (reduction partials, the Θ̄
// buffer of angle_backward, the f32 product of a typed biased GEMM); the launchers check their
// share and throw m3::Error if short.
#include <initializer_list>

#include "convert.cuh"
#include "reduce.cuh"

namespace m3::gpu {

namespace {

// Stage 2 of colsum_rows (reduce.cuh): block x owns columns 32x … 32x + 31.
__global__ void __launch_bounds__(kThreads)
colsum_finish_kernel(Idx chunks, Idx cols, const float* partial, ColsumOut out, bool accumulate) {
  __shared__ float slab[kColsumSlab][33];
  const Idx c = Idx(blockIdx.x) * 32 + threadIdx.x;
  float s = 0.0f;
  for (Idx k0 = 0; k0 < chunks; k0 += kColsumSlab) {
    const int n = static_cast<int>(min(Idx(kColsumSlab), chunks - k0));
    if (c < cols)
      for (int k = threadIdx.y; k < n; k += kColsumLanes)
        slab[k][threadIdx.x] = partial[(k0 + k) * cols + c];
    __syncthreads();
    if (threadIdx.y == 0 && c < cols) {
      int k = 0;
      if (k0 == 0) s = slab[k++][threadIdx.x];  // s = p₀ itself (not 0 + p₀: −0 stays −0)
      for (; k < n; ++k) s += slab[k][threadIdx.x];
    }
    __syncthreads();  // the slab is free for the next rows
  }
  if (threadIdx.y == 0 && c < cols) {
    float* o = out.at(c);
    *o = accumulate ? *o + s : s;
  }
}

// Values per vector of an elementwise kernel whose narrowest type is A or B.
template <class A, class B>
constexpr int kVec = 16 / static_cast<int>(sizeof(A) < sizeof(B) ? sizeof(A) : sizeof(B));

// Vectors of V values an elementwise kernel takes: n / V if every pointer is 16-byte aligned,
// else 0; and its blocks (one thread per vector and per leftover value).
template <int V>
Idx vectors(Idx n, std::initializer_list<const void*> ptrs) {
  for (const void* p : ptrs)
    if (!is_aligned(p, 16)) return 0;
  return n / V;
}
template <int V>
unsigned int elementwise_blocks(Idx n, Idx nv) {
  return grid_for(std::max(nv, n - nv * V), kThreads);
}

// Values [0, nv·V) in vectors of V, then [nv·V, n) one per thread.
template <class T>
__global__ void __launch_bounds__(kThreads)
add_kernel(Idx n, Idx nv, const float* a, const T* b, float* out) {
  constexpr int V = kVec<float, T>;
  const Idx first = blockIdx.x * Idx(kThreads) + threadIdx.x, stride = Idx(gridDim.x) * kThreads;
  for (Idx i = first * V; i < nv * V; i += stride * V) {
    float x[V], y[V];
    load_vec(a + i, x);
    load_vec(b + i, y);
#pragma unroll
    for (int e = 0; e < V; ++e) x[e] = x[e] + y[e];
    store_vec(out + i, x);
  }
  for (Idx i = nv * V + first; i < n; i += stride) out[i] = a[i] + to_float(b[i]);
}

template <class Tin, class Tout>
__global__ void __launch_bounds__(kThreads)
convert_kernel(Idx n, Idx nv, const Tin* in, Tout* out) {
  constexpr int V = kVec<Tin, Tout>;
  const Idx first = blockIdx.x * Idx(kThreads) + threadIdx.x, stride = Idx(gridDim.x) * kThreads;
  for (Idx i = first * V; i < nv * V; i += stride * V) {
    float x[V];
    load_vec(in + i, x);
    store_vec(out + i, x);
  }
  for (Idx i = nv * V + first; i < n; i += stride) out[i] = from_float<Tout>(to_float(in[i]));
}

}  // namespace

Idx scratch_floats(const Dims& d) {
  const Idx bt = d.BT;
  Idx need = colsum_scratch_floats(bt, d.dm);                     // input_proj_b
  need = std::max(need, rmsnorm_backward_scratch_floats(bt, d.dm));  // B1, norm_f backward
  if (d.storage == Precision::BF16 || d.storage == Precision::F16)
    need = std::max(need, bt * d.dm);                              // typed gemm_forward + bias
  need = std::max(need, colsum_scratch_floats(bt, d.nh));          // activations_backward
  need = std::max(need, colsum_pair_scratch_floats(bt, d.nh * d.ds));  // bcnorm_backward: biases
  need = std::max(need, colsum_pair_scratch_floats(bt * d.ng, d.ds));  // bcnorm_backward: norm w
  if (d.outproj_norm) need = std::max(need, colsum_scratch_floats(bt, d.di));  // gating_backward
  need = std::max(need, angle_forward_scratch_floats(d));          // angle_forward: τ
  need = std::max(need, angle_backward_scratch_floats(d));         // angle_backward: Θ̄, τ
  need = std::max(need, ssm_chunked_scratch_floats(d));            // ssm_chunked_backward
  return need;
}

void colsum_finish(cudaStream_t s, Idx chunks, Idx cols, const float* partial, ColsumOut out,
                   bool accumulate) {
  // colsum_rows checked that chunks · tiles fits an int.
  const auto tiles = static_cast<unsigned int>((cols + 31) / 32);
  colsum_finish_kernel<<<tiles, dim3(32, kColsumLanes), 0, s>>>(chunks, cols, partial, out,
                                                                accumulate);
  M3_LAUNCH_CHECK();
}

void colsum(cudaStream_t s, Idx rows, Idx cols, const float* in, float* out, bool accumulate,
            Scratch scratch) {
  colsum_rows(s, rows, cols, LoadMatrix{in, cols}, out, accumulate, scratch, "gpu::colsum");
}

template <class T>
void add(cudaStream_t s, Idx n, const float* a, const T* b, float* out) {
  if (n <= 0) return;
  constexpr int V = kVec<float, T>;
  const Idx nv = vectors<V>(n, {a, b, out});
  add_kernel<T><<<elementwise_blocks<V>(n, nv), kThreads, 0, s>>>(n, nv, a, b, out);
  M3_LAUNCH_CHECK();
}

template <class Tin, class Tout>
void convert(cudaStream_t s, Idx n, const Tin* in, Tout* out) {
  if (n <= 0) return;
  constexpr int V = kVec<Tin, Tout>;
  const Idx nv = vectors<V>(n, {in, out});
  convert_kernel<Tin, Tout><<<elementwise_blocks<V>(n, nv), kThreads, 0, s>>>(n, nv, in, out);
  M3_LAUNCH_CHECK();
}

template <class T>
void round_to(cudaStream_t s, Idx n, const float* in, T* out) {
  convert<float, T>(s, n, in, out);
}

#define M3_INSTANTIATE(T)                                                             \
  template void add<T>(cudaStream_t, Idx, const float*, const T*, float*);            \
  template void convert<float, T>(cudaStream_t, Idx, const float*, T*);               \
  template void round_to<T>(cudaStream_t, Idx, const float*, T*);
M3_FOR_EACH_STORAGE(M3_INSTANTIATE)
#undef M3_INSTANTIATE

#define M3_INSTANTIATE(T)                                                             \
  template void convert<T, float>(cudaStream_t, Idx, const T*, float*);
M3_FOR_EACH_TYPED_STORAGE(M3_INSTANTIATE)
#undef M3_INSTANTIATE

}  // namespace m3::gpu
