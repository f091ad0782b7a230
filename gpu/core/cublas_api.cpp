// cuBLAS loaded on first use (cublas_api.hpp): dlopen of libcublas.so.<major>, dlsym of each
// entry point by its exported name (the cublas_v2.h macros name the _v2 / _64 symbols, so the
// name is taken after macro expansion).
#include "cublas_api.hpp"

#include <dlfcn.h>

#include <atomic>
#include <mutex>
#include <string>

#include "error.hpp"

namespace m3::gpu {

namespace {

#define M3_STRINGIFY_EXPANDED(x) M3_STRINGIFY(x)
#define M3_STRINGIFY(x) #x

std::atomic<bool> g_loaded{false};

std::string soname() { return "libcublas.so." + std::to_string(CUBLAS_VER_MAJOR); }

void* open_library() {
  const std::string name = soname();
  if (void* h = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL)) return h;
  const char* err = dlerror();
  const std::string why = err ? err : "not found";  // the search path's reason is the telling one
#ifdef M3_CUDA_LIBRARY_DIR
  const std::string there = std::string(M3_CUDA_LIBRARY_DIR) + "/" + name;
  if (void* h = dlopen(there.c_str(), RTLD_NOW | RTLD_LOCAL)) return h;
#endif
  throw Error("cuBLAS", name + " could not be loaded", why);
}

template <class F>
void resolve(void* lib, F& slot, const char* symbol) {
  dlerror();
  void* p = dlsym(lib, symbol);
  if (!p) {
    const char* err = dlerror();
    throw Error("cuBLAS", soname() + " lacks " + symbol, err ? err : "no such symbol");
  }
  slot = reinterpret_cast<F>(p);
}

CublasApi load() {
  void* lib = open_library();
  CublasApi a{};
#define M3_RESOLVE(member, fn) resolve(lib, a.member, M3_STRINGIFY_EXPANDED(fn))
  M3_RESOLVE(create, cublasCreate);
  M3_RESOLVE(destroy, cublasDestroy);
  M3_RESOLVE(set_stream, cublasSetStream);
  M3_RESOLVE(set_math_mode, cublasSetMathMode);
  M3_RESOLVE(set_pointer_mode, cublasSetPointerMode);
  M3_RESOLVE(set_workspace, cublasSetWorkspace);
  M3_RESOLVE(gemm_ex, cublasGemmEx);
  M3_RESOLVE(dgemm_64, cublasDgemm_64);
  M3_RESOLVE(get_property, cublasGetProperty);
  M3_RESOLVE(status_string, cublasGetStatusString);
#undef M3_RESOLVE
  g_loaded = true;
  return a;
}

}  // namespace

const CublasApi& cublas() {
  // A function-local static initialises once; a throw leaves it uninitialised, so a later call
  // tries again and reports the same reason.
  static const CublasApi api = load();
  return api;
}

bool cublas_loaded() { return g_loaded; }

}  // namespace m3::gpu
