// Capture: named copies of intermediate tensors, widened to double, in the order they were
// produced. Every implementation (double oracle, float baseline, later the GPU subject) fills
// one Capture under the same keys (registry.hpp), which is what the harness compares.
//
//   Tensor       shape (row-major, last index fastest) + data as double
//   Capture::put checks the key against the stage registry and the data size against the
//                registry shape for (cfg, B, T); a mismatch is an m3::Error, never silent.
//
// A streaming Capture (constructed with a TensorSink) keeps nothing but the keys: every tensor
// is handed to the sink the moment it is put, so that a consumer (the harness's judge of a
// cell) can measure it and drop it. A whole backbone's tensors in double take hundreds of MB at
// the default problem; streamed, a run holds only its own working buffers.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "config.hpp"

namespace m3 {

struct Tensor {
  std::vector<Idx> shape;
  std::vector<double> data;
  Idx numel() const {
    Idx n = 1;
    for (Idx d : shape) n *= d;
    return n;
  }
};

std::string shape_str(const std::vector<Idx>& shape);  // "[512, 16, 4]"

// Receives each tensor of a streaming Capture as it is put (its key, and the tensor to keep or
// drop). Called on the thread that puts it, in the order the run produces them.
using TensorSink = std::function<void(const std::string& key, Tensor&& t)>;

class Capture {
 public:
  Capture() = default;
  Capture(const Config& cfg, Idx B, Idx T) : cfg_(cfg), B_(B), T_(T), bound_(true) {}
  // Streaming: every tensor goes to `sink` instead of being stored (an empty sink: stored).
  Capture(const Config& cfg, Idx B, Idx T, TensorSink sink)
      : cfg_(cfg), B_(B), T_(T), bound_(true), sink_(std::move(sink)) {}

  // Stage tensor: key "L<l>/<stage>/<tensor>" (layer >= 0) or "<stage>/<tensor>".
  template <class S>
  void put_stage(int layer, const char* stage, const char* tensor, const S* data, Idx n);
  // Any tensor with an explicit shape (parameter gradients, weights, inputs).
  template <class S>
  void put(const std::string& key, std::vector<Idx> shape, const S* data);

  // Of a streaming Capture: keys() lists what was put, has(), find() and at() see nothing.
  bool streaming() const { return static_cast<bool>(sink_); }
  bool has(const std::string& key) const { return map_.count(key) != 0; }
  const Tensor& at(const std::string& key) const;  // throws m3::Error naming the key
  const Tensor* find(const std::string& key) const;
  const std::vector<std::string>& keys() const { return order_; }
  void clear() {
    map_.clear();
    order_.clear();
  }
  // Hands every stored tensor to `sink` in the order they were put, moving each out (the
  // Capture is empty afterwards): a stored Capture streamed as if its run streamed it.
  void drain(const TensorSink& sink);

 private:
  void insert(const std::string& key, Tensor t);
  Config cfg_;
  Idx B_ = 0, T_ = 0;
  bool bound_ = false;
  TensorSink sink_;
  std::map<std::string, Tensor> map_;
  std::vector<std::string> order_;
};

}  // namespace m3
