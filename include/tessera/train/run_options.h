#pragma once
// The run configuration of a training command (docs/train-gpt.md): every
// choice of a run in one struct with its defaults, and the option table
// that reads it from flags and --config and prints it as --help
// (Note [One option table] in tessera/core/cli.h). train_gpt is a loop
// over it; a user's own command can add its options beside these.
//
//   train::RunOptions run;
//   cli::Command cmd = train::run_command("my_trainer", "What it trains.", run);
//   if (!cmd.parse(argc, argv).run) ...;     // --help, --version: print its text
//   run.check(world_size);                   // the rules between options, on every rank alike
#include "tessera/comm/factory.h"
#include "tessera/context/parallel_config.h"
#include "tessera/core/cli.h"
#include "tessera/models/gpt.h"
#include "tessera/parallel/offload.h"
#include "tessera/parallel/pipeline_schedule.h"
#include "tessera/parallel/sharding_spec.h"
#include "tessera/train/lr_schedule.h"
#include "tessera/train/token_data.h"
#include "tessera/train/trainer.h"

#include <c10/core/Device.h>
#include <torch/arg.h>

#include <cstdint>
#include <string>
#include <vector>

namespace tessera {
namespace train {

enum class Precision { kFp32, kBf16 };
// --plan: none; auto, the planner chooses the layout; flags, it predicts the flags' layout.
enum class PlanMode { kNone, kAuto, kFlags };

struct RunOptions {
  RunOptions();

  // Layout. grid().seed() is the run's seed: initial weights, the data
  // windows and every dropout stream.
  TORCH_ARG(context::ParallelConfig, grid);
  TORCH_ARG(bool, sequence_parallel) = false;
  TORCH_ARG(bool, expert_tensor_parallel) = false;
  TORCH_ARG(parallel::ShardingSpec, spec) = parallel::ShardingSpec::ddp();
  TORCH_ARG(parallel::ScheduleKind, schedule) = parallel::ScheduleKind::k1F1B;
  TORCH_ARG(int64_t, microbatches) = 0;  // 0: 2 x pipeline size
  TORCH_ARG(int, chunks) = 1;
  TORCH_ARG(int64_t, accumulation) = 1;
  TORCH_ARG(parallel::Offload, offload) = parallel::Offload::kNone;
  TORCH_ARG(std::string, offload_dir) = "";
  TORCH_ARG(bool, offload_params) = false;
  // Gradient buckets of unsharded data parallelism, in MiB (DDP's
  // bucket_cap_mb): smaller ones start reducing earlier in backward. 0:
  // 25, or a sixteenth of the gradient where the data group reduces by
  // host (Note [Buckets across hosts]).
  TORCH_ARG(double, bucket_mb) = 0;
  // Where the model, its gradients and optimizer states live: cpu, cuda
  // (this process's GPU: its local rank modulo the GPUs it sees) or cuda:N.
  TORCH_ARG(std::string, device) = "cpu";
  // The collectives: auto (NCCL for a CUDA device when tessera has it, MPI
  // otherwise), mpi (CUDA tensors staged through host memory: ranks may
  // share a GPU) or nccl (one GPU per rank). Read by whoever makes the world
  // communicator (train_gpt does); GPTRun takes the world it is given.
  TORCH_ARG(comm::Backend, backend) = comm::Backend::kAuto;
  // The model: architecture, sizes, dropout, experts, activation
  // checkpointing; its vocabulary comes from the data and its context from seq.
  TORCH_ARG(models::GPTConfig, model);
  // --model: a GPTConfig preset the model starts from (the model flags given
  // beside it win); empty: the flags alone.
  TORCH_ARG(std::string, model_preset) = "";
  // --init-from hf:DIR: the architecture from DIR's config.json and the
  // initial weights from its safetensors (docs/huggingface.md).
  TORCH_ARG(std::string, init_from) = "";
  // Optimization.
  TORCH_ARG(Precision, precision) = Precision::kFp32;
  TORCH_ARG(std::string, optimizer) = "adamw";
  TORCH_ARG(double, lr) = 3e-3;
  TORCH_ARG(double, min_lr_ratio) = 0.1;
  TORCH_ARG(int64_t, warmup) = -1;  // -1: warmup_for(steps)
  TORCH_ARG(LrDecay, decay) = LrDecay::kCosine;
  TORCH_ARG(double, weight_decay) = 0.1;
  TORCH_ARG(double, clip) = 1.0;
  // Data and batch.
  TORCH_ARG(std::string, data) = kDefaultCorpus;
  TORCH_ARG(TokenFormat, data_format) = TokenFormat::kAuto;
  TORCH_ARG(int64_t, steps) = 100;
  TORCH_ARG(int64_t, batch) = 16;
  // Elastic: "STEP:BATCH,..." changes the global batch (and the data size) at those steps.
  TORCH_ARG(std::string, batch_schedule) = "";
  TORCH_ARG(int64_t, min_rows_per_replica) = 1;
  // Output: what is written, and only where asked.
  TORCH_ARG(std::string, save) = "";
  TORCH_ARG(int64_t, save_every) = 0;
  TORCH_ARG(std::string, resume) = "";
  TORCH_ARG(std::string, metrics) = "";
  TORCH_ARG(std::string, consolidate) = "";
  // The final weights as a Hugging Face directory, in export_dtype
  // (empty: the checkpoint's, fp32) and shards of export_shard_mb.
  TORCH_ARG(std::string, export_hf) = "";
  TORCH_ARG(std::string, export_dtype) = "";
  TORCH_ARG(int64_t, export_shard_mb) = 5000;
  TORCH_ARG(int64_t, sample) = 200;
  TORCH_ARG(int64_t, eval_every) = 25;
  TORCH_ARG(int64_t, log_every) = 1;
  // Note [Stragglers] in trainer.h: the progress line names the slowest rank
  // when its lag exceeds this fraction of the step (0: never, and no
  // gathering); rank_times writes every rank's times to the metrics.
  TORCH_ARG(double, straggler_threshold) = 0.1;
  TORCH_ARG(bool, rank_times) = false;
  // Note [Slow links] in link_probe.h: on several hosts, the links between
  // them timed every this many steps (0: never); a slow one is named.
  TORCH_ARG(int64_t, link_probe_every) = 10;
  // Planner (docs/planner.md).
  TORCH_ARG(PlanMode, plan) = PlanMode::kNone;
  TORCH_ARG(std::string, cluster) = "";
  TORCH_ARG(std::string, comm_bench) = "";
  TORCH_ARG(double, memory_gb) = 0;
  TORCH_ARG(double, overlap) = 0;
  TORCH_ARG(int64_t, plan_top) = 5;
  // The options the user set (flags or --config), by option name: rules that
  // refuse a combination only when it was asked for read them.
  TORCH_ARG(std::vector<std::string>, given) = {};

 public:
  static constexpr const char* kDefaultCorpus = "/usr/share/games/fortunes";

  bool was_given(const std::string& option) const;
  bool elastic() const { return !batch_schedule().empty(); }
  bool bf16() const { return precision() == Precision::kBf16; }
  // The DIR of --init-from hf:DIR; "" without --init-from.
  std::string hf_init_dir() const;
  int64_t seq() const { return model().context(); }
  // The warm-up steps: the flag, or warmup_for(steps()).
  int64_t warmup_steps() const;
  // Pipeline micro-batches: the flag, or twice the pipeline size.
  int64_t pipeline_microbatches() const;
  // --device on this process (cuda: its local rank's GPU). Refuses a
  // device this process does not have, or a backend that cannot serve it.
  c10::Device resolved_device() const;
  // The rules between options, on every rank alike (a c10::Error naming the
  // options and what to do). world_size: the ranks of the job.
  void check(int world_size) const;
  // The trainer's options of this run.
  TrainerOptions trainer_options() const;
};

// Warm-up when the run does not say: a tenth of the steps.
int64_t warmup_for(int64_t steps);

// The option names --plan auto chooses; giving one of them beside it is refused.
const std::vector<std::string>& planned_options();

// The option table of a training command over `run`, bound to its fields
// (`run` must outlive the command); parsing also records run.given().
cli::Command run_command(const std::string& name, const std::string& summary, RunOptions& run);

}  // namespace train
}  // namespace tessera
