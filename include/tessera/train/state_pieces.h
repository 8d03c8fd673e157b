#pragma once
// The model and optimizer state of a ShardedOptimizer as checkpoint pieces
// (Note [Checkpoint layout]) and back, by full parameter name, so that a
// checkpoint loads into another data, tensor or pipeline configuration.
//
// Every element of every trained parameter lies in exactly one optimizer
// piece of each replica group, so the pieces carry the model too:
// "model/<name>" (the values the optimizer steps: fp32 masters when the
// model is bf16/fp16), "optim/<state>/<name>" ("exp_avg", ...) and
// "optim/step/<name>". Loading writes the pieces of the new layout from the
// full tensors and re-gathers the parameters.
#include "tessera/nn/placement.h"
#include "tessera/parallel/sharded_optimizer.h"
#include "tessera/train/checkpoint.h"

#include <string>
#include <utility>
#include <vector>

namespace tessera {
namespace train {

// Full names and placements of the parameters a rank trains (GPT::placements(),
// or named_placements() for a module without tensor parallelism).
using Placements = nn::NamedPlacements;

// Every parameter of `module` whole, under its name in named_parameters().
Placements named_placements(torch::nn::Module& module);

std::vector<TensorPiece> optimizer_pieces(parallel::ShardedOptimizer& optimizer, const Placements& placements);

// Loads model and optimizer state from `reader` into this rank's pieces.
// Throws naming the parameter when the checkpoint lacks it or has another shape.
void load_optimizer_pieces(const infer::PieceSource& reader, parallel::ShardedOptimizer& optimizer,
                           const Placements& placements);

// The model's values alone ("model/<name>"), for a run that starts from
// weights (a Hugging Face model, infer/hf_checkpoint.h): the optimizer's
// states stay as they are (fresh).
void load_model_pieces(const infer::PieceSource& reader, parallel::ShardedOptimizer& optimizer,
                       const Placements& placements);

// What load_optimizer_pieces will read for this rank's pieces, given the
// "optim/..." names the source holds (a fresh optimizer has no states yet
// to say which): for receiving them before loading (train/piece_exchange.h).
std::vector<infer::PieceRequest> optimizer_requests(const parallel::ShardedOptimizer& optimizer, const Placements& placements,
                                             const std::vector<std::string>& optim_names);

// Note [Buffers in checkpoints]
// A module's buffers (BatchNorm's running statistics, any registered
// buffer) are saved whole as "buffer/<name>" (named_buffers() names). The
// data-parallel replicas hold the same buffers when ShardedModule
// broadcasts them (its default); otherwise they differ, and the checkpoint
// keeps data rank 0's, which every rank loads: pass `writer` true on data
// rank 0 only. Buffers are not sharded, so they load into any data,
// tensor or pipeline layout whose ranks hold buffers of those names.
std::vector<TensorPiece> buffer_pieces(torch::nn::Module& module, bool writer);

// Copies "buffer/<name>" into each buffer of `module`. Throws naming the
// buffer when the checkpoint lacks it or has another shape.
void load_buffer_pieces(const infer::PieceSource& reader, torch::nn::Module& module);
// What load_buffer_pieces will read.
std::vector<infer::PieceRequest> buffer_requests(torch::nn::Module& module);

// Note [Random states in checkpoints]
// A rank's random streams are its default CPU generator ("rng/<rank>/cpu"),
// the default generator of each CUDA device holding the module's parameters
// or buffers ("rng/<rank>/cuda:<i>") and each ParallelDropout layer's stream
// per device ("rng/<rank>/dropout/<k>/<device>", layers in module order).
// Generator states are CPU byte tensors (CPU: the Mersenne Twister; CUDA:
// Philox seed and offset), written like any piece. A stream belongs to a
// rank's place in the grid, so the trainer restores them only into the same
// world size and configuration. A stream of a device this process does not
// have (a GPU run resumed on a CPU-only machine) cannot be restored; it is
// returned by name so that the caller can say so (the run is then not
// bit-exact), and that dropout layer restarts that device's stream.
std::vector<TensorPiece> random_state_pieces(torch::nn::Module& module, int global_rank);

// Restores the streams saved by random_state_pieces; returns the names of
// those this process has no device for.
std::vector<std::string> load_random_state_pieces(const infer::PieceSource& reader, torch::nn::Module& module,
                                                  int global_rank);

// The same under "rng/<key>/"; without `process_generators` the dropout
// streams only (the process's default generators stay with the process:
// live migration, Note [Random streams in migration] in train/elastic.h).
std::vector<TensorPiece> random_state_pieces(torch::nn::Module& module, const std::string& key,
                                             bool process_generators);
std::vector<std::string> load_random_state_pieces(const infer::PieceSource& reader, torch::nn::Module& module,
                                                  const std::string& key);

}  // namespace train
}  // namespace tessera
