#pragma once
// Dropout whose randomness follows the activation's layout.
//
// Note [Dropout seeds]
// Where an activation is replicated over the tensor group (1D between
// blocks), every tensor rank must drop the same elements, or the replicas
// drift apart; where it is sharded (attention heads, MLP features, sequence
// shards), ranks must draw independently, or the shards repeat one mask. The
// layer draws from its own generator seeded with `seed`, so the choice is the
// seed's: ctx->seed(ParallelMode::kData) is equal on the ranks of a tensor
// group and differs between data replicas and pipeline stages (replicated
// activations); ctx->seed(ParallelMode::kTensor) differs between tensor ranks
// (sharded activations). See Note [Seeds per mode] in context/rank_grid.h.
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <map>
#include <ostream>
#include <string>

namespace tessera {
namespace nn {

struct ParallelDropoutOptions {
  ParallelDropoutOptions(double p, uint64_t seed) : p_(p), seed_(seed) {}
  TORCH_ARG(double, p);
  TORCH_ARG(uint64_t, seed);
};

class ParallelDropoutImpl : public torch::nn::Cloneable<ParallelDropoutImpl> {
 public:
  explicit ParallelDropoutImpl(const ParallelDropoutOptions& options);

  // Restarts the random stream from options.seed().
  void reset() override;
  void pretty_print(std::ostream& stream) const override;
  // Identity in eval mode or with p = 0; otherwise zeroes each element with
  // probability p and scales the rest by 1 / (1 - p), like torch dropout.
  at::Tensor forward(const at::Tensor& input);

  // Copies of the random streams (one per device used so far), so that
  // activation checkpointing can replay a forward's masks; set_rng_state
  // makes the layer draw from copies of `state` (a device missing from it
  // restarts from the seed). Note [Activation checkpointing and RNG].
  // A seed drawn from the layer's CPU stream, for a layer that makes its
  // masks in pieces it must draw again in backward (ring attention): the
  // stream advances as a mask would advance it, and checkpointing replays it.
  uint64_t draw_seed();

  using RngState = std::map<std::string, at::Generator>;
  RngState rng_state() const;
  void set_rng_state(const RngState& state);

  ParallelDropoutOptions options;

 private:
  at::Generator& generator_for(const c10::Device& device);
  std::map<std::string, at::Generator> generators_;  // one stream per device
};

TORCH_MODULE(ParallelDropout);

}  // namespace nn
}  // namespace tessera
