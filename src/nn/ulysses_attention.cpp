// Ulysses: trade the sequence split for a head split around local attention.
#include "tessera/comm/functional.h"
#include "tessera/nn/attention.h"
#include "tessera/nn/sequence_attention.h"

#include "sequence_checks.h"

#include <ATen/ATen.h>

namespace tessera {
namespace nn {

UlyssesAttentionImpl::UlyssesAttentionImpl(int64_t head_dim, torch::nn::AnyModule dropout,
                                           comm::CommunicatorPtr group, SequenceLayout layout)
    : head_dim_(head_dim), group_(std::move(group)), layout_(layout) {
  TORCH_CHECK(group_ != nullptr && group_->size() == layout_.size() && group_->rank() == layout_.rank(),
              "UlyssesAttention: the sequence group and the layout must describe the same ranks");
  local_ = register_module("local", LocalAttention(head_dim_, std::move(dropout)));
}

at::Tensor UlyssesAttentionImpl::forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         const at::Tensor& positions) {
  const int64_t seq_len = check_sequence_attention("UlyssesAttention", q, k, v, positions, head_dim_, layout_);
  const int p = group_->size();
  TORCH_CHECK(q.size(1) % p == 0, "UlyssesAttention: ", q.size(1),
              " heads (per tensor rank) do not divide over ", p,
              " sequence ranks; Ulysses gives each sequence rank whole heads: choose a sequence size that divides the "
              "heads, or sequence mode ring or rsa");
  // q, k and v travel in one all-to-all: [3, b, heads, n, d] -> [3, b, heads/P, S, d],
  // the tokens in rank order (layout_.gathered_positions).
  at::Tensor qkv = comm::all_to_all_along_dims(at::stack({q, k, v}), 2, 3, group_);
  // Attention masks by position, so the gathered order needs no sorting.
  at::Tensor out = local_->forward(qkv[0], qkv[1], qkv[2], layout_.gathered_positions(seq_len).to(q.device()));
  return comm::all_to_all_along_dims(out, 2, 1, group_);
}

}  // namespace nn
}  // namespace tessera
