// Ring attention: an online softmax over key/value blocks passed around the
// sequence group (Note [Ring attention] in tiled_attention.cpp).
#include "tessera/comm/p2p.h"
#include "tessera/nn/sequence_attention.h"

#include "sequence_checks.h"
#include "tiled_attention.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <vector>

namespace tessera {
namespace nn {
namespace {

using detail::TokenRun;

// A rank's runs of positions under the layout: one chunk (contiguous) or two (zigzag).
std::vector<TokenRun> chunks_of(const SequenceLayout& layout, int64_t seq_len, int rank) {
  if (layout.split() == context::SequenceSplit::kContiguous) {
    const int64_t n = seq_len / layout.size();
    return {{0, n, layout.first_position(seq_len, rank)}};
  }
  const int64_t c = seq_len / (2 * layout.size());
  return {{0, c, rank * c}, {c, c, (2 * int64_t{layout.size()} - 1 - rank) * c}};
}

struct RingAttentionFunction : torch::autograd::Function<RingAttentionFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, comm::CommunicatorPtr group, SequenceLayout layout, double drop,
                            int64_t drop_seed) {
    const auto ct = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    const at::Tensor qc = q.to(ct).contiguous();
    const at::Tensor kv = at::stack({k, v}).to(ct).contiguous();
    const int64_t seq_len = q.size(2) * layout.size();
    const int64_t tile = ring_tile_tokens(q.size(0) * q.size(1));
    const auto queries = detail::tiles_of(chunks_of(layout, seq_len, layout.rank()), tile);
    detail::OnlineSoftmax softmax(qc);
    comm::ring_pass(*group, kv, [&](int src, const at::Tensor& block, const comm::RingProgress& progress) {
      const detail::BlockDropout dropout{drop, static_cast<uint64_t>(drop_seed), src};
      softmax.extend(qc, block, queries, detail::tiles_of(chunks_of(layout, seq_len, src), tile), dropout, progress);
    });
    const auto [out, lse] = softmax.finish();
    ctx->save_for_backward({qc, kv, out, lse});
    ctx->saved_data["group"] = at::IValue::make_capsule(c10::make_intrusive<GroupHolder>(group, layout));
    ctx->saved_data["drop"] = drop;
    ctx->saved_data["drop_seed"] = drop_seed;
    ctx->saved_data["dtypes"] = std::vector<int64_t>{static_cast<int64_t>(q.scalar_type()),
                                                     static_cast<int64_t>(k.scalar_type()),
                                                     static_cast<int64_t>(v.scalar_type())};
    return out.to(q.scalar_type());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& qc = saved[0];
    const at::Tensor& kv = saved[1];
    const at::Tensor& out = saved[2];
    const at::Tensor& lse = saved[3];
    auto holder = ctx->saved_data["group"].toCapsule();
    auto* g = static_cast<GroupHolder*>(holder.get());
    const SequenceLayout& layout = g->layout;
    const auto dtypes = ctx->saved_data["dtypes"].toIntVector();
    const at::Tensor dout = grads[0].to(qc.scalar_type());
    const int64_t seq_len = qc.size(2) * layout.size();
    const double drop = ctx->saved_data["drop"].toDouble();
    const auto drop_seed = static_cast<uint64_t>(ctx->saved_data["drop_seed"].toInt());

    const at::Tensor delta = (dout * out).sum(-1);
    at::Tensor dq = at::zeros_like(qc);
    const int64_t tile = ring_tile_tokens(qc.size(0) * qc.size(1));
    const auto queries = detail::tiles_of(chunks_of(layout, seq_len, layout.rank()), tile);
    at::Tensor dkv = comm::ring_pass_reduce(
        *g->group, kv, [&](int src, const at::Tensor& block, const comm::RingProgress& progress) {
          const detail::BlockDropout dropout{drop, drop_seed, src};
          return detail::attention_block_backward(qc, block, dout, delta, lse, queries,
                                                  detail::tiles_of(chunks_of(layout, seq_len, src), tile), dropout, dq,
                                                  progress);
        });
    auto as = [&](const at::Tensor& t, size_t i) { return t.to(static_cast<at::ScalarType>(dtypes[i])); };
    return {as(dq, 0), as(dkv[0], 1), as(dkv[1], 2), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }

  struct GroupHolder : torch::CustomClassHolder {
    GroupHolder(comm::CommunicatorPtr g, SequenceLayout l) : group(std::move(g)), layout(l) {}
    comm::CommunicatorPtr group;
    SequenceLayout layout;
  };
};

}  // namespace

RingAttentionImpl::RingAttentionImpl(int64_t head_dim, ParallelDropout dropout, comm::CommunicatorPtr group,
                                     SequenceLayout layout)
    : head_dim_(head_dim), dropout_(std::move(dropout)), group_(std::move(group)), layout_(layout) {
  TORCH_CHECK(!dropout_.is_empty(), "RingAttention: the dropout layer is null (give one with p = 0 for none)");
  register_module("dropout", dropout_);
  TORCH_CHECK(head_dim_ > 0, "RingAttention: head_dim must be positive, got ", head_dim_);
  TORCH_CHECK(group_ != nullptr && group_->size() == layout_.size() && group_->rank() == layout_.rank(),
              "RingAttention: the sequence group and the layout must describe the same ranks");
}

at::Tensor RingAttentionImpl::forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& positions) {
  check_sequence_attention("RingAttention", q, k, v, positions, head_dim_, layout_);
  const double drop = is_training() ? dropout_->options.p() : 0.0;
  const int64_t seed = drop > 0 ? static_cast<int64_t>(dropout_->draw_seed()) : 0;
  return RingAttentionFunction::apply(q, k, v, group_, layout_, drop, seed);
}

}  // namespace nn
}  // namespace tessera
