#pragma once
// The trainer: a model given as a sequence of layers, data parallelism
// under any sharding spec, a pipeline schedule when the context has
// pipeline stages, tensor parallelism from the model's layers, any
// optimizer, mixed precision with loss scaling, global gradient clipping,
// gradient accumulation and a learning-rate schedule, behind one
// train_step(); checkpoints that reshard (docs/trainer.md).
#include "tessera/context/parallel_context.h"
#include "tessera/optim/loss_scaler.h"
#include "tessera/parallel/pipeline_executor.h"
#include "tessera/parallel/sharded_module.h"
#include "tessera/parallel/sharded_optimizer.h"
#include "tessera/parallel/whole_norms.h"
#include "tessera/train/checkpoint.h"
#include "tessera/train/lr_schedule.h"
#include "tessera/train/state_pieces.h"

#include <torch/arg.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace tessera {
class FaultInjector;
namespace comm {
class FlightRecorder;
}
namespace models {
class GPTImpl;
}
namespace nn {
class ParallelDropoutImpl;
}
namespace train {

// What the trainer needs to know of a model.
struct TrainModel {
  // The model as a sequence of layers (the pipeline cuts it; without a
  // pipeline each layer is a unit of ZeRO-3 gathering).
  torch::nn::Sequential layers;
  // (output of the last layer, targets) -> mean loss over those rows.
  std::function<at::Tensor(const at::Tensor&, const at::Tensor&)> loss;
  // Full names and placements of the parameters (nn/placement.h): the
  // checkpoint pieces, the gradient groups and the whole norms come from
  // them. named_placements(*layers) (everything whole) when empty.
  Placements placements;
  // Sets the factor by which auxiliary losses that act through gradients
  // (MoE load balancing, Note [MoE auxiliary losses]) are scaled, as the
  // trainer scales the loss before backward; empty: the model has none.
  std::function<void(double)> set_aux_loss_scale;
  std::shared_ptr<torch::nn::Module> owner;  // keeps the model alive
};

// tessera's GPT as a TrainModel: as_sequential(), its loss and its placements.
TrainModel gpt_train_model(const std::shared_ptr<models::GPTImpl>& gpt);

// (name, parameter) of what this rank trains -> the optimizer over them
// (param groups as it likes: optim::param_groups for LAMB/LARS).
using OptimizerFactory =
    std::function<std::shared_ptr<torch::optim::Optimizer>(const std::vector<std::pair<std::string, at::Tensor>>&)>;

struct TrainerOptions {
  TORCH_ARG(parallel::ShardingSpec, spec) = parallel::ShardingSpec::ddp();
  // Schedule, micro-batches, chunks and partition when the context has pipeline stages.
  TORCH_ARG(parallel::PipelineOptions, pipeline) = {};
  // Without a pipeline: micro-batches per step, gradients accumulated
  // without communication until the last.
  TORCH_ARG(int64_t, accumulation) = 1;
  TORCH_ARG(double, clip_grad_norm) = 0;  // 0: no clipping
  // Dynamic loss scaling (fp16 parameters).
  TORCH_ARG(bool, loss_scaling) = false;
  TORCH_ARG(optim::LossScalerOptions, scaler) = {};
  TORCH_ARG(LrSchedule, lr) = {};
  // Where optimizer states and masters live (parallel/offload.h); disk
  // needs disk().dir().
  TORCH_ARG(parallel::Offload, offload) = parallel::Offload::kNone;
  TORCH_ARG(parallel::DiskOffloadOptions, disk) = {};
  // Parameter shards in host memory between uses (ShardedModuleOptions::offload_params).
  TORCH_ARG(bool, offload_params) = false;
  // ShardedModuleOptions::bucket_bytes: 0 is 25 MiB, or smaller across hosts.
  TORCH_ARG(int64_t, bucket_bytes) = 0;
  // Gather every rank's compute and wait times each step (Note
  // [Stragglers]): one all_gather of two doubles per rank on the world's
  // host channel.
  TORCH_ARG(bool, rank_times) = false;

 public:
  TrainerOptions() = default;
};

// Note [Stragglers]
// A rank that computes slower than the others makes them wait in the next
// collective that needs it. Per step the trainer takes this rank's time
// waiting for communication from its world communicator's flight recorder
// (every host-side wait of the family, comm/flight_recorder.h); compute is
// the rest of the step. With rank_times, every rank's pair is gathered, and
// the slowest rank is the one with the most compute; its lag is that
// compute minus the median rank's (the lower median: with two ranks, the
// other one). Ranks that merely wait for it show a
// short compute and a long wait, so the lag names the cause, not the
// victims. Under a pipeline, stages differ in work by design: the lag there
// also measures the partition's imbalance.

struct StepStats {
  int64_t step = 0;  // steps taken after this one
  double loss = 0;   // mean over the global batch
  double lr = 0;
  double grad_norm = -1;  // before clipping; -1 when not clipping
  bool skipped = false;   // an overflow under loss scaling
  double seconds = 0;
  // Note [Stragglers]: this rank's wait in the step; the rest is filled
  // with TrainerOptions::rank_times (else empty, -1 and 0), alike on every rank.
  double wait_seconds = 0;
  std::vector<double> rank_compute_seconds;  // by world rank
  std::vector<double> rank_wait_seconds;
  int slowest_rank = -1;     // world rank with the most compute
  double straggler_lag = 0;  // its compute minus the median rank's, seconds
};

class Trainer {
 public:
  // Collective over the context's world. The model must be built alike on
  // every rank of a pipeline (same layers and initial values).
  Trainer(context::ParallelContextPtr ctx, TrainModel model, const OptimizerFactory& make_optimizer,
          TrainerOptions options = {});
  ~Trainer();

  // One optimizer step on this data rank's rows of the global batch
  // (inputs matter on the first pipeline stage, targets on the last), on
  // any device: they are copied to device() first. Collective over the world.
  StepStats train_step(const at::Tensor& inputs, const at::Tensor& targets);
  // Mean loss over the global batch, without changing any state. Collective.
  double evaluate(const at::Tensor& inputs, const at::Tensor& targets);

  // Checkpoint: model, optimizer, loss scaler, RNG states, step, and
  // `extra` (a JSON object: the data position, ...). Collective.
  void save(const std::string& dir, const std::string& extra_json = "{}", const CheckpointOptions& options = {});
  // Loads a checkpoint saved in any parallel configuration of the same
  // model; RNG states only when the world size matches. Returns its extra
  // JSON. Collective.
  std::string load(const std::string& dir);

  // The state as pieces (Note [Checkpoint layout]) without random streams,
  // for checkpoints and live resharding (train/elastic.h). Under disk
  // offload the states are fetched into memory; optimizer().park_offloaded()
  // sends them back.
  std::vector<TensorPiece> state_pieces();
  // Step, layout, optimizer kind and loss-scaler state (JSON text).
  std::string state_metadata() const;
  // What load_state will read, given the names the source holds.
  std::vector<infer::PieceRequest> state_requests(const std::vector<std::string>& optim_names);
  // Loads model, optimizer, buffers, step and loss scaler from pieces of
  // any layout of the same model and the metadata state_metadata() wrote.
  void load_state(const infer::PieceSource& source, const std::string& metadata_json);
  // The model's weights alone (a Hugging Face model: infer::HFCheckpoint);
  // the optimizer starts fresh and the step stays. Collective like load().
  void load_weights(const infer::PieceSource& source);
  // The layers this rank trains (its pipeline stages' when pipelined).
  torch::nn::Module& local_module() { return *local_; }
  const Placements& placements() const { return placements_; }

  int64_t step() const { return step_; }
  // The device of the model's parameters when the trainer was made (the CPU
  // for a model without any): where the steps compute and batches go.
  const c10::Device& device() const { return device_; }
  parallel::ShardedModule& module() { return *sharded_; }
  parallel::ShardedOptimizer& optimizer() { return *optimizer_; }
  const std::optional<optim::LossScaler>& scaler() const { return scaler_; }
  // Model states held by this rank (parameters, gradients, optimizer).
  parallel::ModelStateBytes memory() const { return optimizer_->memory(); }
  const context::ParallelContextPtr& context() const { return ctx_; }
  bool pipelined() const { return pipe_ != nullptr; }
  // The pipeline executor, or null without pipeline stages.
  const parallel::PipelineExecutor* pipeline() const { return pipe_.get(); }

 private:
  double forward_backward(const at::Tensor& inputs, const at::Tensor& targets);
  double finish_step();
  // Note [Stragglers]: every rank's compute and wait, gathered into stats.
  void gather_rank_times(StepStats& stats) const;

  context::ParallelContextPtr ctx_;
  TrainModel model_;
  TrainerOptions options_;
  std::unique_ptr<parallel::PipelineExecutor> pipe_;
  std::shared_ptr<torch::nn::Module> local_;  // the layers this rank trains
  parallel::ShardedModulePtr sharded_;
  std::unique_ptr<parallel::ShardedOptimizer> optimizer_;
  std::optional<optim::LossScaler> scaler_;
  Placements placements_;  // of local_'s parameters
  // Without a pipeline: gather one layer at a time, unless layers share a
  // parameter (tied weights), which must stay gathered for the whole forward.
  bool gather_by_unit_ = true;
  // Row-keyed dropout layers: told each micro-batch's first global row.
  std::vector<nn::ParallelDropoutImpl*> row_dropouts_;
  std::shared_ptr<comm::FlightRecorder> recorder_;  // the world's, for wait times; may be null
  std::shared_ptr<FaultInjector> faults_;           // Note [Fault injection]; null without TESSERA_FAULT
  c10::Device device_ = c10::Device(c10::kCPU);
  int64_t step_ = 0;
};

}  // namespace train
}  // namespace tessera
