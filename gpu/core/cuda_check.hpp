// Error checks for CUDA runtime and cuBLAS calls. Internal to gpu/: include only from .cu files.
//
// M3_CUDA_CHECK(expr) and M3_CUBLAS_CHECK(expr) evaluate expr once and, when it does not
// return success, throw m3::Error(where = "file:line", what = the statement text,
// why = the library's error string; cuBLAS's through cublas_api.hpp, which loads the library
// when first used). Both come from one generator, M3_CHECK_GEN.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <string>

#include "cublas_api.hpp"
#include "error.hpp"

namespace m3::gpu::detail {

[[noreturn]] inline void throw_check_failure(const char* stmt, const char* file, int line,
                                             const char* msg) {
  std::string path(file);
  std::string::size_type slash = path.find_last_of('/');
  std::string base = slash == std::string::npos ? path : path.substr(slash + 1);
  throw ::m3::Error(base + ":" + std::to_string(line), stmt, msg ? msg : "unknown error");
}

}  // namespace m3::gpu::detail

// stmt is the statement as written (stringified here, before macros inside it expand).
#define M3_CHECK_GEN(expr, stmt, success, error_fn)                                    \
  do {                                                                                 \
    auto m3_status_ = (expr);                                                          \
    if (m3_status_ != (success))                                                       \
      ::m3::gpu::detail::throw_check_failure(stmt, __FILE__, __LINE__,                 \
                                             error_fn(m3_status_));                    \
  } while (0)

#define M3_CUDA_CHECK(expr) M3_CHECK_GEN(expr, #expr, cudaSuccess, cudaGetErrorString)
#define M3_CUBLAS_CHECK(expr) \
  M3_CHECK_GEN(expr, #expr, CUBLAS_STATUS_SUCCESS, ::m3::gpu::cublas().status_string)
