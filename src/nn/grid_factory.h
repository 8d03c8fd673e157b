#pragma once
// What the 2D/2.5D and 3D layer factories share (src/nn/layer_factory_2d_2p5d.cpp,
// layer_factory_3d.cpp). In both, the block layout cuts the hidden dimension
// over one group and the batch over the others; layer norm and position
// embedding are the 2D layers over (hidden group, the two batch-side groups);
// every activation is cut over the whole grid, so dropout draws one stream per
// rank; the loss sums each batch block's token losses over the vocabulary
// group and over the batch blocks. A mode adds its linears, its vocabulary
// embedding and its LM head.
#include "tessera/nn/layer_factory.h"

#include <string>

namespace tessera {
namespace nn {

struct GridGroups {
  comm::CommunicatorPtr tensor;
  comm::CommunicatorPtr hidden;       // the block layout's hidden blocks (2D row, 3D output)
  comm::CommunicatorPtr across;       // holds other batch rows (2D col, 3D input)
  comm::CommunicatorPtr depth;        // holds other batch rows too (2.5D depth, 3D weight); may be null
  comm::CommunicatorPtr batch;        // the block layout's batch blocks, in batch order
  comm::CommunicatorPtr vocab;        // the logits' vocabulary blocks
  comm::CommunicatorPtr logit_batch;  // the logits' batch blocks, in batch order
  std::string mode;                   // "2d", "2.5d", "3d"
  std::string blocks_rule;            // how the batch blocks are counted, for messages: "q*depth", "q*q"
};

class GridFactory : public LayerFactory {
 public:
  GridFactory(const context::ParallelContextPtr& ctx, GridGroups groups);

  std::string mode() const override { return g_.mode; }
  const comm::CommunicatorPtr& tensor_group() const override { return g_.tensor; }
  at::Tensor scatter_activation(const at::Tensor& full) const override;
  at::Tensor gather_activation(const at::Tensor& local) const override;
  at::Tensor positions(int64_t seq_len) const override;
  // Heads are split over the hidden group's q blocks.
  int64_t local_heads(int64_t heads) const override;
  int64_t head_split() const override { return g_.hidden->size(); }
  at::Tensor attention_positions(int64_t tokens) const override;
  torch::nn::AnyModule norm(int64_t dim, NormKind kind, double eps) override;
  torch::nn::AnyModule position_embedding(int64_t context, int64_t dim) override;
  torch::nn::AnyModule dropout(double p, DropoutSite site) override;
  // Replicated over the hidden group, Partial over the batch-side groups.
  ParamPlacement replicated_param(const at::Tensor& param) const override;
  // Attention's activations differ over every group of the grid.
  ParamPlacement head_param(const at::Tensor& param) const override;
  // Each batch block's sum of token losses, divided by the whole batch's
  // count of targets (the full targets are on every rank) and summed over
  // the logits' batch blocks with an identity backward: every rank holds the
  // mean, and each backpropagates its own tokens' share.
  at::Tensor loss(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab) override;

 protected:
  void check_batch(int64_t b) const;
  const GridGroups& groups() const { return g_; }

 private:
  GridGroups g_;
  uint64_t seed_;
  uint64_t dropouts_ = 0;
};

}  // namespace nn
}  // namespace tessera
