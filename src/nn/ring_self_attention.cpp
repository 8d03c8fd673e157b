// Ring self-attention (Li et al., arXiv 2105.13120): keys around the ring
// to build each query's full score row, then values around the ring.
#include "tessera/comm/p2p.h"
#include "tessera/nn/sequence_attention.h"

#include "sequence_checks.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <cmath>
#include <limits>
#include <vector>

namespace tessera {
namespace nn {
namespace {

// Note [Ring self-attention]
// The paper's two ring products, each an autograd function over
// comm::ring_pass (Note [Ring pass]):
//   scores = q·Kᵀ   [b, h, n, S]: the key blocks pass around the ring; in
//                   backward dq = Σ_j dS_j·k_j (keys around again) and
//                   dk_j = dS_jᵀ·q returns to k_j's owner;
//   out = P·V       the value blocks pass around; in backward dP_j = dO·v_jᵀ
//                   (values around again) and dv_j = P_jᵀ·dO returns.
// Between them the mask, softmax and dropout are ordinary autograd on the
// [b, h, n, S] rows, which this form keeps (1/P of the serial S x S), as the
// paper does. Score columns are in rank order (SequenceLayout::gathered_positions).

struct GroupHolder : torch::CustomClassHolder {
  explicit GroupHolder(comm::CommunicatorPtr g) : group(std::move(g)) {}
  comm::CommunicatorPtr group;
};

comm::Communicator& group_of(torch::autograd::AutogradContext* ctx) {
  auto holder = ctx->saved_data["group"].toCapsule();
  return *static_cast<GroupHolder*>(holder.get())->group;
}

struct RingScores : torch::autograd::Function<RingScores> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            comm::CommunicatorPtr group) {
    std::vector<at::Tensor> blocks(group->size());
    comm::ring_pass(*group, k, [&](int src, const at::Tensor& block, const comm::RingProgress&) {
      blocks[src] = at::matmul(q, block.transpose(-2, -1));
    });
    ctx->save_for_backward({q, k});
    ctx->saved_data["group"] = at::IValue::make_capsule(c10::make_intrusive<GroupHolder>(std::move(group)));
    return at::cat(blocks, -1);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1];
    const at::Tensor& dscores = grads[0];
    const int64_t n = k.size(2);
    at::Tensor dq = at::zeros_like(q);
    at::Tensor dk = comm::ring_pass_reduce(group_of(ctx), k.contiguous(),
                                           [&](int src, const at::Tensor& block, const comm::RingProgress&) {
                                             const at::Tensor ds = dscores.narrow(-1, src * n, n);
                                             dq.add_(at::matmul(ds, block));
                                             return at::matmul(ds.transpose(-2, -1), q).contiguous();
                                           });
    return {dq, dk, at::Tensor()};
  }
};

struct RingValues : torch::autograd::Function<RingValues> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& probs, const at::Tensor& v,
                            comm::CommunicatorPtr group) {
    const int64_t n = v.size(2);
    at::Tensor out = at::zeros({probs.size(0), probs.size(1), probs.size(2), v.size(3)}, v.options());
    comm::ring_pass(*group, v, [&](int src, const at::Tensor& block, const comm::RingProgress&) {
      out.add_(at::matmul(probs.narrow(-1, src * n, n), block));
    });
    ctx->save_for_backward({probs, v});
    ctx->saved_data["group"] = at::IValue::make_capsule(c10::make_intrusive<GroupHolder>(std::move(group)));
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &probs = saved[0], &v = saved[1];
    const at::Tensor& dout = grads[0];
    const int64_t n = v.size(2);
    at::Tensor dprobs = at::empty_like(probs);
    at::Tensor dv = comm::ring_pass_reduce(
        group_of(ctx), v.contiguous(), [&](int src, const at::Tensor& block, const comm::RingProgress&) {
          dprobs.narrow(-1, src * n, n).copy_(at::matmul(dout, block.transpose(-2, -1)));
          return at::matmul(probs.narrow(-1, src * n, n).transpose(-2, -1), dout).contiguous();
        });
    return {dprobs, dv, at::Tensor()};
  }
};

}  // namespace

RingSelfAttentionImpl::RingSelfAttentionImpl(int64_t head_dim, torch::nn::AnyModule dropout,
                                             comm::CommunicatorPtr group, SequenceLayout layout)
    : head_dim_(head_dim), dropout_(std::move(dropout)), group_(std::move(group)), layout_(layout) {
  TORCH_CHECK(head_dim_ > 0, "RingSelfAttention: head_dim must be positive, got ", head_dim_);
  TORCH_CHECK(group_ != nullptr && group_->size() == layout_.size() && group_->rank() == layout_.rank(),
              "RingSelfAttention: the sequence group and the layout must describe the same ranks");
  register_module("dropout", dropout_.ptr());
}

at::Tensor RingSelfAttentionImpl::forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                          const at::Tensor& positions) {
  const int64_t seq_len = check_sequence_attention("RingSelfAttention", q, k, v, positions, head_dim_, layout_);
  at::Tensor scores = RingScores::apply(q, k, group_) / std::sqrt(static_cast<double>(head_dim_));
  const at::Tensor qp = positions.to(q.device(), at::kLong);
  const at::Tensor kp = layout_.gathered_positions(seq_len).to(q.device());
  scores = scores.masked_fill(kp.unsqueeze(0) > qp.unsqueeze(1), -std::numeric_limits<float>::infinity());
  return RingValues::apply(dropout_.forward(at::softmax(scores, -1)), v, group_);
}

}  // namespace nn
}  // namespace tessera
