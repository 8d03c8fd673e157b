#include "tessera/nn/vocab_parallel_cross_entropy.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <limits>

namespace tessera {
namespace nn {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Note [Vocabulary-parallel cross entropy]
// loss = log Σ_v exp(z_v) − z_t over the full vocabulary, with z split by
// columns over the group (Megatron-LM's algorithm):
// 1. m = max_v z_v: local max, all-reduce(max). Subtracting it keeps exp()
//    in range for any logits; m is a constant for the gradient (the loss does
//    not depend on it), so no backward flows through the max.
// 2. z_t − m: the rank whose columns hold target t gathers it, the others
//    contribute 0; Σ_v exp(z_v − m): local sums. Both are summed over the group
//    in one all-reduce of a [2, ...] tensor.
// 3. Backward is local: ∂loss/∂z_v = softmax_v − [v == t], restricted to this
//    rank's columns, with the softmax saved by forward.
// Padded columns (global index >= vocab_size) are set to −inf before step 1,
// so they add exp(−inf) = 0 to the sum and get a zero gradient, whatever the
// padded logits hold. Ignored targets get loss 0 and gradient 0, and mean
// divides by the number of targets that are not ignored, as torch does.
struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& target,
                            comm::CommunicatorPtr group, int64_t vocab_size, int64_t ignore_index, int64_t reduction) {
    const int64_t local_vocab = logits.size(-1);
    const int64_t start = group->rank() * local_vocab;
    const int64_t end = start + local_vocab;
    // Half-precision exponentials and sums lose the loss: compute in float32 at least.
    const at::ScalarType compute_type = at::promote_types(logits.scalar_type(), at::kFloat);

    at::Tensor z = logits.to(compute_type);
    if (vocab_size < end) {
      const int64_t real = std::max<int64_t>(vocab_size - start, 0);
      z = z.clone();  // never write into the caller's logits
      z.narrow(-1, real, local_vocab - real).fill_(-std::numeric_limits<double>::infinity());
    }

    at::Tensor max = z.amax(-1).contiguous();
    group->all_reduce(max, {comm::ReduceOp::kMax});
    at::Tensor shifted = z - max.unsqueeze(-1);

    const at::Tensor valid = target != ignore_index;
    const at::Tensor in_range = valid.logical_and((target >= start).logical_and_(target < end));
    const at::Tensor not_in_range = in_range.logical_not();
    const at::Tensor local_target = (target - start).masked_fill_(not_in_range, 0).unsqueeze(-1);
    const at::Tensor predicted = shifted.gather(-1, local_target).squeeze(-1).masked_fill_(not_in_range, 0);

    at::Tensor softmax = shifted.exp_();  // shifted is not needed any more
    at::Tensor sums = at::stack({predicted, softmax.sum(-1)});
    group->all_reduce(sums);
    const at::Tensor sum_exp = sums[1];
    softmax.div_(sum_exp.unsqueeze(-1));
    const at::Tensor loss = (sum_exp.log() - sums[0]).masked_fill_(valid.logical_not(), 0);

    const at::Tensor count = valid.sum().to(compute_type);
    ctx->save_for_backward({softmax, local_target, in_range, valid, count});
    ctx->saved_data["reduction"] = reduction;
    ctx->saved_data["logits_type"] = logits.scalar_type();

    at::Tensor out;
    switch (static_cast<Reduction>(reduction)) {
      case Reduction::kNone:
        out = loss;
        break;
      case Reduction::kSum:
        out = loss.sum();
        break;
      case Reduction::kMean:
        out = loss.sum() / count;  // NaN when every target is ignored, as in torch
        break;
    }
    return out.to(logits.scalar_type());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& softmax = saved[0];
    const at::Tensor& local_target = saved[1];
    const at::Tensor& in_range = saved[2];
    const at::Tensor& valid = saved[3];
    const at::Tensor& count = saved[4];

    // softmax − one_hot(target) on this rank's columns; out of place, so the
    // graph can be run backward again (retain_graph).
    at::Tensor grad = softmax.scatter_add(-1, local_target, in_range.to(softmax.scalar_type()).neg_().unsqueeze(-1));
    grad.masked_fill_(valid.logical_not().unsqueeze(-1), 0);

    const at::Tensor g = grad_outputs[0].to(softmax.scalar_type());
    switch (static_cast<Reduction>(ctx->saved_data["reduction"].toInt())) {
      case Reduction::kNone:
        grad.mul_(g.unsqueeze(-1));
        break;
      case Reduction::kSum:
        grad.mul_(g);
        break;
      case Reduction::kMean:
        grad.mul_(g / count);
        break;
    }
    return {grad.to(ctx->saved_data["logits_type"].toScalarType()),
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor()};
  }
};

}  // namespace

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits_shard, const at::Tensor& target,
                                        const comm::CommunicatorPtr& tensor_group,
                                        const VocabParallelCrossEntropyOptions& options) {
  TORCH_CHECK(tensor_group != nullptr, "vocab_parallel_cross_entropy needs a tensor-parallel communicator");
  TORCH_CHECK(logits_shard.dim() >= 1 && logits_shard.is_floating_point(),
              "vocab_parallel_cross_entropy: logits must be a floating-point tensor [..., vocabulary shard], got ",
              logits_shard.scalar_type(), " of shape ", logits_shard.sizes());
  TORCH_CHECK(target.sizes() == logits_shard.sizes().slice(0, logits_shard.dim() - 1),
              "vocab_parallel_cross_entropy: target of shape ", target.sizes(), " given for logits of shape ",
              logits_shard.sizes(), "; the target must have the logits' shape without the last (vocabulary) dimension");
  TORCH_CHECK(c10::isIntegralType(target.scalar_type(), /*includeBool=*/false),
              "vocab_parallel_cross_entropy: target must hold integer class ids, got ", target.scalar_type());
  const int64_t padded_vocab = logits_shard.size(-1) * tensor_group->size();
  const int64_t vocab = options.vocab_size() == 0 ? padded_vocab : options.vocab_size();
  TORCH_CHECK(vocab > 0 && vocab <= padded_vocab, "vocab_parallel_cross_entropy: vocab_size ", options.vocab_size(),
              " is not in [1, ", padded_vocab, "], the padded vocabulary of the shards (", logits_shard.size(-1),
              " columns on each of ", tensor_group->size(),
              " ranks); pass the true vocabulary size, or 0 when no column is padding");
  TORCH_CHECK(options.reduction() == Reduction::kMean || options.reduction() == Reduction::kSum ||
                  options.reduction() == Reduction::kNone,
              "vocab_parallel_cross_entropy: unknown reduction ", static_cast<int>(options.reduction()));

  // The target is replicated, so every rank rejects it alike, before any collective.
  const at::Tensor ids = target.to(at::kLong);
  const at::Tensor bad = (ids != options.ignore_index()).logical_and_((ids < 0).logical_or_(ids >= vocab));
  if (bad.any().item<bool>()) {
    TORCH_CHECK(false, "vocab_parallel_cross_entropy: target ", ids.masked_select(bad)[0].item<int64_t>(),
                " is out of range; targets must lie in [0, vocab_size = ", vocab, ") or equal ignore_index (",
                options.ignore_index(), ")");
  }
  return VocabParallelCrossEntropy::apply(logits_shard, ids, tensor_group, vocab, options.ignore_index(),
                                          static_cast<int64_t>(options.reduction()));
}

}  // namespace nn
}  // namespace tessera
