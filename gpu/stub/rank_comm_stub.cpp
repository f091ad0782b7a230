// A build without NCCL (or without CUDA): the data-parallel collectives' API exists so that the
// trainer links the same way in every build; every entry says in one line why it cannot run.
// One GPU trains without it (--gpus 1 takes the plain path).
#include "error.hpp"
#include "rank_comm.hpp"

namespace m3::gpu {

namespace {
std::string why_not() {
#if M3_HAVE_CUDA
  return "built without NCCL (CMake found no nccl.h / libnccl: install libnccl-dev or use the "
         "CUDA toolkit's, then reconfigure)";
#else
  return "built without CUDA (M3_CUDA=OFF)";
#endif
}
[[noreturn]] void no_nccl(const char* where) {
  throw Error(where, "no NCCL: several GPUs cannot exchange gradients", why_not());
}
}  // namespace

bool have_nccl() { return false; }
std::string nccl_version() { return why_not(); }

struct RankComm::Impl {};
RankComm::RankComm(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RankComm::~RankComm() = default;
std::vector<std::unique_ptr<RankComm>> RankComm::init_all(int) { no_nccl("RankComm::init_all"); }
std::unique_ptr<RankComm> RankComm::init_rank(int, int, const std::string&, int, double) {
  no_nccl("RankComm::init_rank");
}
int RankComm::rank() const { no_nccl("RankComm::rank"); }
int RankComm::world() const { no_nccl("RankComm::world"); }
int RankComm::device() const { no_nccl("RankComm::device"); }
void RankComm::reduce_scatter_in_rank_order(GpuContext&, float*, const std::vector<Idx>&) {
  no_nccl("RankComm::reduce_scatter_in_rank_order");
}
void RankComm::all_gather_ranges(GpuContext&, void*, std::size_t, const std::vector<Idx>&) {
  no_nccl("RankComm::all_gather_ranges");
}
void RankComm::abort() {}
void RankComm::all_gather_host(GpuContext&, const void*, std::size_t, void*) {
  no_nccl("RankComm::all_gather_host");
}

}  // namespace m3::gpu
