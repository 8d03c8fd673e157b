#include "tessera/train/trainer.h"

#include "tessera/comm/factory.h"
#include "tessera/comm/flight_recorder.h"
#include "tessera/core/logging.h"
#include "tessera/models/gpt.h"
#include "tessera/nn/parallel_dropout.h"
#include "tessera/optim/by_name.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <set>

namespace tessera {
namespace train {
namespace {

using Json = nlohmann::json;

// True when some parameter belongs to two children of the Sequential (tied
// weights): those cannot be gathered one child at a time.
bool shares_parameters(const torch::nn::Sequential& layers) {
  std::map<const c10::TensorImpl*, size_t> owner;
  size_t i = 0;
  for (const auto& child : layers->children()) {
    for (const auto& p : child->parameters()) {
      auto [it, fresh] = owner.emplace(p.unsafeGetTensorImpl(), i);
      if (!fresh && it->second != i) return true;
    }
    ++i;
  }
  return false;
}

// The optimizer's family, recorded in a checkpoint: states of one family
// mean nothing to another (exp_avg of AdamW is not LAMB's).
std::string optimizer_kind(torch::optim::Optimizer& o) {
  const std::string name = optim::optimizer_name(o);
  return name.empty() ? "other" : name;
}

// Undefined tensors (a pipeline rank's unused inputs) stay undefined.
at::Tensor on_device(const at::Tensor& t, const c10::Device& device) { return t.defined() ? t.to(device) : t; }

at::Tensor rows(const at::Tensor& t, int64_t begin, int64_t count) {
  return t.defined() && t.dim() > 0 ? t.narrow(0, begin, count) : t;
}

}  // namespace

TrainModel gpt_train_model(const std::shared_ptr<models::GPTImpl>& gpt) {
  TORCH_CHECK(gpt != nullptr, "gpt_train_model: the model must not be null");
  TrainModel m;
  m.layers = gpt->as_sequential();
  models::GPTImpl* raw = gpt.get();
  m.loss = [raw](const at::Tensor& logits, const at::Tensor& targets) { return raw->loss(logits, targets); };
  m.placements = gpt->placements();
  if (gpt->config().experts() > 0) m.set_aux_loss_scale = [raw](double scale) { raw->set_aux_loss_scale(scale); };
  m.owner = gpt;
  return m;
}

Trainer::Trainer(context::ParallelContextPtr ctx, TrainModel model, const OptimizerFactory& make_optimizer,
                 TrainerOptions options)
    : ctx_(std::move(ctx)), model_(std::move(model)), options_(std::move(options)) {
  TORCH_CHECK(ctx_ != nullptr && model_.layers && model_.loss,
              "Trainer: the context, the layers and the loss must be given");
  TORCH_CHECK(options_.accumulation() >= 1, "Trainer: accumulation must be >= 1, got ", options_.accumulation());
  TORCH_CHECK(options_.clip_grad_norm() >= 0, "Trainer: clip_grad_norm must be >= 0 (0: off), got ",
              options_.clip_grad_norm());
  options_.lr().validate();
  // Before any sharding: offloaded parameter shards live in host memory.
  const auto params = model_.layers->parameters();
  if (!params.empty()) device_ = params.front().device();
  for (const auto& p : params)
    TORCH_CHECK(p.device() == device_, "Trainer: the model's parameters are on ", device_, " and on ", p.device(),
                "; move the whole model to one device (module->to(device)) before making the trainer");
  recorder_ = comm::flight_recorder_of(ctx_->world());
  faults_ = comm::fault_injector_of(ctx_->world());
  // Dimensions the trainer would otherwise ignore (duplicating work) are refused.
  const auto& config = ctx_->config();
  if (config.expert() > 1) {
    // The expert group only carries layers that place parameters on it.
    const auto expert_data = ctx_->comm(context::ParallelMode::kExpertData);
    bool placed = false;
    for (const auto& entry : model_.placements) placed = placed || entry.second.replica_group == expert_data;
    TORCH_CHECK(placed, "Trainer: the context has expert size ", config.expert(),
                ", but no parameter of the model lives on the expert group (no mixture-of-experts layer); "
                "set expert size 1 or give the model experts");
  }
  const int pp = ctx_->has(context::ParallelMode::kPipeline) ? ctx_->size(context::ParallelMode::kPipeline) : 1;
  TORCH_CHECK(pp == 1 || options_.accumulation() == 1,
              "Trainer: with pipeline stages, accumulate through "
              "pipeline micro-batches (PipelineOptions::microbatches), not accumulation (got ",
              options_.accumulation(), ")");
  auto module_options = parallel::ShardedModuleOptions()
                            .spec(options_.spec())
                            .bucket_bytes(options_.bucket_bytes())
                            .placements(model_.placements)
                            .offload_params(options_.offload_params());
  // Before the pipeline executor empties the other stages' layers.
  placements_ = model_.placements.empty() ? named_placements(*model_.layers) : model_.placements;
  if (pp > 1) {
    // Each local layer is a unit; the executor gathers a stage's units
    // around its actions (Note [ZeRO-3 under a pipeline]).
    auto pipeline = options_.pipeline();
    pipeline.shard([&](const parallel::LocalLayers& layers) -> parallel::ShardedModulePtr {
      local_ = std::make_shared<torch::nn::Module>("Stages");
      std::vector<std::string> units;
      for (const auto& [name, layer] : layers) {
        local_->register_module(name, layer);
        units.push_back(name);
      }
      sharded_ = std::make_shared<parallel::ShardedModule>(local_, ctx_, module_options.units(units));
      sharded_->set_gradient_sync(false);  // reduced once after the schedule
      return sharded_->degrees().params > 1 ? sharded_ : nullptr;
    });
    pipe_ = std::make_unique<parallel::PipelineExecutor>(model_.layers, ctx_, model_.loss, pipeline);
  } else {
    local_ = model_.layers.ptr();
    sharded_ = std::make_shared<parallel::ShardedModule>(local_, ctx_, module_options);
  }
  gather_by_unit_ = !shares_parameters(model_.layers);
  for (auto* d : nn::dropout_layers(*local_))
    if (d->options.row_keyed()) row_dropouts_.push_back(d);
  TORCH_CHECK(!pipe_ || row_dropouts_.empty(),
              "Trainer: row-keyed dropout (Note [Row-keyed dropout]) needs each micro-batch's place in the global "
              "batch, which the pipeline executor does not give its stages yet; build the model without "
              "row-keyed dropout, or without pipeline stages");

  std::vector<std::pair<std::string, at::Tensor>> named;
  std::set<const c10::TensorImpl*> seen;
  for (const auto& p : local_->named_parameters(true))
    if (p.value().requires_grad() && seen.insert(p.value().unsafeGetTensorImpl()).second)
      named.emplace_back(p.key(), p.value());
  auto inner = make_optimizer(named);
  TORCH_CHECK(inner != nullptr, "Trainer: the optimizer factory returned null");
  TORCH_CHECK(optimizer_kind(*inner) != "other",
              "Trainer: the optimizer is none of AdamW, Adam, SGD, LAMB, LARS, whose states checkpoints can save; "
              "use one of those");
  auto opt_options = parallel::ShardedOptimizerOptions().offload(options_.offload()).disk(options_.disk());
  if (!model_.placements.empty())
    opt_options.whole_norms(std::make_shared<parallel::PlacementNorms>(model_.placements));
  optimizer_ = std::make_unique<parallel::ShardedOptimizer>(sharded_, inner, opt_options);
  if (options_.loss_scaling()) scaler_.emplace(ctx_->world(), options_.scaler());
}

Trainer::~Trainer() = default;

double Trainer::forward_backward(const at::Tensor& inputs, const at::Tensor& targets) {
  const double scale = scaler_ ? scaler_->current_scale() : 1.0;
  if (pipe_) {
    // The executor divides each micro-batch's loss by their number.
    if (model_.set_aux_loss_scale) model_.set_aux_loss_scale(scale / options_.pipeline().microbatches());
    const double loss = pipe_->run(inputs, targets, scale);
    sharded_->reduce_gradients();
    return loss;
  }
  const int64_t n = inputs.size(0), m = options_.accumulation();
  TORCH_CHECK(n % m == 0, "Trainer: this rank's ", n, " rows do not split into ", m,
              " accumulation micro-batches; make the local batch a multiple of accumulation");
  double total = 0;
  if (model_.set_aux_loss_scale) model_.set_aux_loss_scale(scale / static_cast<double>(m));
  for (int64_t i = 0; i < m; ++i) {
    sharded_->set_gradient_sync(i == m - 1);
    const at::Tensor x = rows(inputs, i * (n / m), n / m), y = rows(targets, i * (n / m), n / m);
    // Rows are numbered in the global batch (Note [Rows of the global batch]).
    const int64_t first_row = ctx_->batch_rows(n * ctx_->size(context::ParallelMode::kData)).first + i * (n / m);
    for (auto* d : row_dropouts_) d->set_first_row(first_row);
    at::Tensor out = gather_by_unit_ ? sharded_->forward(x) : sharded_->run([&] { return model_.layers->forward(x); });
    at::Tensor loss = model_.loss(out, y) / static_cast<double>(m);
    total += loss.item<double>();
    (scale != 1.0 ? loss * scale : loss).backward();
  }
  return total;
}

StepStats Trainer::train_step(const at::Tensor& inputs_anywhere, const at::Tensor& targets_anywhere) {
  const at::Tensor inputs = on_device(inputs_anywhere, device_), targets = on_device(targets_anywhere, device_);
  const auto start = std::chrono::steady_clock::now();
  const double waited_before = recorder_ ? recorder_->waited_seconds() : 0;
  if (faults_) faults_->begin_step(step_ + 1);
  StepStats stats;
  stats.lr = options_.lr().at(step_);
  for (auto& group : optimizer_->param_groups()) group.options().set_lr(stats.lr);
  optimizer_->zero_grad();
  const double local_loss = forward_backward(inputs, targets);
  if (faults_) {
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    faults_->slow_down(elapsed - (recorder_ ? recorder_->waited_seconds() - waited_before : 0));
  }

  std::vector<comm::CommunicatorPtr> across;
  std::vector<at::Tensor> uncounted;
  if (pipe_) {
    across.push_back(pipe_->group());
    uncounted = pipe_->tied_copies();
  }
  bool finite = true;
  if (scaler_) finite = scaler_->unscale(optimizer_->pieces_for_step());
  if (finite && options_.clip_grad_norm() > 0)
    stats.grad_norm = optimizer_->clip_grad_norm(options_.clip_grad_norm(), across, uncounted);
  if (finite) {
    optimizer_->step();
  } else {
    optimizer_->skip_step();
  }
  if (scaler_) scaler_->update(!finite);
  stats.skipped = !finite;
  ++step_;

  // The loss of the global batch: pipeline ranks agree already; mean over data.
  at::Tensor loss = at::tensor({local_loss}, at::kDouble);
  auto data = ctx_->comm(context::ParallelMode::kData)->control();  // a host scalar
  if (data->size() > 1) {
    data->all_reduce(loss);
    loss /= data->size();
  }
  stats.loss = loss.item<double>();
  stats.step = step_;
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  stats.wait_seconds = recorder_ ? recorder_->waited_seconds() - waited_before : 0;
  if (options_.rank_times()) gather_rank_times(stats);
  return stats;
}

void Trainer::gather_rank_times(StepStats& stats) const {
  auto world = ctx_->world()->control();  // host doubles
  const int n = world->size();
  at::Tensor mine = at::tensor({stats.seconds - stats.wait_seconds, stats.wait_seconds}, at::kDouble);
  at::Tensor all = at::empty({2 * n}, at::kDouble);
  world->all_gather(all, mine);
  const auto a = all.accessor<double, 1>();
  stats.rank_compute_seconds.resize(static_cast<size_t>(n));
  stats.rank_wait_seconds.resize(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    stats.rank_compute_seconds[static_cast<size_t>(r)] = a[2 * r];
    stats.rank_wait_seconds[static_cast<size_t>(r)] = a[2 * r + 1];
  }
  const auto& compute = stats.rank_compute_seconds;
  stats.slowest_rank = static_cast<int>(std::max_element(compute.begin(), compute.end()) - compute.begin());
  std::vector<double> sorted = compute;
  // The lower median: with two ranks, the other one.
  const int middle = (n - 1) / 2;
  std::nth_element(sorted.begin(), sorted.begin() + middle, sorted.end());
  stats.straggler_lag = compute[static_cast<size_t>(stats.slowest_rank)] - sorted[static_cast<size_t>(middle)];
}

double Trainer::evaluate(const at::Tensor& inputs_anywhere, const at::Tensor& targets_anywhere) {
  const at::Tensor inputs = on_device(inputs_anywhere, device_), targets = on_device(targets_anywhere, device_);
  // Eval mode: no dropout drawn (its random streams stay where training left
  // them) and BatchNorm reads its running statistics without updating them.
  const bool training = local_->is_training();
  local_->eval();
  struct Restore {
    torch::nn::Module& module;
    bool training;
    ~Restore() { module.train(training); }
  } restore{*local_, training};
  double local = 0;
  if (pipe_) {
    local = pipe_->evaluate(inputs, targets);
  } else {
    at::NoGradGuard no_grad;
    at::Tensor out = sharded_->run([&] { return model_.layers->forward(inputs); });
    local = model_.loss(out, targets).item<double>();
  }
  at::Tensor loss = at::tensor({local}, at::kDouble);
  auto data = ctx_->comm(context::ParallelMode::kData)->control();  // a host scalar
  if (data->size() > 1) {
    data->all_reduce(loss);
    loss /= data->size();
  }
  return loss.item<double>();
}

std::vector<TensorPiece> Trainer::state_pieces() {
  optimizer_->fetch_offloaded();  // Note [Disk offload]: the caller parks them again
  std::vector<TensorPiece> pieces = optimizer_pieces(*optimizer_, placements_);
  for (auto& b : buffer_pieces(*local_, ctx_->comm(context::ParallelMode::kData)->rank() == 0))
    pieces.push_back(std::move(b));
  return pieces;
}

std::vector<infer::PieceRequest> Trainer::state_requests(const std::vector<std::string>& optim_names) {
  std::vector<infer::PieceRequest> out = optimizer_requests(*optimizer_, placements_, optim_names);
  for (auto& b : buffer_requests(*local_)) out.push_back(std::move(b));
  return out;
}

std::string Trainer::state_metadata() const {
  Json meta;
  meta["step"] = step_;
  meta["world_size"] = ctx_->world()->size();
  meta["parallel"] = context::to_string(ctx_->config());
  meta["spec"] = options_.spec().to_string();
  meta["optimizer"] = optimizer_kind(optimizer_->inner());
  if (scaler_) {
    const auto s = scaler_->state();
    meta["loss_scaler"] = {{"scale", s.scale},
                           {"clean_steps", s.clean_steps},
                           {"hysteresis_left", s.hysteresis_left},
                           {"skipped", s.skipped}};
  }
  return meta.dump();
}

void Trainer::load_state(const infer::PieceSource& source, const std::string& metadata_json) {
  const Json meta = Json::parse(metadata_json);
  const std::string kind = optimizer_kind(optimizer_->inner());
  TORCH_CHECK(meta.value("optimizer", kind) == kind, source.describe(), " holds the states of optimizer '",
              meta.value("optimizer", ""), "', this trainer's optimizer is '", kind,
              "': their states do not carry over; resume with the same optimizer");
  load_optimizer_pieces(source, *optimizer_, placements_);
  load_buffer_pieces(source, *local_);
  step_ = meta.at("step").get<int64_t>();
  if (scaler_ && meta.contains("loss_scaler")) {
    const auto& s = meta["loss_scaler"];
    scaler_->load_state({s["scale"].get<double>(), s["clean_steps"].get<int64_t>(), s["hysteresis_left"].get<int64_t>(),
                         s["skipped"].get<int64_t>()});
  }
}

void Trainer::load_weights(const infer::PieceSource& source) { load_model_pieces(source, *optimizer_, placements_); }

void Trainer::save(const std::string& dir, const std::string& extra_json, const CheckpointOptions& options) {
  std::vector<TensorPiece> pieces = state_pieces();
  // This rank's random streams (Note [Random states in checkpoints]).
  for (auto& r : random_state_pieces(*local_, ctx_->global_rank())) pieces.push_back(std::move(r));
  Json meta = Json::parse(state_metadata());
  meta["extra"] = Json::parse(extra_json.empty() ? "{}" : extra_json);
  save_checkpoint(dir, pieces, meta.dump(), ctx_->world(), options);
  pieces.clear();
  optimizer_->park_offloaded();
}

std::string Trainer::load(const std::string& dir) {
  // Every rank opens it, so an error (a missing or partial checkpoint) is raised on every rank.
  infer::CheckpointReader reader(dir);
  load_state(reader, reader.metadata());
  const Json meta = Json::parse(reader.metadata());
  // Random streams belong to a rank's place in the same configuration.
  if (reader.world_size() == ctx_->world()->size() &&
      meta.value("parallel", "") == context::to_string(ctx_->config())) {
    for (const auto& name : load_random_state_pieces(reader, *local_, ctx_->global_rank()))
      log_warning(ctx_->global_rank(),
                  "checkpoint {}: random stream '{}' is of a device this process does not have; it is not restored, "
                  "so the resumed run is not bit-exact",
                  dir, name);
  }
  return meta.contains("extra") ? meta["extra"].dump() : "{}";
}

}  // namespace train
}  // namespace tessera
