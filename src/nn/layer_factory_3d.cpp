// The 3D layer factory (arXiv 2105.14450): block layout A [b/q², s, h/q],
// column-role linears to layout B and row-role linears back (Note [3D
// layouts] in nn/linear_3d.h). Attention needs no communication: c_attn's
// output (layout B) holds whole heads in its feature block j. Layer norm
// and the position embedding are the 2D layers over (row = 3d_output,
// col = 3d_input, depth = 3d_weight): layout A's hidden block is 3d_output's
// index and the other two groups hold other batch rows, exactly the roles
// of 2D's row, col and depth.
#include "tessera/comm/functional.h"
#include "tessera/core/hash.h"
#include "tessera/nn/init.h"
#include "tessera/nn/layer_factory.h"
#include "tessera/nn/layer_norm_2d.h"
#include "tessera/nn/linear_3d.h"
#include "tessera/nn/parallel_dropout.h"
#include "tessera/nn/position_embedding_2d.h"
#include "tessera/nn/vocab_embedding_3d.h"
#include "tessera/nn/vocab_parallel_cross_entropy.h"

#include <ATen/ATen.h>

namespace tessera {
namespace nn {
namespace {

using context::ParallelMode;

class Factory3D : public LayerFactory {
 public:
  explicit Factory3D(const context::ParallelContextPtr& ctx)
      : tensor_(ctx->comm(ParallelMode::kTensor)),
        input_(ctx->comm(ParallelMode::k3DInput)),
        weight_(ctx->comm(ParallelMode::k3DWeight)),
        output_(ctx->comm(ParallelMode::k3DOutput)),
        batch_a_(ctx->comm(ParallelMode::k3DInputWeight)),
        batch_b_(ctx->comm(ParallelMode::k3DOutputWeight)),
        seed_(splitmix64(ctx->seed(ParallelMode::kTensor) ^ splitmix64(ctx->seed(ParallelMode::kData)))) {}

  std::string mode() const override { return "3d"; }
  const comm::CommunicatorPtr& tensor_group() const override { return tensor_; }

  at::Tensor scatter_activation(const at::Tensor& full) const override {
    check_batch(full.size(0));
    return comm::split_along_dim(comm::split_along_dim(full, 0, batch_a_), -1, output_);
  }
  at::Tensor gather_activation(const at::Tensor& local) const override {
    return comm::gather_along_dim(comm::gather_along_dim(local, -1, output_), 0, batch_a_);
  }
  at::Tensor positions(int64_t seq_len) const override { return at::arange(seq_len, at::kLong); }
  int64_t local_heads(int64_t heads) const override {
    TORCH_CHECK(heads % input_->size() == 0, "the number of attention heads (", heads, ") is not divisible by q = ",
                input_->size(), " of tensor mode 3d (each feature block holds whole heads); choose heads divisible by q");
    return heads / input_->size();
  }
  at::Tensor attention_positions(int64_t tokens) const override { return at::arange(tokens, at::kLong); }

  torch::nn::AnyModule linear(int64_t in, int64_t out, LinearRole role, bool bias) override {
    const bool column = role == LinearRole::kColumn;  // layout A -> B; a row-role layer swaps the groups back
    return torch::nn::AnyModule(Linear3D(Linear3DOptions(in, out).bias(bias).init_seed(draw_seed()),
                                         column ? input_ : output_, weight_, column ? output_ : input_));
  }
  torch::nn::AnyModule vocab_embedding(int64_t vocab, int64_t dim) override {
    return torch::nn::AnyModule(
        VocabEmbedding3D(VocabEmbedding3DOptions(vocab, dim).init_seed(draw_seed()), input_, weight_, output_));
  }
  torch::nn::AnyModule layer_norm(int64_t dim) override {
    return torch::nn::AnyModule(LayerNorm2D(LayerNorm2DOptions(dim), output_, input_, weight_));
  }
  torch::nn::AnyModule position_embedding(int64_t context, int64_t dim) override {
    return torch::nn::AnyModule(PositionEmbedding2D(PositionEmbedding2DOptions(context, dim).init_seed(draw_seed()),
                                                    output_, input_, weight_));
  }
  torch::nn::AnyModule dropout(double p, DropoutSite /*site*/) override {
    // Both layouts are cut over the whole cube: one stream per rank.
    return torch::nn::AnyModule(ParallelDropout(ParallelDropoutOptions(p, splitmix64(seed_ + (++dropouts_)))));
  }

  // A parameter no 3D layer describes, on layout A: the other hidden blocks
  // are on 3d_output; the other two groups hold other batch rows.
  ParamPlacement replicated_param(const at::Tensor& param) const override {
    ParamPlacement p = replicated_placement(param);
    p.replicate(output_->name(), output_).partial(input_->name(), input_).partial(weight_->name(), weight_);
    return p;
  }

  at::Tensor lm_logits(const at::Tensor& hidden, torch::nn::AnyModule& vocab_embedding) override {
    auto e = std::dynamic_pointer_cast<VocabEmbedding3DImpl>(vocab_embedding.ptr());
    TORCH_CHECK(e != nullptr, "lm_logits needs a vocabulary embedding made by this factory");
    return e->logits(hidden);  // layout B: [b/q², s, V_p/q], vocabulary block j
  }

  // As in 2D: each batch sub-block's sum of token losses (the vocabulary
  // blocks of layout B are on 3d_input), over the whole batch's count, summed
  // over the sub-blocks (3d_output_weight) with an identity backward.
  at::Tensor loss(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab) override {
    check_batch(targets.size(0));
    const int64_t rows = targets.size(0) / batch_b_->size();
    const at::Tensor mine = targets.narrow(0, batch_b_->rank() * rows, rows);
    const at::Tensor sum = vocab_parallel_cross_entropy(
        logits.reshape({-1, logits.size(-1)}), mine.reshape({-1}), input_,
        VocabParallelCrossEntropyOptions().vocab_size(vocab).reduction(Reduction::kSum));
    const at::Tensor count = targets.ne(-100).sum().to(sum.scalar_type());
    return comm::reduce_from_group(sum / count, batch_b_);
  }

 private:
  void check_batch(int64_t b) const {
    TORCH_CHECK(b % batch_a_->size() == 0, "the batch size ", b, " is not divisible by ", batch_a_->size(),
                ", the number of batch sub-blocks of tensor mode 3d (q*q); choose a batch (or micro-batch) size "
                "divisible by ",
                batch_a_->size());
  }

  comm::CommunicatorPtr tensor_, input_, weight_, output_, batch_a_, batch_b_;
  uint64_t seed_ = 0;
  uint64_t dropouts_ = 0;
};

}  // namespace

std::shared_ptr<LayerFactory> make_3d_factory(const context::ParallelContextPtr& ctx) {
  TORCH_CHECK(ctx != nullptr, "make_3d_factory: the ParallelContext is null");
  TORCH_CHECK(ctx->config().tensor_mode() == context::TensorMode::k3D, "make_3d_factory: the context's tensor mode is ",
              context::tensor_mode_name(ctx->config().tensor_mode()), ", 3d expected");
  return std::make_shared<Factory3D>(ctx);
}

}  // namespace nn
}  // namespace tessera
