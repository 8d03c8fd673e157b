#include "grid_factory.h"

#include "tessera/comm/functional.h"
#include "tessera/core/hash.h"
#include "tessera/nn/init.h"
#include "tessera/nn/layer_norm_2d.h"
#include "tessera/nn/parallel_dropout.h"
#include "tessera/nn/position_embedding_2d.h"
#include "tessera/nn/vocab_parallel_cross_entropy.h"

#include <ATen/ATen.h>

namespace tessera {
namespace nn {

GridFactory::GridFactory(const context::ParallelContextPtr& ctx, GridGroups groups)
    : g_(std::move(groups)),
      // Both kinds of activation are cut over the whole grid, so every dropout
      // stream differs between tensor ranks and data replicas alike.
      seed_(splitmix64(ctx->seed(context::ParallelMode::kTensor) ^
                       splitmix64(ctx->seed(context::ParallelMode::kData)))) {}

void GridFactory::check_batch(int64_t b) const {
  TORCH_CHECK(b % g_.batch->size() == 0, "the batch size ", b, " is not divisible by ", g_.batch->size(),
              ", the number of batch blocks of tensor mode ", g_.mode, " (", g_.blocks_rule,
              "); choose a batch (or micro-batch) size divisible by ", g_.batch->size());
}

at::Tensor GridFactory::scatter_activation(const at::Tensor& full) const {
  check_batch(full.size(0));
  return comm::split_along_dim(comm::split_along_dim(full, 0, g_.batch), -1, g_.hidden);
}

at::Tensor GridFactory::gather_activation(const at::Tensor& local) const {
  return comm::gather_along_dim(comm::gather_along_dim(local, -1, g_.hidden), 0, g_.batch);
}

at::Tensor GridFactory::positions(int64_t seq_len) const { return at::arange(seq_len, at::kLong); }

at::Tensor GridFactory::attention_positions(int64_t tokens) const { return at::arange(tokens, at::kLong); }

int64_t GridFactory::local_heads(int64_t heads) const {
  const int64_t q = g_.hidden->size();
  TORCH_CHECK(heads % q == 0, "the number of attention heads (", heads, ") is not divisible by q = ", q,
              " of tensor mode ", g_.mode, " (each hidden block holds whole heads); choose heads divisible by q");
  return heads / q;
}

torch::nn::AnyModule GridFactory::norm(int64_t dim, NormKind kind, double eps) {
  return torch::nn::AnyModule(LayerNorm2D(LayerNorm2DOptions(dim).eps(eps).rms(kind == NormKind::kRMSNorm), g_.hidden,
                                          g_.across, g_.depth));
}

ParamPlacement GridFactory::head_param(const at::Tensor& param) const {
  ParamPlacement p = replicated_placement(param);
  p.partial(g_.hidden->name(), g_.hidden).partial(g_.across->name(), g_.across);
  if (g_.depth && g_.depth->size() > 1) p.partial(g_.depth->name(), g_.depth);
  return p;
}

torch::nn::AnyModule GridFactory::position_embedding(int64_t context, int64_t dim) {
  return torch::nn::AnyModule(PositionEmbedding2D(PositionEmbedding2DOptions(context, dim).init_seed(draw_seed()),
                                                  g_.hidden, g_.across, g_.depth));
}

torch::nn::AnyModule GridFactory::dropout(double p, DropoutSite /*site*/) {
  return torch::nn::AnyModule(ParallelDropout(ParallelDropoutOptions(p, splitmix64(seed_ + (++dropouts_)))));
}

ParamPlacement GridFactory::replicated_param(const at::Tensor& param) const {
  ParamPlacement p = replicated_placement(param);
  p.replicate(g_.hidden->name(), g_.hidden).partial(g_.across->name(), g_.across);
  if (g_.depth && g_.depth->size() > 1) p.partial(g_.depth->name(), g_.depth);
  return p;
}

at::Tensor GridFactory::loss(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab) {
  check_batch(targets.size(0));
  const int64_t rows = targets.size(0) / g_.logit_batch->size();
  const at::Tensor mine = targets.narrow(0, g_.logit_batch->rank() * rows, rows);
  const at::Tensor sum = vocab_parallel_cross_entropy(
      logits.reshape({-1, logits.size(-1)}), mine.reshape({-1}), g_.vocab,
      VocabParallelCrossEntropyOptions().vocab_size(vocab).reduction(Reduction::kSum));
  const at::Tensor count = targets.ne(-100).sum().to(sum.scalar_type());
  return comm::reduce_from_group(sum / count, g_.logit_batch);
}

}  // namespace nn
}  // namespace tessera
