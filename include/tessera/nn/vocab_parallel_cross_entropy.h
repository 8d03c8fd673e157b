#pragma once
// Cross entropy over logits whose vocabulary dimension is split over the
// tensor-parallel group (the output of a vocabulary-parallel LM head), without
// ever gathering the [..., V] logits: Megatron-LM's algorithm with two
// all-reduces of [...]-sized tensors (the max; the target logit and the sum of
// exponentials together). Note [Vocabulary-parallel cross entropy] in the source.
#include "tessera/comm/communicator.h"

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <cstdint>

namespace tessera {
namespace nn {

// How per-token losses are combined, as torch's cross_entropy does it.
enum class Reduction {
  kMean,  // sum over non-ignored targets / their count
  kSum,
  kNone,  // one loss per target, 0 where ignored
};

struct VocabParallelCrossEntropyOptions {
  // The true, unpadded vocabulary size V: global columns >= V are padding
  // (Note [Vocabulary padding] in vocab_parallel_embedding.h) and take no part
  // in the loss. 0: every column is a real class.
  TORCH_ARG(int64_t, vocab_size) = 0;
  // Targets equal to it contribute no loss and no gradient.
  TORCH_ARG(int64_t, ignore_index) = -100;
  TORCH_ARG(Reduction, reduction) = Reduction::kMean;

 public:
};

// logits_shard: [..., V_p/n], this rank's columns [r·V_p/n, (r+1)·V_p/n) of the
// (padded) vocabulary; target: [...] int64 ids into the full vocabulary, the
// same on every rank. Collective over tensor_group. The loss is the same on
// every rank; backward needs no communication (each rank's logits gradient
// is local). Computed in at least float32; the loss has the logits' dtype.
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits_shard, const at::Tensor& target,
                                        const comm::CommunicatorPtr& tensor_group,
                                        const VocabParallelCrossEntropyOptions& options = {});

}  // namespace nn
}  // namespace tessera
