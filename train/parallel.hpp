// Data-parallel training (TRAINING.md §8): G ranks, each a backend on its B/G rows of
// every global batch, presented to the training loop as one Backend, so train_step, evaluate and
// run_training are the same code for one rank and for G.
//
// The step, rank r of G (shard.hpp has the arithmetic and its proofs):
//   forward/backward   rank r on rows [r·B/G, (r+1)·B/G) of each micro-batch, with the global
//                      normaliser N (the step's scored positions), so the ranks' gradients sum
//                      to the gradient of the global loss; losses summed in rank order
//   grad_norm()        the ranks' gradients summed in rank order into each owner's shard
//                      (ĝ = ((g_0 + g_1) + …) + g_{G−1}), each shard's f64 norm partials of its
//                      blocks, gathered: the one-rank norm's partials, so every rank gets the same
//                      norm (and clip coefficient, and f16 skip decision)
//   adamw()            AdamW on each rank's shard with its shard of m and v (ZeRO-1), then the
//                      updated f32 masters all-gathered and the typed copies refreshed
//   state()/set_state  the masters (replicated) and the moments gathered from / cut into the
//                      shards: the checkpoint format of one rank, so a run saved with G ranks
//                      resumes with any G' (bit-exact when G' = G)
// Two kinds of rank:
//   cpu  G reference ranks (the float LmModel of backend.hpp) in this process; the exchange is
//        host memory. The step's arithmetic without NCCL or a GPU, for CI.
//   gpu  one GPU per rank through gpu::RankComm (NCCL copies, the rank-order sum as our own
//        kernel): G GPUs of this process (a thread per GPU, ncclCommInitAll), or this process
//        as one rank of `world` (ncclCommInitRank, the id through --nccl-id-file: the path past
//        one host).
// Guarantees: for a fixed G, runs are bit-identical; G = 1 is the plain backend bit for bit;
// G against 1 on the same global batch differ by the gradients' summation order only (each
// rank's backward sums its own rows; the ranks are summed after).
#pragma once

#include <memory>
#include <string>

#include "backend.hpp"

namespace m3::train {

struct ParallelSpec {
  int gpus = 1;  // ranks driven by this process (single-process mode)
  // One process per rank: this process's rank of `world` (world 0: single-process mode).
  int rank = 0, world = 0;
  std::string nccl_id_file;  // where rank 0 puts NCCL's unique id for the others
  int device = -1;           // this process's GPU; −1: the launcher's local rank, else rank % GPUs
  double id_timeout_s = 300;
  bool through_exchange = false;  // one rank through the data-parallel path all the same (tests)
  bool multi_process() const { return world > 0; }
  int ranks() const { return multi_process() ? world : gpus; }
  // Whether the plain single-rank backend is the one to use (one rank, not a job of processes).
  bool plain() const { return !multi_process() && gpus == 1 && !through_exchange; }
};

// The spec against the device and the global batch B (one-line m3::Error: ranks < 1, B not a
// multiple of the ranks, a rank outside the world, no id file for a job of processes, a job on
// the CPU, several GPUs without NCCL). Cheap: the trainer calls it before it touches --out.
void check_parallel(const std::string& device, Idx B, const ParallelSpec& p);

// check_parallel, then the ranks (the plain backend for one rank). `global.B` is the global
// batch.
std::unique_ptr<Backend> make_data_parallel(const std::string& device, const BackendSpec& global,
                                            const ParallelSpec& p);

// The rank, world size and local device of a launcher's environment, for options left unset:
// M3_RANK / M3_WORLD_SIZE / M3_LOCAL_RANK, then torchrun's RANK / WORLD_SIZE / LOCAL_RANK,
// Open MPI's OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK}, Slurm's SLURM_{PROCID,NTASKS,LOCALID}.
// Fields already set (rank ≥ 0 given, world > 0, device ≥ 0) are kept; `rank_given` says
// whether --rank was given. A malformed value is a one-line m3::Error naming the variable.
void fill_from_launcher_env(ParallelSpec& p, bool rank_given);

}  // namespace m3::train
