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
//
// Note [Row-keyed dropout]
// With row_keyed, the mask of row r (dimension 0, a sample) is drawn from a
// generator seeded with (a 64-bit draw of the layer's stream, first_row + r),
// where the trainer sets first_row to the row's place in the global batch.
// A sample then gets the same mask whichever data rank holds it and however
// many ranks share the batch, so a job that changes its data-parallel size
// (train/elastic.h) trains as a fixed layout does. The layer's seed must
// then be equal across data ranks (make_layer_factory's row_keyed_dropout
// chooses such seeds). The stream advances once per call, so the masks match
// between layouts with the same number of micro-batches per step. It costs a
// reseed per row (a small CPU cost; one kernel per row on CUDA).
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <map>
#include <ostream>
#include <string>
#include <vector>

namespace tessera {
namespace nn {

struct ParallelDropoutOptions {
  ParallelDropoutOptions(double p, uint64_t seed) : p_(p), seed_(seed) {}
  TORCH_ARG(double, p);
  TORCH_ARG(uint64_t, seed);
  // Note [Row-keyed dropout].
  TORCH_ARG(bool, row_keyed) = false;
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

  // Row-keyed layers: the global batch position of the next inputs' row 0.
  void set_first_row(int64_t row) { first_row_ = row; }
  int64_t first_row() const { return first_row_; }

  using RngState = std::map<std::string, at::Generator>;
  RngState rng_state() const;
  void set_rng_state(const RngState& state);

  ParallelDropoutOptions options;

 private:
  at::Generator& generator_for(const c10::Device& device);
  std::map<std::string, at::Generator> generators_;  // one stream per device
  std::map<std::string, at::Generator> row_generators_;  // reseeded per row: no state
  int64_t first_row_ = 0;
};

TORCH_MODULE(ParallelDropout);

// The ParallelDropout layers of a module, each once, in module order.
std::vector<ParallelDropoutImpl*> dropout_layers(torch::nn::Module& module);

}  // namespace nn
}  // namespace tessera
