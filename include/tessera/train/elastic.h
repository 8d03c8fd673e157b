#pragma once
// Elastic training: every rank is launched once (mpirun -np N) and the
// trainer moves between parallel layouts while it runs, its state sent over
// the network (train/piece_exchange.h), without files or a restart
// (docs/elastic.md).
//
// Note [Live resharding]
// A layout is a ParallelConfig over the first dp·pp·tp·sp ranks of the
// world; the others are idle. reshape(layout) is collective over the whole
// world:
// 1. Idle ranks wait in it, sleeping between polls of one message from
//    world rank 0 (always active), so they take no core while the others
//    train and no timeout runs out however long that is. Then one 16-byte
//    all-reduce checks that every rank asked for the same layout.
// 2. The running ranks give their state as pieces (model and optimizer per
//    parameter, buffers, dropout streams) and the step and loss-scaler state
//    as metadata; PieceDirectory::gather tells every rank who holds what.
// 3. The world is split into the new layout's ranks, which build a
//    ParallelContext, the model (the user's builder) and a Trainer on it.
//    The process's default generators are put back as they were, so that
//    building the model does not change the random numbers the training
//    code draws afterwards.
// 4. exchange_pieces moves the elements each new rank holds from whoever
//    holds them in the old layout; the new trainer loads them as it loads a
//    checkpoint, and the old trainer is dropped.
// Any data, pipeline or tensor size works (the pieces machinery reshards
// between any two layouts of the same model); what the model supports in
// each layout is the builder's business.
//
// Note [Random streams in migration]
// Dropout streams move with a rank's place when the tensor, pipeline and
// sequence sizes stay: new data rank d takes old data rank d's streams, and
// a data rank the old layout did not have takes data rank 0's for
// row-keyed layers (equal on every data rank, Note [Row-keyed dropout]) and
// restarts the others from their seeds. When those sizes change, every
// stream restarts from its seed. The process's default CPU and CUDA
// generators are not moved: they belong to the process.
#include "tessera/comm/communicator.h"
#include "tessera/context/parallel_config.h"
#include "tessera/train/piece_exchange.h"
#include "tessera/train/trainer.h"

#include <torch/arg.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace tessera {
namespace train {

// Builds the model on a layout's context (called on that layout's ranks,
// alike on every one of them, as for a Trainer).
using ModelBuilder = std::function<TrainModel(const context::ParallelContextPtr&)>;

// Note [Sharding spec per data size]
// The trainer's sharding spec holds in every layout, except that a
// partial shard P(k) becomes P(gcd(k, dp)) at a data size dp that k does not
// divide (R when that is 1): {R,P(2),S} runs as {R,R,S} at dp 1. The
// sharding changes where the states live, not the arithmetic.
struct ElasticOptions {
  TORCH_ARG(TrainerOptions, trainer) = {};
  // Replicas get at least this many rows of the global batch (Note
  // [Data size from the batch]).
  TORCH_ARG(int64_t, min_rows_per_replica) = 1;
  // How often an idle rank looks for the call to reshape, sleeping between.
  TORCH_ARG(std::chrono::milliseconds, idle_poll) = std::chrono::milliseconds(5);

 public:
  ElasticOptions() = default;
};

struct MigrationStats {
  std::string from, to;      // the layouts (context::to_string)
  int64_t step = 0;          // steps taken before the move
  int64_t bytes_moved = 0;   // over the network, all ranks
  int64_t bytes_kept = 0;    // copied within a rank, all ranks
  int64_t messages = 0;      // all ranks
  double seconds = 0;        // the whole reshape, slowest rank
  double build_seconds = 0;  // of which building the new trainer, slowest rank
  double exchange_seconds = 0;  // of which the exchange, slowest rank
  std::string to_json() const;
};

// Note [Data size from the batch]
// The data size a global batch uses: the largest d <= max_data that divides
// the batch into rows per replica that are at least min_rows and a multiple
// of `accumulation`, and is a multiple of `data_multiple` (the expert size:
// expert groups are carved out of the data dimension); the smallest such
// size when none has min_rows.
int data_size_for(int64_t global_batch, int max_data, int64_t min_rows, int64_t accumulation = 1,
                  int data_multiple = 1);

class ElasticTrainer {
 public:
  // Collective over `world`: trains in `layout` (its data size explicit;
  // world->size() or fewer ranks) from the start.
  ElasticTrainer(comm::CommunicatorPtr world, ModelBuilder build, OptimizerFactory make_optimizer,
                 const context::ParallelConfig& layout, ElasticOptions options = {});
  ~ElasticTrainer();

  // Collective over the world, idle ranks included (Note [Live resharding]).
  MigrationStats reshape(const context::ParallelConfig& layout);
  // The layout of this one with the data size data_size_for(global_batch)
  // (max: the world over pp·tp·sp), reshaping when it differs. Every rank
  // calls it with the same batch before each step. Returns whether it moved.
  bool adapt(int64_t global_batch);
  // Collective over the world: idle ranks leave their wait. Call it after
  // the last step; the trainer stays usable on the active ranks.
  void finish();

  bool active() const { return trainer_ != nullptr; }
  // The trainer of the current layout; throws on an idle rank.
  Trainer& trainer();
  const context::ParallelConfig& layout() const { return layout_; }
  int active_size() const;
  int data_size() const { return layout_.data(); }
  // This rank's rows [first, first + count) of a global batch (Note [Rows
  // of the global batch] in context/parallel_context.h). Throws on an idle
  // rank or when the data size does not divide the batch.
  context::ParallelContext::Rows rows_of(int64_t global_batch) const;
  // Every move so far, in order.
  const std::vector<MigrationStats>& history() const { return history_; }
  // Wall and CPU seconds this rank spent waiting idle.
  double idle_seconds() const { return idle_wall_; }
  double idle_cpu_seconds() const { return idle_cpu_; }
  // A short description of the layout for progress lines: "dp4 pp1 tp1".
  std::string layout_name() const;

 private:
  TrainerOptions options_for(const context::ParallelConfig& layout) const;
  void wait_for_leader();
  void release_idle();

  comm::CommunicatorPtr world_;
  ModelBuilder build_;
  OptimizerFactory make_optimizer_;
  ElasticOptions options_;
  context::ParallelConfig layout_;
  std::unique_ptr<Trainer> trainer_;
  std::vector<MigrationStats> history_;
  bool finished_ = false;
  double idle_wall_ = 0, idle_cpu_ = 0;
};

}  // namespace train
}  // namespace tessera
