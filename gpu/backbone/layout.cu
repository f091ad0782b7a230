// BackboneT's layout (backbone_t.cuh): the buffers of every registry tensor, allocated from the
// registry with their production lifetimes (registry.hpp Life) or, for verification, each its
// own; the parameter arenas and the typed GEMM weight copies; the scratch and the memory
// accounting.
#include "backbone_t.cuh"

namespace m3::gpu::detail {

template <class T>
BackboneT<T>::BackboneT(GpuContext& c, const Config& cf, Idx B, Idx T_, ScanMode m, Recompute rc)
    : ctx_(c), cfg_(cf), d_(ref::Dims::of(cf, B, T_, precision_of<T>())), mode_(m), rc_(rc),
           s_(stream_of(c)) {
  layers_.resize(static_cast<size_t>(cf.n_layers));
  const StateSizes z = state_sizes(cf);
  // Every registry tensor of the run (n = 0 where the run has none), with its lifetime.
  for (const auto& spec : stage_registry()) {
    const Idx n = exists_in(spec, cf, m) ? shape_numel(resolve_shape(spec.shape, cf, B, T_)) : 0;
    const std::size_t elem = spec.typed ? sizeof(T) : sizeof(float);
    if (spec.scope == Scope::Layer) {
      const Life life = layer_life(spec);
      for (auto& L : layers_) L.add(spec.tensor, n, elem, life);
    } else {
      // Backbone tensors exist once per run: all kept, norm_f's input a view of the last
      // layer's output and the head's d_Out a view of d_out, the backbone's output gradient
      // (each its own buffer in the verification layout).
      const std::string tensor = spec.tensor, stage = spec.stage;
      const bool view = tensor == "norm_f_input" || (stage == "head" && tensor == "d_Out");
      bb_.add(backbone_name(spec.stage, spec.tensor), n, elem, view ? Life::View : Life::Saved);
    }
  }
  // Per layer, beyond the registry: the entering states (the backward reads k_in, v_in) and
  // the gradients wrt the leaving states.
  for (auto& L : layers_) {
    for (const char* nm : {"ssm_in", "d_ssm_out"}) L.add(nm, B * z.ssm, 4);
    for (const char* nm : {"k_in", "d_k_out"}) L.add(nm, B * z.k, 4);
    for (const char* nm : {"v_in", "d_v_out"}) L.add(nm, B * z.v, 4);
    for (const char* nm : {"angle_in", "d_angle_out"}) L.add(nm, B * z.angle, 4);
  }
  bb_.add("d_out", d_.BT * d_.dm, 4);
  bb_.add("delta", d_.BT * d_.dm, 4, Life::View);  // δ: a view of the buffer that made it
  bb_.add("delta_typed", d_.BT * d_.dm, sizeof(T));
  table_ = stage_table(cf, m);
  plan_ = ChainPlan::of(cf, m);
  // The flat arenas: f32 masters and gradients in param_layout order; the typed GEMM weight
  // copies in one buffer of T, one segment per weight (refresh_typed_copies: one launch).
  layout_ = m3::param_layout(cf);
  const int n_prm = static_cast<int>(Prm::kCount);
  param_off_.assign(static_cast<size_t>((cf.n_layers + 1) * n_prm), -1);
  for (const ParamSlot& sl : layout_.slots)
    for (int i = 0; i < n_prm; ++i)
      if (std::string(sl.spec->name) == kPrmNames[i])
        param_off_[static_cast<size_t>((sl.layer + 1) * n_prm + i)] = sl.offset;
  check_fits();
  lay_out();
  params_.resize(layout_.total);
  grads_.resize(layout_.total);
  params_.zero(s_);
  if constexpr (!std::is_same_v<T, float>) {
    std::vector<CopySegment> segs;
    Idx off = 0;
    auto segment = [&](int l, const char* name) {
      const ParamSlot& sl = layout_.at(l, name);
      segs.push_back({sl.offset, off, sl.size});
      max_segment_ = std::max(max_segment_, sl.size);
      const Idx at = off;
      off += (sl.size + 127) / 128 * 128;  // 256-byte aligned copies
      return at;
    };
    for (int l = 0; l < static_cast<int>(cf.n_layers); ++l) {
      w_in_off_.push_back(segment(l, "in_proj_w"));
      w_out_off_.push_back(segment(l, "out_proj_w"));
    }
    if (!cf.input_proj_identity) w_input_off_ = segment(-1, "input_proj_w");
    if (cf.vocab_size > 0) w_head_off_ = segment(-1, "head_w");
    typed_.resize(off);
    segments_.resize(static_cast<Idx>(segs.size() * sizeof(CopySegment)));
    M3_CUDA_CHECK(cudaMemcpyAsync(segments_.data(), segs.data(), segs.size() * sizeof(CopySegment),
                                  cudaMemcpyHostToDevice, s_));
    n_segments_ = static_cast<int>(segs.size());
  }
  const Idx LB = cf.n_layers * B;
  for (StateArrays* a : {&st_, &st0_, &dl_, &de_}) {
    a->ssm.resize(LB * z.ssm);
    a->k.resize(LB * z.k);
    a->v.resize(LB * z.v);
    a->angle.resize(LB * z.angle);
  }
  scratch_.resize(scratch_need());
  if (cf.vocab_size > 0) {  // the token model's inputs and the embedding backward's order
    const Idx BT = d_.BT, V = cf.vocab_size;
    tok_.resize(BT);
    tgt_.resize(BT);
    tw_.resize(BT);
    perm_.resize(BT);
    const Idx max_chunks = BT / kEmbedChunk + V;
    chunks_.resize(max_chunks * 3);
    token_chunks_.resize(V + 1);
    embed_partial_.resize(max_chunks * d_.dm);
    row_loss_.resize(BT);
    loss_sum_.resize(1);
    argmax_.resize(BT);
  }
  zero_states(dl_);
  grads_.zero(s_);
  M3_CUDA_CHECK(cudaStreamSynchronize(s_));
}

template <class T>
Life BackboneT<T>::layer_life(const TensorSpec& spec) const {
  const std::string t = spec.tensor;
  // The chunked tail's fused head sums make d_b/c_pre_rope verification-only.
  if (mode_ == ScanMode::Chunked && (t == "d_b_pre_rope" || t == "d_c_pre_rope"))
    return Life::Verify;
  // B6's tail fused into B3 (cluster tail) keeps dQ_mid and dK_mid on chip.
  if (cluster_tail() && (t == "dQ_mid" || t == "dK_mid")) return Life::Verify;
  return lifetime(spec, mode_, rc_);
}

template <class T>
const TensorSpec& BackboneT<T>::layer_spec(const std::string& name) {
  for (const auto& s : stage_registry())
    if (s.scope == Scope::Layer && name == s.tensor) return s;
  throw Error("GpuBackbone", "no layer tensor '" + name + "'", "not in the stage registry");
}

template <class T>
Idx BackboneT<T>::shared_ld(int l, LBuf id, LBuf grad) {
  const Idx ld = ld_of(l, id);
  M3_REQUIRE(ld_of(l, grad) == ld, "GpuBackbone",
             std::string(buf_name(id)) + " and " + buf_name(grad) + " differ in layout", "");
  return ld;
}

template <class T>
Idx BackboneT<T>::raw_ld(int l) {
  const Idx ld = shared_ld(l, LBuf::b_raw, LBuf::d_b_raw);
  M3_REQUIRE(shared_ld(l, LBuf::c_raw, LBuf::d_c_raw) == ld, "GpuBackbone",
             "b_raw and c_raw differ in layout", "");
  return ld;
}

template <class T>
void BackboneT<T>::check_fits() const {
  std::size_t free_b = 0, total_b = 0;
  M3_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  auto need = [&](Recompute rc) {
    const LayerBytes plan = layer_bytes(cfg_, d_.B, d_.T, mode_, precision_of<T>(), rc);
    std::size_t n = static_cast<std::size_t>(cfg_.n_layers) * plan.saved + plan.view +
                    plan.workspace + 4 * static_cast<std::size_t>(scratch_need()) +
                    12 * static_cast<std::size_t>(layout_.total);
    for (const auto& [name, b] : bb_.all()) n += b.nbytes();
    return n;
  };
  const std::size_t mine = need(rc_);
  if (mine <= free_b) return;
  const double gib = 1024.0 * 1024.0 * 1024.0;
  std::string why = "needs about " + std::to_string(mine / gib).substr(0, 6) + " GiB, " +
                    std::to_string(free_b / gib).substr(0, 6) + " GiB are free";
  if (mode_ == ScanMode::Chunked && rc_ == Recompute::None)
    why += "; with the scan recomputed (Recompute::Scan, m3h --recompute scan) about " +
           std::to_string(need(Recompute::Scan) / gib).substr(0, 6) + " GiB";
  throw Error("GpuBackbone", "the run does not fit the device's memory", why);
}

template <class T>
void BackboneT<T>::lay_out() {
  for (auto& [name, b] : bb_.all()) {
    b.viewed = nullptr;
    const bool own = full_ || b.life != Life::View;
    if (b.n > 0 && own && b.bytes.size() == 0) b.bytes.resize(static_cast<Idx>(b.nbytes()));
    if (!own) b.bytes.resize(0);
  }
  const int L = static_cast<int>(layers_.size());
  for (int l = 0; l < L; ++l)
    for (auto& [name, b] : layers_[l].all()) {
      b.viewed = nullptr;
      b.shared = nullptr;
      const bool own = full_ || b.life == Life::Saved || (b.life == Life::View && l == 0);
      if (b.n == 0 || !own) b.bytes.resize(0);
      if (b.n > 0 && own && b.bytes.size() == 0) b.bytes.resize(static_cast<Idx>(b.nbytes()));
      b.ld = 0;
      if (b.n == 0 || own || b.life != Life::Workspace) continue;
      const bool on_d_norm = name == "d_temporal" && (L - 1 - l) % 2 == 1;
      b.shared = on_d_norm ? bb_.at(BBuf::d_norm).data() : workspace(name, b.nbytes());
    }
  // Column views (production layout), once their tensors have storage: z, x at proj's
  // columns 0 and di, d_z, d_x at d_proj's (registry column_view), read with its row stride.
  if (!full_)
    for (int l = 0; l < L; ++l)
      for (auto& [name, b] : layers_[l].all()) {
        if (b.n == 0 || b.life != Life::Columns) continue;
        const ColumnView cv = column_view(layer_spec(name), cfg_);
        NamedBuf& of = layers_[l].at(cv.tensor);
        M3_REQUIRE(of.data() != nullptr && of.n % d_.BT == 0 && b.n % d_.BT == 0 &&
                       cv.first + b.n / d_.BT <= of.n / d_.BT && of.elem == b.elem,
                   "GpuBackbone", "column view '" + name + "' does not fit '" + cv.tensor + "'",
                   "");
        b.viewed = of.data() + static_cast<std::size_t>(cv.first) * b.elem;
        b.ld = of.n / d_.BT;
      }
  if (full_) ws_.clear();
  have_forward_ = false;
}

template <class T>
unsigned char* BackboneT<T>::workspace(const std::string& name, std::size_t bytes) {
  DeviceArray<unsigned char>& a = ws_[name];
  if (a.size() == 0) a.resize(static_cast<Idx>(bytes));
  return a.data();
}

template <class T>
void BackboneT<T>::ensure_full() {
  if (full_) return;
  full_ = true;
  lay_out();  // the values of workspace tensors are gone: a backward needs a new forward
}

template <class T>
void BackboneT<T>::relayout() {
  for (auto& L : layers_)
    for (const auto& spec : stage_registry())
      if (spec.scope == Scope::Layer) L.at(spec.tensor).life = layer_life(spec);
  ws_.clear();
  lay_out();
}

template <class T>
Idx BackboneT<T>::scratch_need() const {
  Idx n = scratch_floats(d_);
  if (cluster_tail())
    n = std::max(n, ssm_chunked_scratch_floats(d_) + ssm_chunked_cluster_scratch_floats(d_));
  return n;
}

template <class T>
BackboneMemory BackboneT<T>::memory() const {
  BackboneMemory m;
  for (size_t l = 0; l < layers_.size(); ++l) {
    std::size_t own = 0;
    for (const auto& [name, b] : layers_[l].all())
      own += static_cast<std::size_t>(b.bytes.size());
    m.layers.push_back(own);
  }
  for (const auto& [name, a] : ws_) m.workspace += static_cast<std::size_t>(a.size());
  for (const auto& [name, b] : bb_.all())
    m.backbone += static_cast<std::size_t>(b.bytes.size());
  m.params = 4 * static_cast<std::size_t>(params_.size() + grads_.size()) +
             sizeof(T) * static_cast<std::size_t>(typed_.size()) +
             static_cast<std::size_t>(segments_.size());
  for (const StateArrays* a : {&st_, &st0_, &dl_, &de_})
    m.states += 4 * static_cast<std::size_t>(a->ssm.size() + a->k.size() + a->v.size() +
                                             a->angle.size());
  m.scratch = 4 * static_cast<std::size_t>(scratch_.size());
  for (const DeviceArray<std::int32_t>* a : {&tok_, &tgt_, &perm_, &chunks_, &token_chunks_,
       &argmax_})
    m.tokens += 4 * static_cast<std::size_t>(a->size());
  m.tokens += 4 * static_cast<std::size_t>(tw_.size() + embed_partial_.size()) +
              8 * static_cast<std::size_t>(row_loss_.size() + loss_sum_.size());
  m.digests = static_cast<std::size_t>(digest_segs_.size()) +
              8 * static_cast<std::size_t>(digests_.size());
  return m;
}

#define M3_INSTANTIATE(T) \
  template BackboneT<T>::BackboneT(GpuContext& c, const Config& cf, Idx B, Idx T_, ScanMode m, \
                                   Recompute rc); \
  template Life BackboneT<T>::layer_life(const TensorSpec& spec) const; \
  template const TensorSpec& BackboneT<T>::layer_spec(const std::string& name); \
  template Idx BackboneT<T>::shared_ld(int l, LBuf id, LBuf grad); \
  template Idx BackboneT<T>::raw_ld(int l); \
  template void BackboneT<T>::check_fits() const; \
  template void BackboneT<T>::lay_out(); \
  template unsigned char* BackboneT<T>::workspace(const std::string& name, std::size_t bytes); \
  template void BackboneT<T>::ensure_full(); \
  template void BackboneT<T>::relayout(); \
  template Idx BackboneT<T>::scratch_need() const; \
  template BackboneMemory BackboneT<T>::memory() const;
M3_INSTANTIATE(float)
M3_INSTANTIATE(__nv_bfloat16)
M3_INSTANTIATE(__half)
#undef M3_INSTANTIATE

}  // namespace m3::gpu::detail
