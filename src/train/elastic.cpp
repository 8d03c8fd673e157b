#include "tessera/train/elastic.h"

#include "tessera/comm/agree.h"
#include "tessera/core/hash.h"
#include "tessera/core/logging.h"
#include "tessera/nn/parallel_dropout.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <ctime>
#include <numeric>
#include <mutex>
#include <sstream>
#include <thread>

namespace tessera {
namespace train {
namespace {

using Json = nlohmann::json;
using context::ParallelMode;

constexpr int64_t kReshape = 1, kFinish = 2;

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

int layout_size(const context::ParallelConfig& c) { return c.data() * c.pipeline() * c.tensor() * c.sequence(); }

// The layout resolved over its own ranks; the same error on every rank.
context::ParallelConfig checked_layout(const context::ParallelConfig& layout, int world_size) {
  TORCH_CHECK(layout.data() >= 1, "elastic layout ", context::to_string(layout),
              ": the data size must be given (>= 1), since the layout runs on part of the world; got ", layout.data());
  const int size = layout_size(layout);
  TORCH_CHECK(size <= world_size, "elastic layout ", context::to_string(layout), " needs ", size,
              " ranks, but the world has ", world_size, "; launch more ranks or choose a smaller layout");
  return context::resolve(layout, size);
}

int coordinate(const context::ParallelContext& ctx, ParallelMode mode) { return ctx.has(mode) ? ctx.rank(mode) : 0; }

// Note [Random streams in migration]: a stream's key is its rank's place.
std::string stream_key(int data, int tensor, int sequence, int stage) {
  std::ostringstream out;
  out << "elastic/d" << data << ".t" << tensor << ".s" << sequence << ".p" << stage;
  return out.str();
}

std::string stream_key(const context::ParallelContext& ctx, int data) {
  return stream_key(data, coordinate(ctx, ParallelMode::kTensor), coordinate(ctx, ParallelMode::kSequence),
                    coordinate(ctx, ParallelMode::kPipeline));
}

// Keeps the process's default CPU generator as it was over a scope.
class KeepDefaultGenerator {
 public:
  KeepDefaultGenerator() : gen_(at::globalContext().defaultGenerator(c10::Device(c10::kCPU))) {
    std::lock_guard<std::mutex> lock(gen_.mutex());
    state_ = gen_.get_state();
  }
  ~KeepDefaultGenerator() {
    std::lock_guard<std::mutex> lock(gen_.mutex());
    gen_.set_state(state_);
  }

 private:
  at::Generator gen_;
  at::Tensor state_;
};

// Note [Sharding spec per data size]
parallel::Placement fitted(const parallel::Placement& p, int data) {
  // P(host) stays: ShardedModule finds the hosts of each layout's group.
  if (p.kind() != parallel::Placement::Kind::kPartialShard || p.per_host()) return p;
  const int k = std::gcd(p.k(), data);
  return k == 1 ? parallel::Placement::replicate() : parallel::Placement::partial_shard(k);
}

c10::Device device_of(Trainer* trainer) {
  if (trainer != nullptr)
    for (const auto& p : trainer->local_module().parameters()) return p.device();
  return c10::Device(c10::kCPU);
}

}  // namespace

std::string MigrationStats::to_json() const {
  Json j;
  j["from"] = from;
  j["to"] = to;
  j["step"] = step;
  j["bytes_moved"] = bytes_moved;
  j["bytes_kept"] = bytes_kept;
  j["messages"] = messages;
  j["seconds"] = seconds;
  j["build_seconds"] = build_seconds;
  j["exchange_seconds"] = exchange_seconds;
  return j.dump();
}

int data_size_for(int64_t global_batch, int max_data, int64_t min_rows, int64_t accumulation, int data_multiple) {
  TORCH_CHECK(global_batch >= 1 && max_data >= 1 && min_rows >= 1 && accumulation >= 1 && data_multiple >= 1,
              "data_size_for: the batch (", global_batch, "), the largest data size (", max_data,
              "), the rows per replica (", min_rows, "), accumulation (", accumulation, ") and the multiple (",
              data_multiple, ") must all be >= 1");
  TORCH_CHECK(data_multiple <= max_data, "data_size_for: the data size must be a multiple of ", data_multiple,
              " (the expert-parallel size), but at most ", max_data, " fits in the world");
  auto fits = [&](int d) {
    const int64_t rows = global_batch / d;
    return global_batch % d == 0 && rows % accumulation == 0;
  };
  for (int d = max_data - max_data % data_multiple; d > data_multiple; d -= data_multiple)
    if (fits(d) && global_batch / d >= min_rows) return d;
  TORCH_CHECK(fits(data_multiple), "data_size_for: a global batch of ", global_batch, " rows does not split into ",
              data_multiple, " replicas with a multiple of ", accumulation,
              " rows each (the accumulation steps); choose a batch that does");
  return data_multiple;
}

ElasticTrainer::ElasticTrainer(comm::CommunicatorPtr world, ModelBuilder build, OptimizerFactory make_optimizer,
                               const context::ParallelConfig& layout, ElasticOptions options)
    : world_(std::move(world)),
      build_(std::move(build)),
      make_optimizer_(std::move(make_optimizer)),
      options_(std::move(options)) {
  TORCH_CHECK(world_ != nullptr && build_ && make_optimizer_,
              "ElasticTrainer: the world, the model builder and the optimizer factory must be given");
  TORCH_CHECK(options_.min_rows_per_replica() >= 1, "ElasticTrainer: min_rows_per_replica must be >= 1, got ",
              options_.min_rows_per_replica());
  TORCH_CHECK(options_.idle_poll().count() >= 1, "ElasticTrainer: idle_poll must be >= 1 ms, got ",
              options_.idle_poll().count(), " ms");
  layout_ = checked_layout(layout, world_->size());
  auto group = world_->split(world_->rank() < layout_size(layout_) ? 0 : -1, world_->rank(), "world");
  // A builder or trainer option that fails stops the idle ranks too.
  comm::on_every_rank(world_, "building layout " + context::to_string(layout_), [&] {
    if (!group) return;
    auto ctx = context::ParallelContext::create(group, layout_);
    trainer_ = std::make_unique<Trainer>(ctx, build_(ctx), make_optimizer_, options_for(layout_));
  });
}

ElasticTrainer::~ElasticTrainer() = default;

TrainerOptions ElasticTrainer::options_for(const context::ParallelConfig& layout) const {
  TrainerOptions o = options_.trainer();
  parallel::ShardingSpec spec = o.spec();
  spec.params = fitted(spec.params, layout.data());
  spec.grads = fitted(spec.grads, layout.data());
  spec.optim_states = fitted(spec.optim_states, layout.data());
  return o.spec(spec);
}

Trainer& ElasticTrainer::trainer() {
  TORCH_CHECK(trainer_ != nullptr, "ElasticTrainer: world rank ", world_->rank(), " is idle in layout ",
              context::to_string(layout_), "; only its first ", active_size(), " ranks train (check active())");
  return *trainer_;
}

int ElasticTrainer::active_size() const { return layout_size(layout_); }

context::ParallelContext::Rows ElasticTrainer::rows_of(int64_t global_batch) const {
  TORCH_CHECK(trainer_ != nullptr, "ElasticTrainer::rows_of: world rank ", world_->rank(), " is idle");
  return trainer_->context()->batch_rows(global_batch);
}

std::string ElasticTrainer::layout_name() const {
  std::ostringstream out;
  out << "dp" << layout_.data() << " pp" << layout_.pipeline() << " tp" << layout_.tensor();
  if (layout_.sequence() > 1) out << " sp" << layout_.sequence();
  return out.str();
}

void ElasticTrainer::release_idle() {
  // Only its arrival counts: agree() checks what every rank was called for.
  at::Tensor msg = at::zeros({1}, at::kLong);
  auto control = world_->control();
  for (int r = active_size(); r < world_->size(); ++r) control->send(msg, r);
}

void ElasticTrainer::wait_for_leader() {
  // Note [Live resharding] 1: polled, so the wait takes no core and no timeout.
  const double wall = now_seconds(), cpu = cpu_seconds();
  at::Tensor msg = at::empty({1}, at::kLong);
  comm::RecvOptions async;
  async.async = true;
  auto work = world_->control()->recv(msg, 0, async);
  while (!work->is_completed()) std::this_thread::sleep_for(options_.idle_poll());
  work->wait();
  idle_wall_ += now_seconds() - wall;
  idle_cpu_ += cpu_seconds() - cpu;
}

namespace {

// Every rank called for the same thing, or every rank throws.
void agree(comm::Communicator& world, int64_t kind, uint64_t hash, const std::string& what) {
  const auto v = static_cast<int64_t>(splitmix64(hash ^ static_cast<uint64_t>(kind)) >> 1);
  at::Tensor t = at::tensor({v, -v}, at::kLong);
  world.control()->all_reduce(t, comm::AllReduceOptions{comm::ReduceOp::kMax});
  TORCH_CHECK(t[0].item<int64_t>() == -t[1].item<int64_t>(), "ElasticTrainer: the ranks of the world did not all call ",
              what, " (or called it with different layouts); every rank must call reshape(), adapt() and finish() "
              "alike, from a batch schedule that gives the same batch on every rank");
}

}  // namespace

MigrationStats ElasticTrainer::reshape(const context::ParallelConfig& layout) {
  TORCH_CHECK(!finished_, "ElasticTrainer: reshape() after finish()");
  const context::ParallelConfig next = checked_layout(layout, world_->size());
  const std::string name = context::to_string(next);
  const uint64_t hash = hash_bytes(name.data(), name.size());
  if (!active()) {
    wait_for_leader();
  } else if (world_->rank() == 0) {
    release_idle();
  }
  agree(*world_, kReshape, hash, "reshape(" + context::to_string(next) + ")");
  const double after_wait = now_seconds();

  MigrationStats stats;
  stats.from = context::to_string(layout_);
  stats.to = context::to_string(next);
  // 2. The running state as pieces.
  std::vector<TensorPiece> held;
  std::string meta;
  int old_data = layout_.data();
  if (trainer_) {
    held = trainer_->state_pieces();
    const auto& ctx = *trainer_->context();
    for (auto& r : random_state_pieces(trainer_->local_module(),
                                       stream_key(ctx, ctx.rank(ParallelMode::kData)), false))
      held.push_back(std::move(r));
    meta = trainer_->state_metadata();
  }
  const PieceDirectory directory = PieceDirectory::gather(*world_, held, meta);
  stats.step = Json::parse(directory.metadata(0)).at("step").get<int64_t>();

  // 3. The new layout's ranks build its trainer.
  const double build_start = now_seconds();
  auto group = world_->split(world_->rank() < layout_size(next) ? 0 : -1, world_->rank(), "world");
  std::unique_ptr<Trainer> fresh;
  std::vector<infer::PieceRequest> requests;
  const bool streams_move = next.tensor() == layout_.tensor() && next.pipeline() == layout_.pipeline() &&
                            next.sequence() == layout_.sequence();
  std::string stream_source;
  // A builder that fails on the new ranks stops every rank instead of
  // leaving the others in the exchange.
  comm::on_every_rank(world_, "building layout " + stats.to, [&] {
    if (!group) return;
    {
      KeepDefaultGenerator keep;
      auto ctx = context::ParallelContext::create(group, next);
      fresh = std::make_unique<Trainer>(ctx, build_(ctx), make_optimizer_, options_for(next));
    }
    requests = fresh->state_requests(directory.names("optim/"));
    if (streams_move) {
      const auto& ctx = *fresh->context();
      const int d = ctx.rank(ParallelMode::kData);
      stream_source = stream_key(ctx, d < old_data ? d : 0);
      for (const auto& name : directory.names("rng/" + stream_source + "/")) requests.push_back({name, {}, {}, 0, -1});
    }
  });
  const double build_seconds = now_seconds() - build_start;

  // 4. The exchange, then the new trainer loads what it received.
  PieceExchangeStats ex;
  const c10::Device device = device_of(trainer_ ? trainer_.get() : fresh.get());
  const ExchangedPieces got = exchange_pieces(world_, directory, held, requests, device,
                                              "live resharding from " + stats.from + " to " + stats.to, &ex);
  held.clear();
  trainer_.reset();
  if (fresh) {
    fresh->load_state(got, directory.metadata(0));
    if (!stream_source.empty()) {
      load_random_state_pieces(got, fresh->local_module(), stream_source);
      if (fresh->context()->rank(ParallelMode::kData) >= old_data)
        for (auto* d : nn::dropout_layers(fresh->local_module()))
          if (!d->options.row_keyed()) d->reset();
    }
  }
  trainer_ = std::move(fresh);
  const context::ParallelConfig previous = layout_;
  layout_ = next;

  at::Tensor sums = at::tensor({ex.bytes_sent, ex.bytes_copied, ex.messages}, at::kLong);
  world_->control()->all_reduce(sums);
  at::Tensor times = at::tensor({now_seconds() - after_wait, build_seconds, ex.seconds}, at::kDouble);
  world_->control()->all_reduce(times, comm::AllReduceOptions{comm::ReduceOp::kMax});
  stats.bytes_moved = sums[0].item<int64_t>();
  stats.bytes_kept = sums[1].item<int64_t>();
  stats.messages = sums[2].item<int64_t>();
  stats.seconds = times[0].item<double>();
  stats.build_seconds = times[1].item<double>();
  stats.exchange_seconds = times[2].item<double>();
  if (!streams_move && world_->rank() == 0)
    log_info(0, "elastic: {} -> {} changes the tensor, pipeline or sequence size; dropout streams restart from "
                "their seeds (Note [Random streams in migration])",
             context::to_string(previous), stats.to);
  history_.push_back(stats);
  return stats;
}

bool ElasticTrainer::adapt(int64_t global_batch) {
  const int per_replica = layout_.pipeline() * layout_.tensor() * layout_.sequence();
  const int d = data_size_for(global_batch, world_->size() / per_replica, options_.min_rows_per_replica(),
                              options_.trainer().accumulation(), layout_.expert());
  if (d == layout_.data()) return false;
  context::ParallelConfig next = layout_;
  next.data(d);
  reshape(next);
  return true;
}

void ElasticTrainer::finish() {
  if (finished_) return;
  if (!active()) {
    wait_for_leader();
  } else if (world_->rank() == 0) {
    release_idle();
  }
  agree(*world_, kFinish, 0, "finish()");
  finished_ = true;
}

}  // namespace train
}  // namespace tessera
