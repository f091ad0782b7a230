// Bugs planted in a correct subject's Capture, one tensor each, as a kernel bug would leave
// them: every comparison rule of the harness must fail the planted tensor alone and name it
// first (tests/test_budget_precision.cpp with the floors, tests/test_sweep.cpp with the
// perturbed oracle). On a model of at least 3 layers with 6 heads and a RoPE angle:
//
//   L1/F4ef/k        k = R(−θ)·b instead of R(θ)·b (the sign of sin θ)
//   L2/F6/y          heads 2 and 5 of y swapped (an index bug)
//   L1/B6/d_x        d_x shifted by one time step (an off-by-one)
//   grad/L0/dt_bias  dt_bias's gradient times 1 + delta (the smallest systematic error a
//                    precision's rule must catch; delta chosen by the caller)
// and in the problem itself (a wrong parameter reaches every tensor downstream, so the first
// failure must be where it enters), on a model of at least 2 layers:
//   L1/F6/y          D's sign flipped in layer 1 (y = … + D·x is the first tensor it reaches)
//   L0/F3/dt         dt_bias of layer 0's fastest head shifted by +0.5
#pragma once

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "capture.hpp"
#include "config.hpp"
#include "problem.hpp"

namespace m3::test {

struct PlantedBug {
  std::string what;  // for SCOPED_TRACE
  std::string key;   // the tensor it breaks
  std::function<void(Capture&)> plant;
};

// Replaces cap[key] by f applied to a copy of it.
inline void edit_tensor(Capture& cap, const std::string& key,
                        const std::function<void(Tensor&)>& f) {
  Tensor t = cap.at(key);
  f(t);
  cap.put(key, t.shape, t.data.data());
}

inline std::vector<PlantedBug> planted_bugs(const Config& cfg, Idx B, Idx T,
                                            double dt_bias_delta) {
  const Idx nh = cfg.nheads(), ds = cfg.d_state, na = cfg.num_rope_angles(), hd = cfg.headdim;
  std::vector<PlantedBug> bugs;
  bugs.push_back({"k = R(-theta) b instead of R(theta) b (a sign bug of sin theta)", "L1/F4ef/k",
                  [=](Capture& s) {
                    const Tensor b = s.at("L1/F4/b_biased");
                    const Tensor th = s.at("L1/F5/angle_cumsum");
                    edit_tensor(s, "L1/F4ef/k", [&](Tensor& k) {
                      for (Idx r = 0; r < k.shape[0]; ++r)
                        for (Idx h = 0; h < nh; ++h)
                          for (Idx a = 0; a < na; ++a) {
                            const double t = th.data[static_cast<size_t>((r * nh + h) * na + a)];
                            const size_t i = static_cast<size_t>((r * nh + h) * ds + 2 * a);
                            const double b0 = b.data[i], b1 = b.data[i + 1];
                            k.data[i] = std::cos(t) * b0 + std::sin(t) * b1;
                            k.data[i + 1] = -std::sin(t) * b0 + std::cos(t) * b1;
                          }
                    });
                  }});
  bugs.push_back({"heads 2 and 5 of y swapped (an index bug)", "L2/F6/y", [=](Capture& s) {
                    edit_tensor(s, "L2/F6/y", [&](Tensor& y) {
                      for (Idx r = 0; r < y.shape[0]; ++r)
                        for (Idx q = 0; q < hd; ++q)
                          std::swap(y.data[static_cast<size_t>((r * nh + 2) * hd + q)],
                                    y.data[static_cast<size_t>((r * nh + 5) * hd + q)]);
                    });
                  }});
  bugs.push_back({"d_x shifted by one time step (an off-by-one)", "L1/B6/d_x", [=](Capture& s) {
                    edit_tensor(s, "L1/B6/d_x", [&](Tensor& t) {
                      const Idx w = t.shape[1];
                      for (Idx b = 0; b < B; ++b)
                        for (Idx tt = T - 1; tt >= 1; --tt)
                          for (Idx j = 0; j < w; ++j)
                            t.data[static_cast<size_t>((b * T + tt) * w + j)] =
                                t.data[static_cast<size_t>((b * T + tt - 1) * w + j)];
                    });
                  }});
  bugs.push_back({"grad/L0/dt_bias off by a factor 1 + " + std::to_string(dt_bias_delta),
                  "grad/L0/dt_bias", [=](Capture& s) {
                    edit_tensor(s, "grad/L0/dt_bias", [&](Tensor& t) {
                      for (double& v : t.data) v *= 1.0 + dt_bias_delta;
                    });
                  }});
  return bugs;
}

struct PlantedProblemBug {
  std::string what;       // for SCOPED_TRACE
  std::string first_key;  // where it must fail first
  std::function<void(Problem&)> plant;
};

inline std::vector<PlantedProblemBug> planted_problem_bugs() {
  return {{"D's sign flipped in layer 1: y = ... + D x is the first tensor it reaches", "L1/F6/y",
           [](Problem& pb) {
             for (double& d : pb.params.layers[1].d_param) d = -d;
           }},
          {"dt_bias of the fastest head of layer 0 shifted by +0.5", "L0/F3/dt",
           [](Problem& pb) {
             auto& bias = pb.params.layers[0].dt_bias;
             const auto h = std::max_element(bias.begin(), bias.end()) - bias.begin();
             bias[static_cast<size_t>(h)] += 0.5;
           }}};
}

}  // namespace m3::test
