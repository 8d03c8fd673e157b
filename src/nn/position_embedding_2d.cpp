#include "tessera/nn/position_embedding_2d.h"

#include "linear_init.h"
#include "tessera/nn/init.h"
#include "tessera/nn/shard.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

namespace tessera {
namespace nn {

PositionEmbedding2DImpl::PositionEmbedding2DImpl(const PositionEmbedding2DOptions& options_,
                                                 comm::CommunicatorPtr row, comm::CommunicatorPtr col,
                                                 comm::CommunicatorPtr depth)
    : options(options_), row_(std::move(row)), col_(std::move(col)), depth_(std::move(depth)) {
  TORCH_CHECK(row_ && col_, "PositionEmbedding2D needs the row and column communicators of the 2D grid");
  reset();
}

void PositionEmbedding2DImpl::reset() {
  TORCH_CHECK(options.num_embeddings() > 0 && options.embedding_dim() > 0,
              "PositionEmbedding2D: num_embeddings and embedding_dim must be positive, got ", options.num_embeddings(),
              " and ", options.embedding_dim());
  check_divisible(options.embedding_dim(), row_->size(), "PositionEmbedding2D embedding_dim",
                  "choose a hidden size divisible by q");
  weight = register_parameter("weight", at::empty({options.num_embeddings(), options.embedding_dim() / row_->size()}));
  reset_parameters();
}

void PositionEmbedding2DImpl::reset_parameters() {
  init_embedding_params(local_placements().front().second, options.num_embeddings(), options.embedding_dim(),
                        options.init_seed());
}

NamedPlacements PositionEmbedding2DImpl::local_placements() {
  ParamPlacement p = replicated_placement(weight).shard(row_->name(), row_, 1).partial(col_->name(), col_);
  if (depth_ && depth_->size() > 1) p.partial(depth_->name(), depth_);
  return {{"weight", p}};
}

at::Tensor PositionEmbedding2DImpl::forward(const at::Tensor& positions) {
  TORCH_CHECK(positions.scalar_type() == at::kLong || positions.scalar_type() == at::kInt,
              "PositionEmbedding2D: positions must be int64 or int32, got ", positions.scalar_type());
  if (positions.numel() > 0) {
    const int64_t lowest = positions.min().item<int64_t>(), highest = positions.max().item<int64_t>();
    TORCH_CHECK(lowest >= 0 && highest < options.num_embeddings(), "PositionEmbedding2D: position ",
                lowest < 0 ? lowest : highest, " is out of range [0, ", options.num_embeddings(),
                "): the sequence is longer than the context length");
  }
  return at::embedding(weight, positions);
}

void PositionEmbedding2DImpl::pretty_print(std::ostream& stream) const {
  stream << "tessera::nn::PositionEmbedding2D(num_embeddings=" << options.num_embeddings()
         << ", embedding_dim=" << options.embedding_dim() << ", q=" << row_->size() << ")";
}

}  // namespace nn
}  // namespace tessera
