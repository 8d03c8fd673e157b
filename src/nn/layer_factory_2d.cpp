// The 2D (Optimus) and 2.5D (Tesseract) layer factory: every activation
// between blocks is [b/(q·d), s, h/q] (Note [2D and 2.5D layouts] in
// nn/linear_2d.h), every linear is a SUMMA product, and attention needs no
// communication at all: c_attn's output block j holds whole heads (c_attn's
// rows are grouped per head, Note [GPT full weights]), so each rank attends
// over its batch rows and its heads alone.
#include "tessera/comm/functional.h"
#include "tessera/core/hash.h"
#include "tessera/nn/init.h"
#include "tessera/nn/layer_factory.h"
#include "tessera/nn/layer_norm_2d.h"
#include "tessera/nn/linear_2d.h"
#include "tessera/nn/parallel_dropout.h"
#include "tessera/nn/position_embedding_2d.h"
#include "tessera/nn/shard.h"
#include "tessera/nn/summa.h"
#include "tessera/nn/vocab_embedding_2d.h"
#include "tessera/nn/vocab_parallel_cross_entropy.h"

#include <ATen/ATen.h>

namespace tessera {
namespace nn {
namespace {

using context::ParallelMode;

class Factory2D : public LayerFactory {
 public:
  explicit Factory2D(const context::ParallelContextPtr& ctx) {
    const bool deep = ctx->config().tensor_mode() == context::TensorMode::k2p5D;
    tensor_ = ctx->comm(ParallelMode::kTensor);
    row_ = ctx->comm(deep ? ParallelMode::k2p5DRow : ParallelMode::k2DRow);
    col_ = ctx->comm(deep ? ParallelMode::k2p5DCol : ParallelMode::k2DCol);
    if (deep) depth_ = ctx->comm(ParallelMode::k2p5DDep);
    // The batch is cut into q·d blocks: block i + q·k on rank (i, j, k),
    // which is that rank's local rank in 2.5D's xz group.
    batch_ = deep ? ctx->comm(ParallelMode::k2p5DXZ) : col_;
    mode_ = deep ? "2.5d" : "2d";
    // Both kinds of activation are cut over the whole grid here, so every
    // dropout stream differs between tensor ranks and data replicas alike.
    seed_ = splitmix64(ctx->seed(ParallelMode::kTensor) ^ splitmix64(ctx->seed(ParallelMode::kData)));
  }

  std::string mode() const override { return mode_; }
  const comm::CommunicatorPtr& tensor_group() const override { return tensor_; }

  at::Tensor scatter_activation(const at::Tensor& full) const override {
    check_batch(full.size(0));
    return comm::split_along_dim(comm::split_along_dim(full, 0, batch_), -1, row_);
  }
  at::Tensor gather_activation(const at::Tensor& local) const override {
    return comm::gather_along_dim(comm::gather_along_dim(local, -1, row_), 0, batch_);
  }
  at::Tensor positions(int64_t seq_len) const override { return at::arange(seq_len, at::kLong); }
  int64_t local_heads(int64_t heads) const override {
    TORCH_CHECK(heads % row_->size() == 0, "the number of attention heads (", heads, ") is not divisible by q = ",
                row_->size(), " of tensor mode ", mode_,
                " (each grid column holds whole heads); choose heads divisible by q");
    return heads / row_->size();
  }
  at::Tensor attention_positions(int64_t tokens) const override { return at::arange(tokens, at::kLong); }

  // Both roles are the same layer: a SUMMA product takes and gives the block layout.
  torch::nn::AnyModule linear(int64_t in, int64_t out, LinearRole /*role*/, bool bias) override {
    return torch::nn::AnyModule(
        Linear2D(Linear2DOptions(in, out).bias(bias).init_seed(draw_seed()), row_, col_, depth_));
  }
  torch::nn::AnyModule vocab_embedding(int64_t vocab, int64_t dim) override {
    return torch::nn::AnyModule(VocabEmbedding2D(
        VocabEmbedding2DOptions(vocab, dim).full_batch(true).init_seed(draw_seed()), row_, col_, depth_));
  }
  torch::nn::AnyModule layer_norm(int64_t dim) override {
    return torch::nn::AnyModule(LayerNorm2D(LayerNorm2DOptions(dim), row_, col_, depth_));
  }
  torch::nn::AnyModule position_embedding(int64_t context, int64_t dim) override {
    return torch::nn::AnyModule(
        PositionEmbedding2D(PositionEmbedding2DOptions(context, dim).init_seed(draw_seed()), row_, col_, depth_));
  }
  torch::nn::AnyModule dropout(double p, DropoutSite /*site*/) override {
    return torch::nn::AnyModule(ParallelDropout(ParallelDropoutOptions(p, splitmix64(seed_ + (++dropouts_)))));
  }

  // A parameter no 2D layer describes sees this rank's batch rows only.
  ParamPlacement replicated_param(const at::Tensor& param) const override {
    ParamPlacement p = replicated_placement(param);
    p.replicate(row_->name(), row_).partial(col_->name(), col_);
    if (depth_ && depth_->size() > 1) p.partial(depth_->name(), depth_);
    return p;
  }

  at::Tensor lm_logits(const at::Tensor& hidden, torch::nn::AnyModule& vocab_embedding) override {
    auto e = std::dynamic_pointer_cast<VocabEmbedding2DImpl>(vocab_embedding.ptr());
    TORCH_CHECK(e != nullptr, "lm_logits needs a vocabulary embedding made by this factory");
    return summa_matmul_nt(hidden, e->weight, row_, col_);  // [b/(q·d), s, V_p/q]: vocabulary block j
  }

  // Each grid row's sum over its tokens, divided by the whole batch's count
  // of targets (the full targets are on every rank) and summed over the
  // batch group: every rank holds the mean, and backward gives each rank
  // the gradient of its own tokens' share.
  at::Tensor loss(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab) override {
    check_batch(targets.size(0));
    const int64_t rows = targets.size(0) / batch_->size();
    const at::Tensor mine = targets.narrow(0, batch_->rank() * rows, rows);
    const at::Tensor sum = vocab_parallel_cross_entropy(
        logits.reshape({-1, logits.size(-1)}), mine.reshape({-1}), row_,
        VocabParallelCrossEntropyOptions().vocab_size(vocab).reduction(Reduction::kSum));
    const at::Tensor count = targets.ne(-100).sum().to(sum.scalar_type());
    return comm::reduce_from_group(sum / count, batch_);
  }

 private:
  void check_batch(int64_t b) const {
    TORCH_CHECK(b % batch_->size() == 0, "the batch size ", b, " is not divisible by ", batch_->size(),
                ", the number of batch blocks of tensor mode ", mode_,
                " (q*depth); choose a batch (or micro-batch) size divisible by ", batch_->size());
  }

  comm::CommunicatorPtr tensor_, row_, col_, depth_, batch_;
  std::string mode_;
  uint64_t seed_ = 0;
  uint64_t dropouts_ = 0;
};

}  // namespace

std::shared_ptr<LayerFactory> make_2d_factory(const context::ParallelContextPtr& ctx) {
  TORCH_CHECK(ctx != nullptr, "make_2d_factory: the ParallelContext is null");
  const auto mode = ctx->config().tensor_mode();
  TORCH_CHECK(mode == context::TensorMode::k2D || mode == context::TensorMode::k2p5D,
              "make_2d_factory: the context's tensor mode is ", context::tensor_mode_name(mode),
              ", 2d or 2.5d expected");
  return std::make_shared<Factory2D>(ctx);
}

}  // namespace nn
}  // namespace tessera
