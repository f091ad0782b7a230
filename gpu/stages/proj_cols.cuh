// A block of columns of a typed matrix that a producer of an f32 tensor also writes, rounded to
// the storage type: value (r, j) of the f32 output to p[r·ld + j] as from_float<T>(value).
// Production uses it for d_proj's f32 parts (MODEL.md §2.1, B3): B5b writes d_dd_dt, d_dd_a,
// d_trap_raw and B5a d_angles_raw straight into d_proj's columns, so that B3 (split_backward)
// has nothing left to move. The rounding is the one split_backward applies (from_float<T>), so
// d_proj holds the bits B3 would have stored; the f32 tensors are still written.
// Null p: not written (every launcher's default).
#pragma once

#include <cstdint>
#include <string>

#include "common.cuh"
#include "convert.cuh"

namespace m3::gpu {

struct ProjCols {
  enum class Type { kF32, kBf16, kF16 };
  void* p = nullptr;  // column 0 of row 0 of the block
  Idx ld = 0;         // the matrix's row stride (elements)
  Type type = Type::kF32;
};

template <class T>
ProjCols proj_cols(T* first, Idx ld) {
  ProjCols c;
  c.p = first;
  c.ld = ld;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) c.type = ProjCols::Type::kBf16;
  else if constexpr (std::is_same_v<T, __half>) c.type = ProjCols::Type::kF16;
  else static_assert(std::is_same_v<T, float>, "a storage type");
  return c;
}

// Launchers: c, when set, must have rows of at least the part's `width` values (named `what`).
inline void require_cols(const ProjCols& c, Idx width, const char* what, const char* where) {
  M3_REQUIRE(!c.p || c.ld >= width, where, std::string("d_proj's row stride is shorter than ") + what,
             "stride=", c.ld, " ", what, "=", width);
}

// Value (r, j) to c (nothing when c.p is null). The type is one for the whole launch, so the
// switch does not diverge.
__device__ __forceinline__ void store_col(const ProjCols& c, Idx r, Idx j, float v) {
  if (!c.p) return;
  const Idx o = r * c.ld + j;
  switch (c.type) {
    case ProjCols::Type::kF32: static_cast<float*>(c.p)[o] = v; break;
    case ProjCols::Type::kBf16:
      static_cast<__nv_bfloat16*>(c.p)[o] = from_float<__nv_bfloat16>(v);
      break;
    case ProjCols::Type::kF16: static_cast<__half*>(c.p)[o] = from_float<__half>(v); break;
  }
}

// Bytes of one value of c's type.
inline int proj_cols_value_bytes(const ProjCols& c) {
  return c.type == ProjCols::Type::kF32 ? 4 : 2;
}
// Whether store_cols4 may serve c: rows and the first column 4-value aligned (ld % 4 == 0 and
// p aligned to 4 values), so that every group of 4 columns from a multiple of 4 is one access.
inline bool proj_cols4(const ProjCols& c) {
  const int vb = proj_cols_value_bytes(c);
  return c.p && c.ld % 4 == 0 && reinterpret_cast<std::uintptr_t>(c.p) % (4 * vb) == 0;
}

// Values (r, j … j + 3) to c in one access (convert.cuh's store_n: from_float's bits, paired
// conversions for the 16-bit types), as store_col rounds them (j % 4 == 0 and proj_cols4(c):
// the caller's guarantee).
__device__ __forceinline__ void store_cols4(const ProjCols& c, Idx r, Idx j, const float (&v)[4]) {
  const Idx o = r * c.ld + j;
  switch (c.type) {
    case ProjCols::Type::kF32: store_n<4>(static_cast<float*>(c.p) + o, v); break;
    case ProjCols::Type::kBf16: store_n<4>(static_cast<__nv_bfloat16*>(c.p) + o, v); break;
    case ProjCols::Type::kF16: store_n<4>(static_cast<__half*>(c.p) + o, v); break;
  }
}

}  // namespace m3::gpu
