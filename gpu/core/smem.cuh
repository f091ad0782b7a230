// Dynamic shared memory beyond the default, for every launcher.
//
// A block may use 48 KB of shared memory, its static and dynamic bytes together, without asking.
// Up to the device's opt-in limit (cudaDevAttrMaxSharedMemoryPerBlockOptin: 227 KB on sm_90) a
// kernel's cudaFuncAttributeMaxDynamicSharedMemorySize must first be raised to at least its
// dynamic bytes, on each device it runs on; beyond that limit no launch can work.
//
// opt_in_smem(kernel, dynamic, where) reads the kernel's static bytes (cudaFuncGetAttributes),
// refuses static + dynamic beyond the opt-in limit with an m3::Error from `where`, and raises the
// attribute only when static + dynamic passes 48 KB and this device's value for this kernel is
// not already that high: once per kernel, device and larger size, not on every launch. The
// per-(kernel, device) record is guarded by a mutex, so launchers on several host threads (one
// per rank) may call it at once.
#pragma once

#include <cstddef>

namespace m3::gpu {

// The byte count a block may use without opting in.
inline constexpr std::size_t kDefaultSmemBytes = 48 * 1024;

void opt_in_smem_raw(const void* kernel, std::size_t dynamic, const char* where);

template <class K>
inline void opt_in_smem(K kernel, std::size_t dynamic, const char* where) {
  opt_in_smem_raw(reinterpret_cast<const void*>(kernel), dynamic, where);
}

}  // namespace m3::gpu
