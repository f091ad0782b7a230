// Device query and a GPU self-test: the one part of gpu/ that every build has.
//
// This header compiles with a plain C++ compiler (no CUDA types), so the harness, tools and
// tests can include it without nvcc. With M3_CUDA=ON it is implemented by device.cu (CUDA
// runtime API); with M3_CUDA=OFF by device_stub.cpp, which reports that no device is present.
// The m3_gpu target defines M3_HAVE_CUDA to 1 or 0 for everything that links it.
#pragma once

#include <cstddef>
#include <string>

namespace m3::gpu {

// What the CUDA runtime reports about device 0 (and how many devices there are).
struct DeviceInfo {
  bool present = false;       // a usable CUDA device was found
  int count = 0;              // number of CUDA devices
  std::string name;           // device 0's name, e.g. "NVIDIA H200"
  int cc_major = 0;           // compute capability of device 0
  int cc_minor = 0;
  std::size_t total_mem = 0;  // device 0's global memory, bytes
  int runtime_version = 0;    // cudaRuntimeGetVersion, e.g. 13000 (when present)
  std::string why_absent;     // when !present: why (built without CUDA, runtime error, no device)
};

// Never throws: with no device or no driver, present=false and why_absent says why. Every
// command asks it (is there a GPU?), so it leaves cuBLAS unloaded (gpu/core/cublas_api.hpp).
DeviceInfo query_device();

// The cuBLAS library's version, major·10000 + minor·100 + patch, e.g. 130100; loads cuBLAS.
// 0 in a CPU-only build or when the library cannot be loaded. Never throws.
int cublas_version();

// True when this build was compiled with CUDA (M3_CUDA=ON).
bool cuda_compiled();

// One line: "GPU 0 of 1: NVIDIA H200, sm_90, 139.8 GiB" or "no GPU: <why_absent>".
std::string describe(const DeviceInfo& info);

// What the GPU path's bits depend on beyond the source: "NVIDIA H200, sm_90, CUDA runtime
// 13.0, cuBLAS 13.1.0" (the cuBLAS GEMMs pick their kernels by device and version), or
// "no GPU: <why_absent>"; with a device it loads cuBLAS for the version (cublas_version). m3h
// determinism's digest records carry it.
std::string bits_environment(const DeviceInfo& info);

// Bytes held by the GPU path's own device arrays (every tensor, parameter, gradient, scratch
// and state buffer; not the CUDA context nor cuBLAS's fixed workspace): now, and the most at
// any time since the last reset_device_bytes_peak(). Zero without CUDA.
std::size_t device_bytes_live();
std::size_t device_bytes_peak();
void reset_device_bytes_peak();  // the peak becomes the live bytes

// Adds two small arrays on the device and checks the sum on the host.
// Returns false when no device is present or the sum is wrong; throws m3::Error when a CUDA
// call fails on a device that is present.
bool gpu_selftest();

}  // namespace m3::gpu
