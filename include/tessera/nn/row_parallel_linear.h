#pragma once
// Megatron's row-parallel linear layer: y = x Aᵀ + b with A split by columns
// (input features) over the tensor-parallel group; each rank multiplies its
// input shard and the partial products are summed (all-reduce), or
// reduce-scattered along the sequence in the sequence-parallel variant (Note
// [1D activation layouts] in column_parallel_linear.h). The bias is
// replicated and added after the reduction.
#include "tessera/comm/communicator.h"
#include "tessera/nn/placement.h"

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <ostream>

namespace tessera {
namespace nn {

struct RowParallelLinearOptions {
  RowParallelLinearOptions(int64_t in_features, int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  TORCH_ARG(int64_t, in_features);  // full size; divisible by the tensor-parallel size
  TORCH_ARG(int64_t, out_features);
  TORCH_ARG(bool, bias) = true;
  // The input is already this rank's shard of the last dimension (the output
  // of a ColumnParallelLinear); otherwise the full input is split here.
  TORCH_ARG(bool, input_is_parallel) = true;
  // Reduce-scatter the output along the sequence instead of all-reducing it.
  TORCH_ARG(bool, sequence_parallel) = false;
  TORCH_ARG(int64_t, sequence_dim) = 1;
  // Draw the weights blockwise from this seed (Note [Layout-independent
  // initialization]: no full tensor, the same whatever the layout) instead of
  // drawing the full tensors as LibTorch's layer does.
  TORCH_ARG(c10::optional<uint64_t>, init_seed) = c10::nullopt;
};

class RowParallelLinearImpl : public torch::nn::Cloneable<RowParallelLinearImpl>, public PlacedModule {
 public:
  RowParallelLinearImpl(const RowParallelLinearOptions& options, comm::CommunicatorPtr tensor_group);

  void reset() override;
  void reset_parameters();  // as torch::nn::Linear, drawn full then sharded
  void pretty_print(std::ostream& stream) const override;
  // Where this rank's weight (and bias) sit in the full tensors.
  NamedPlacements local_placements() override;
  at::Tensor forward(const at::Tensor& input);

  // Loads this rank's columns of the full [out, in] weight and the full bias.
  void load_full(const at::Tensor& weight, const at::Tensor& bias = at::Tensor());
  at::Tensor full_weight() const;  // collective
  at::Tensor full_bias() const { return bias.detach().clone(); }

  // Note [Sequence-parallel bias gradient]
  // With sequence_parallel the bias is added to this rank's sequence shard
  // only, so bias.grad() holds this rank's part of the gradient. This sums it
  // over the tensor group (collective; does nothing without sequence
  // parallelism). Call it after backward, before the optimizer step; the data
  // parallel wrapper (ShardedModuleOptions::partial_gradients) does it
  // inside its own reduction.
  void reduce_partial_gradients();

  const comm::CommunicatorPtr& tensor_group() const { return group_; }

  RowParallelLinearOptions options;
  at::Tensor weight;  // [out, in/n]
  at::Tensor bias;    // [out], replicated

 private:
  comm::CommunicatorPtr group_;
};

TORCH_MODULE(RowParallelLinear);

}  // namespace nn
}  // namespace tessera
