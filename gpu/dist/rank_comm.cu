// RankComm over NCCL (rank_comm.hpp): the data-parallel step's copies and its rank-order sum.
//
//   reduce_scatter_in_rank_order, rank me of G, shard s_q = [bounds[q], bounds[q+1]):
//     one NCCL group: for every q ≠ me, ncclSend(grads + bounds[q], |s_q|) to q and
//     ncclRecv(recv + q·cap, |s_me|) from q (cap = the largest shard); then
//     rank_order_sum_kernel: grads[b_me + i] = (…((x_0 + x_1) + x_2) + …) + x_{G−1}, with
//     x_me = grads[b_me + i] and x_q = recv[q·cap + i] — float adds, ascending q, one thread
//     per element (no other order exists for an element).
//   all_gather_ranges: one NCCL group of G in-place ncclBroadcast (bytes, root q, range q).
//   all_gather_host: upload into slot `rank` of a staging buffer, in-place ncclAllGather, download.
// NCCL moves bytes only; the sums never leave this file's kernel, so the step is bit-identical
// run to run for a fixed G (TRAINING.md §8).
#include <nccl.h>

#include <chrono>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <thread>

#include <unistd.h>  // getpid

#include "common.cuh"
#include "device.hpp"
#include "rank_comm.hpp"

#define M3_NCCL_CHECK(expr) M3_CHECK_GEN(expr, #expr, ncclSuccess, ncclGetErrorString)

namespace m3::gpu {

namespace {

constexpr int kSumThreads = 256;

__global__ void __launch_bounds__(kSumThreads)
rank_order_sum_kernel(float* __restrict__ own, const float* __restrict__ recv, Idx cap, Idx n,
                      int world, int me) {
  const Idx stride = static_cast<Idx>(gridDim.x) * kSumThreads;
  for (Idx i = static_cast<Idx>(blockIdx.x) * kSumThreads + threadIdx.x; i < n; i += stride) {
    float acc = me == 0 ? own[i] : recv[i];
    for (int q = 1; q < world; ++q) acc = __fadd_rn(acc, q == me ? own[i] : recv[q * cap + i]);
    own[i] = acc;
  }
}

void check_bounds(const std::vector<Idx>& bounds, int world, const char* where) {
  M3_REQUIRE(static_cast<int>(bounds.size()) == world + 1, where,
             "the shard boundaries are not one per rank plus the end", "got ", bounds.size(),
             " boundaries for ", world, " ranks");
  for (int q = 0; q < world; ++q)
    M3_REQUIRE(bounds[q] >= 0 && bounds[q] <= bounds[q + 1], where,
               "the shard boundaries do not ascend", "bounds[", q, "]=", bounds[q], " bounds[",
               q + 1, "]=", bounds[q + 1]);
}

}  // namespace

bool have_nccl() { return true; }

std::string nccl_version() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "unknown NCCL version";
  // NCCL_VERSION(X, Y, Z) = X·10000 + Y·100 + Z since 2.9.
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." +
         std::to_string(v % 100);
}

struct RankComm::Impl {
  ncclComm_t comm = nullptr;
  int rank = 0, world = 1, device = 0;
  DeviceArray<float> recv;            // [world][cap]: the others' pieces of this rank's shard
  DeviceArray<unsigned char> staging;  // all_gather_host: [world][bytes]
};

RankComm::RankComm(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

RankComm::~RankComm() {
  if (impl_ && impl_->comm) {
    cudaSetDevice(impl_->device);
    ncclCommDestroy(impl_->comm);
  }
}

void RankComm::abort() {
  if (!impl_->comm) return;
  ncclCommAbort(impl_->comm);  // its own error, if any, is not this rank's failure
  impl_->comm = nullptr;
}

int RankComm::rank() const { return impl_->rank; }
int RankComm::world() const { return impl_->world; }
int RankComm::device() const { return impl_->device; }

std::vector<std::unique_ptr<RankComm>> RankComm::init_all(int G) {
  const char* where = "RankComm::init_all";
  const DeviceInfo info = query_device();
  M3_REQUIRE(info.present, where, "no usable CUDA device", info.why_absent);
  M3_REQUIRE(G >= 1 && G <= info.count, where, "more ranks than GPUs",
             "--gpus ", G, ", this machine has ", info.count, " (one rank per GPU)");
  std::vector<ncclComm_t> comms(static_cast<std::size_t>(G), nullptr);
  std::vector<int> devs(static_cast<std::size_t>(G));
  for (int g = 0; g < G; ++g) devs[g] = g;
  M3_NCCL_CHECK(ncclCommInitAll(comms.data(), G, devs.data()));
  std::vector<std::unique_ptr<RankComm>> out;
  for (int g = 0; g < G; ++g) {
    auto im = std::make_unique<Impl>();
    im->comm = comms[g];
    im->rank = g;
    im->world = G;
    im->device = g;
    out.push_back(std::make_unique<RankComm>(std::move(im)));
  }
  return out;
}

std::unique_ptr<RankComm> RankComm::init_rank(int rank, int world, const std::string& id_file,
                                              int device, double timeout_s) {
  const char* where = "RankComm::init_rank";
  M3_REQUIRE(world >= 1 && rank >= 0 && rank < world, where, "bad rank or world size",
             "rank ", rank, ", world size ", world);
  M3_REQUIRE(!id_file.empty(), where, "no --nccl-id-file",
             "one process per GPU needs a file (on a filesystem every rank sees) for NCCL's id");
  const DeviceInfo info = query_device();
  M3_REQUIRE(info.present, where, "no usable CUDA device", info.why_absent);
  M3_REQUIRE(device >= 0 && device < info.count, where, "local device index out of range",
             "device ", device, ", this machine has ", info.count);
  M3_CUDA_CHECK(cudaSetDevice(device));
  ncclUniqueId id{};
  namespace fs = std::filesystem;
  if (rank == 0) {
    M3_REQUIRE(!fs::exists(id_file), where, "the NCCL id file exists already",
               id_file + " (a previous job's id: remove it; a job never reuses one)");
    M3_NCCL_CHECK(ncclGetUniqueId(&id));
    const std::string tmp = id_file + ".tmp" + std::to_string(::getpid());
    {
      std::ofstream f(tmp, std::ios::binary);
      f.write(reinterpret_cast<const char*>(&id), sizeof(id));
      M3_REQUIRE(f.good(), where, "cannot write the NCCL id file", tmp);
    }
    std::error_code ec;
    fs::rename(tmp, id_file, ec);
    M3_REQUIRE(!ec, where, "cannot move the NCCL id file into place",
               id_file + ": " + ec.message());
  } else {
    const auto t0 = std::chrono::steady_clock::now();
    while (!fs::exists(id_file)) {
      const double waited =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      M3_REQUIRE(waited < timeout_s, where, "no NCCL id file from rank 0",
                 id_file + " did not appear within " + std::to_string(timeout_s) + " s");
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    std::ifstream f(id_file, std::ios::binary);
    f.read(reinterpret_cast<char*>(&id), sizeof(id));
    M3_REQUIRE(f.gcount() == static_cast<std::streamsize>(sizeof(id)), where,
               "the NCCL id file is malformed",
               id_file + " holds " + std::to_string(f.gcount()) + " bytes, an id is " +
                   std::to_string(sizeof(id)));
  }
  auto im = std::make_unique<Impl>();
  im->rank = rank;
  im->world = world;
  im->device = device;
  M3_NCCL_CHECK(ncclCommInitRank(&im->comm, world, id, rank));
  return std::make_unique<RankComm>(std::move(im));
}

void RankComm::reduce_scatter_in_rank_order(GpuContext& ctx, float* grads,
                                            const std::vector<Idx>& bounds) {
  const char* where = "RankComm::reduce_scatter_in_rank_order";
  Impl& im = *impl_;
  check_bounds(bounds, im.world, where);
  if (im.world == 1) return;  // the one-term sum is the gradient itself
  M3_REQUIRE(im.comm != nullptr, where, "the communicator was aborted", "another rank failed");
  const int me = im.rank;
  Idx cap = 0;
  for (int q = 0; q < im.world; ++q) cap = std::max(cap, bounds[q + 1] - bounds[q]);
  if (im.recv.size() < cap * im.world) im.recv.resize(cap * im.world);
  const cudaStream_t s = stream_of(ctx);
  const Idx mine = bounds[me + 1] - bounds[me];
  M3_NCCL_CHECK(ncclGroupStart());
  for (int q = 0; q < im.world; ++q) {
    if (q == me) continue;
    const Idx theirs = bounds[q + 1] - bounds[q];
    if (theirs > 0)
      M3_NCCL_CHECK(ncclSend(grads + bounds[q], static_cast<std::size_t>(theirs), ncclFloat32, q,
                             im.comm, s));
    if (mine > 0)
      M3_NCCL_CHECK(ncclRecv(im.recv.data() + q * cap, static_cast<std::size_t>(mine),
                             ncclFloat32, q, im.comm, s));
  }
  M3_NCCL_CHECK(ncclGroupEnd());
  if (mine == 0) return;
  const unsigned grid = std::min<unsigned>(blocks_for(mine, kSumThreads), 4096u);
  rank_order_sum_kernel<<<grid, kSumThreads, 0, s>>>(grads + bounds[me], im.recv.data(), cap,
                                                      mine, im.world, me);
  M3_LAUNCH_CHECK();
}

void RankComm::all_gather_ranges(GpuContext& ctx, void* buf, std::size_t elem_bytes,
                                 const std::vector<Idx>& bounds) {
  const char* where = "RankComm::all_gather_ranges";
  Impl& im = *impl_;
  check_bounds(bounds, im.world, where);
  if (im.world == 1) return;
  M3_REQUIRE(im.comm != nullptr, where, "the communicator was aborted", "another rank failed");
  M3_REQUIRE(buf != nullptr && elem_bytes > 0, where, "no buffer", "");
  const cudaStream_t s = stream_of(ctx);
  char* b = static_cast<char*>(buf);
  M3_NCCL_CHECK(ncclGroupStart());
  for (int q = 0; q < im.world; ++q) {
    const Idx n = bounds[q + 1] - bounds[q];
    if (n == 0) continue;
    char* at = b + static_cast<std::size_t>(bounds[q]) * elem_bytes;
    M3_NCCL_CHECK(ncclBroadcast(at, at, static_cast<std::size_t>(n) * elem_bytes, ncclUint8, q,
                                im.comm, s));
  }
  M3_NCCL_CHECK(ncclGroupEnd());
}

void RankComm::all_gather_host(GpuContext& ctx, const void* mine, std::size_t bytes, void* all) {
  Impl& im = *impl_;
  if (bytes == 0) return;
  M3_REQUIRE(mine != nullptr && all != nullptr, "RankComm::all_gather_host", "no buffer", "");
  if (im.world == 1) {
    std::memcpy(all, mine, bytes);
    return;
  }
  M3_REQUIRE(im.comm != nullptr, "RankComm::all_gather_host", "the communicator was aborted",
             "another rank failed");
  const Idx n = static_cast<Idx>(bytes) * im.world;
  if (im.staging.size() < n) im.staging.resize(n);
  const cudaStream_t s = stream_of(ctx);
  unsigned char* slot = im.staging.data() + bytes * static_cast<std::size_t>(im.rank);
  M3_CUDA_CHECK(cudaMemcpyAsync(slot, mine, bytes, cudaMemcpyHostToDevice, s));
  M3_NCCL_CHECK(ncclAllGather(slot, im.staging.data(), bytes, ncclUint8, im.comm, s));
  M3_CUDA_CHECK(cudaMemcpyAsync(all, im.staging.data(), static_cast<std::size_t>(n),
                                cudaMemcpyDeviceToHost, s));
  M3_CUDA_CHECK(cudaStreamSynchronize(s));
}

}  // namespace m3::gpu
