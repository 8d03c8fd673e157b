#pragma once
// A GPT training run of RunOptions on the ranks of a world: the model built
// on the run's layout, a Trainer (or an ElasticTrainer that follows the
// batch schedule), resuming, the rows each rank trains, and the final
// weights. train_gpt is a loop over it (docs/train-gpt.md); the pieces it
// uses (TokenData, Trainer, MetricsLog) are the library's.
//
//   train::GPTRun run(world, options, data.vocab());
//   for (int64_t step = run.start_step(); step < options.steps(); ++step) {
//     run.adapt(step);                       // elastic: the layout of this step's batch
//     if (train::Trainer* t = run.trainer()) {
//       auto rows = run.rows(options.batch()); ...
//     }
//   }
#include "tessera/comm/communicator.h"
#include "tessera/models/gpt.h"
#include "tessera/train/batch_schedule.h"
#include "tessera/train/elastic.h"
#include "tessera/train/run_options.h"
#include "tessera/train/trainer.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace tessera {
namespace train {

// tessera's GPT as the trainer takes it; in bf16 its loss is taken in fp32.
TrainModel gpt_train_model(const std::shared_ptr<models::GPTImpl>& gpt, Precision precision);

// The GPT of `config` on a context, as RunOptions describes the layout
// (its seed drawn from the run's seed, row-keyed dropout for elastic runs).
std::shared_ptr<models::GPTImpl> build_gpt(const models::GPTConfig& config, const context::ParallelContextPtr& ctx,
                                           const RunOptions& run, bool row_keyed_dropout);

// The model a run trains: run.model(), or with --init-from hf:DIR DIR's
// config.json with the run's choices (dropout, activation checkpointing,
// expert capacity, the sequence as the rotary context). Refuses a sequence
// the model cannot run (HFConfig::check_sequence).
models::GPTConfig run_model(const RunOptions& run);

class GPTRun {
 public:
  // Collective over `world`: checks the options, builds the context, the
  // model and the trainer (elastic: the layout of the first step's batch),
  // and resumes from run.resume(), or starts from --init-from's weights.
  // `vocab`: the data's (TokenData::vocab(); with --init-from, the
  // vocabulary the data needs, TokenData::needed_vocab(), which must not
  // exceed the model's).
  GPTRun(comm::CommunicatorPtr world, RunOptions run, int64_t vocab);
  ~GPTRun();

  const models::GPTConfig& config() const { return config_; }
  // The step the run starts at: 0, or the checkpoint's.
  int64_t start_step() const { return start_; }
  // The global batch of `step`: --batch, or the batch schedule's.
  int64_t batch(int64_t step) const { return schedule_.at(step); }

  // Elastic runs: moves to the layout of `step`'s batch; the move when it
  // moved. Fixed layouts: nothing. Collective over the world.
  std::optional<MigrationStats> adapt(int64_t step);
  // The trainer of the current layout; null on a rank it leaves idle.
  Trainer* trainer();
  // This rank's GPT; null on an idle rank.
  models::GPTImpl* model() { return gpt_.get(); }
  // This rank's rows of a global batch (Note [Rows of the global batch]).
  context::ParallelContext::Rows rows(int64_t global_batch) const;
  // "dp2 pp1 tp2", the current layout.
  std::string layout_name() const;
  // One line: the layout (or the elastic range), spec, checkpointing,
  // offload, schedule.
  std::string describe() const;
  // Parameters of the whole model (full shapes).
  int64_t parameters() const { return parameters_; }
  // The data size of the current layout.
  int data_size() const;

  // The checkpoint's metadata of `step`: the step and what tessera_generate
  // needs of the shape ({"step": N, "gpt": {"heads": H}}).
  std::string metadata(int64_t step) const;
  // Elastic: wakes the idle ranks for good. Collective; call after the last step.
  void finish();

  // Saves DIR/final when --save is given; otherwise, when --consolidate,
  // --export-hf or --sample needs the final weights, into a temporary
  // directory that is removed with this run. Returns the directory, or ""
  // when nothing was saved. Collective.
  std::string save_final();
  // --export-hf: writes the final weights (save_final's directory) as a
  // Hugging Face model directory. Collective; a no-op without --export-hf.
  void export_hf(const std::string& final_dir);
  // Collective: rank 0 writes --consolidate from the final weights and
  // returns the --sample tokens drawn from a serial copy of them at
  // temperature 0.8; the other ranks return nothing.
  std::vector<int64_t> consolidate_and_sample(const std::string& final_dir, int64_t first_token);

 private:
  comm::CommunicatorPtr world_;
  RunOptions run_;
  models::GPTConfig config_;
  BatchSchedule schedule_;
  std::shared_ptr<models::GPTImpl> gpt_;
  context::ParallelContextPtr ctx_;  // fixed layouts
  std::unique_ptr<Trainer> fixed_;
  std::unique_ptr<ElasticTrainer> elastic_;
  int64_t start_ = 0;
  int64_t parameters_ = 0;
  std::string temporary_;  // the final weights' directory when --save was not given
  std::string hf_config_;  // --init-from's config.json, written back by --export-hf
};

}  // namespace train
}  // namespace tessera
