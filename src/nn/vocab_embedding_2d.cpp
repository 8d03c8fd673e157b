#include "tessera/nn/vocab_embedding_2d.h"

#include "tessera/comm/functional.h"
#include "linear_init.h"
#include "tessera/nn/init.h"
#include "tessera/nn/shard.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

namespace tessera {
namespace nn {

VocabEmbedding2DImpl::VocabEmbedding2DImpl(const VocabEmbedding2DOptions& options_, comm::CommunicatorPtr row,
                                           comm::CommunicatorPtr col, comm::CommunicatorPtr depth)
    : options(options_), row_(std::move(row)), col_(std::move(col)), depth_(std::move(depth)) {
  TORCH_CHECK(row_ && col_, "VocabEmbedding2D needs the row and column communicators of the 2D grid");
  reset();
}

void VocabEmbedding2DImpl::reset() {
  TORCH_CHECK(options.num_embeddings() > 0 && options.embedding_dim() > 0,
              "VocabEmbedding2D: num_embeddings and embedding_dim must be positive, got ", options.num_embeddings(),
              " and ", options.embedding_dim());
  const int64_t q = row_->size();
  check_divisible(options.embedding_dim(), q, "VocabEmbedding2D embedding_dim", "choose a hidden size divisible by q");
  padded_vocab_ = pad_to_multiple(options.num_embeddings(), q);
  const int64_t rows = padded_vocab_ / q;
  vocab_start_ = col_->rank() * rows;
  vocab_end_ = vocab_start_ + rows;
  weight = register_parameter("weight", at::empty({rows, options.embedding_dim() / q}));
  reset_parameters();
}

void VocabEmbedding2DImpl::reset_parameters() {
  init_embedding_params(local_placements().front().second, options.num_embeddings(), options.embedding_dim(),
                        options.init_seed());
}

NamedPlacements VocabEmbedding2DImpl::local_placements() {
  ParamPlacement p = replicated_placement(weight)
                         .shard(col_->name(), col_, 0, options.num_embeddings())
                         .shard(row_->name(), row_, 1);
  if (depth_ && depth_->size() > 1) p.partial(depth_->name(), depth_);
  return {{"weight", p}};
}

void VocabEmbedding2DImpl::load_full(const at::Tensor& full) {
  TORCH_CHECK(full.dim() == 2 && full.size(0) == options.num_embeddings() && full.size(1) == options.embedding_dim(),
              "VocabEmbedding2D::load_full: weight of shape ", full.sizes(), " given, [", options.num_embeddings(),
              ", ", options.embedding_dim(), "] expected (the unpadded table; padding is added here)");
  nn::load_full(local_placements().front().second, full);
}

at::Tensor VocabEmbedding2DImpl::full_weight() { return full_value(local_placements().front().second); }

at::Tensor VocabEmbedding2DImpl::forward(const at::Tensor& ids) {
  TORCH_CHECK(ids.scalar_type() == at::kLong || ids.scalar_type() == at::kInt,
              "VocabEmbedding2D: ids must be int64 or int32, got ", ids.scalar_type());
  TORCH_CHECK(ids.dim() >= 1, "VocabEmbedding2D: ids need a batch dimension, got a 0-dimensional tensor");
  at::Tensor all_ids;  // every id of this depth layer's batch blocks, the same on every column
  at::Tensor range;    // -lowest and highest id, agreed by every rank
  if (options.full_batch()) {
    const int64_t d = depth_ ? depth_->size() : 1, parts = row_->size() * d, b = ids.size(0);
    TORCH_CHECK(b % parts == 0, "VocabEmbedding2D: the batch size ", b, " is not divisible by q*depth = ", parts,
                " (2D and 2.5D split the batch over the ", parts,
                " grid rows of the tensor group); choose a batch (or micro-batch) size divisible by ", parts);
    all_ids = ids.narrow(0, (depth_ ? depth_->rank() : 0) * (b / d), b / d);
    range = ids.numel() > 0 ? at::stack({-ids.min(), ids.max()}).to(at::kLong)
                            : at::zeros({2}, ids.options().dtype(at::kLong));
  } else {
    all_ids = comm::raw::all_gather(ids, 0, *col_);
    range = all_ids.numel() > 0 ? at::stack({-all_ids.min(), all_ids.max()}).to(at::kLong)
                                : at::zeros({2}, ids.options().dtype(at::kLong));
    // Agree on bad ids across depth layers too, so that every rank throws.
    if (depth_ && depth_->size() > 1) {
      comm::AllReduceOptions opts;
      opts.op = comm::ReduceOp::kMax;
      depth_->all_reduce(range, opts);
    }
  }
  const int64_t lowest = -range[0].item<int64_t>(), highest = range[1].item<int64_t>();
  TORCH_CHECK(lowest >= 0 && highest < options.num_embeddings(), "VocabEmbedding2D: token id ",
              lowest < 0 ? lowest : highest, " is out of range; ids must lie in [0, num_embeddings = ",
              options.num_embeddings(), "): check the tokenizer's vocabulary against the model's");
  // Ids outside this vocabulary block look up local row 0 and are zeroed.
  const at::Tensor foreign = (all_ids < vocab_start_).logical_or_(all_ids >= vocab_end_);
  const at::Tensor local_ids = (all_ids - vocab_start_).masked_fill_(foreign, 0);
  const at::Tensor partial = at::embedding(weight, local_ids).masked_fill(foreign.unsqueeze(-1), 0);
  return comm::reduce_scatter_along_dim(partial, 0, col_);
}

void VocabEmbedding2DImpl::pretty_print(std::ostream& stream) const {
  stream << "tessera::nn::VocabEmbedding2D(num_embeddings=" << options.num_embeddings()
         << ", embedding_dim=" << options.embedding_dim() << ", padded_vocab=" << padded_vocab_
         << ", q=" << row_->size() << ")";
}

}  // namespace nn
}  // namespace tessera
