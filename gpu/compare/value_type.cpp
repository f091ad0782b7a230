// The names of the comparer's value types (compare_gpu.hpp), in every build.
#include "compare_gpu.hpp"

namespace m3::gpu {

const char* value_type_name(ValueType t) {
  switch (t) {
    case ValueType::F64: return "f64";
    case ValueType::F32: return "f32";
    case ValueType::BF16: return "bf16";
    case ValueType::F16: return "f16";
  }
  return "unknown";
}

}  // namespace m3::gpu
