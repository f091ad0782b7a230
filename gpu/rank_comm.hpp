// The collectives of the data-parallel step (TRAINING.md §8) between G ranks, one GPU
// each, through NCCL. Only copies go through NCCL (grouped ncclSend/ncclRecv and broadcasts),
// never an NCCL reduction, whose order NCCL would choose: every sum is this project's kernel in
// rank order.
//
//   reduce_scatter_in_rank_order   bounds = the G + 1 shard boundaries of the flat gradient
//       arena (train::shard_plan), rank q owning [bounds[q], bounds[q+1]). Every rank sends its
//       piece of shard q to rank q and receives the others' pieces of its own shard, then
//         grads[i] = ((g_0[i] + g_1[i]) + g_2[i]) + … + g_{G−1}[i],   i in its shard
//       in float, rank order, one kernel (g_me read from grads itself, before it is
//       overwritten). Outside its shard grads keeps this rank's own gradient.
//   all_gather_ranges              in place: rank q's range [bounds[q], bounds[q+1]) of a
//       buffer (elements of elem_bytes bytes) is broadcast to every rank — a copy, so the
//       result is the same bits on every rank whatever order NCCL moves them in.
//   all_gather_host                every rank's `bytes` host bytes to every rank, in rank order
//       (ncclAllGather through a device staging buffer; synchronous): the losses, argmax rows,
//       stop flags and optimizer-moment shards the training loop needs from every rank.
// Every call is asynchronous on the context's stream; the context must be on this rank's device
// (its thread's current device). G = 1: nothing moves and no kernel runs (the one-term sum is
// the gradient itself), so one rank through this path is the plain path bit for bit.
//
// Two ways to build the ranks: one process driving G devices (init_all: ncclCommInitAll, a
// thread per rank), or one process per rank (init_rank: ncclCommInitRank, rank 0 writing the
// unique id to a file that the others read; the path past one host).
// Plain C++ header (no CUDA or NCCL types). Implemented by dist/rank_comm.cu; stub/
// rank_comm_stub.cpp in a build without CUDA or without NCCL (have_nccl() false, every entry a
// one-line m3::Error).
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "config.hpp"  // Idx
#include "context.hpp"

namespace m3::gpu {

bool have_nccl();
std::string nccl_version();  // "2.28.9", or why there is none

class RankComm {
 public:
  // Ranks 0..G−1 on devices 0..G−1 of this process. Throws m3::Error when G exceeds the
  // devices present or NCCL fails.
  static std::vector<std::unique_ptr<RankComm>> init_all(int G);
  // Rank `rank` of a job of `world` processes on local device `device`. Rank 0 writes a fresh
  // unique id to id_file (temporary + rename, never over an existing file); the others wait up
  // to timeout_s seconds for it. Throws m3::Error (one line) on a bad rank/world, a missing id
  // after the timeout, a malformed id file, or an NCCL failure.
  static std::unique_ptr<RankComm> init_rank(int rank, int world, const std::string& id_file,
                                             int device, double timeout_s);
  ~RankComm();
  RankComm(const RankComm&) = delete;
  RankComm& operator=(const RankComm&) = delete;

  int rank() const;
  int world() const;
  int device() const;

  void reduce_scatter_in_rank_order(GpuContext& ctx, float* grads, const std::vector<Idx>& bounds);
  void all_gather_ranges(GpuContext& ctx, void* buf, std::size_t elem_bytes,
                         const std::vector<Idx>& bounds);
  // all[q·bytes, (q+1)·bytes) = rank q's `mine`; the same `bytes` on every rank.
  void all_gather_host(GpuContext& ctx, const void* mine, std::size_t bytes, void* all);
  // After another rank failed: ncclCommAbort, so that this rank's operations waiting for the
  // failed one return an error instead of blocking forever. The communicator is unusable after.
  void abort();

  struct Impl;
  explicit RankComm(std::unique_ptr<Impl> impl);

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace m3::gpu
