// Data-parallel training on the GPU (train/parallel.hpp, gpu/rank_comm.hpp; TRAINING.md §8):
//   - one GPU through NCCL (ncclCommInitAll of one rank, the sharded optimizer, the gathers) is
//     the plain GPU path bit for bit, and so is a job of one process (ncclCommInitRank through
//     the id file);
//   - the id file's errors (already there, malformed, never written) are one line;
//   - with two or more GPUs: G = 2 runs bit-identical, and within the summation-order bound of
//     one GPU on the same global batch (skipped, saying so, on a machine with one GPU).
// Every test skips itself without a device or without NCCL.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "backend.hpp"
#include "device.hpp"
#include "error.hpp"
#include "gpu_test_util.hpp"
#include "../lm_test_util.hpp"
#include "optimizer.hpp"
#include "parallel.hpp"
#include "rank_comm.hpp"
#include "trainer.hpp"

namespace fs = std::filesystem;

namespace {

using m3::Config;
using m3::Idx;
using m3::Precision;
using m3::ScanMode;
using namespace m3::train;

#define M3_SKIP_WITHOUT_NCCL()                                                      \
  do {                                                                              \
    M3_SKIP_WITHOUT_GPU();                                                          \
    if (!m3::gpu::have_nccl()) GTEST_SKIP() << m3::gpu::nccl_version();             \
  } while (0)

BackendSpec spec(Idx B, Precision st) {
  Config c;
  c.d_model = 64;
  c.d_state = 16;
  c.headdim = 16;
  c.expand = 2;
  c.n_layers = 2;
  c.chunk_size = 16;
  return m3::test::chunked_spec(m3::test::token_model(c, 50), B, 32, st);
}

using m3::test::Trajectory;

Trajectory run_steps(Backend& be, const BackendSpec& s, int steps, bool staged = false) {
  return m3::test::train_trajectory(be, s.cfg, s.storage, s.B, s.T, steps, staged);
}

// The plain one-GPU path's trajectory (its device memory freed before the caller's next backend).
Trajectory plain_run(const BackendSpec& s, int steps) {
  auto plain = make_gpu_backend(s);
  return run_steps(*plain, s, steps);
}

void expect_same(const Trajectory& a, const Trajectory& b) {
  EXPECT_EQ(a.loss, b.loss);
  EXPECT_EQ(a.norm, b.norm);
  EXPECT_EQ(a.end.params, b.end.params);
  EXPECT_EQ(a.end.m, b.end.m);
  EXPECT_EQ(a.end.v, b.end.v);
}

std::string temp_path(const std::string& name) {
  return (fs::temp_directory_path() / ("m3_nccl_" + std::to_string(::getpid()) + "_" + name))
      .string();
}

TEST(DataParallelGpu, OneGpuThroughNcclIsThePlainPathBitForBit) {
  M3_SKIP_WITHOUT_NCCL();
  for (Precision st : {Precision::F32, Precision::BF16, Precision::F16}) {
    SCOPED_TRACE(m3::precision_name(st));
    const BackendSpec s = spec(4, st);
    const Trajectory a = plain_run(s, 3);
    ParallelSpec p;
    p.through_exchange = true;
    auto one = make_data_parallel("gpu", s, p);
    EXPECT_NE(one->name().find("NCCL"), std::string::npos) << one->name();
    expect_same(a, run_steps(*one, s, 3));
    expect_same(a, run_steps(*one, s, 3, true));  // each rank stages its rows
  }
}

TEST(DataParallelGpu, AOneProcessJobThroughTheIdFileIsThePlainPathBitForBit) {
  M3_SKIP_WITHOUT_NCCL();
  const BackendSpec s = spec(4, Precision::BF16);
  const Trajectory a = plain_run(s, 2);
  ParallelSpec job;
  job.world = 1;
  job.rank = 0;
  job.nccl_id_file = temp_path("job1");
  fs::remove(job.nccl_id_file);
  {
    auto be = make_data_parallel("gpu", s, job);
    EXPECT_EQ(be->rank(), 0);
    EXPECT_EQ(be->ranks(), 1);
    expect_same(a, run_steps(*be, s, 2));
  }
  ASSERT_TRUE(fs::exists(job.nccl_id_file)) << "rank 0 wrote the id";
  // A job never reuses an id: rank 0 refuses a file that exists.
  m3::test::expect_one_line_error([&] { make_data_parallel("gpu", s, job); }, "exists already");
  fs::remove(job.nccl_id_file);
}

TEST(DataParallelGpu, ARankWithoutAGoodIdFileSaysSoInOneLine) {
  M3_SKIP_WITHOUT_NCCL();
  const BackendSpec s = spec(4, Precision::BF16);
  ParallelSpec job;
  job.world = 2;
  job.rank = 1;
  job.device = 0;
  job.id_timeout_s = 0.3;
  job.nccl_id_file = temp_path("never");
  fs::remove(job.nccl_id_file);
  auto expect_error = [&](const std::string& needle) {
    m3::test::expect_one_line_error([&] { make_data_parallel("gpu", s, job); }, needle);
  };
  expect_error("no NCCL id file from rank 0");
  std::ofstream(job.nccl_id_file) << "abc";
  expect_error("malformed");
  fs::remove(job.nccl_id_file);
}

TEST(DataParallelGpu, TwoGpusAreBitIdenticalRunToRunAndWithinTheOrderBoundOfOne) {
  M3_SKIP_WITHOUT_NCCL();
  const int n = m3::gpu::query_device().count;
  if (n < 2) GTEST_SKIP() << "one GPU here (" << n << "): G = 2 needs two";
  const BackendSpec s = spec(4, Precision::BF16);
  const Trajectory one = plain_run(s, 3);
  ParallelSpec p;
  p.gpus = 2;
  Trajectory first;
  for (int run = 0; run < 2; ++run) {
    auto two = make_data_parallel("gpu", s, p);
    const Trajectory t = run_steps(*two, s, 3, run == 1);  // the second run stages
    if (run == 0) {
      first = t;
    } else {
      expect_same(first, t);
    }
  }
  for (size_t k = 0; k < one.loss.size(); ++k)
    EXPECT_NEAR(first.loss[k], one.loss[k], 1e-3 * std::fabs(one.loss[k])) << "step " << k + 1;
}

}  // namespace
