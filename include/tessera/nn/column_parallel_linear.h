#pragma once
// Megatron's column-parallel linear layer: y = x Aᵀ + b with A split by rows
// (output features) over the tensor-parallel group, so rank r computes
// output features [r·out/n, (r+1)·out/n).
//
// Note [1D activation layouts]
// Between blocks, 1D keeps activations replicated on every tensor rank; the
// column layer enters the parallel region with copy_to_group (backward sums
// the input gradients of all ranks) and its output is sharded along the last
// dimension, ready for a RowParallelLinear. In the sequence-parallel variant
// (Korthikanti et al. 2022) activations between blocks are sharded along the
// sequence instead: the column layer all-gathers the sequence first (backward:
// reduce-scatter) and the row layer reduce-scatters its output back to
// sequence shards instead of all-reducing it.
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

struct ColumnParallelLinearOptions {
  ColumnParallelLinearOptions(int64_t in_features, int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  TORCH_ARG(int64_t, in_features);
  TORCH_ARG(int64_t, out_features);  // full size; divisible by the tensor-parallel size
  TORCH_ARG(bool, bias) = true;
  // All-gather the output features so every rank gets the full output.
  TORCH_ARG(bool, gather_output) = false;
  // Input is this rank's sequence shard (Note [1D activation layouts]).
  TORCH_ARG(bool, sequence_parallel) = false;
  TORCH_ARG(int64_t, sequence_dim) = 1;  // [batch, sequence, hidden]
  // The input has entered the parallel region already (copy_to_group, or the
  // sequence all-gather, done once by the caller: LayerFactory::column_entry),
  // so that several column layers reading one input share that collective
  // and its backward.
  TORCH_ARG(bool, input_entered) = false;
  // Draw the weights blockwise from this seed (Note [Layout-independent
  // initialization]: no full tensor, the same whatever the layout) instead of
  // drawing the full tensors as LibTorch's layer does.
  TORCH_ARG(c10::optional<uint64_t>, init_seed) = c10::nullopt;
};

class ColumnParallelLinearImpl : public torch::nn::Cloneable<ColumnParallelLinearImpl>, public PlacedModule {
 public:
  ColumnParallelLinearImpl(const ColumnParallelLinearOptions& options, comm::CommunicatorPtr tensor_group);

  void reset() override;
  // The full weight and bias drawn as torch::nn::Linear draws them, then
  // sharded: with the same seed on every rank the layer equals the serial one.
  void reset_parameters();
  void pretty_print(std::ostream& stream) const override;
  // Where this rank's weight (and bias) sit in the full tensors.
  NamedPlacements local_placements() override;
  at::Tensor forward(const at::Tensor& input);

  // Loads this rank's rows of the full [out, in] weight and [out] bias.
  void load_full(const at::Tensor& weight, const at::Tensor& bias = at::Tensor());
  // The full weight / bias, gathered from every rank (collective).
  at::Tensor full_weight() const;
  at::Tensor full_bias() const;
  const comm::CommunicatorPtr& tensor_group() const { return group_; }

  ColumnParallelLinearOptions options;
  at::Tensor weight;  // [out/n, in]
  at::Tensor bias;    // [out/n], undefined without bias

 private:
  comm::CommunicatorPtr group_;
};

TORCH_MODULE(ColumnParallelLinear);

}  // namespace nn
}  // namespace tessera
