// The safetensors file format: read, check and write (docs/INTEROP.md §1).
//
//   bytes [0, 8)        n, the header's length: an unsigned 64-bit little-endian integer
//   bytes [8, 8 + n)    the header: a JSON object (UTF-8), padded with trailing spaces
//                         "__metadata__": {"key": "value", …}            optional, strings only
//                         "<name>": {"dtype": "F32", "shape": [d0, d1, …],
//                                    "data_offsets": [begin, end]}      one per tensor
//   bytes [8 + n, end)  the data: each tensor's elements row-major, little-endian, at
//                       [8 + n + begin, 8 + n + end); end − begin = prod(shape) · element size
//
// Element types read and written: F32, BF16, F16 (floats; to_floats widens them exactly) and
// I32 (token ids). Any other dtype of the format (F64, I64, U8, …) is refused by name.
//
// Writing (encode): the tensors in the order given, back to back from offset 0, the header
// padded with spaces to a multiple of 8 bytes so that every tensor starts 8-byte aligned in
// the file (all element sizes divide 8); the same File always encodes to the same bytes.
//
// Reading (decode) treats the file as untrusted and refuses, in one m3::Error line naming the
// file and the tensor where there is one: a file shorter than 8 bytes, a header length past the
// end of the file or above 100 MiB, a header that is not a JSON object (or repeats a key), a
// tensor entry without a string dtype, an array of non-negative integer dims or two
// data_offsets, an unknown dtype, a byte range whose length is not the shape's, that runs past
// the data or overlaps another tensor's, data bytes no tensor covers (the format indexes the
// whole buffer), and __metadata__ values that are not strings.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "config.hpp"

namespace m3::st {

enum class DType { F32, BF16, F16, I32 };

const char* dtype_name(DType d);  // "F32" | "BF16" | "F16" | "I32" (the format's spelling)
std::size_t dtype_size(DType d);  // bytes per element: 4, 2, 2, 4

struct TensorData {
  std::string name;
  DType dtype = DType::F32;
  std::vector<Idx> shape;           // row-major, outermost first; [] is a scalar
  std::vector<std::uint8_t> bytes;  // prod(shape) · dtype_size little-endian elements
  Idx numel() const;
};

struct File {
  std::vector<std::pair<std::string, std::string>> metadata;  // "__metadata__", in order
  std::vector<TensorData> tensors;                            // in data order

  const TensorData* find(const std::string& name) const;  // null when absent
  const std::string* meta(const std::string& key) const;  // null when absent
};

// Tensors from values: f32 little-endian bytes of `values` (and an I32 one of ids).
TensorData f32_tensor(std::string name, std::vector<Idx> shape, const std::vector<float>& values);
TensorData i32_tensor(std::string name, std::vector<Idx> shape,
                      const std::vector<std::int32_t>& values);

// The elements of a floating-point tensor as float: F32 as stored, BF16 / F16 widened (exact:
// every bf16 and f16 value is a float). An I32 tensor is an m3::Error naming it.
std::vector<float> to_floats(const TensorData& t, const std::string& where);
// The elements of an I32 tensor (any other dtype is an m3::Error naming it).
std::vector<std::int32_t> to_ints(const TensorData& t, const std::string& where);

// The bytes of a safetensors file holding `f`. Throws m3::Error (where = `where`) on an empty
// or repeated tensor name, the name "__metadata__", or a byte count that is not the shape's.
std::string encode(const File& f, const std::string& where = "safetensors");
// Parses and checks `bytes` (see the file comment); `where` (the file's name) leads each error.
File decode(const std::string& bytes, const std::string& where);

// decode() of a file's bytes; a file that cannot be opened or read is an m3::Error naming it.
File read_file(const std::string& path);
// encode() written atomically (temporary file beside `path`, fsync, rename): never a half
// file. Replaces an existing file; the caller decides whether it may (the tools' --force).
void write_file(const std::string& path, const File& f);

}  // namespace m3::st
