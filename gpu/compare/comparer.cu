// The comparer's plumbing (compare_gpu.hpp): whether a device is usable, the free and used
// device bytes, DeviceBuffer (device memory, or page-locked host memory the device maps), the
// stream a DeviceComparer queues on, its copies, and the check of a DeviceValues argument. The
// comparisons themselves are metrics.cu, position.cu and condition.cu.
#include <cstdio>
#include <utility>

#include "common.cuh"
#include "error.hpp"

namespace m3::gpu {

std::string compare_unavailable() {
  try {
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) return std::string("no usable CUDA device: ") + cudaGetErrorString(e);
    if (n == 0) return "no CUDA device";
    return "";
  } catch (...) {
    return "no usable CUDA device: the device query failed";
  }
}

namespace {
// cudaMemGetInfo's (free, total); (0, 0) from a device that cannot answer, which has nothing in
// use or free to report.
std::pair<std::size_t, std::size_t> memory_info() {
  std::size_t free_b = 0, total_b = 0;
  if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) {
    cudaGetLastError();
    return {0, 0};
  }
  return {free_b, total_b};
}
}  // namespace

std::size_t device_bytes_in_use() {
  const auto [free_b, total_b] = memory_info();
  return total_b - free_b;
}

std::size_t device_bytes_free() { return memory_info().first; }

namespace {
[[noreturn]] void allocation_failed(const char* how, std::size_t bytes, cudaError_t e) {
  cudaGetLastError();  // an allocation's failure is not sticky; leave no error behind
  char size[64];
  std::snprintf(size, sizeof size, "%zu bytes (%.3f GiB)", bytes,
                static_cast<double>(bytes) / (1u << 30));
  throw Error("DeviceBuffer", std::string(how) + " of " + size, cudaGetErrorString(e));
}
}  // namespace

DeviceBuffer::DeviceBuffer(std::size_t bytes, Place place) {
  if (bytes == 0) return;
  if (place == Place::Device) {
    const cudaError_t e = cudaMalloc(&data_, bytes);
    if (e != cudaSuccess) {
      data_ = nullptr;
      allocation_failed("cudaMalloc", bytes, e);
    }
  } else {
    const cudaError_t e = cudaHostAlloc(&host_, bytes, cudaHostAllocMapped);
    if (e != cudaSuccess) {
      host_ = nullptr;
      allocation_failed("cudaHostAlloc (page-locked host memory)", bytes, e);
    }
    const cudaError_t m = cudaHostGetDevicePointer(&data_, host_, 0);
    if (m != cudaSuccess) {
      cudaFreeHost(host_);
      host_ = data_ = nullptr;
      allocation_failed("the device's mapping of page-locked host memory", bytes, m);
    }
  }
  bytes_ = bytes;
}

namespace {
void release(void* data, void* host) {
  // A destructor does not throw; a failure here has no remedy.
  if (host) cudaFreeHost(host);
  else if (data) cudaFree(data);
}
}  // namespace

DeviceBuffer::~DeviceBuffer() { release(data_, host_); }

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), host_(std::exchange(other.host_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    release(data_, host_);
    data_ = std::exchange(other.data_, nullptr);
    host_ = std::exchange(other.host_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

DeviceComparer::DeviceComparer(void* stream) : impl_(std::make_unique<Impl>()) {
  const std::string why = compare_unavailable();
  M3_REQUIRE(why.empty(), "DeviceComparer", "no GPU", why);
  if (stream) {
    impl_->stream = static_cast<cudaStream_t>(stream);
  } else {
    M3_CUDA_CHECK(cudaStreamCreateWithFlags(&impl_->stream, cudaStreamNonBlocking));
    impl_->owns_stream = true;
  }
}

DeviceComparer::~DeviceComparer() {
  if (impl_ && impl_->owns_stream) {
    cudaStreamSynchronize(impl_->stream);  // the scratch buffers go with impl_ right after
    cudaStreamDestroy(impl_->stream);
  }
}

DeviceComparer::DeviceComparer(DeviceComparer&&) noexcept = default;

DeviceComparer& DeviceComparer::operator=(DeviceComparer&& other) noexcept {
  if (this != &other) {
    if (impl_ && impl_->owns_stream) {
      cudaStreamSynchronize(impl_->stream);
      cudaStreamDestroy(impl_->stream);
    }
    impl_ = std::move(other.impl_);
  }
  return *this;
}

void* DeviceComparer::stream() const {
  M3_REQUIRE(impl_, "DeviceComparer::stream", "a moved-from comparer", "");
  return impl_->stream;
}

void DeviceComparer::copy(void* dst, const void* src, std::size_t bytes) {
  if (bytes == 0) return;
  M3_REQUIRE(dst && src, "DeviceComparer::copy", "null pointer", "dst ", dst, ", src ", src,
             ", ", bytes, " bytes");
  // cudaMemcpyDefault: either side may be mapped host memory (Place::Host).
  M3_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, impl_->stream));
}

void DeviceComparer::upload(void* device_dst, const void* host_src, std::size_t bytes) {
  if (bytes == 0) return;
  M3_REQUIRE(device_dst && host_src, "DeviceComparer::upload", "null pointer", "dst ",
             device_dst, ", src ", host_src, ", ", bytes, " bytes");
  M3_CUDA_CHECK(cudaMemcpyAsync(device_dst, host_src, bytes, cudaMemcpyHostToDevice,
                                impl_->stream));
  M3_CUDA_CHECK(cudaStreamSynchronize(impl_->stream));
}

void DeviceComparer::download(void* host_dst, const void* device_src, std::size_t bytes) {
  if (bytes == 0) return;
  M3_REQUIRE(host_dst && device_src, "DeviceComparer::download", "null pointer", "dst ",
             host_dst, ", src ", device_src, ", ", bytes, " bytes");
  impl_->download(host_dst, device_src, bytes);
}

void DeviceComparer::synchronize() { M3_CUDA_CHECK(cudaStreamSynchronize(impl_->stream)); }

namespace compare {

void check_values(const char* where, const char* what, const DeviceValues& v) {
  M3_REQUIRE(v.n >= 0, where, std::string(what) + " has a negative size", "n ", v.n);
  M3_REQUIRE(v.data || v.n == 0, where, std::string(what) + " has no data", "n ", v.n);
  const bool known = v.type == ValueType::F64 || v.type == ValueType::F32 ||
                     v.type == ValueType::BF16 || v.type == ValueType::F16;
  M3_REQUIRE(known, where, std::string(what) + " has an unknown value type", "type ",
             static_cast<int>(v.type));
}

}  // namespace compare

}  // namespace m3::gpu
