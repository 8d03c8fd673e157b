#pragma once
// Runs one pipeline schedule (pipeline_schedule.h) over a model given as a
// torch::nn::Sequential of layers: this rank keeps the layers of its stages,
// runs the schedule's actions for a batch cut into micro-batches, exchanges
// activations and gradients with its neighbours (shapes and dtypes agreed at
// run time), and leaves the batch's gradients in the local parameters' .grad
// for the caller's optimizer. evaluate() runs a forward-only schedule. See
// docs/pipeline.md.
//
// Note [Pipeline loss and tied weights]
// The last stage divides each micro-batch's loss by the number of
// micro-batches before its backward, so with equal micro-batches the
// gradients are those of the mean loss over the batch, as the serial model
// computes it. Parameters that the first and the last stage share (GPT's
// token embedding and tied LM head) live on two ranks; after the schedule
// their gradients are summed over those ranks, so both copies take the
// same optimizer step and stay equal.
#include "tessera/comm/communicator.h"
#include "tessera/context/parallel_context.h"
#include "tessera/parallel/pipeline_schedule.h"

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/modules/container/sequential.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace tessera {
namespace parallel {

enum class PartitionMethod {
  kLayerCount,
  kParameterCount,
  kSizes,         // PipelineOptions::stage_sizes
  kWeights,       // PipelineOptions::layer_weights, one per layer
  kMeasuredTime,  // forward + backward seconds per layer on PipelineOptions::sample
};

// What one run() spent, on this rank.
struct PipelineRunStats {
  double wait_seconds = 0;           // blocked on receives and on the step's last sends
  double compute_seconds = 0;        // inside F, B, I and W
  double seconds[4] = {0, 0, 0, 0};  // per ActionKind F, B, I, W
  int count[4] = {0, 0, 0, 0};
};

class ShardedModule;
// This rank's layers, with the model's names ("h3", ...).
using LocalLayers = std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>;

struct PipelineOptions {
  TORCH_ARG(ScheduleKind, schedule) = ScheduleKind::k1F1B;
  TORCH_ARG(int, microbatches) = 1;
  // Stages per rank (interleaved schedules only).
  TORCH_ARG(int, chunks) = 1;
  TORCH_ARG(PartitionMethod, partition) = PartitionMethod::kLayerCount;
  // Layers per stage, for PartitionMethod::kSizes.
  TORCH_ARG(std::vector<int64_t>, stage_sizes) = {};
  // A weight per layer (cost, memory, ...), for PartitionMethod::kWeights.
  TORCH_ARG(std::vector<double>, layer_weights) = {};
  // One micro-batch of inputs, for PartitionMethod::kMeasuredTime: every
  // rank times each layer on it, and pipeline rank 0's times are used.
  TORCH_ARG(at::Tensor, sample) = {};
  // The pipeline group; the context's pipeline group when null.
  TORCH_ARG(comm::CommunicatorPtr, group) = nullptr;
  // ZeRO-3 under a pipeline (Note [ZeRO-3 under a pipeline] in the source):
  // called once by the constructor, after the model is cut, with this
  // rank's layers. The ShardedModule it returns (wrapping those layers) has
  // each stage's units gathered around every action of the stage and freed
  // after; null, or no function: the parameters stay whole.
  TORCH_ARG(std::function<std::shared_ptr<ShardedModule>(const LocalLayers&)>, shard) = nullptr;
};

// (output of the last layer for a micro-batch, that micro-batch's targets) -> its mean loss.
using PipelineLossFn = std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>;

// Seconds of forward + backward of each layer of `model` run in sequence on
// `sample` (the best of `repeats`); the layers' gradients are cleared after.
std::vector<double> measure_layer_seconds(torch::nn::Sequential model, const at::Tensor& sample, int repeats = 3);


class PipelineExecutor {
 public:
  // Collective over the pipeline group. `model` must be built alike on every
  // pipeline rank (same layers, same initial values). The layers of other
  // ranks' stages are released: their parameters and buffers become empty
  // tensors on this rank (Note [Other stages released]).
  PipelineExecutor(torch::nn::Sequential model, const context::ParallelContextPtr& ctx, PipelineLossFn loss,
                   PipelineOptions options = {});
  ~PipelineExecutor();

  // Forward and backward of the batch (rows split into micro-batches along
  // dim 0; `inputs` matter on the first stage, `targets` on the last, other
  // ranks may pass them too). Gradients accumulate into the local
  // parameters' .grad. Returns the batch's mean loss on every pipeline rank.
  // The last stage multiplies each micro-batch's loss by `loss_scale`
  // before its backward (dynamic loss scaling): every gradient, those sent
  // between stages included, is scaled by it; the returned loss is not.
  double run(const at::Tensor& inputs, const at::Tensor& targets, double loss_scale = 1.0);
  // The batch's mean loss by a forward-only schedule (make_forward_schedule):
  // no autograd graph, no backward, no gradient message; gradients are left
  // as they are. Collective over the pipeline group.
  double evaluate(const at::Tensor& inputs, const at::Tensor& targets);

  // The parameters of this rank's stages, each once: give them to the optimizer.
  std::vector<at::Tensor> parameters() const;
  // parameters() without the last stage's copies of tied weights (unless
  // this rank also holds the first stage): every parameter of the model
  // once over the pipeline group, for global norms (clip_grad_norm across it).
  std::vector<at::Tensor> unique_parameters() const;
  // The tied copies unique_parameters() leaves out: clipping must still
  // scale them so that both holders keep equal weights.
  std::vector<at::Tensor> tied_copies() const;
  // The layers of this rank's stages, with the model's names ("h3", ...).
  LocalLayers local_layers() const;
  const Schedule& schedule() const { return schedule_; }
  const Schedule& forward_schedule() const { return forward_schedule_; }
  // Stage s holds layers [bounds[s], bounds[s + 1]).
  const std::vector<int64_t>& stage_bounds() const { return bounds_; }
  const comm::CommunicatorPtr& group() const { return group_; }
  const PipelineRunStats& last_stats() const { return stats_; }

 private:
  struct Impl;
  double run_schedule(const Schedule& schedule, const at::Tensor& inputs, const at::Tensor& targets);
  size_t run_messages(const std::vector<Action>& actions, size_t first, const std::vector<int>& batch_of);
  double finish_run();
  void run_action(const Action& a);

  PipelineOptions options_;
  comm::CommunicatorPtr group_;
  comm::CommunicatorPtr tied_group_;  // first and last stage ranks, when they differ
  PipelineLossFn loss_;
  Schedule schedule_;
  Schedule forward_schedule_;
  // Per rank and action: its message batch (Note [Pipeline message batches]).
  std::vector<std::vector<int>> batches_, forward_batches_;
  std::vector<int64_t> bounds_;
  std::map<int, torch::nn::Sequential> chunks_;  // stage -> its layers, for this rank's stages
  std::vector<at::Tensor> tied_;                 // parameters shared by the first and the last stage
  std::unique_ptr<Impl> impl_;
  PipelineRunStats stats_;
};

}  // namespace parallel
}  // namespace tessera
