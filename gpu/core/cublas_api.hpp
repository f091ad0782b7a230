// cuBLAS, loaded the first time it is used rather than when the program starts.
//
// libcublas.so pulls in libcublasLt.so, whose loading alone makes about 150 MB of a process
// resident (relocations and static tables). A program that never touches the GPU — the CPU
// comparison, golden checks, every CPU test — should not carry that, so nothing here links
// against cuBLAS: cublas() opens libcublas.so.<the major version these headers declare> with
// dlopen on its first call (the loader's search path, then the CUDA toolkit's library folder
// this build was configured with) and resolves the few entry points the project calls. Each
// member has the exact type of the cuBLAS function it stands for, so a call reads as the
// library's own (cublas().gemm_ex(handle, …) is cublasGemmEx(handle, …)).
//
// A library that cannot be opened, or lacks one of the symbols, is an m3::Error naming the file
// and the loader's reason; a failed load is tried again by the next call, a successful one
// stands for the process (thread-safe).
#pragma once

#include <cublas_v2.h>

namespace m3::gpu {

struct CublasApi {
  decltype(&::cublasCreate) create;
  decltype(&::cublasDestroy) destroy;
  decltype(&::cublasSetStream) set_stream;
  decltype(&::cublasSetMathMode) set_math_mode;
  decltype(&::cublasSetPointerMode) set_pointer_mode;
  decltype(&::cublasSetWorkspace) set_workspace;
  // cublasGemmEx is overloaded in C++ (an inline form taking a cudaDataType compute type): the
  // exported one, with cublasComputeType_t.
  cublasStatus_t (*gemm_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                            const void*, const void*, cudaDataType, int, const void*,
                            cudaDataType, int, const void*, void*, cudaDataType, int,
                            cublasComputeType_t, cublasGemmAlgo_t);
  decltype(&::cublasDgemm_64) dgemm_64;
  decltype(&::cublasGetProperty) get_property;
  decltype(&::cublasGetStatusString) status_string;
};

// The loaded entry points. Throws m3::Error when libcublas cannot be loaded.
const CublasApi& cublas();

// Whether cuBLAS has been loaded in this process (for the test that holds a CPU-only run free
// of it).
bool cublas_loaded();

}  // namespace m3::gpu
