// BackboneT's token input (backbone_t.cuh, TRAINING.md §1): tokens, targets and loss weights
// checked on the host, the embedding backward's fixed order computed there, and the copies to
// the device, direct or staged in page-locked slots so that a batch uploads while the previous
// step runs.
#include "backbone_t.cuh"

namespace m3::gpu::detail {

template <class T>
void BackboneT<T>::set_tokens(const std::vector<std::int32_t>& tok) {
  check_token_model("GpuBackbone::set_tokens");
  plain_perm_.resize(static_cast<size_t>(d_.BT));
  plain_chunks_.resize(chunks_.size());
  plain_token_chunks_.resize(token_chunks_.size());
  const Idx n_chunks = order_tokens("GpuBackbone::set_tokens", tok, plain_perm_.data(),
                                    plain_chunks_.data(), plain_token_chunks_.data());
  // No synchronisation: an asynchronous copy from pageable memory has taken the host data
  // when it returns, so the vectors may change; the kernels before it keep running meanwhile.
  upload_tokens(tok.data(), plain_perm_.data(), plain_chunks_.data(),
                plain_token_chunks_.data(), n_chunks);
}

template <class T>
void BackboneT<T>::set_targets(const std::vector<std::int32_t>& tgt, const std::vector<float>& w,
                               double n_norm) {
  check_token_model("GpuBackbone::set_targets");
  check_targets("GpuBackbone::set_targets", tgt, w, n_norm);
  upload_targets(tgt.data(), w.data(), n_norm);  // pageable: taken when the copies return
}

template <class T>
void BackboneT<T>::stage_batch(const std::vector<std::int32_t>& tok,
                               const std::vector<std::int32_t>& tgt, const std::vector<float>& w,
                               double n_norm) {
  // The checks of set_tokens and then set_targets, with their names; a failed stage leaves
  // nothing staged.
  check_token_model("GpuBackbone::set_tokens");
  const Idx BT = d_.BT;
  HostSlot& slot = slots_[next_slot_];
  if (!slot.tok.p) {  // first use: pinned arrays of the device arrays' sizes
    slot.tok.resize(BT);
    slot.perm.resize(BT);
    slot.chunks.resize(static_cast<Idx>(chunks_.size()));
    slot.token_chunks.resize(static_cast<Idx>(token_chunks_.size()));
    slot.tgt.resize(BT);
    slot.w.resize(BT);
  }
  if (slot.copying) M3_CUDA_CHECK(cudaEventSynchronize(slot.copied.e));  // its last copies
  slot.copying = false;
  slot.staged = false;
  slot.n_chunks = order_tokens("GpuBackbone::set_tokens", tok, slot.perm.p, slot.chunks.p,
                               slot.token_chunks.p);
  check_targets("GpuBackbone::set_targets", tgt, w, n_norm);
  std::copy(tok.begin(), tok.end(), slot.tok.p);
  std::copy(tgt.begin(), tgt.end(), slot.tgt.p);
  std::copy(w.begin(), w.end(), slot.w.p);
  slot.n_norm = n_norm;
  slot.staged = true;
}

template <class T>
void BackboneT<T>::upload_staged() {
  HostSlot& slot = slots_[next_slot_];
  M3_REQUIRE(slot.staged, "GpuBackbone::upload_staged", "no staged batch",
             "stage_batch comes first (each staged batch is uploaded once)");
  upload_tokens(slot.tok.p, slot.perm.p, slot.chunks.p, slot.token_chunks.p, slot.n_chunks);
  upload_targets(slot.tgt.p, slot.w.p, slot.n_norm);
  M3_CUDA_CHECK(cudaEventRecord(slot.copied.e, s_));
  slot.copying = true;
  slot.staged = false;
  next_slot_ ^= 1;
}

template <class T>
void BackboneT<T>::check_token_model(const char* where) const {
  M3_REQUIRE(cfg_.vocab_size > 0, where, "the config is no token model (vocab_size = 0)", "");
}

template <class T>
Idx BackboneT<T>::order_tokens(const char* where, const std::vector<std::int32_t>& tok,
                               std::int32_t* perm, std::int32_t* chunks,
                               std::int32_t* token_chunks) const {
  M3_REQUIRE(static_cast<Idx>(tok.size()) == d_.BT, where, "tokens have the wrong size",
             "got ", tok.size(), ", expected B*T = ", d_.BT);
  const Idx V = cfg_.vocab_size;
  std::vector<Idx> order, starts;
  ref::embed_order(tok.data(), d_.BT, V, order, starts);
  for (Idx i = 0; i < d_.BT; ++i) perm[i] = static_cast<std::int32_t>(order[i]);
  Idx n = 0;
  for (Idx v = 0; v < V; ++v) {
    token_chunks[v] = static_cast<std::int32_t>(n);
    for (Idx a = starts[v]; a < starts[v + 1]; a += kEmbedChunk, ++n) {
      chunks[3 * n] = static_cast<std::int32_t>(v);
      chunks[3 * n + 1] = static_cast<std::int32_t>(a);
      chunks[3 * n + 2] = static_cast<std::int32_t>(std::min(a + kEmbedChunk, starts[v + 1]));
    }
  }
  token_chunks[V] = static_cast<std::int32_t>(n);
  return n;
}

template <class T>
void BackboneT<T>::check_targets(const char* where, const std::vector<std::int32_t>& tgt,
                                 const std::vector<float>& w, double n_norm) const {
  const Idx V = cfg_.vocab_size;
  M3_REQUIRE(static_cast<Idx>(tgt.size()) == d_.BT && static_cast<Idx>(w.size()) == d_.BT,
             where, "targets and weights must have B*T entries", "got ", tgt.size(), " and ",
             w.size(), ", expected ", d_.BT);
  M3_REQUIRE(n_norm > 0, where, "no scored position (N = 0): the loss is undefined", "N=",
             n_norm);
  for (Idx r = 0; r < d_.BT; ++r) {
    M3_REQUIRE(tgt[r] >= 0 && tgt[r] < V, where, "target outside the vocabulary", "row ", r,
               ": target ", tgt[r], ", vocab_size ", V);
    M3_REQUIRE(std::isfinite(w[r]) && w[r] >= 0, where,
               "a position weight is not finite and >= 0", "row ", r, ": ", w[r]);
  }
}

template <class T>
void BackboneT<T>::upload_tokens(const std::int32_t* tok, const std::int32_t* perm,
                                 const std::int32_t* chunks, const std::int32_t* token_chunks,
                                 Idx n_chunks) {
  tok_.upload(tok, s_);
  perm_.upload(perm, s_);
  M3_CUDA_CHECK(cudaMemcpyAsync(chunks_.data(), chunks, static_cast<size_t>(n_chunks) * 12,
                                cudaMemcpyHostToDevice, s_));
  token_chunks_.upload(token_chunks, s_);
  n_chunks_ = n_chunks;
  tokens_ = true;
}

template <class T>
void BackboneT<T>::upload_targets(const std::int32_t* tgt, const float* w, double n_norm) {
  tgt_.upload(tgt, s_);
  tw_.upload(w, s_);
  n_norm_ = n_norm;
  targets_ = true;
}

#define M3_INSTANTIATE(T) \
  template void BackboneT<T>::set_tokens(const std::vector<std::int32_t>& tok); \
  template void BackboneT<T>::set_targets(const std::vector<std::int32_t>& tgt, \
                                          const std::vector<float>& w, double n_norm); \
  template void BackboneT<T>::stage_batch(const std::vector<std::int32_t>& tok, \
                                          const std::vector<std::int32_t>& tgt, \
                                          const std::vector<float>& w, double n_norm); \
  template void BackboneT<T>::upload_staged(); \
  template void BackboneT<T>::check_token_model(const char* where) const; \
  template Idx BackboneT<T>::order_tokens(const char* where, const std::vector<std::int32_t>& tok, \
                                          std::int32_t* perm, std::int32_t* chunks, \
                                          std::int32_t* token_chunks) const; \
  template void BackboneT<T>::check_targets(const char* where, \
                                            const std::vector<std::int32_t>& tgt, \
                                            const std::vector<float>& w, double n_norm) const; \
  template void BackboneT<T>::upload_tokens(const std::int32_t* tok, const std::int32_t* perm, \
                                            const std::int32_t* chunks, \
                                            const std::int32_t* token_chunks, Idx n_chunks); \
  template void BackboneT<T>::upload_targets(const std::int32_t* tgt, const float* w, \
                                             double n_norm);
M3_INSTANTIATE(float)
M3_INSTANTIATE(__nv_bfloat16)
M3_INSTANTIATE(__half)
#undef M3_INSTANTIATE

}  // namespace m3::gpu::detail
