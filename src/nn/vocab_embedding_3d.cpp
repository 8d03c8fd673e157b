#include "tessera/nn/vocab_embedding_3d.h"

#include "tessera/comm/functional.h"
#include "linear_init.h"
#include "tessera/nn/init.h"
#include "tessera/nn/matmul_3d.h"
#include "tessera/nn/shard.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

namespace tessera {
namespace nn {

VocabEmbedding3DImpl::VocabEmbedding3DImpl(const VocabEmbedding3DOptions& options_, comm::CommunicatorPtr input,
                                           comm::CommunicatorPtr weight, comm::CommunicatorPtr output)
    : options(options_), input_(std::move(input)), weight_(std::move(weight)), output_(std::move(output)) {
  TORCH_CHECK(input_ && weight_ && output_,
              "VocabEmbedding3D needs the input, weight and output communicators of the 3D cube");
  reset();
}

void VocabEmbedding3DImpl::reset() {
  TORCH_CHECK(options.num_embeddings() > 0 && options.embedding_dim() > 0,
              "VocabEmbedding3D: num_embeddings and embedding_dim must be positive, got ", options.num_embeddings(),
              " and ", options.embedding_dim());
  const int64_t q = input_->size();
  check_divisible(options.embedding_dim(), q * q, "VocabEmbedding3D embedding_dim",
                  "in 3D the hidden size must divide by q²");
  const int64_t rows = pad_to_multiple(options.num_embeddings(), q) / q;
  vocab_start_ = input_->rank() * rows;
  vocab_end_ = vocab_start_ + rows;
  weight = register_parameter("weight", at::empty({rows, options.embedding_dim() / (q * q)}));
  reset_parameters();
}

void VocabEmbedding3DImpl::reset_parameters() {
  init_embedding_params(local_placements().front().second, options.num_embeddings(), options.embedding_dim(),
                        options.init_seed());
}

NamedPlacements VocabEmbedding3DImpl::local_placements() {
  return {{"weight", replicated_placement(weight)
                         .shard(input_->name(), input_, 0, options.num_embeddings())
                         .shard(output_->name(), output_, 1)
                         .shard(weight_->name(), weight_, 1)}};
}

void VocabEmbedding3DImpl::load_full(const at::Tensor& full) {
  TORCH_CHECK(full.dim() == 2 && full.size(0) == options.num_embeddings() && full.size(1) == options.embedding_dim(),
              "VocabEmbedding3D::load_full: weight of shape ", full.sizes(), " given, [", options.num_embeddings(),
              ", ", options.embedding_dim(), "] expected (the unpadded table; padding is added here)");
  nn::load_full(local_placements().front().second, full);
}

at::Tensor VocabEmbedding3DImpl::full_weight() { return full_value(local_placements().front().second); }

at::Tensor VocabEmbedding3DImpl::forward(const at::Tensor& ids) {
  TORCH_CHECK(ids.scalar_type() == at::kLong || ids.scalar_type() == at::kInt,
              "VocabEmbedding3D: ids must be int64 or int32, got ", ids.scalar_type());
  TORCH_CHECK(ids.dim() >= 1, "VocabEmbedding3D: ids need a batch dimension, got a 0-dimensional tensor");
  const int64_t q = input_->size(), b = ids.size(0);
  TORCH_CHECK(b % (q * q) == 0, "VocabEmbedding3D: the batch size ", b, " is not divisible by q*q = ", q * q,
              " (3D splits the batch over the ", q * q,
              " batch sub-blocks of the cube); choose a batch (or micro-batch) size divisible by ", q * q);
  // Every rank sees the whole batch, so every rank reaches the same verdict.
  if (ids.numel() > 0) {
    const int64_t lowest = ids.min().item<int64_t>(), highest = ids.max().item<int64_t>();
    TORCH_CHECK(lowest >= 0 && highest < options.num_embeddings(), "VocabEmbedding3D: token id ",
                lowest < 0 ? lowest : highest, " is out of range; ids must lie in [0, num_embeddings = ",
                options.num_embeddings(), "): check the tokenizer's vocabulary against the model's");
  }
  const at::Tensor block_ids = ids.narrow(0, weight_->rank() * (b / q), b / q);
  const at::Tensor table = comm::all_gather_along_dim(weight, 1, weight_);  // [V_p/q, h/q]
  const at::Tensor foreign = (block_ids < vocab_start_).logical_or_(block_ids >= vocab_end_);
  const at::Tensor local_ids = (block_ids - vocab_start_).masked_fill_(foreign, 0);
  const at::Tensor partial = at::embedding(table, local_ids).masked_fill(foreign.unsqueeze(-1), 0);
  return comm::reduce_scatter_along_dim(partial, 0, input_);
}

at::Tensor VocabEmbedding3DImpl::logits(const at::Tensor& hidden) {
  return matmul_3d(hidden, weight, input_, weight_, output_);
}

void VocabEmbedding3DImpl::pretty_print(std::ostream& stream) const {
  stream << "tessera::nn::VocabEmbedding3D(num_embeddings=" << options.num_embeddings()
         << ", embedding_dim=" << options.embedding_dim() << ", q=" << input_->size() << ")";
}

}  // namespace nn
}  // namespace tessera
