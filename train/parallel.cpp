// Data-parallel ranks as one Backend (parallel.hpp): the host ranks (cpu), the GPU ranks through
// gpu::RankComm (gpu), and the launcher environment.
// The GPU step, rank r on its own thread and device, all on its context's stream:
//   forward/backward  its GpuBackbone on rows [r·B/G, (r+1)·B/G) with the global N
//   loss()            its share, all_gather_host, Σ in rank order (every rank the same value)
//   grad_norm()       reduce_scatter_in_rank_order (shard r := ((g_0 + g_1) + …) + g_{G−1}),
//                     norm_partials of shard r's blocks, all_gather_ranges of the partials,
//                     norm_from_partials (the one-GPU total kernel on the same partials)
//   adamw()           GpuOptimizer::step on shard r (its m, v), all_gather_ranges of the f32
//                     masters, refresh_typed_copies
//   state()           the masters from rank 0 (replicated), the m/v shards all_gather_host'ed
// The host ranks do the same in host memory: fixed_order_sum, norm_partials, adamw_step_range
// over one vector each of m and v whose shard r is [b_r, e_r).
#include "parallel.hpp"

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

#include "backbone_gpu.hpp"
#include "context.hpp"
#include "device.hpp"
#include "error.hpp"
#include "optimizer_gpu.hpp"
#include "rank_comm.hpp"
#include "shard.hpp"

namespace m3::train {

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The G + 1 boundaries of shard_plan(total, G), and of the norm blocks they hold.
std::vector<Idx> shard_bounds(Idx total, int G) {
  std::vector<Idx> b{0};
  for (const Shard& s : shard_plan(total, G)) b.push_back(s.end);
  return b;
}
std::vector<Idx> block_bounds(const std::vector<Idx>& bounds) {
  std::vector<Idx> b;
  for (Idx x : bounds) b.push_back((x + kNormBlock - 1) / kNormBlock);
  return b;
}

// What every data-parallel backend shares: the global batch's rows cut over the ranks, the
// shard boundaries of the flat arena, and the gathered results put back in rank order.
class DataParallel : public Backend {
 public:
  DataParallel(const BackendSpec& global, int world)
      : global_(global), layout_(param_layout(global.cfg)), world_(world),
        rows_(global.B / world), bounds_(shard_bounds(layout_.total, world)) {}
  const ParamLayout& layout() const override { return layout_; }
  int ranks() const override { return world_; }
  double exchange_seconds() const override { return exchange_s_; }

 protected:
  Batch rows_of(const Batch& b, int r) const {
    M3_REQUIRE(b.B == global_.B, "train (data parallel)", "a batch of another size",
               "got B=", b.B, ", the ranks share B=", global_.B);
    return slice_rows(b, r * rows_, rows_);
  }
  Shard shard(int r) const { return {bounds_[r], bounds_[r + 1]}; }
  // The whole arena from the ranks' shards, given shard r's values at pieces[r].
  std::vector<float> assemble(const std::vector<std::vector<float>>& pieces) const {
    std::vector<float> out(static_cast<size_t>(layout_.total), 0.0f);
    for (int r = 0; r < world_; ++r) {
      M3_REQUIRE(static_cast<Idx>(pieces[r].size()) >= shard(r).size(), "train (data parallel)",
                 "a shard came back short", "rank ", r);
      std::copy(pieces[r].begin(), pieces[r].begin() + shard(r).size(), out.begin() + bounds_[r]);
    }
    return out;
  }
  std::vector<float> cut(const std::vector<float>& whole, int r) const {
    return {whole.begin() + bounds_[r], whole.begin() + bounds_[r + 1]};
  }

  BackendSpec global_;
  ParamLayout layout_;
  int world_;
  Idx rows_;
  std::vector<Idx> bounds_;
  double exchange_s_ = 0;
  bool reduced_ = false;  // the ranks' gradients are summed into the shards (grad_norm ran)
};

// ---- cpu: G reference ranks, the exchange in host memory -----------------------------------
class HostParallel final : public DataParallel {
 public:
  HostParallel(const BackendSpec& global, int G)
      : DataParallel(global, G), decay_(decay_flags(layout_)),
        zeros_(static_cast<size_t>(layout_.total), 0.0f) {
    BackendSpec local = global;
    local.B = rows_;
    for (int r = 0; r < G; ++r) ranks_.push_back(make_cpu_backend(local));
    set_state(initial_state(global.cfg, 0));
  }
  std::string name() const override {
    return std::to_string(world_) + (world_ == 1 ? " CPU rank" : " CPU ranks");
  }
  // Rank r's shards of m and v are m_[b_r, e_r), v_[b_r, e_r): the shards are disjoint, so
  // one host vector holds them all.
  TrainState state() override { return {params_, m_, v_}; }
  void set_state(const TrainState& st) override {
    check_state(st, layout_.total, "train (data parallel)");
    params_ = st.params;
    m_ = st.m;
    v_ = st.v;
    push_params();
  }
  void zero_grads() override {
    for (auto& be : ranks_) be->zero_grads();
    reduced_ = false;
  }
  void forward(const Batch& b, double n_norm) override {
    for (int r = 0; r < world_; ++r) ranks_[r]->forward(rows_of(b, r), n_norm);
  }
  double loss() override {
    double sum = 0;
    for (auto& be : ranks_) sum += be->loss();  // rank order
    return sum;
  }
  void backward(double scale) override {
    M3_REQUIRE(!reduced_, "train (data parallel)", "backward after the gradient exchange",
               "zero_grads() starts the next step");
    for (auto& be : ranks_) be->backward(scale);
  }
  std::vector<std::int32_t> argmax() override {
    return concat<std::int32_t>([](Backend& be) { return be.argmax(); });
  }
  std::vector<float> logits() override {
    return concat<float>([](Backend& be) { return be.logits(); });
  }
  double grad_norm() override {
    reduce();
    std::vector<double> partials;
    for (int r = 0; r < world_; ++r) {  // rank r's blocks, gathered in rank order
      const std::vector<double> p = norm_partials(summed_.data(), bounds_[r], bounds_[r + 1]);
      partials.insert(partials.end(), p.begin(), p.end());
    }
    return norm_from_partials(partials);
  }
  void adamw(const AdamWScalars& a) override {
    reduce();
    const auto t0 = Clock::now();
    std::vector<float> next = params_;
    for (int r = 0; r < world_; ++r)  // rank r steps its shard of the masters, m and v
      adamw_step_range(layout_, decay_, a, bounds_[r], bounds_[r + 1], next.data(), m_.data(),
                       v_.data(), summed_.data());
    params_ = next;  // the all-gather: every rank's shard of the masters to every rank
    push_params();
    exchange_s_ += since(t0);
  }
  std::vector<float> grads() override {
    reduce();
    return summed_;
  }

 private:
  template <class V, class F>
  std::vector<V> concat(F&& f) {
    std::vector<V> out;
    for (auto& be : ranks_) {
      const auto part = f(*be);
      out.insert(out.end(), part.begin(), part.end());
    }
    return out;
  }
  // The ranks' gradients summed in rank order, each shard by its owner (fixed_order_sum).
  void reduce() {
    if (reduced_) return;
    const auto t0 = Clock::now();
    std::vector<std::vector<float>> g;
    std::vector<const float*> ptrs;
    for (auto& be : ranks_) g.push_back(be->grads());
    for (const auto& x : g) ptrs.push_back(x.data());
    summed_.assign(static_cast<size_t>(layout_.total), 0.0f);
    for (int r = 0; r < world_; ++r) fixed_order_sum(ptrs, shard(r), summed_.data() + bounds_[r]);
    reduced_ = true;
    exchange_s_ += since(t0);
  }
  void push_params() {
    for (auto& be : ranks_) be->set_state({params_, zeros_, zeros_});
  }

  std::vector<std::unique_ptr<Backend>> ranks_;
  std::vector<std::uint8_t> decay_;
  std::vector<float> zeros_, params_, summed_, m_, v_;
};

// ---- gpu: a thread per rank ------------------------------------------------------------------
// Persistent workers, one per rank of this process, so that each keeps its device current.
// run(fn) runs fn(i) on worker i for every i and waits for all; the first failure in rank order
// is rethrown. If a worker fails while others are still busy (blocked in a collective that the
// failed rank will never join), on_stuck runs once — the GPU ranks abort their communicators —
// so that the others return with an error instead of waiting forever.
class RankThreads {
 public:
  explicit RankThreads(int n) : err_(static_cast<size_t>(n)) {
    for (int i = 0; i < n; ++i) threads_.emplace_back([this, i] { loop(i); });
  }
  ~RankThreads() {
    {
      std::lock_guard<std::mutex> l(mu_);
      quit_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  void run(const std::function<void(int)>& fn, const std::function<void()>& on_stuck = {}) {
    std::unique_lock<std::mutex> l(mu_);
    job_ = &fn;
    pending_ = static_cast<int>(threads_.size());
    for (auto& e : err_) e = nullptr;
    ++generation_;
    cv_.notify_all();
    bool aborted = false;
    while (pending_ > 0) {
      done_.wait_for(l, std::chrono::seconds(1));
      bool failed = false;
      for (auto& e : err_) failed = failed || e != nullptr;
      if (failed && pending_ > 0 && !aborted && on_stuck) {
        aborted = true;
        l.unlock();
        on_stuck();
        l.lock();
      }
    }
    job_ = nullptr;
    for (auto& e : err_)
      if (e) std::rethrow_exception(e);
  }

 private:
  void loop(int i) {
    std::uint64_t seen = 0;
    for (;;) {
      const std::function<void(int)>* job = nullptr;
      {
        std::unique_lock<std::mutex> l(mu_);
        cv_.wait(l, [&] { return quit_ || generation_ != seen; });
        if (quit_) return;
        seen = generation_;
        job = job_;
      }
      std::exception_ptr err;
      try {
        (*job)(i);
      } catch (...) {
        err = std::current_exception();
      }
      std::lock_guard<std::mutex> l(mu_);
      err_[i] = err;
      if (--pending_ == 0 || err) done_.notify_all();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_, done_;
  std::vector<std::thread> threads_;
  std::vector<std::exception_ptr> err_;
  const std::function<void(int)>* job_ = nullptr;
  std::uint64_t generation_ = 0;
  int pending_ = 0;
  bool quit_ = false;
};

struct GpuRank {
  std::unique_ptr<gpu::RankComm> comm;
  std::unique_ptr<gpu::GpuContext> ctx;
  std::unique_ptr<gpu::GpuBackbone> net;
  std::unique_ptr<gpu::GpuOptimizer> opt;
};

class GpuParallel final : public DataParallel {
 public:
  GpuParallel(const BackendSpec& global, const ParallelSpec& p)
      : DataParallel(global, p.ranks()), job_(p.multi_process()),
        local_(job_ ? 1 : p.gpus), threads_(local_), blocks_(block_bounds(bounds_)) {
    BackendSpec local = global;
    local.B = rows_;
    const std::string why = gpu::GpuBackbone::unsupported(local.cfg, local.B, local.T);
    M3_REQUIRE(why.empty(), "train (gpu)", "the GPU path cannot run this shape", why);
    ranks_.resize(static_cast<size_t>(local_));
    if (p.multi_process()) {
      const int device = p.device;
      run([&](int, GpuRank& k) {
        k.comm = gpu::RankComm::init_rank(p.rank, p.world, p.nccl_id_file, device, p.id_timeout_s);
      });
    } else {
      std::vector<std::unique_ptr<gpu::RankComm>> comms = gpu::RankComm::init_all(p.gpus);
      for (int i = 0; i < local_; ++i) ranks_[i].comm = std::move(comms[i]);
    }
    run([&](int, GpuRank& k) {
      k.ctx = std::make_unique<gpu::GpuContext>(k.comm->device());
      k.net = std::make_unique<gpu::GpuBackbone>(*k.ctx, local.cfg, local.B, local.T, local.mode,
                                                 local.storage, local.recompute);
      const int r = k.comm->rank();
      k.opt = std::make_unique<gpu::GpuOptimizer>(*k.ctx, k.net->param_layout(), bounds_[r],
                                                  bounds_[r + 1]);
    });
    M3_REQUIRE(ranks_[0].net->param_layout().total == layout_.total, "train (gpu)",
               "the device layout differs from the host's", "");
    set_state(initial_state(global.cfg, 0));
    zero_grads();
  }
  // Each rank's device objects go on the thread whose device they are on.
  ~GpuParallel() override {
    try {
      run([](int, GpuRank& k) {
        k.opt.reset();
        k.net.reset();
        k.ctx.reset();
        k.comm.reset();
      });
    } catch (...) {  // a destructor does not throw; the process is past caring
    }
  }
  std::string name() const override {
    const std::string nccl = "NCCL " + gpu::nccl_version();
    if (job_)
      return "GPU rank " + std::to_string(rank()) + " of a job of " + std::to_string(world_) +
             (world_ == 1 ? " process (" : " processes (") + nccl + ")";
    return std::to_string(world_) + (world_ == 1 ? " GPU" : " GPUs") + " (" + nccl + ")";
  }
  int rank() const override { return job_ ? ranks_[0].comm->rank() : 0; }

  TrainState state() override {
    TrainState st;
    std::vector<std::vector<float>> m(static_cast<size_t>(world_)), v = m;
    run([&](int i, GpuRank& k) {
      if (i == 0) st.params = k.net->params_flat();  // replicated: every rank has the same
      gather_shard(i, k, k.opt->m(), m);
      gather_shard(i, k, k.opt->v(), v);
    });
    st.m = assemble(m);
    st.v = assemble(v);
    return st;
  }
  void set_state(const TrainState& st) override {
    check_state(st, layout_.total, "train (data parallel)");
    run([&](int, GpuRank& k) {
      const int r = k.comm->rank();
      k.net->set_params_flat(st.params);
      k.opt->set_moments(cut(st.m, r), cut(st.v, r));
    });
  }
  void zero_grads() override {
    run([](int, GpuRank& k) { k.net->zero_grads(); });
    reduced_ = false;
  }
  void forward(const Batch& b, double n_norm) override {
    run([&](int, GpuRank& k) {
      const Batch mine = rows_of(b, k.comm->rank());
      k.net->set_tokens(mine.tok);
      k.net->set_targets(mine.tgt, mine.w, n_norm);
      start_forward(k);
    });
  }
  void stage(const Batch& b, double n_norm) override {
    run([&](int, GpuRank& k) {
      const Batch mine = rows_of(b, k.comm->rank());
      k.net->stage_batch(mine.tok, mine.tgt, mine.w, n_norm);
    });
  }
  void forward_staged() override {
    run([&](int, GpuRank& k) {
      k.net->upload_staged();
      start_forward(k);
    });
  }
  double loss() override {
    std::vector<double> sums(static_cast<size_t>(local_));
    run([&](int i, GpuRank& k) {
      const double mine = k.net->loss();
      std::vector<double> all(static_cast<size_t>(world_));
      k.comm->all_gather_host(*k.ctx, &mine, sizeof(double), all.data());
      double s = 0;
      for (double x : all) s += x;  // rank order
      sums[i] = s;
    });
    return sums[0];
  }
  void backward(double scale) override {
    M3_REQUIRE(!reduced_, "train (data parallel)", "backward after the gradient exchange",
               "zero_grads() starts the next step");
    run([&](int, GpuRank& k) { k.net->backward_loss(scale); });
  }
  std::vector<std::int32_t> argmax() override {
    return gather_rows<std::int32_t>([](GpuRank& k) { return k.net->argmax(); });
  }
  std::vector<float> logits() override {
    return gather_rows<float>([](GpuRank& k) { return k.net->logits(); });
  }
  double grad_norm() override {
    std::vector<double> norms(static_cast<size_t>(local_));
    run([&](int i, GpuRank& k) {
      reduce(i, k);
      k.opt->norm_partials(k.net->grad_arena());
      k.comm->all_gather_ranges(*k.ctx, k.opt->partials_device(), sizeof(double), blocks_);
      norms[i] = k.opt->norm_from_partials();
    });
    for (int i = 1; i < local_; ++i)
      M3_REQUIRE(std::memcmp(&norms[i], &norms[0], sizeof(double)) == 0, "train (data parallel)",
                 "the ranks disagree on the gradient norm", "rank 0: ", norms[0], ", rank ", i,
                 ": ", norms[i], " (the gathered partials differ: a bug)");
    reduced_ = true;
    return norms[0];
  }
  void adamw(const AdamWScalars& a) override {
    M3_REQUIRE(reduced_, "train (data parallel)", "AdamW before the gradient exchange",
               "grad_norm() sums the ranks' gradients first");
    run([&](int i, GpuRank& k) {
      k.opt->step(a, k.net->param_arena(), k.net->grad_arena());
      k.ctx->synchronize();
      const auto t0 = Clock::now();
      k.comm->all_gather_ranges(*k.ctx, k.net->param_arena(), sizeof(float), bounds_);
      k.ctx->synchronize();
      if (i == 0) exchange_s_ += since(t0);
      k.net->refresh_typed_copies();
    });
  }
  std::vector<float> grads() override {
    if (!reduced_) {
      run([&](int i, GpuRank& k) { reduce(i, k); });
      reduced_ = true;
    }
    std::vector<std::vector<float>> g(static_cast<size_t>(world_));
    run([&](int i, GpuRank& k) {
      const int r = k.comm->rank();
      gather_shard(i, k, cut(to_flat(k.net->grads(), layout_), r), g);
    });
    return assemble(g);
  }
  bool any_rank(bool mine) override {
    if (!job_) return mine;  // one process: the flag is already everyone's
    bool any = mine;
    run([&](int, GpuRank& k) {
      const int m = mine ? 1 : 0;
      std::vector<int> all(static_cast<size_t>(world_));
      k.comm->all_gather_host(*k.ctx, &m, sizeof(int), all.data());
      for (int x : all) any = any || x != 0;
    });
    return any;
  }

 private:
  void run(const std::function<void(int, GpuRank&)>& f) {
    threads_.run([&](int i) { f(i, ranks_[i]); }, [&] {
      // Another rank failed: unblock the ones waiting for it in a collective.
      for (auto& k : ranks_)
        if (k.comm) k.comm->abort();
    });
  }
  // Rank i's gradients summed with the others' in rank order into its shard; timed on rank 0
  // from the end of its backward.
  void reduce(int i, GpuRank& k) {
    k.ctx->synchronize();
    const auto t0 = Clock::now();
    k.comm->reduce_scatter_in_rank_order(*k.ctx, k.net->grad_arena(), bounds_);
    k.ctx->synchronize();
    if (i == 0) exchange_s_ += since(t0);
  }
  // Every rank's shard values (padded to the largest shard) into all[r]; worker i = 0 of this
  // process stores them (the others hold the same bytes).
  void gather_shard(int i, GpuRank& k, const std::vector<float>& mine,
                    std::vector<std::vector<float>>& all) {
    Idx cap = 0;
    for (int r = 0; r < world_; ++r) cap = std::max(cap, shard(r).size());
    std::vector<float> padded(static_cast<size_t>(cap), 0.0f);
    std::vector<float> out(static_cast<size_t>(cap * world_));
    std::copy(mine.begin(), mine.end(), padded.begin());
    k.comm->all_gather_host(*k.ctx, padded.data(), static_cast<size_t>(cap) * sizeof(float),
                            out.data());
    if (i != 0) return;
    for (int r = 0; r < world_; ++r)
      all[r].assign(out.begin() + r * cap, out.begin() + (r + 1) * cap);
  }
  static void start_forward(GpuRank& k) {
    k.net->zero_states();
    k.net->forward_loss_async();
  }
  // Every rank's rows in rank order (equal row counts).
  template <class V, class F>
  std::vector<V> gather_rows(F&& f) {
    std::vector<V> out;
    run([&](int i, GpuRank& k) {
      const std::vector<V> mine = f(k);
      std::vector<V> all(mine.size() * static_cast<size_t>(world_));
      k.comm->all_gather_host(*k.ctx, mine.data(), mine.size() * sizeof(V), all.data());
      if (i == 0) out = std::move(all);
    });
    return out;
  }

  bool job_;   // this process is one rank of a job of processes
  int local_;  // ranks driven by this process
  RankThreads threads_;
  std::vector<GpuRank> ranks_;
  std::vector<Idx> blocks_;
};

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  M3_REQUIRE(end && *end == '\0' && x >= 0 && x < (1L << 30), "train",
             std::string("the launcher's ") + name + " is not a rank", std::string(name) + "=" + v);
  return static_cast<int>(x);
}

}  // namespace

void fill_from_launcher_env(ParallelSpec& p, bool rank_given) {
  const char* kSets[][3] = {{"M3_RANK", "M3_WORLD_SIZE", "M3_LOCAL_RANK"},
                            {"RANK", "WORLD_SIZE", "LOCAL_RANK"},
                            {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                             "OMPI_COMM_WORLD_LOCAL_RANK"},
                            {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"}};
  for (const auto& set : kSets) {
    const int rank = env_int(set[0], -1), world = env_int(set[1], -1);
    if (rank < 0 && world < 0) continue;
    if (!rank_given && rank >= 0) p.rank = rank;
    if (p.world == 0 && world > 0) p.world = world;
    if (p.device < 0) p.device = env_int(set[2], -1);
    return;
  }
}

void check_parallel(const std::string& device, Idx B, const ParallelSpec& p) {
  const char* where = "train";
  M3_REQUIRE(p.gpus >= 1, where, "--gpus must be >= 1", "--gpus ", p.gpus);
  M3_REQUIRE(!p.multi_process() || p.gpus == 1, where,
             "--gpus and a job of processes exclude each other",
             "one process per GPU: each takes one (--gpus 1), the job has --world-size ranks");
  const int G = p.ranks();
  M3_REQUIRE(B % G == 0, where, "the global batch does not split evenly over the ranks",
             "--B ", B, " over ", G, " ranks (B must be a multiple of the rank count)");
  if (p.multi_process()) {
    M3_REQUIRE(device == "gpu", where, "a job of processes trains on GPUs",
               "--device cpu runs its ranks in one process: use --gpus G");
    M3_REQUIRE(p.rank >= 0 && p.rank < p.world, where, "the rank is outside the job",
               "--rank ", p.rank, ", --world-size ", p.world);
    M3_REQUIRE(!p.nccl_id_file.empty(), where, "a job of processes needs --nccl-id-file",
               "rank 0 writes NCCL's id there for the others");
  }
  if (device == "gpu" && !p.plain())
    M3_REQUIRE(gpu::have_nccl(), where, "several GPUs need NCCL", gpu::nccl_version());
}

std::unique_ptr<Backend> make_data_parallel(const std::string& device, const BackendSpec& global,
                                            const ParallelSpec& p) {
  const char* where = "train";
  check_parallel(device, global.B, p);
  const int G = p.ranks();
  if (p.plain()) return make_backend(device, global);
  if (device == "cpu") return std::make_unique<HostParallel>(global, G);
  if (device == "gpu") {
    ParallelSpec q = p;
    if (q.multi_process() && q.device < 0) {
      const gpu::DeviceInfo info = gpu::query_device();
      M3_REQUIRE(info.present, where, "no usable CUDA device", info.why_absent);
      q.device = q.rank % info.count;
    }
    return std::make_unique<GpuParallel>(global, q);
  }
  throw Error(where, "unknown device '" + device + "'", "use gpu or cpu");
}

}  // namespace m3::train
