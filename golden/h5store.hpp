// m3::h5 — the golden-file store (HARNESS.md §8): a small RAII layer over the HDF5 C API that
// writes and reads m3::Tensor (shape + double data) as datasets, plus attributes.
//
// What it does
//   Writer  writes tensors at absolute object paths ("/stages/L0/F3/dt"), creating the groups
//           on the way, and string / integer / double attributes on any group or dataset
//           ("/" is the root). A dataset or attribute written twice is an error.
//   Reader  opens a file read-only and reads tensors and attributes back, checking shapes.
//   Every failure is an m3::Error whose what() is ONE line naming the file and the object, e.g.
//     golden/default.h5: dataset '/stages/L0/F3/dt': shape [512, 16] does not match expected
//     [512, 32]   (printed as one line)
//   HDF5's automatic error-stack printing is switched off; the innermost HDF5 message goes into
//   the "why" part of the Error instead. HDF5 handles (file, group, dataset, dataspace,
//   datatype, attribute, property list) are RAII wrappers inside h5store.cpp; this header
//   does not include hdf5.h, so users of the store need no HDF5 include paths.
//
// Stored dtypes (DType = m3::Precision: the same four formats as the GPU storage precisions)
//   f64, f32   IEEE little-endian (H5T_IEEE_F64LE / H5T_IEEE_F32LE): every HDF5 tool reads them.
//   bf16, f16  HDF5 has no standard type for either, so the raw bit patterns are stored as
//              uint16 (H5T_STD_U16LE) with a string attribute dtype = "bf16" | "f16" on the
//              dataset. h5py and h5dump show uint16; decode with the attribute, in numpy:
//                f16:  a.view(np.float16)      bf16: (a.astype(np.uint32) << 16).view(np.float32)
//   Writing rounds the double values: f32 by one round-to-nearest-even cast; bf16 / f16 by
//   double → float → RNE bits (m3::float_to_bf16_bits / float_to_f16_bits). Reading decodes
//   to double exactly, so a value read back and written again gives the same bits.
//   Non-finite values — NaN, ±inf, and finite values that overflow the stored dtype — are
//   rejected (naming the dataset and the first bad index) unless NonFinite::Allow is passed.
//
// Atomic writes
//   A Writer never writes to its final path. It creates "<final>.tmp.<pid>.<n>" in the same
//   folder, and commit() flushes, closes, fsyncs and renames it over the final path (a rename
//   within one folder is atomic). A Writer destroyed without commit() — an exception, an early
//   return — deletes its temporary file: an error never leaves a half-written file under the
//   final name, and an existing final file stays byte-identical until commit(). (A killed
//   process may leave a stale "*.tmp.*" file beside it, never a partial final file.)
//   An existing final file is replaced only when the Writer is made with overwrite = true.
//   After a failed call that may have modified the temporary file, commit() refuses.
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "capture.hpp"
#include "config.hpp"
#include "error.hpp"
#include "precision.hpp"

namespace m3::h5 {

// The stored dtype of a dataset: F64, F32, BF16, F16 (names "f64" … via m3::precision_name).
using DType = m3::Precision;

// Whether a write accepts NaN / ±inf (and values that overflow the stored dtype).
enum class NonFinite { Reject, Allow };

// True when every value is finite.
bool all_finite(const Tensor& t);

// "[i0, i1, ...]": the multi-index of flat (row-major) position `flat` in `shape`.
std::string index_str(const std::vector<Idx>& shape, Idx flat);

class Writer {
 public:
  // Creates the temporary file beside final_path. Throws when final_path exists and
  // !overwrite ("file exists (pass --force to replace it)"), or its folder does not exist.
  Writer(std::string final_path, bool overwrite);
  ~Writer();  // without commit(): closes and deletes the temporary file; never throws
  Writer(Writer&&) noexcept;
  Writer& operator=(Writer&&) noexcept;
  Writer(const Writer&) = delete;
  Writer& operator=(const Writer&) = delete;

  const std::string& path() const;       // the final path
  const std::string& temp_path() const;  // where the data goes until commit()

  // Dataset `path` (intermediate groups are created) holding t rounded to `stored`.
  // t.data.size() must equal t.numel(); rank 0 (a scalar) and zero-sized dimensions are fine.
  void write(const std::string& path, const Tensor& t, DType stored,
             NonFinite nonfinite = NonFinite::Reject);
  // Already-rounded bf16 / f16 bit patterns (prod(shape) values), stored as they are.
  void write_raw_u16(const std::string& path, const std::vector<Idx>& shape,
                     const std::uint16_t* bits, DType stored,
                     NonFinite nonfinite = NonFinite::Reject);
  // An (empty) group; creating an existing group again is a no-op.
  void group(const std::string& path);
  bool has(const std::string& path) const;  // a group or dataset exists at path

  // Attributes on an existing group or dataset ("/" = root). Strings are variable-length
  // UTF-8 (h5py reads them as str), integers int64, doubles f64, vectors 1-D f64.
  void attr(const std::string& path, const std::string& name, const std::string& value);
  void attr(const std::string& path, const std::string& name, const char* value);
  void attr(const std::string& path, const std::string& name, double value);
  void attr(const std::string& path, const std::string& name, const std::vector<double>& value);
  void attr(const std::string& path, const std::string& name, bool value) = delete;  // use 0 / 1
  template <class I, std::enable_if_t<std::is_integral_v<I> && !std::is_same_v<I, bool>, int> = 0>
  void attr(const std::string& path, const std::string& name, I value) {
    if constexpr (std::is_unsigned_v<I> && sizeof(I) >= sizeof(std::int64_t)) {
      M3_REQUIRE(value <= static_cast<I>(std::numeric_limits<std::int64_t>::max()), this->path(),
                 "attribute '" + name + "' of '" + path + "': value does not fit in int64", value);
    }
    attr_int64(path, name, static_cast<std::int64_t>(value));
  }

  // Flush, close, fsync and rename the temporary file over the final path. Once only.
  void commit();

 private:
  void attr_int64(const std::string& path, const std::string& name, std::int64_t value);
  struct Impl;
  Impl& impl() const;  // throws when used after a move
  std::unique_ptr<Impl> impl_;
};

class Reader {
 public:
  // Throws, one distinct message each: "file does not exist", "file is empty (0 bytes)",
  // "file is not an HDF5 file", "file is truncated or corrupt" (also from a later read).
  explicit Reader(std::string path);
  ~Reader();
  Reader(Reader&&) noexcept;
  Reader& operator=(Reader&&) noexcept;
  Reader(const Reader&) = delete;
  Reader& operator=(const Reader&) = delete;

  const std::string& path() const;

  bool has(const std::string& path) const;       // a group or dataset exists at path
  bool is_group(const std::string& path) const;  // a group exists at path
  std::vector<std::string> children(const std::string& group_path) const;  // sorted names

  DType dtype(const std::string& path) const;
  std::vector<Idx> shape(const std::string& path) const;
  Tensor read(const std::string& path) const;
  // Throws naming the dataset and both shapes when the stored shape differs.
  Tensor read(const std::string& path, const std::vector<Idx>& expected_shape) const;
  // As read(path, expected_shape), and throws naming the first NaN / inf and its index.
  Tensor read_finite(const std::string& path, const std::vector<Idx>& expected_shape) const;
  // The stored bit patterns of a bf16 / f16 dataset (an error for f32 / f64).
  std::vector<std::uint16_t> read_raw_u16(const std::string& path) const;

  bool has_attr(const std::string& path, const std::string& name) const;
  // The names of every attribute of a group or dataset, sorted.
  std::vector<std::string> attr_names(const std::string& path) const;
  // Each throws naming the object and the attribute when it is missing or of another kind.
  std::string attr_string(const std::string& path, const std::string& name) const;
  std::int64_t attr_int(const std::string& path, const std::string& name) const;
  double attr_double(const std::string& path, const std::string& name) const;
  std::vector<double> attr_doubles(const std::string& path, const std::string& name) const;

 private:
  struct Impl;
  const Impl& impl() const;  // throws when used after a move
  std::unique_ptr<Impl> impl_;
};

}  // namespace m3::h5
