// CPU-only build (M3_CUDA=OFF): the device comparer's API exists so that the harness and the
// tools link the same way in every build; compare_unavailable() says why it cannot run, and
// every entry that needs a device throws m3::Error saying so in one line. (value_type_name is
// real in both builds: compare/value_type.cpp.)
#include "compare_gpu.hpp"
#include "error.hpp"

namespace m3::gpu {

namespace {
constexpr const char* kNoCuda = "built without CUDA (M3_CUDA=OFF)";
[[noreturn]] void no_cuda(const char* where) { throw Error(where, "no GPU", kNoCuda); }
}  // namespace

std::string compare_unavailable() { return kNoCuda; }
std::size_t device_bytes_in_use() { return 0; }

std::size_t device_bytes_free() { return 0; }

DeviceBuffer::DeviceBuffer(std::size_t bytes, Place) {
  if (bytes > 0) no_cuda("DeviceBuffer");
}
DeviceBuffer::~DeviceBuffer() = default;
DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : data_(other.data_), host_(other.host_), bytes_(other.bytes_) {}
DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&&) noexcept { return *this; }

struct DeviceComparer::Impl {};
DeviceComparer::DeviceComparer(void*) { no_cuda("DeviceComparer"); }
DeviceComparer::~DeviceComparer() = default;
DeviceComparer::DeviceComparer(DeviceComparer&&) noexcept = default;
DeviceComparer& DeviceComparer::operator=(DeviceComparer&&) noexcept = default;
void* DeviceComparer::stream() const { no_cuda("DeviceComparer::stream"); }
DeviceMetrics DeviceComparer::metrics(DeviceValues, DeviceValues, bool, Precision, bool) {
  no_cuda("DeviceComparer::metrics");
}
void DeviceComparer::position_profile(DeviceValues, DeviceValues, Idx, Idx, bool,
                                      std::vector<double>*, std::vector<double>*) {
  no_cuda("DeviceComparer::position_profile");
}
void DeviceComparer::abs_dev(DeviceValues, DeviceValues, bool, float*) {
  no_cuda("DeviceComparer::abs_dev");
}
ConditionSums DeviceComparer::condition(const double*, const std::vector<const float*>&,
                                        const std::vector<const float*>&, Idx, double, double) {
  no_cuda("DeviceComparer::condition");
}
void DeviceComparer::copy(void*, const void*, std::size_t) { no_cuda("DeviceComparer::copy"); }
void DeviceComparer::upload(void*, const void*, std::size_t) { no_cuda("DeviceComparer::upload"); }
void DeviceComparer::download(void*, const void*, std::size_t) {
  no_cuda("DeviceComparer::download");
}
void DeviceComparer::synchronize() { no_cuda("DeviceComparer::synchronize"); }

}  // namespace m3::gpu
