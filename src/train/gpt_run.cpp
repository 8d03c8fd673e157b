#include "tessera/train/gpt_run.h"

#include "tessera/context/hosts.h"
#include "tessera/context/layout.h"
#include "tessera/core/remove_tree.h"
#include "tessera/infer/hf_checkpoint.h"
#include "tessera/infer/windowed_gpt.h"
#include "tessera/nn/layer_factory.h"
#include "tessera/optim/by_name.h"
#include "tessera/train/checkpoint.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <cstring>
#include <filesystem>

namespace tessera {
namespace train {
namespace {

namespace fs = std::filesystem;

OptimizerFactory optimizer_factory(const RunOptions& run) {
  const auto by_name = optim::OptimizerByName().name(run.optimizer()).lr(run.lr()).weight_decay(run.weight_decay());
  return [by_name](const std::vector<std::pair<std::string, at::Tensor>>& named) {
    return optim::make_optimizer(by_name, named);
  };
}

// A directory of our own under $TMPDIR (or /tmp) for the final weights.
std::string make_temporary_dir() {
  std::string pattern = (fs::temp_directory_path() / "tessera-final-XXXXXX").string();
  TORCH_CHECK(mkdtemp(pattern.data()) != nullptr, "cannot create a temporary directory like ", pattern,
              " for the final weights; pass --save DIR");
  return pattern;
}

}  // namespace

TrainModel gpt_train_model(const std::shared_ptr<models::GPTImpl>& gpt, Precision precision) {
  if (precision == Precision::kBf16) gpt->to(at::kBFloat16);
  TrainModel model = gpt_train_model(gpt);
  if (precision == Precision::kBf16) {
    auto inner = model.loss;
    model.loss = [inner](const at::Tensor& logits, const at::Tensor& y) { return inner(logits.to(at::kFloat), y); };
  }
  return model;
}

std::shared_ptr<models::GPTImpl> build_gpt(const models::GPTConfig& config, const context::ParallelContextPtr& ctx,
                                           const RunOptions& run, bool row_keyed_dropout) {
  at::manual_seed(run.grid().seed());
  // The layout's rules on this model (an expert option on a dense model).
  context::check_shape(context::Layout(ctx->config())
                           .sequence_parallel(run.sequence_parallel())
                           .expert_tensor_parallel(run.expert_tensor_parallel()),
                       context::ModelShape().experts(config.experts()));
  auto factory = nn::make_layer_factory(ctx, run.sequence_parallel(), row_keyed_dropout, run.expert_tensor_parallel());
  return std::make_shared<models::GPTImpl>(config, factory);
}

models::GPTConfig run_model(const RunOptions& run) {
  const std::string dir = run.hf_init_dir();
  if (dir.empty()) return run.model();
  const models::HFConfig hf = infer::read_hf_config(dir);
  models::GPTConfig c = hf.model;
  const auto& m = run.model();
  c.dropout(m.dropout()).checkpoint_activations(m.checkpoint_activations()).capacity_factor(m.capacity_factor());
  c.drop_policy(m.drop_policy());
  if (c.positions() == models::Positions::kRotary) c.context(run.seq());
  hf.check_sequence(run.seq());
  c.check();
  return c;
}

GPTRun::GPTRun(comm::CommunicatorPtr world, RunOptions run, int64_t vocab)
    : world_(std::move(world)),
      run_(std::move(run)),
      config_(models::GPTConfig(run_.model()).vocab(vocab)),
      schedule_(run_.elastic() ? BatchSchedule::parse(run_.batch_schedule()) : BatchSchedule::constant(run_.batch())) {
  run_.check(world_->size());
  // --init-from hf:DIR: every rank opens it, so that a bad directory is refused on every rank.
  std::unique_ptr<infer::HFCheckpoint> hf;
  if (!run_.hf_init_dir().empty()) {
    hf = std::make_unique<infer::HFCheckpoint>(run_.hf_init_dir());
    const models::GPTConfig c = run_model(run_);
    TORCH_CHECK(vocab <= c.vocab(), "the token data needs a vocabulary of ", vocab, " (its metadata's vocab_size, or "
                "its largest id + 1), but ", hf->dir(), "'s model has ", c.vocab(), " tokens: tokenize the data with "
                "this model's tokenizer (scripts/tokenize.py)");
    config_ = c;
    hf_config_ = hf->hf().json;
  }
  // Note [Final weights without --save]: a temporary directory rank 0 reads.
  if (run_.save().empty() && (run_.sample() > 0 || !run_.consolidate().empty() || !run_.export_hf().empty())) {
    const int hosts = context::map_hosts(*world_).hosts();
    TORCH_CHECK(hosts == 1, "--sample, --consolidate and --export-hf read the final weights (rank 0, or every rank "
                "its shards); without --save they pass through a temporary directory, but the ranks span ", hosts,
                " hosts, whose temporary directories the others cannot read: give --save DIR on a filesystem every "
                "host shares, or --sample 0");
  }
  // Elastic dropout is keyed by the row of the global batch, so that the
  // masks do not depend on the data size (Note [Row-keyed dropout]).
  const bool row_keyed = run_.elastic() && config_.dropout() > 0;
  const c10::Device device = run_.resolved_device();
  auto build = [this, row_keyed, device](const context::ParallelContextPtr& c) {
    gpt_ = build_gpt(config_, c, run_, row_keyed);
    gpt_->to(device);  // built on the CPU from the seed: the same weights on every device
    return gpt_train_model(gpt_, run_.precision());
  };
  context::ParallelConfig layout = run_.grid();
  const std::string& resume = run_.resume();
  if (run_.elastic()) {
    // A resumed elastic run starts in the layout of its step's batch: the
    // checkpoint's, so that the dropout streams are restored too.
    if (!resume.empty())
      start_ = nlohmann::json::parse(infer::CheckpointReader(resume).metadata()).at("step").get<int64_t>();
    const int per_replica = layout.pipeline() * layout.tensor() * layout.sequence();
    layout.data(data_size_for(schedule_.at(start_), world_->size() / per_replica, run_.min_rows_per_replica(),
                              run_.accumulation(), layout.expert()));
    elastic_ = std::make_unique<ElasticTrainer>(
        world_, build, optimizer_factory(run_), layout,
        ElasticOptions().trainer(run_.trainer_options()).min_rows_per_replica(run_.min_rows_per_replica()));
  } else {
    ctx_ = context::ParallelContext::create(world_, layout);
    fixed_ = std::make_unique<Trainer>(ctx_, build(ctx_), optimizer_factory(run_), run_.trainer_options());
    ctx_->batch_rows(run_.batch());  // refuses a batch the data size does not divide, before any step
  }
  if (!resume.empty()) {
    if (Trainer* t = trainer()) {
      t->load(resume);
      start_ = t->step();
    }
  } else if (hf) {
    if (Trainer* t = trainer()) t->load_weights(*hf);
  }
  if (gpt_)
    for (const auto& entry : gpt_->placements()) {
      int64_t numel = 1;
      for (int64_t d : entry.second.full_shape) numel *= d;
      parameters_ += numel;
    }
  at::Tensor count = at::tensor({parameters_}, at::kLong);  // idle ranks learn it too
  world_->control()->all_reduce(count, comm::AllReduceOptions{comm::ReduceOp::kMax})->wait();
  parameters_ = count.item<int64_t>();
}

GPTRun::~GPTRun() {
  // Rank 0 made it and reads it last (consolidate_and_sample).
  if (!temporary_.empty() && world_->rank() == 0) remove_tree(temporary_);
}

std::optional<MigrationStats> GPTRun::adapt(int64_t step) {
  if (!elastic_ || !elastic_->adapt(schedule_.at(step))) return std::nullopt;
  if (!elastic_->active()) gpt_ = nullptr;
  return elastic_->history().back();
}

Trainer* GPTRun::trainer() {
  if (elastic_) return elastic_->active() ? &elastic_->trainer() : nullptr;
  return fixed_.get();
}

context::ParallelContext::Rows GPTRun::rows(int64_t global_batch) const {
  return elastic_ ? elastic_->rows_of(global_batch) : ctx_->batch_rows(global_batch);
}

std::string GPTRun::layout_name() const {
  if (elastic_) return elastic_->layout_name();
  const auto& c = ctx_->config();
  std::string s = fmt::format("dp{} pp{} tp{}", c.data(), c.pipeline(), c.tensor());
  if (c.sequence() > 1) s += fmt::format(" sp{}", c.sequence());
  return s;
}

int GPTRun::data_size() const { return elastic_ ? elastic_->data_size() : ctx_->config().data(); }

std::string GPTRun::describe() const {
  const std::string layout =
      elastic_ ? fmt::format("elastic over {} ranks, {}, data size from the batch (>= {} rows per replica)",
                             world_->size(), elastic_->layout_name(), run_.min_rows_per_replica())
               : context::to_string(ctx_->config());
  const int pp = run_.grid().pipeline();
  return fmt::format("{} | {}spec {}{}{} | {}", layout,
                     run_.device() == "cpu" ? std::string() : "device " + run_.resolved_device().str() + ", ",
                     run_.spec().to_string(), config_.checkpoint_activations() ? ", activation checkpointing" : "",
                     run_.offload() != parallel::Offload::kNone ? ", offload " + parallel::offload_name(run_.offload())
                                                                : std::string(),
                     pp > 1 ? fmt::format("schedule {} x {} micro-batches", parallel::to_string(run_.schedule()),
                                          run_.pipeline_microbatches())
                            : std::string("no pipeline"));
}

std::string GPTRun::metadata(int64_t step) const {
  nlohmann::json meta = {{"step", step}, {"gpt", nlohmann::json::parse(config_.to_json())}};
  if (!hf_config_.empty()) meta["hf"] = hf_config_;  // written back by --export-hf (infer::export_hf)
  return meta.dump();
}

void GPTRun::export_hf(const std::string& final_dir) {
  if (run_.export_hf().empty()) return;
  TORCH_INTERNAL_ASSERT(!final_dir.empty(), "--export-hf without the final weights");
  infer::HFExportOptions options;
  options.shard_bytes(run_.export_shard_mb() * 1000 * 1000);
  if (!run_.export_dtype().empty()) options.dtype(infer::hf_dtype(run_.export_dtype()));
  infer::export_hf(final_dir, run_.export_hf(), world_, options);
}

void GPTRun::finish() {
  if (elastic_) elastic_->finish();
}

// Note [Final weights without --save]
// --consolidate and --sample need the final weights whole on rank 0. With
// --save they are DIR/final; without it, a checkpoint in a directory rank 0
// makes under $TMPDIR, which every rank writes its pieces into and rank 0
// removes once it has read them. That needs one filesystem: ranks on several
// hosts are refused at the start.
std::string GPTRun::save_final() {
  std::string dir;
  if (!run_.save().empty()) {
    dir = run_.save() + "/final";
  } else if (!run_.consolidate().empty() || run_.sample() > 0 || !run_.export_hf().empty()) {
    // Rank 0 names the directory; the others write their pieces into it.
    std::string made = world_->rank() == 0 ? make_temporary_dir() : std::string();
    at::Tensor name = at::zeros({4096}, at::kByte);
    TORCH_CHECK(made.size() < 4096, "the temporary directory's name is too long: ", made);
    std::memcpy(name.data_ptr(), made.data(), made.size());
    world_->control()->broadcast(name)->wait();
    temporary_ = std::string(reinterpret_cast<const char*>(name.data_ptr()));
    dir = temporary_ + "/final";  // the checkpoint makes its own directory
  } else {
    return "";
  }
  if (Trainer* t = trainer()) t->save(dir, metadata(t->step()));
  world_->control()->barrier()->wait();  // idle ranks wait for the files too
  return dir;
}

std::vector<int64_t> GPTRun::consolidate_and_sample(const std::string& final_dir, int64_t first_token) {
  // Collective: rank 0 alone gets a communicator for its serial copy.
  const bool sampling = !final_dir.empty() && run_.sample() > 0;
  auto self = sampling ? world_->split(world_->rank() == 0 ? 0 : -1, 0, "sample") : nullptr;
  if (final_dir.empty() || world_->rank() != 0) return {};
  if (!run_.consolidate().empty()) consolidate_checkpoint(final_dir, run_.consolidate());
  if (!sampling) return {};
  // A serial copy of the final weights, sampled through generate(); the
  // window slides past the context (WindowedGPT).
  infer::CheckpointReader reader(final_dir);
  std::map<std::string, at::Tensor> full;
  for (const auto& name : reader.names("model/")) full[name.substr(6)] = reader.full(name).to(at::kFloat);
  auto serial = std::make_shared<models::GPTImpl>(models::GPTConfig(config_).dropout(0).checkpoint_activations(false),
                                                  nn::make_1d_factory(self, false, 1, 2));
  serial->load_full_state(full);
  infer::WindowedGPT model(serial);
  const infer::Generation g = infer::generate(model, at::full({1, 1}, first_token, at::kLong), run_.sample(),
                                              infer::SamplingOptions().temperature(0.8).seed(run_.grid().seed()));
  const at::Tensor row = g.tokens[0].contiguous();
  return std::vector<int64_t>(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + row.numel());
}

}  // namespace train
}  // namespace tessera
