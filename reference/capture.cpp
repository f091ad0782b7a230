// Capture storage (see capture.hpp).
#include "capture.hpp"

#include <algorithm>
#include <sstream>

#include "error.hpp"
#include "registry.hpp"

namespace m3 {

std::string shape_str(const std::vector<Idx>& shape) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << "]";
  return os.str();
}

template <class S>
void Capture::put_stage(int layer, const char* stage, const char* tensor, const S* data, Idx n) {
  const TensorSpec* spec = &find_spec(stage, tensor);  // a pointer: g++ 13 -Wdangling-reference
  const std::string key = stage_key(layer, stage, tensor);
  M3_REQUIRE(bound_, "capture", "stage capture needs a Capture bound to (config, B, T)",
             "key ", key);
  Tensor t;
  t.shape = resolve_shape(spec->shape, cfg_, B_, T_);
  M3_REQUIRE(t.numel() == n, "capture", "size of '" + key + "' does not match the registry",
             "got ", n, " elements, registry shape ", shape_str(t.shape));
  t.data.assign(data, data + n);
  insert(key, std::move(t));
}

template <class S>
void Capture::put(const std::string& key, std::vector<Idx> shape, const S* data) {
  Tensor t;
  t.shape = std::move(shape);
  t.data.assign(data, data + t.numel());
  insert(key, std::move(t));
}

void Capture::insert(const std::string& key, Tensor t) {
  if (sink_) {
    if (std::find(order_.begin(), order_.end(), key) == order_.end()) order_.push_back(key);
    sink_(key, std::move(t));
    return;
  }
  if (map_.count(key) == 0) order_.push_back(key);
  map_[key] = std::move(t);
}

void Capture::drain(const TensorSink& sink) {
  for (const std::string& key : order_) {
    auto it = map_.find(key);
    if (it == map_.end()) continue;
    Tensor t = std::move(it->second);
    map_.erase(it);
    sink(key, std::move(t));
  }
  clear();
}

const Tensor* Capture::find(const std::string& key) const {
  auto it = map_.find(key);
  return it == map_.end() ? nullptr : &it->second;
}

const Tensor& Capture::at(const std::string& key) const {
  const Tensor* t = find(key);
  M3_REQUIRE(t != nullptr, "capture", "tensor '" + key + "' was not captured", "");
  return *t;
}

template void Capture::put_stage<double>(int, const char*, const char*, const double*, Idx);
template void Capture::put_stage<float>(int, const char*, const char*, const float*, Idx);
template void Capture::put<double>(const std::string&, std::vector<Idx>, const double*);
template void Capture::put<float>(const std::string&, std::vector<Idx>, const float*);

}  // namespace m3
