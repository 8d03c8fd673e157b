#include "tessera/nn/vocab_parallel_embedding.h"

#include "tessera/comm/functional.h"
#include "linear_init.h"
#include "tessera/nn/init.h"
#include "tessera/nn/shard.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <limits>

namespace tessera {
namespace nn {

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(const VocabParallelEmbeddingOptions& options_,
                                                       comm::CommunicatorPtr tensor_group)
    : options(options_), group_(std::move(tensor_group)) {
  TORCH_CHECK(group_ != nullptr, "VocabParallelEmbedding needs a tensor-parallel communicator");
  reset();
}

void VocabParallelEmbeddingImpl::reset() {
  TORCH_CHECK(options.num_embeddings() > 0 && options.embedding_dim() > 0,
              "VocabParallelEmbedding: num_embeddings and embedding_dim must be positive, got ",
              options.num_embeddings(), " and ", options.embedding_dim());
  const int64_t n = group_->size();
  // Note [Vocabulary padding] in the header.
  padded_vocab_ = pad_to_multiple(options.num_embeddings(), n);
  const int64_t rows = padded_vocab_ / n;
  vocab_start_ = group_->rank() * rows;
  vocab_end_ = vocab_start_ + rows;
  weight = register_parameter("weight", at::empty({rows, options.embedding_dim()}));
  reset_parameters();
}

void VocabParallelEmbeddingImpl::reset_parameters() {
  init_embedding_params(local_placements().front().second, options.num_embeddings(), options.embedding_dim(),
                        options.init_seed());
}

void VocabParallelEmbeddingImpl::load_full(const at::Tensor& full) {
  TORCH_CHECK(full.dim() == 2 && full.size(0) == options.num_embeddings() && full.size(1) == options.embedding_dim(),
              "VocabParallelEmbedding::load_full: weight of shape ", full.sizes(), " given, [",
              options.num_embeddings(), ", ", options.embedding_dim(),
              "] expected (the unpadded table; padding is added here)");
  at::NoGradGuard no_grad;
  const int64_t pad_rows = padded_vocab_ - options.num_embeddings();
  const at::Tensor padded = pad_rows == 0 ? full : at::constant_pad_nd(full.detach(), {0, 0, 0, pad_rows}, 0);
  weight.copy_(shard_of(padded, 0, *group_));
}

at::Tensor VocabParallelEmbeddingImpl::full_weight() const {
  return unshard(weight, 0, *group_).narrow(0, 0, options.num_embeddings()).contiguous();
}

at::Tensor VocabParallelEmbeddingImpl::forward(const at::Tensor& ids) {
  TORCH_CHECK(ids.scalar_type() == at::kLong || ids.scalar_type() == at::kInt,
              "VocabParallelEmbedding: ids must be int64 or int32, got ", ids.scalar_type());
  // ids are replicated, so every rank rejects the same bad id before any
  // collective and no rank is left waiting.
  if (ids.numel() > 0) {
    const int64_t lowest = ids.min().item<int64_t>();
    const int64_t highest = ids.max().item<int64_t>();
    const int64_t bad = lowest < 0 ? lowest : highest;
    TORCH_CHECK(lowest >= 0 && highest < options.num_embeddings(), "VocabParallelEmbedding: token id ", bad,
                " is out of range; ids must lie in [0, num_embeddings = ", options.num_embeddings(),
                "): check the tokenizer's vocabulary against the model's");
  }

  at::Tensor partial;
  if (group_->size() == 1) {
    partial = at::embedding(weight, ids);
  } else {
    // Ids of other ranks look up local row 0 and are then zeroed, so the sum
    // over the group holds each id's row exactly once.
    const at::Tensor foreign = (ids < vocab_start_).logical_or_(ids >= vocab_end_);
    const at::Tensor local_ids = (ids - vocab_start_).masked_fill_(foreign, 0);
    partial = at::embedding(weight, local_ids).masked_fill(foreign.unsqueeze(-1), 0);
  }
  return options.sequence_parallel() ? comm::reduce_scatter_along_dim(partial, options.sequence_dim(), group_)
                                     : comm::reduce_from_group(partial, group_);
}

NamedPlacements VocabParallelEmbeddingImpl::local_placements() {
  return {{"weight", sharded_placement(weight, 0, options.num_embeddings(), group_)}};
}

void VocabParallelEmbeddingImpl::pretty_print(std::ostream& stream) const {
  stream << "tessera::nn::VocabParallelEmbedding(num_embeddings=" << options.num_embeddings()
         << ", embedding_dim=" << options.embedding_dim() << ", padded_vocab=" << padded_vocab_ << " (rows ["
         << vocab_start_ << ", " << vocab_end_ << ") on rank " << group_->rank() << " of " << group_->size()
         << "), sequence_parallel=" << std::boolalpha << options.sequence_parallel() << ")";
}

}  // namespace nn
}  // namespace tessera
