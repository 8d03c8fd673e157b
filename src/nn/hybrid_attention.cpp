// Hybrid sequence parallelism: Ulysses inside a group, ring attention across
// groups (Note [Hybrid sequence layout] in sequence_layout.cpp).
#include "tessera/comm/functional.h"
#include "tessera/nn/sequence_attention.h"

#include "sequence_checks.h"

#include <ATen/ATen.h>

namespace tessera {
namespace nn {

HybridAttentionImpl::HybridAttentionImpl(int64_t head_dim, ParallelDropout dropout, comm::CommunicatorPtr ulysses_group,
                                         comm::CommunicatorPtr ring_group, SequenceLayout layout)
    : head_dim_(head_dim), ulysses_(std::move(ulysses_group)), layout_(layout) {
  TORCH_CHECK(ulysses_ != nullptr && ring_group != nullptr && ulysses_->size() == layout_.ulysses() &&
                  ulysses_->rank() == layout_.rank() % layout_.ulysses(),
              "HybridAttention: the Ulysses group (", ulysses_ ? ulysses_->size() : 0,
              " ranks) and the layout's Ulysses size ", layout_.ulysses(), " must describe the same ranks");
  ring_ = register_module("ring",
                          RingAttention(head_dim_, std::move(dropout), std::move(ring_group), layout_.ring_layout()));
}

at::Tensor HybridAttentionImpl::forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        const at::Tensor& positions) {
  const int64_t seq_len = check_sequence_attention("HybridAttention", q, k, v, positions, head_dim_, layout_);
  const int u = ulysses_->size();
  TORCH_CHECK(q.size(1) % u == 0, "HybridAttention: ", q.size(1), " heads (per tensor rank) do not divide over the ", u,
              " ranks of a Ulysses group; choose a sequence ulysses size that divides the heads");
  // [3, b, heads, n, d] -> [3, b, heads/U, n·U, d]: ring rank r's tokens in order.
  const at::Tensor qkv = comm::all_to_all_along_dims(at::stack({q, k, v}), 2, 3, ulysses_);
  const SequenceLayout ring = layout_.ring_layout();
  const at::Tensor out = ring_->forward(qkv[0], qkv[1], qkv[2], ring.positions(seq_len).to(q.device()));
  return comm::all_to_all_along_dims(out, 2, 1, ulysses_);
}

}  // namespace nn
}  // namespace tessera
