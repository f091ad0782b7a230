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
// scratch_floats(d) is the most any launcher needs for dims d (reduction partials, the Θ̄
// buffer of angle_backward, the f32 product of a typed biased GEMM); the launchers check their
// share and throw m3::Error if short.
#include "convert.cuh"
#include "reduce.cuh"

namespace m3::gpu {

namespace {

__global__ void __launch_bounds__(kThreads)
colsum_finish_kernel(Idx chunks, Idx cols, const float* partial, float* out, bool accumulate) {
  for (Idx c = blockIdx.x * Idx(kThreads) + threadIdx.x; c < cols;
       c += Idx(gridDim.x) * kThreads) {
    float s = partial[c];
    for (Idx k = 1; k < chunks; ++k) s += partial[k * cols + c];
    out[c] = accumulate ? out[c] + s : s;
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads)
add_kernel(Idx n, const float* a, const T* b, float* out) {
  for (Idx i = blockIdx.x * Idx(kThreads) + threadIdx.x; i < n; i += Idx(gridDim.x) * kThreads)
    out[i] = a[i] + to_float(b[i]);
}

template <class Tin, class Tout>
__global__ void __launch_bounds__(kThreads)
convert_kernel(Idx n, const Tin* in, Tout* out) {
  for (Idx i = blockIdx.x * Idx(kThreads) + threadIdx.x; i < n; i += Idx(gridDim.x) * kThreads)
    out[i] = from_float<Tout>(to_float(in[i]));
}

}  // namespace

Idx scratch_floats(const Dims& d) {
  const Idx bt = d.BT;
  Idx need = colsum_scratch_floats(bt, d.dm);                     // rmsnorm_backward, input_proj_b
  if (d.storage == Precision::BF16 || d.storage == Precision::F16)
    need = std::max(need, bt * d.dm);                              // typed gemm_forward + bias
  need = std::max(need, colsum_scratch_floats(bt, d.nh));          // activations_backward
  need = std::max(need, colsum_scratch_floats(bt, d.nh * d.ds));   // bcnorm_backward: biases
  need = std::max(need, colsum_scratch_floats(bt * d.ng, d.ds));   // bcnorm_backward: norm w
  if (d.outproj_norm) need = std::max(need, colsum_scratch_floats(bt, d.di));  // gating_backward
  need = std::max(need, bt * d.nh * d.na);                         // angle_backward: Θ̄
  need = std::max(need, ssm_chunked_scratch_floats(d));            // ssm_chunked_backward
  return need;
}

void colsum_finish(cudaStream_t s, Idx chunks, Idx cols, const float* partial, float* out,
                   bool accumulate) {
  colsum_finish_kernel<<<grid_for(cols, kThreads), kThreads, 0, s>>>(chunks, cols, partial, out,
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
  add_kernel<T><<<grid_for(n, kThreads), kThreads, 0, s>>>(n, a, b, out);
  M3_LAUNCH_CHECK();
}

template <class Tin, class Tout>
void convert(cudaStream_t s, Idx n, const Tin* in, Tout* out) {
  if (n <= 0) return;
  convert_kernel<Tin, Tout><<<grid_for(n, kThreads), kThreads, 0, s>>>(n, in, out);
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
