// The golden-file store (h5store.hpp) over the HDF5 C API.
//
//   Handle<Close>   RAII owner of one hid_t, closed with the matching H5?close on destruction
//   lookup()        walks an absolute path one link at a time (H5Lexists + H5Oopen), so a
//                   missing object is reported with the deepest group that does exist
//   Writer          temporary file "<final>.tmp.<pid>.<n>", renamed over <final> by commit()
//   Reader          signature check before H5Fopen, so "empty", "not HDF5" and "truncated or
//                   corrupt" are told apart; every later HDF5 failure reads as corrupt
// Only API that is stable from HDF5 1.10 on is used (no H5Literate / H5Oget_info, whose
// callback and struct types changed in 1.12).
#include "h5store.hpp"
#include "temp_files.hpp"

#include <fcntl.h>
#include <hdf5.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <utility>

namespace fs = std::filesystem;

namespace m3::h5 {
namespace {

// --- RAII handles -------------------------------------------------------------------------------

template <herr_t (*Close)(hid_t)>
class Handle {
 public:
  Handle() = default;
  explicit Handle(hid_t id) : id_(id) {}
  ~Handle() { reset(); }
  Handle(Handle&& o) noexcept : id_(std::exchange(o.id_, -1)) {}
  Handle& operator=(Handle&& o) noexcept {
    if (this != &o) {
      reset();
      id_ = std::exchange(o.id_, -1);
    }
    return *this;
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;

  hid_t get() const { return id_; }
  explicit operator bool() const { return id_ >= 0; }
  hid_t release() { return std::exchange(id_, -1); }
  void reset() {
    if (id_ >= 0) Close(id_);
    id_ = -1;
  }

 private:
  hid_t id_ = -1;
};

using FileId = Handle<H5Fclose>;
using GroupId = Handle<H5Gclose>;
using DatasetId = Handle<H5Dclose>;
using SpaceId = Handle<H5Sclose>;
using TypeId = Handle<H5Tclose>;
using AttrId = Handle<H5Aclose>;
using PlistId = Handle<H5Pclose>;
using ObjectId = Handle<H5Oclose>;

// --- errors -------------------------------------------------------------------------------------

// Before the library's first use: no automatic error printing, and no library shutdown at exit.
// That shutdown would close the files still open, and the only one that can be is a discarded
// temporary whose flush failed (a full disk at commit): the library keeps such a file with its
// metadata cache half-flushed even after the descriptor is redirected, and crashes closing it.
// Skipping the shutdown loses nothing: a committed file is closed and synced by commit(), a
// Reader's by its handle, and the discarded temporary's path is removed by ~Writer.
void quiet_hdf5() {
  static const bool once = [] {
    H5dont_atexit();
    return true;
  }();
  (void)once;
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
}

std::string one_line(std::string s) {
  for (char& c : s)
    if (c == '\n' || c == '\r' || c == '\t') c = ' ';
  return s;
}

herr_t keep_innermost(unsigned n, const H5E_error2_t* err, void* out) {
  if (n == 0 && err != nullptr && err->desc != nullptr) *static_cast<std::string*>(out) = err->desc;
  return 0;
}

// The innermost message of HDF5's error stack (then cleared), for the "why" of an Error. A
// failed system call's message ("file write failed: time = …, buf = 0x…, errno = 28, error
// message = 'No space left on device', …") is cut to what it says: the operation and the
// system's error message.
std::string hdf5_why() {
  std::string desc;
  H5Ewalk2(H5E_DEFAULT, H5E_WALK_UPWARD, keep_innermost, &desc);
  H5Eclear2(H5E_DEFAULT);
  if (desc.empty()) return "HDF5 gave no message";
  const std::string key = "error message = '";
  const std::size_t at = desc.find(key), colon = desc.find(':');
  if (at != std::string::npos) {
    const std::size_t from = at + key.size(), to = desc.find('\'', from);
    const std::string op = colon != std::string::npos && colon < at ? desc.substr(0, colon) : "";
    return "HDF5: " + (op.empty() ? "" : op + ": ") +
           desc.substr(from, to == std::string::npos ? std::string::npos : to - from);
  }
  return "HDF5: " + one_line(desc);
}

// Where errors are reported: the file's display name, and whether it is being read (then any
// HDF5 failure means the file is damaged) or written (a temporary file we own).
struct Ctx {
  std::string file;
  bool reading = false;
};

[[noreturn]] void fail(const Ctx& c, const std::string& what, const std::string& why = "") {
  throw Error(c.file, one_line(what), one_line(why));
}

// An HDF5 call failed: reading → the file is damaged; writing → the call is named.
[[noreturn]] void fail_hdf5(const Ctx& c, const std::string& what) {
  const std::string why = hdf5_why();
  if (c.reading) fail(c, what + ": the file is truncated or corrupt", why);
  fail(c, what, why);
}

template <class H>
H checked(hid_t id, const Ctx& c, const std::string& what) {
  if (id < 0) fail_hdf5(c, what);
  return H(id);
}

void check(herr_t status, const Ctx& c, const std::string& what) {
  if (status < 0) fail_hdf5(c, what);
}

std::string num_str(double v) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

// --- paths --------------------------------------------------------------------------------------

std::vector<std::string> split_path(const Ctx& c, const std::string& path) {
  if (path.empty()) fail(c, "empty object path", "expected an absolute path like '/stages/x'");
  std::vector<std::string> parts;
  std::string cur;
  for (char ch : path) {
    if (ch == '/') {
      if (!cur.empty()) parts.push_back(cur);
      cur.clear();
    } else {
      cur += ch;
    }
  }
  if (!cur.empty()) parts.push_back(cur);
  for (const auto& p : parts)
    if (p == "." || p == "..") fail(c, "object path '" + path + "' has a '.' or '..' component");
  return parts;
}

std::string join_path(const std::vector<std::string>& parts, std::size_t n) {
  if (n == 0) return "/";
  std::string s;
  for (std::size_t i = 0; i < n; ++i) s += "/" + parts[i];
  return s;
}

// "/a//b/" → "/a/b"; "" is an error; "/" stays "/".
std::string norm_path(const Ctx& c, const std::string& path) {
  const auto parts = split_path(c, path);
  return join_path(parts, parts.size());
}

enum class Kind { None, Group, Dataset, Other };

struct Lookup {
  Kind kind = Kind::None;     // what is at the full path
  std::string deepest = "/";  // the deepest existing prefix of the path
  Kind deepest_kind = Kind::Group;
  std::string missing;  // the first component not found (when kind == None)
};

Kind kind_at(hid_t file, const Ctx& c, const std::string& path) {
  const auto obj = checked<ObjectId>(H5Oopen(file, path.c_str(), H5P_DEFAULT), c,
                                     "object '" + path + "' cannot be opened");
  switch (H5Iget_type(obj.get())) {
    case H5I_GROUP:
      return Kind::Group;
    case H5I_DATASET:
      return Kind::Dataset;
    default:
      return Kind::Other;
  }
}

Lookup lookup(hid_t file, const Ctx& c, const std::string& path) {
  const auto parts = split_path(c, path);
  Lookup r;
  r.kind = Kind::Group;
  for (std::size_t i = 0; i < parts.size(); ++i) {
    if (r.kind != Kind::Group) {
      r.kind = Kind::None;
      r.missing = parts[i];
      return r;
    }
    const std::string next = join_path(parts, i + 1);
    const htri_t e = H5Lexists(file, next.c_str(), H5P_DEFAULT);
    if (e < 0) fail_hdf5(c, "object '" + next + "' cannot be looked up");
    if (e == 0) {
      r.kind = Kind::None;
      r.missing = parts[i];
      return r;
    }
    r.kind = kind_at(file, c, next);
    r.deepest = next;
    r.deepest_kind = r.kind;
  }
  return r;
}

// Why a lookup found nothing: "group '/stages' has no 'L9'" or "'/a' is a dataset, not a group".
std::string missing_why(const Lookup& lk) {
  if (lk.deepest_kind == Kind::Group)
    return "group '" + lk.deepest + "' has no '" + lk.missing + "'";
  return "'" + lk.deepest + "' is a dataset, not a group";
}

// --- dataspaces and dtypes ----------------------------------------------------------------------

Idx checked_numel(const Ctx& c, const std::string& obj, const std::vector<Idx>& shape) {
  Idx n = 1;
  for (Idx d : shape) {
    if (d < 0) fail(c, obj + ": negative dimension in shape " + shape_str(shape));
    if (d != 0 && n > std::numeric_limits<Idx>::max() / d)
      fail(c, obj + ": shape " + shape_str(shape) + " has too many elements");
    n *= d;
  }
  return n;
}

SpaceId make_space(const Ctx& c, const std::string& obj, const std::vector<Idx>& shape) {
  if (shape.empty())
    return checked<SpaceId>(H5Screate(H5S_SCALAR), c, obj + ": cannot create a scalar dataspace");
  std::vector<hsize_t> dims(shape.begin(), shape.end());
  return checked<SpaceId>(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), c,
                          obj + ": cannot create dataspace " + shape_str(shape));
}

std::vector<Idx> space_shape(hid_t space, const Ctx& c, const std::string& obj) {
  const H5S_class_t cls = H5Sget_simple_extent_type(space);
  if (cls == H5S_SCALAR) return {};
  if (cls != H5S_SIMPLE) {
    if (cls == H5S_NULL) fail(c, obj + ": has a null dataspace (no values)");
    fail_hdf5(c, obj + ": dataspace cannot be read");
  }
  const int rank = H5Sget_simple_extent_ndims(space);
  if (rank < 0) fail_hdf5(c, obj + ": rank cannot be read");
  std::vector<hsize_t> dims(static_cast<std::size_t>(rank));
  if (rank > 0 && H5Sget_simple_extent_dims(space, dims.data(), nullptr) < 0)
    fail_hdf5(c, obj + ": dimensions cannot be read");
  std::vector<Idx> shape;
  for (hsize_t d : dims) {
    if (d > static_cast<hsize_t>(std::numeric_limits<Idx>::max()))
      fail(c, obj + ": a dimension exceeds int64");
    shape.push_back(static_cast<Idx>(d));
  }
  return shape;
}

bool is_u16_dtype(DType d) { return d == DType::BF16 || d == DType::F16; }

bool u16_finite(DType d, std::uint16_t h) {
  return d == DType::BF16 ? (h & 0x7F80u) != 0x7F80u : (h & 0x7C00u) != 0x7C00u;
}

double u16_decode(DType d, std::uint16_t h) {
  return static_cast<double>(d == DType::BF16 ? bf16_bits_to_float(h) : f16_bits_to_float(h));
}

TypeId vlen_utf8_type(const Ctx& c) {
  auto t = checked<TypeId>(H5Tcopy(H5T_C_S1), c, "cannot create a string type");
  check(H5Tset_size(t.get(), H5T_VARIABLE), c, "cannot create a string type");
  check(H5Tset_cset(t.get(), H5T_CSET_UTF8), c, "cannot create a string type");
  return t;
}

// A one-value attribute's element count check, then its HDF5 type class.
H5T_class_t attr_class(hid_t a, const Ctx& c, const std::string& obj, bool single) {
  const auto space = checked<SpaceId>(H5Aget_space(a), c, obj + " cannot be read");
  const hssize_t n = H5Sget_simple_extent_npoints(space.get());
  if (n < 0) fail_hdf5(c, obj + " cannot be read");
  if (single && n != 1) fail(c, obj + " holds " + std::to_string(n) + " values, expected one");
  const auto type = checked<TypeId>(H5Aget_type(a), c, obj + " cannot be read");
  const H5T_class_t cls = H5Tget_class(type.get());
  if (cls == H5T_NO_CLASS) fail_hdf5(c, obj + " cannot be read");
  return cls;
}

std::string read_string_attr(hid_t a, const Ctx& c, const std::string& obj) {
  if (attr_class(a, c, obj, true) != H5T_STRING) fail(c, obj + " is not a string");
  const auto ftype = checked<TypeId>(H5Aget_type(a), c, obj + " cannot be read");
  const htri_t vlen = H5Tis_variable_str(ftype.get());
  if (vlen < 0) fail_hdf5(c, obj + " cannot be read");
  if (vlen > 0) {
    TypeId mtype = vlen_utf8_type(c);
    check(H5Tset_cset(mtype.get(), H5Tget_cset(ftype.get())), c, obj + " cannot be read");
    char* s = nullptr;
    check(H5Aread(a, mtype.get(), &s), c, obj + " cannot be read");
    std::string out = s != nullptr ? s : "";
    H5free_memory(s);
    return out;
  }
  const std::size_t size = H5Tget_size(ftype.get());
  if (size == 0) fail_hdf5(c, obj + " cannot be read");
  std::string buf(size, '\0');
  check(H5Aread(a, ftype.get(), buf.data()), c, obj + " cannot be read");
  return buf.substr(0, buf.find('\0'));
}

// Best-effort durability before the rename: the data, then the folder entry.
bool fsync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), directory ? (O_RDONLY | O_DIRECTORY) : O_RDONLY);
  if (fd < 0) return false;
  const bool ok = ::fsync(fd) == 0;
  ::close(fd);
  return ok;
}

std::atomic<unsigned> g_temp_counter{0};

}  // namespace

// --- helpers of the header ----------------------------------------------------------------------

bool all_finite(const Tensor& t) {
  return std::all_of(t.data.begin(), t.data.end(), [](double v) { return std::isfinite(v); });
}

std::string index_str(const std::vector<Idx>& shape, Idx flat) {
  std::vector<Idx> idx(shape.size(), 0);
  for (std::size_t k = shape.size(); k-- > 0;) {
    if (shape[k] > 0) {
      idx[k] = flat % shape[k];
      flat /= shape[k];
    }
  }
  std::string s = "[";
  for (std::size_t k = 0; k < idx.size(); ++k) s += (k ? ", " : "") + std::to_string(idx[k]);
  return s + "]";
}

// --- Writer -------------------------------------------------------------------------------------

struct Writer::Impl {
  Ctx ctx;  // display name = the final path
  std::string temp_path;
  std::unique_ptr<tmp::TempFile> temp_guard;  // SIGINT / SIGTERM remove the temporary
  bool overwrite = false;
  FileId file;
  bool committed = false;
  bool poisoned = false;  // a failed call may have left the temporary file half-modified

  // Marks the writer poisoned unless the mutation it guards completes.
  class Mutation {
   public:
    explicit Mutation(Impl& w) : w_(w) {}
    ~Mutation() {
      if (!done_) w_.poisoned = true;
    }
    void done() { done_ = true; }

   private:
    Impl& w_;
    bool done_ = false;
  };

  void require_open(const std::string& obj) const {
    if (committed) fail(ctx, obj + ": cannot be written", "the file is already committed");
  }

  void create_dataset(const std::string& p, const std::vector<Idx>& shape, DType stored,
                      hid_t file_type, hid_t mem_type, const void* buf, Idx numel) {
    const std::string obj = "dataset '" + p + "'";
    const Lookup lk = lookup(file.get(), ctx, p);
    if (lk.kind == Kind::Dataset) fail(ctx, obj + ": is written twice (it already exists)");
    if (lk.kind != Kind::None) fail(ctx, obj + ": already exists as a group");
    if (lk.deepest_kind != Kind::Group) fail(ctx, obj + ": cannot be created", missing_why(lk));
    const SpaceId space = make_space(ctx, obj, shape);
    const auto lcpl =
        checked<PlistId>(H5Pcreate(H5P_LINK_CREATE), ctx, obj + ": cannot be created");
    check(H5Pset_create_intermediate_group(lcpl.get(), 1), ctx, obj + ": cannot be created");

    // No modification times in the object headers: regenerating an unchanged case gives a
    // byte-identical file (git sees no change).
    const auto dcpl =
        checked<PlistId>(H5Pcreate(H5P_DATASET_CREATE), ctx, obj + ": cannot be created");
    check(H5Pset_obj_track_times(dcpl.get(), 0), ctx, obj + ": cannot be created");

    Mutation m(*this);
    const auto ds = checked<DatasetId>(H5Dcreate2(file.get(), p.c_str(), file_type, space.get(),
                                                  lcpl.get(), dcpl.get(), H5P_DEFAULT),
                                       ctx, obj + ": cannot be created");
    if (numel > 0)
      check(H5Dwrite(ds.get(), mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf), ctx,
            obj + ": cannot be written");
    if (is_u16_dtype(stored)) {
      const TypeId st = vlen_utf8_type(ctx);
      const auto scalar = checked<SpaceId>(H5Screate(H5S_SCALAR), ctx, obj + ": dtype attribute");
      const auto a = checked<AttrId>(
          H5Acreate2(ds.get(), "dtype", st.get(), scalar.get(), H5P_DEFAULT, H5P_DEFAULT), ctx,
          obj + ": its dtype attribute cannot be created");
      const char* name = precision_name(stored);
      check(H5Awrite(a.get(), st.get(), &name), ctx,
            obj + ": its dtype attribute cannot be written");
    }
    m.done();
  }

  void put_attr(const std::string& path, const std::string& name, hid_t file_type, hid_t mem_type,
                const SpaceId& space, const void* buf) {
    const std::string p = norm_path(ctx, path);
    const std::string obj = "attribute '" + name + "' of '" + p + "'";
    require_open(obj);
    if (name.empty()) fail(ctx, "attribute of '" + p + "': empty attribute name");
    const Lookup lk = lookup(file.get(), ctx, p);
    if (lk.kind == Kind::None)
      fail(ctx, obj + ": object '" + p + "' does not exist", missing_why(lk));
    const htri_t e = H5Aexists_by_name(file.get(), p.c_str(), name.c_str(), H5P_DEFAULT);
    if (e < 0) fail_hdf5(ctx, obj + ": cannot be looked up");
    if (e > 0) fail(ctx, obj + ": is written twice (it already exists)");

    Mutation m(*this);
    const auto a =
        checked<AttrId>(H5Acreate_by_name(file.get(), p.c_str(), name.c_str(), file_type,
                                          space.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
                        ctx, obj + ": cannot be created");
    if (H5Sget_simple_extent_npoints(space.get()) > 0)  // an empty vector has nothing to write
      check(H5Awrite(a.get(), mem_type, buf), ctx, obj + ": cannot be written");
    m.done();
  }
};

Writer::Writer(std::string final_path, bool overwrite) : impl_(std::make_unique<Impl>()) {
  quiet_hdf5();
  Impl& w = *impl_;
  w.ctx.file = std::move(final_path);
  w.overwrite = overwrite;
  const Ctx& c = w.ctx;
  if (c.file.empty()) throw Error("h5::Writer", "empty file path", "");

  std::error_code ec;
  const fs::path fp(c.file);
  const fs::file_status st = fs::status(fp, ec);
  if (fs::exists(st)) {
    if (fs::is_directory(st)) fail(c, "is a directory, not a file");
    if (!overwrite) fail(c, "file exists", "pass --force to replace it");
  }
  const fs::path parent = fp.parent_path();
  if (!parent.empty() && !fs::is_directory(parent, ec))
    fail(c, "cannot be written", "folder '" + parent.string() + "' does not exist");

  tmp::clean_stale_temps(c.file);  // what a killed earlier run left
  w.temp_path = c.file + ".tmp." + std::to_string(::getpid()) + "." +
                std::to_string(g_temp_counter.fetch_add(1));
  w.temp_guard = std::make_unique<tmp::TempFile>(w.temp_path);
  const auto fapl =
      checked<PlistId>(H5Pcreate(H5P_FILE_ACCESS), c, "cannot create file access list");
  check(H5Pset_fclose_degree(fapl.get(), H5F_CLOSE_STRONG), c, "cannot set close degree");
  const hid_t f = H5Fcreate(w.temp_path.c_str(), H5F_ACC_EXCL, H5P_DEFAULT, fapl.get());
  if (f < 0) {
    // A create that fails writing the superblock (a full disk) has made the file already.
    const std::string why = hdf5_why();
    fs::remove(w.temp_path, ec);
    fail(c, "cannot create the temporary file '" + w.temp_path + "'", why);
  }
  w.file = FileId(f);
}

// A discarded temporary is closed with its writes sent to memory: the library's close flushes
// its metadata, and on a full disk that flush would fail, leave the file open inside the library
// with dirty metadata, and crash the library's shutdown at exit. Its descriptor is replaced
// (dup2) by an anonymous in-memory file, so the flush cannot fail; the bytes were to be thrown
// away anyway. The temporary's path is removed after.
namespace {
void close_discarded(FileId& file) {
  if (!file) return;
  void* handle = nullptr;
  if (H5Fget_vfd_handle(file.get(), H5P_DEFAULT, &handle) >= 0 && handle != nullptr) {
    const int sink = ::memfd_create("m3-discarded-h5", MFD_CLOEXEC);
    if (sink >= 0) {
      (void)::dup2(sink, *static_cast<int*>(handle));
      ::close(sink);
    }
  }
  H5Eclear2(H5E_DEFAULT);
  file.reset();
  H5Eclear2(H5E_DEFAULT);
}
}  // namespace

Writer::~Writer() {
  if (!impl_ || impl_->committed) return;
  close_discarded(impl_->file);
  std::error_code ec;
  fs::remove(impl_->temp_path, ec);
}

Writer::Writer(Writer&&) noexcept = default;

Writer& Writer::operator=(Writer&& o) noexcept {
  if (this != &o) {
    Writer discard(std::move(*this));  // an uncommitted file of *this is deleted here
    impl_ = std::move(o.impl_);
  }
  return *this;
}

namespace {
const std::string& moved_from_path() {
  static const std::string empty;
  return empty;
}
}  // namespace

const std::string& Writer::path() const { return impl_ ? impl_->ctx.file : moved_from_path(); }
const std::string& Writer::temp_path() const {
  return impl_ ? impl_->temp_path : moved_from_path();
}

Writer::Impl& Writer::impl() const {
  if (!impl_) throw Error("h5::Writer", "used after it was moved from", "");
  return *impl_;
}

void Writer::write(const std::string& path, const Tensor& t, DType stored, NonFinite nonfinite) {
  Impl& w = impl();
  const Ctx& c = w.ctx;
  const std::string p = norm_path(c, path);
  const std::string obj = "dataset '" + p + "'";
  w.require_open(obj);
  const Idx n = checked_numel(c, obj, t.shape);
  if (static_cast<Idx>(t.data.size()) != n)
    fail(c, obj + ": tensor has " + std::to_string(t.data.size()) + " values for shape " +
                shape_str(t.shape) + " (" + std::to_string(n) + ")");

  const bool reject = nonfinite == NonFinite::Reject;
  const char* dname = precision_name(stored);
  auto check_value = [&](Idx i, bool stored_finite) {
    if (!reject || stored_finite) return;
    const double v = t.data[static_cast<std::size_t>(i)];
    if (!std::isfinite(v))
      fail(c, obj + ": non-finite value " + num_str(v) + " at index " + index_str(t.shape, i),
           "pass NonFinite::Allow to store it");
    fail(c, obj + ": value " + num_str(v) + " at index " + index_str(t.shape, i) + " overflows " +
                dname);
  };

  std::vector<float> f32;
  std::vector<std::uint16_t> u16;
  hid_t file_type = -1, mem_type = -1;
  const void* buf = nullptr;
  switch (stored) {
    case DType::F64:
      for (Idx i = 0; i < n; ++i)
        check_value(i, std::isfinite(t.data[static_cast<std::size_t>(i)]));
      file_type = H5T_IEEE_F64LE;
      mem_type = H5T_NATIVE_DOUBLE;
      buf = t.data.data();
      break;
    case DType::F32:
      f32.resize(static_cast<std::size_t>(n));
      for (Idx i = 0; i < n; ++i) {
        f32[static_cast<std::size_t>(i)] = static_cast<float>(t.data[static_cast<std::size_t>(i)]);
        check_value(i, std::isfinite(f32[static_cast<std::size_t>(i)]));
      }
      file_type = H5T_IEEE_F32LE;
      mem_type = H5T_NATIVE_FLOAT;
      buf = f32.data();
      break;
    case DType::BF16:
    case DType::F16:
      u16.resize(static_cast<std::size_t>(n));
      for (Idx i = 0; i < n; ++i) {
        const float f = static_cast<float>(t.data[static_cast<std::size_t>(i)]);
        const std::uint16_t h =
            stored == DType::BF16 ? float_to_bf16_bits(f) : float_to_f16_bits(f);
        u16[static_cast<std::size_t>(i)] = h;
        check_value(i, u16_finite(stored, h));
      }
      file_type = H5T_STD_U16LE;
      mem_type = H5T_NATIVE_UINT16;
      buf = u16.data();
      break;
  }
  w.create_dataset(p, t.shape, stored, file_type, mem_type, buf, n);
}

void Writer::write_raw_u16(const std::string& path, const std::vector<Idx>& shape,
                           const std::uint16_t* bits, DType stored, NonFinite nonfinite) {
  Impl& w = impl();
  const Ctx& c = w.ctx;
  const std::string p = norm_path(c, path);
  const std::string obj = "dataset '" + p + "'";
  w.require_open(obj);
  if (!is_u16_dtype(stored))
    fail(c, obj + ": write_raw_u16 needs bf16 or f16, got " + precision_name(stored));
  const Idx n = checked_numel(c, obj, shape);
  if (n > 0 && bits == nullptr) fail(c, obj + ": null data for shape " + shape_str(shape));
  if (nonfinite == NonFinite::Reject)
    for (Idx i = 0; i < n; ++i)
      if (!u16_finite(stored, bits[i]))
        fail(c,
             obj + ": non-finite value " + num_str(u16_decode(stored, bits[i])) + " at index " +
                 index_str(shape, i),
             "pass NonFinite::Allow to store it");
  w.create_dataset(p, shape, stored, H5T_STD_U16LE, H5T_NATIVE_UINT16, bits, n);
}

void Writer::group(const std::string& path) {
  Impl& w = impl();
  const Ctx& c = w.ctx;
  const std::string p = norm_path(c, path);
  const std::string obj = "group '" + p + "'";
  w.require_open(obj);
  const Lookup lk = lookup(w.file.get(), c, p);
  if (lk.kind == Kind::Group) return;
  if (lk.kind != Kind::None) fail(c, obj + ": a dataset exists at that path");
  if (lk.deepest_kind != Kind::Group) fail(c, obj + ": cannot be created", missing_why(lk));
  const auto lcpl = checked<PlistId>(H5Pcreate(H5P_LINK_CREATE), c, obj + ": cannot be created");
  check(H5Pset_create_intermediate_group(lcpl.get(), 1), c, obj + ": cannot be created");
  Impl::Mutation m(w);
  const auto gcpl = checked<PlistId>(H5Pcreate(H5P_GROUP_CREATE), c, obj + ": cannot be created");
  check(H5Pset_obj_track_times(gcpl.get(), 0), c, obj + ": cannot be created");
  checked<GroupId>(H5Gcreate2(w.file.get(), p.c_str(), lcpl.get(), gcpl.get(), H5P_DEFAULT), c,
                   obj + ": cannot be created");
  m.done();
}

bool Writer::has(const std::string& path) const {
  const Impl& w = impl();
  if (w.committed) fail(w.ctx, "has('" + path + "'): the file is already committed");
  return lookup(w.file.get(), w.ctx, norm_path(w.ctx, path)).kind != Kind::None;
}

void Writer::attr(const std::string& path, const std::string& name, const std::string& value) {
  Impl& w = impl();
  if (value.find('\0') != std::string::npos)
    fail(w.ctx, "attribute '" + name + "' of '" + path + "': string contains a NUL character");
  const TypeId type = vlen_utf8_type(w.ctx);
  const auto space = checked<SpaceId>(H5Screate(H5S_SCALAR), w.ctx, "attribute '" + name + "'");
  const char* s = value.c_str();
  w.put_attr(path, name, type.get(), type.get(), space, &s);
}

void Writer::attr(const std::string& path, const std::string& name, const char* value) {
  if (value == nullptr)
    throw Error(this->path(), "attribute '" + name + "' of '" + path + "': null string", "");
  attr(path, name, std::string(value));
}

void Writer::attr(const std::string& path, const std::string& name, double value) {
  Impl& w = impl();
  const auto space = checked<SpaceId>(H5Screate(H5S_SCALAR), w.ctx, "attribute '" + name + "'");
  w.put_attr(path, name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, space, &value);
}

void Writer::attr(const std::string& path, const std::string& name,
                  const std::vector<double>& value) {
  Impl& w = impl();
  const hsize_t n = value.size();
  const auto space =
      checked<SpaceId>(H5Screate_simple(1, &n, nullptr), w.ctx, "attribute '" + name + "'");
  w.put_attr(path, name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, space, value.data());
}

void Writer::attr_int64(const std::string& path, const std::string& name, std::int64_t value) {
  Impl& w = impl();
  const auto space = checked<SpaceId>(H5Screate(H5S_SCALAR), w.ctx, "attribute '" + name + "'");
  w.put_attr(path, name, H5T_STD_I64LE, H5T_NATIVE_INT64, space, &value);
}

void Writer::commit() {
  Impl& w = impl();
  const Ctx& c = w.ctx;
  if (w.committed) fail(c, "commit: the file is already committed");
  if (w.poisoned)
    fail(c, "commit refused", "an earlier write failed part-way; the temporary file is discarded");
  std::error_code ec;
  if (!w.overwrite && fs::exists(c.file, ec))
    fail(c, "file exists", "it appeared while writing; pass --force to replace it");
  check(H5Fflush(w.file.get(), H5F_SCOPE_GLOBAL), c,
        "cannot flush the temporary file '" + w.temp_path + "'");
  // A close that fails keeps the file open in the library (its id stays valid): the handle is
  // kept, so that the destructor discards it and nothing is left for the library's shutdown.
  check(H5Fclose(w.file.get()), c, "cannot close the temporary file '" + w.temp_path + "'");
  w.file.release();
  if (!fsync_path(w.temp_path, false))
    fail(c, "cannot sync the temporary file '" + w.temp_path + "'", std::strerror(errno));
  fs::rename(w.temp_path, c.file, ec);
  if (ec)
    fail(c, "cannot rename the temporary file '" + w.temp_path + "' into place", ec.message());
  const fs::path parent = fs::path(c.file).parent_path();
  fsync_path(parent.empty() ? std::string(".") : parent.string(), true);
  w.committed = true;
}

// --- Reader -------------------------------------------------------------------------------------

struct Reader::Impl {
  Ctx ctx;  // reading = true: every HDF5 failure reads "the file is truncated or corrupt"
  FileId file;

  DatasetId open_dataset(const std::string& p) const {
    const std::string obj = "dataset '" + p + "'";
    const Lookup lk = lookup(file.get(), ctx, p);
    if (lk.kind == Kind::None) fail(ctx, obj + " does not exist", missing_why(lk));
    if (lk.kind != Kind::Dataset) fail(ctx, obj + ": is a group, not a dataset");
    return checked<DatasetId>(H5Dopen2(file.get(), p.c_str(), H5P_DEFAULT), ctx,
                              obj + ": cannot be opened");
  }

  std::vector<Idx> shape_of(const DatasetId& ds, const std::string& obj) const {
    const auto space = checked<SpaceId>(H5Dget_space(ds.get()), ctx, obj + ": dataspace");
    return space_shape(space.get(), ctx, obj);
  }

  DType dtype_of(const DatasetId& ds, const std::string& p) const {
    const std::string obj = "dataset '" + p + "'";
    const auto type = checked<TypeId>(H5Dget_type(ds.get()), ctx, obj + ": type cannot be read");
    const H5T_class_t cls = H5Tget_class(type.get());
    const std::size_t size = H5Tget_size(type.get());
    if (cls == H5T_FLOAT && size == 8) return DType::F64;
    if (cls == H5T_FLOAT && size == 4) return DType::F32;
    if (cls == H5T_INTEGER && size == 2 && H5Tget_sign(type.get()) == H5T_SGN_NONE) {
      const std::string aobj = "attribute 'dtype' of '" + p + "'";
      const htri_t e = H5Aexists(ds.get(), "dtype");
      if (e < 0) fail_hdf5(ctx, aobj + ": cannot be looked up");
      if (e == 0)
        fail(ctx, obj + ": uint16 data without a 'dtype' attribute",
             "expected dtype = \"bf16\" or \"f16\"");
      const auto a = checked<AttrId>(H5Aopen(ds.get(), "dtype", H5P_DEFAULT), ctx,
                                     aobj + ": cannot be opened");
      const std::string s = read_string_attr(a.get(), ctx, aobj);
      if (s == "bf16") return DType::BF16;
      if (s == "f16") return DType::F16;
      fail(ctx, obj + ": unknown dtype attribute \"" + s + "\"", "expected \"bf16\" or \"f16\"");
    }
    fail(ctx,
         obj + ": unsupported stored type (HDF5 class " + std::to_string(cls) + ", " +
             std::to_string(size) + " bytes)",
         "expected f64, f32, or uint16 with dtype bf16/f16");
  }

  Tensor read(const std::string& path, const std::vector<Idx>* expected) const {
    const std::string p = norm_path(ctx, path);
    const std::string obj = "dataset '" + p + "'";
    const DatasetId ds = open_dataset(p);
    Tensor t;
    t.shape = shape_of(ds, obj);
    if (expected != nullptr && t.shape != *expected)
      fail(ctx, obj + ": shape " + shape_str(t.shape) + " does not match expected " +
                    shape_str(*expected));
    const DType d = dtype_of(ds, p);
    const Idx n = checked_numel(ctx, obj, t.shape);
    t.data.resize(static_cast<std::size_t>(n));
    if (n == 0) return t;
    const std::string what = obj + ": read failed";
    switch (d) {
      case DType::F64:
        check(H5Dread(ds.get(), H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, t.data.data()),
              ctx, what);
        break;
      case DType::F32: {
        std::vector<float> f(static_cast<std::size_t>(n));
        check(H5Dread(ds.get(), H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, f.data()), ctx,
              what);
        std::copy(f.begin(), f.end(), t.data.begin());
        break;
      }
      case DType::BF16:
      case DType::F16: {
        std::vector<std::uint16_t> u(static_cast<std::size_t>(n));
        check(H5Dread(ds.get(), H5T_NATIVE_UINT16, H5S_ALL, H5S_ALL, H5P_DEFAULT, u.data()), ctx,
              what);
        for (std::size_t i = 0; i < u.size(); ++i) t.data[i] = u16_decode(d, u[i]);
        break;
      }
    }
    return t;
  }

  AttrId open_attr(const std::string& path, const std::string& name, std::string& obj) const {
    const std::string p = norm_path(ctx, path);
    obj = "attribute '" + name + "' of '" + p + "'";
    const Lookup lk = lookup(file.get(), ctx, p);
    if (lk.kind == Kind::None)
      fail(ctx, obj + ": object '" + p + "' does not exist", missing_why(lk));
    const htri_t e = H5Aexists_by_name(file.get(), p.c_str(), name.c_str(), H5P_DEFAULT);
    if (e < 0) fail_hdf5(ctx, obj + ": cannot be looked up");
    if (e == 0) fail(ctx, obj + " does not exist");
    return checked<AttrId>(
        H5Aopen_by_name(file.get(), p.c_str(), name.c_str(), H5P_DEFAULT, H5P_DEFAULT), ctx,
        obj + ": cannot be opened");
  }
};

namespace {

enum class Signature { Found, Absent, Partial };

// The HDF5 signature sits at offset 0 or, after a user block, at 512, 1024, 2048, ...
Signature find_signature(const Ctx& c, std::uintmax_t size) {
  static const char sig[8] = {'\x89', 'H', 'D', 'F', '\r', '\n', '\x1a', '\n'};
  std::ifstream in(c.file, std::ios::binary);
  if (!in) fail(c, "file cannot be read", std::strerror(errno));
  char buf[8];
  if (size < sizeof sig) {
    in.read(buf, static_cast<std::streamsize>(size));
    return std::memcmp(buf, sig, static_cast<std::size_t>(size)) == 0 ? Signature::Partial
                                                                      : Signature::Absent;
  }
  for (std::uintmax_t off = 0; off + sizeof sig <= size; off = off == 0 ? 512 : off * 2) {
    in.seekg(static_cast<std::streamoff>(off));
    if (!in.read(buf, sizeof buf)) fail(c, "file cannot be read", "short read");
    if (std::memcmp(buf, sig, sizeof sig) == 0) return Signature::Found;
  }
  return Signature::Absent;
}

}  // namespace

Reader::Reader(std::string path) : impl_(std::make_unique<Impl>()) {
  quiet_hdf5();
  Impl& r = *impl_;
  r.ctx.file = std::move(path);
  r.ctx.reading = true;
  const Ctx& c = r.ctx;
  if (c.file.empty()) throw Error("h5::Reader", "empty file path", "");

  std::error_code ec;
  const fs::file_status st = fs::status(c.file, ec);
  if (!fs::exists(st)) fail(c, "file does not exist");
  if (fs::is_directory(st)) fail(c, "is a directory, not a file");
  const std::uintmax_t size = fs::file_size(c.file, ec);
  if (ec) fail(c, "file cannot be read", ec.message());
  if (size == 0) fail(c, "file is empty (0 bytes)");
  switch (find_signature(c, size)) {
    case Signature::Found:
      break;
    case Signature::Partial:
      fail(c, "file is truncated or corrupt", "only " + std::to_string(size) + " bytes");
    case Signature::Absent:
      fail(c, "file is not an HDF5 file", "no HDF5 signature");
  }

  const auto fapl = checked<PlistId>(H5Pcreate(H5P_FILE_ACCESS), c, "file access list");
  check(H5Pset_fclose_degree(fapl.get(), H5F_CLOSE_STRONG), c, "file access list");
  const hid_t f = H5Fopen(c.file.c_str(), H5F_ACC_RDONLY, fapl.get());
  if (f < 0) fail(c, "file is truncated or corrupt", hdf5_why());
  r.file = FileId(f);
}

Reader::~Reader() = default;
Reader::Reader(Reader&&) noexcept = default;
Reader& Reader::operator=(Reader&&) noexcept = default;

const Reader::Impl& Reader::impl() const {
  if (!impl_) throw Error("h5::Reader", "used after it was moved from", "");
  return *impl_;
}

const std::string& Reader::path() const { return impl_ ? impl_->ctx.file : moved_from_path(); }

bool Reader::has(const std::string& path) const {
  const Impl& r = impl();
  return lookup(r.file.get(), r.ctx, norm_path(r.ctx, path)).kind != Kind::None;
}

bool Reader::is_group(const std::string& path) const {
  const Impl& r = impl();
  return lookup(r.file.get(), r.ctx, norm_path(r.ctx, path)).kind == Kind::Group;
}

std::vector<std::string> Reader::children(const std::string& group_path) const {
  const Impl& r = impl();
  const Ctx& c = r.ctx;
  const std::string p = norm_path(c, group_path);
  const std::string obj = "group '" + p + "'";
  const Lookup lk = lookup(r.file.get(), c, p);
  if (lk.kind == Kind::None) fail(c, obj + " does not exist", missing_why(lk));
  if (lk.kind != Kind::Group) fail(c, obj + ": is a dataset, not a group");
  const auto g = checked<GroupId>(H5Gopen2(r.file.get(), p.c_str(), H5P_DEFAULT), c,
                                  obj + ": cannot be opened");
  H5G_info_t info;
  check(H5Gget_info(g.get(), &info), c, obj + ": cannot be listed");
  std::vector<std::string> names;
  for (hsize_t i = 0; i < info.nlinks; ++i) {
    const ssize_t len =
        H5Lget_name_by_idx(g.get(), ".", H5_INDEX_NAME, H5_ITER_INC, i, nullptr, 0, H5P_DEFAULT);
    if (len < 0) fail_hdf5(c, obj + ": cannot be listed");
    std::vector<char> buf(static_cast<std::size_t>(len) + 1, '\0');
    if (H5Lget_name_by_idx(g.get(), ".", H5_INDEX_NAME, H5_ITER_INC, i, buf.data(), buf.size(),
                           H5P_DEFAULT) < 0)
      fail_hdf5(c, obj + ": cannot be listed");
    names.emplace_back(buf.data(), static_cast<std::size_t>(len));
  }
  std::sort(names.begin(), names.end());
  return names;
}

DType Reader::dtype(const std::string& path) const {
  const Impl& r = impl();
  const std::string p = norm_path(r.ctx, path);
  return r.dtype_of(r.open_dataset(p), p);
}

std::vector<Idx> Reader::shape(const std::string& path) const {
  const Impl& r = impl();
  const std::string p = norm_path(r.ctx, path);
  return r.shape_of(r.open_dataset(p), "dataset '" + p + "'");
}

Tensor Reader::read(const std::string& path) const { return impl().read(path, nullptr); }

Tensor Reader::read(const std::string& path, const std::vector<Idx>& expected_shape) const {
  return impl().read(path, &expected_shape);
}

Tensor Reader::read_finite(const std::string& path, const std::vector<Idx>& expected_shape) const {
  const Impl& r = impl();
  Tensor t = r.read(path, &expected_shape);
  for (std::size_t i = 0; i < t.data.size(); ++i)
    if (!std::isfinite(t.data[i]))
      fail(r.ctx, "dataset '" + norm_path(r.ctx, path) + "': non-finite value " +
                      num_str(t.data[i]) + " at index " + index_str(t.shape, static_cast<Idx>(i)));
  return t;
}

std::vector<std::uint16_t> Reader::read_raw_u16(const std::string& path) const {
  const Impl& r = impl();
  const Ctx& c = r.ctx;
  const std::string p = norm_path(c, path);
  const std::string obj = "dataset '" + p + "'";
  const DatasetId ds = r.open_dataset(p);
  const DType d = r.dtype_of(ds, p);
  if (!is_u16_dtype(d))
    fail(c, obj + ": is stored as " + precision_name(d) + ", not as bf16 / f16 bits");
  const Idx n = checked_numel(c, obj, r.shape_of(ds, obj));
  std::vector<std::uint16_t> u(static_cast<std::size_t>(n));
  if (n > 0)
    check(H5Dread(ds.get(), H5T_NATIVE_UINT16, H5S_ALL, H5S_ALL, H5P_DEFAULT, u.data()), c,
          obj + ": read failed");
  return u;
}

bool Reader::has_attr(const std::string& path, const std::string& name) const {
  const Impl& r = impl();
  const std::string p = norm_path(r.ctx, path);
  if (lookup(r.file.get(), r.ctx, p).kind == Kind::None) return false;
  const htri_t e = H5Aexists_by_name(r.file.get(), p.c_str(), name.c_str(), H5P_DEFAULT);
  if (e < 0) fail_hdf5(r.ctx, "attribute '" + name + "' of '" + p + "': cannot be looked up");
  return e > 0;
}

namespace {
herr_t collect_attr_name(hid_t, const char* name, const H5A_info_t*, void* out) {
  static_cast<std::vector<std::string>*>(out)->emplace_back(name);
  return 0;
}
}  // namespace

std::vector<std::string> Reader::attr_names(const std::string& path) const {
  const Impl& r = impl();
  const std::string p = norm_path(r.ctx, path);
  const Lookup lk = lookup(r.file.get(), r.ctx, p);
  if (lk.kind == Kind::None) fail(r.ctx, "'" + p + "' does not exist", missing_why(lk));
  std::vector<std::string> names;
  hsize_t idx = 0;
  if (H5Aiterate_by_name(r.file.get(), p.c_str(), H5_INDEX_NAME, H5_ITER_INC, &idx,
                         collect_attr_name, &names, H5P_DEFAULT) < 0)
    fail_hdf5(r.ctx, "attributes of '" + p + "': cannot be listed");
  std::sort(names.begin(), names.end());
  return names;
}

std::string Reader::attr_string(const std::string& path, const std::string& name) const {
  const Impl& r = impl();
  std::string obj;
  const AttrId a = r.open_attr(path, name, obj);
  return read_string_attr(a.get(), r.ctx, obj);
}

std::int64_t Reader::attr_int(const std::string& path, const std::string& name) const {
  const Impl& r = impl();
  std::string obj;
  const AttrId a = r.open_attr(path, name, obj);
  if (attr_class(a.get(), r.ctx, obj, true) != H5T_INTEGER) fail(r.ctx, obj + " is not an integer");
  std::int64_t v = 0;
  check(H5Aread(a.get(), H5T_NATIVE_INT64, &v), r.ctx, obj + ": read failed");
  return v;
}

double Reader::attr_double(const std::string& path, const std::string& name) const {
  const Impl& r = impl();
  std::string obj;
  const AttrId a = r.open_attr(path, name, obj);
  if (attr_class(a.get(), r.ctx, obj, true) != H5T_FLOAT) fail(r.ctx, obj + " is not a float");
  double v = 0;
  check(H5Aread(a.get(), H5T_NATIVE_DOUBLE, &v), r.ctx, obj + ": read failed");
  return v;
}

std::vector<double> Reader::attr_doubles(const std::string& path, const std::string& name) const {
  const Impl& r = impl();
  std::string obj;
  const AttrId a = r.open_attr(path, name, obj);
  if (attr_class(a.get(), r.ctx, obj, false) != H5T_FLOAT) fail(r.ctx, obj + " is not a float");
  const auto space = checked<SpaceId>(H5Aget_space(a.get()), r.ctx, obj + ": read failed");
  const hssize_t n = H5Sget_simple_extent_npoints(space.get());
  if (n < 0) fail_hdf5(r.ctx, obj + ": read failed");
  std::vector<double> v(static_cast<std::size_t>(n));
  if (n > 0) check(H5Aread(a.get(), H5T_NATIVE_DOUBLE, v.data()), r.ctx, obj + ": read failed");
  return v;
}

}  // namespace m3::h5
