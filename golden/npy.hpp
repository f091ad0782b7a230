// m3::npy — tensors as NumPy .npy files: the interchange of `m3h judge` with implementations
// that can write NumPy arrays but not HDF5 (a PyTorch run where h5py is absent; numpy.save and
// numpy.load are all such a program needs). docs/HARNESS.md §10 describes the folders built
// from these files.
//
// Format (NumPy's own, versions 1.0, 2.0 and 3.0): the magic "\x93NUMPY", a major and a minor
// version byte, the header length (uint16 little-endian in 1.0, uint32 in 2.0/3.0), then the
// header — a Python dict literal {'descr': '<f8', 'fortran_order': False, 'shape': (2, 3), }
// padded with spaces to a multiple of 64 bytes and ended by '\n' — then the data, row-major.
//
//   encode  f64 little-endian ('<f8'), version 1.0, C order: the values exactly.
//   decode  '<f8', '<f4' and '<f2' (IEEE binary64/32/16, little-endian), C order, any rank
//           (rank 0 is a scalar), widened to double exactly; a bfloat16 tensor travels as '<f4'
//           (exact). Big-endian data, Fortran order, other dtypes, a malformed header, and data
//           shorter or longer than the shape says are m3::Error lines naming the file.
//           Non-finite values are kept: judging them is the reader's business.
// Tensor (capture.hpp): shape + data as double, row-major.
#pragma once

#include <string>

#include "capture.hpp"

namespace m3::npy {

// The bytes of a .npy file holding t as '<f8'. t.data.size() must equal t.numel().
std::string encode(const Tensor& t);

// The tensor in `bytes`; `name` (a path) is what errors name.
Tensor decode(const std::string& bytes, const std::string& name);

// decode() of a whole file; a missing or unreadable file is an m3::Error naming it.
Tensor read(const std::string& path);

// Writes encode(t) to `path` (created or truncated), checking every step; the caller makes
// the whole write atomic (a temporary folder renamed into place, harness/judge.hpp).
void write(const std::string& path, const Tensor& t);

}  // namespace m3::npy
