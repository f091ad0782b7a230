// The size guard (resources.hpp).
#include "resources.hpp"

#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>

#include "error.hpp"
#include "params.hpp"
#include "registry.hpp"

namespace m3::harness {

namespace {

// f(cfg) for cfg's layer count, from f at one and two layers: f is affine in the layer count
// (every layer has the same tensors), so the cost is that of two small models.
template <class F>
double affine_in_layers(const Config& cfg, F f) {
  if (cfg.n_layers <= 2) return f(cfg);
  Config one = cfg, two = cfg;
  one.n_layers = 1;
  two.n_layers = 2;
  const double a = f(one), b = f(two);
  return a + (b - a) * static_cast<double>(cfg.n_layers - 1);
}

}  // namespace

double stage_elements(const Config& cfg, Idx B, Idx T, ScanMode mode) {
  return affine_in_layers(cfg, [&](const Config& c) {
    double n = 0;
    for (const KeyedSpec& ks : expected_stage_keys(c, B, T, mode)) {
      double e = 1;
      for (Idx v : ks.shape) e *= static_cast<double>(v);
      n += e;
    }
    return n;
  });
}

double parameter_elements(const Config& cfg) {
  return affine_in_layers(cfg, [](const Config& c) { return static_cast<double>(param_layout(c).total); });
}

double host_memory_bytes() {
  const double pages = static_cast<double>(::sysconf(_SC_PHYS_PAGES));
  const double size = static_cast<double>(::sysconf(_SC_PAGE_SIZE));
  return pages > 0 && size > 0 ? pages * size : 0.0;
}

double host_peak_rss_bytes() {
  struct rusage ru {};
  if (getrusage(RUSAGE_SELF, &ru) != 0) return 0;
  return static_cast<double>(ru.ru_maxrss) * 1024.0;  // kilobytes on Linux
}

double problem_host_bytes(const Config& cfg, Idx B, Idx T) {
  const double BT = static_cast<double>(B) * static_cast<double>(T);
  const double states = static_cast<double>(cfg.n_layers) * static_cast<double>(B) *
                        static_cast<double>(cfg.nheads()) *
                        (static_cast<double>(cfg.headdim) * static_cast<double>(cfg.d_state) +
                         static_cast<double>(cfg.d_state) + static_cast<double>(cfg.headdim) +
                         static_cast<double>(cfg.num_rope_angles()));
  return 8.0 * (BT * static_cast<double>(cfg.input_dim + cfg.d_model) + parameter_elements(cfg) +
                states);
}

void check_host_bytes(double need_bytes, const std::string& what, const std::string& advice) {
  const double have = host_memory_bytes();
  if (have <= 0 || need_bytes <= have) return;
  const double gib = 1024.0 * 1024.0 * 1024.0;
  char buf[160];
  std::snprintf(buf, sizeof buf, "needs about %.3g GiB of host memory, the machine has %.3g GiB",
                need_bytes / gib, have / gib);
  throw Error(what, buf, advice);
}

}  // namespace m3::harness
