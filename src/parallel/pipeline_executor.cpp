#include "tessera/parallel/pipeline_executor.h"

#include "split_backward.h"
#include "tessera/parallel/pipeline_partition.h"
#include "tessera/parallel/pipeline_simulator.h"
#include "tessera/parallel/sharded_module.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <optional>
#include <set>
#include <tuple>

namespace tessera {
namespace parallel {

namespace {

constexpr int kMaxDims = 8;
constexpr int kHeaderFields = 5 + kMaxDims;

// A message's header, on the control channel (Note [Pipeline message
// batches]): which message it is (activation or gradient, micro-batch,
// receiving stage), then dtype, number of dimensions and sizes. Receivers
// learn the shape and dtype of every activation and gradient from it.
at::Tensor make_header(const at::Tensor& t, bool activation, int microbatch, int stage) {
  TORCH_CHECK(t.dim() <= kMaxDims, "pipeline: a stage output has ", t.dim(), " dimensions; at most ", kMaxDims,
              " can be exchanged");
  at::Tensor h = at::zeros({kHeaderFields}, at::kLong);
  auto a = h.accessor<int64_t, 1>();
  a[0] = activation ? 1 : 0;
  a[1] = microbatch;
  a[2] = stage;
  a[3] = static_cast<int64_t>(t.scalar_type());
  a[4] = t.dim();
  for (int64_t d = 0; d < t.dim(); ++d) a[5 + d] = t.size(d);
  return h;
}

at::Tensor empty_from_header(const at::Tensor& h, const Action& expected, const c10::Device& device) {
  auto a = h.accessor<int64_t, 1>();
  const bool act = expected.kind == ActionKind::kRecvActivation;
  TORCH_INTERNAL_ASSERT(a[0] == (act ? 1 : 0) && a[1] == expected.microbatch && a[2] == expected.stage,
                        "pipeline: the message received for ", expected.to_string(), " is the ",
                        a[0] ? "activation" : "gradient", " of micro-batch ", a[1], " for stage ", a[2],
                        "; the schedule's message order is broken");
  std::vector<int64_t> sizes;
  for (int64_t d = 0; d < a[4]; ++d) sizes.push_back(a[5 + d]);
  return at::empty(sizes, at::TensorOptions().dtype(static_cast<at::ScalarType>(a[3])).device(device));
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// A remote message of a run: what is sent, or for a receive, what its
// header says arrives.
struct Message {
  Action action;
  at::Tensor payload;
  int peer = 0;
};

}  // namespace

struct PipelineExecutor::Impl {
  struct Slot {
    at::Tensor input, output, grad_output, input_grad;
    detail::SplitBackward split;  // between I and W
  };
  using Key = std::pair<int, int>;                // (micro-batch, stage)
  using MessageKey = std::tuple<bool, int, int>;  // (activation, micro-batch, receiving stage)
  std::map<Key, Slot> slots;
  std::vector<at::Tensor> inputs, targets;   // per micro-batch
  std::map<MessageKey, at::Tensor> mailbox;  // messages to this rank's own stages
  comm::CommunicatorPtr control;             // headers and the loss (Note [Control traffic])
  // Sends wait for their receivers (NCCL): messages go in the paired batches
  // of message_batches. Otherwise a run's sends are posted first and waited
  // at the end of the step (Note [Pipeline message batches]).
  bool paired = false;
  // Paired, but the schedule's batches would not complete if sends were
  // waited with them (MPI's synchronous sends only; NCCL refuses it): sends
  // are posted apart and waited at the end of the step.
  bool sends_block = false;
  std::vector<comm::WorkPtr> sends;
  double loss = 0;
  double loss_scale = 1.0;
  bool forward_only = false;
  c10::Device device = c10::Device(c10::kCPU);
  // Note [ZeRO-3 under a pipeline]
  // With sharded parameters (ZeRO-3, {P(k),..}) the executor gathers a
  // stage's units around each of its actions (F, B, I, W) and frees them
  // after, so a rank holds full parameters of one stage for the length of
  // one action: per stage and micro-batch, as Megatron and PyTorch's
  // pipelining do with FSDP. Gradient sync stays off during the schedule:
  // the stage's full gradients accumulate locally over the micro-batches and
  // are reduce-scattered once after it (Trainer: reduce_gradients()), so the
  // gradient traffic equals ZeRO-2's and the extra traffic is the gathers,
  // one per action that touches the parameters. The split backward's W
  // gathers again: generic autograd nodes may read a weight to produce its
  // own gradient. All data ranks of a stage run the same actions in the same
  // order, so the gathers over the data group line up.
  std::shared_ptr<ShardedModule> sharded;
  std::map<int, std::vector<size_t>> stage_units;  // stage -> units of `sharded`

  void deliver(const Action& a, const at::Tensor& payload);
  void exchange(std::vector<Message>& messages, bool sends_apart, comm::Communicator& payload_group);
};

namespace {

// Note [Other stages released]
// Every pipeline rank builds the whole model (the same layers and initial
// values), but runs only its stages. The parameters and buffers of the
// other layers are released here: set_data swaps each one's storage for an
// empty tensor, so the module tree, the names and the tensors' identities
// stay and only the memory goes. A weight shared with a local layer (the
// tied embedding on the last stage) is kept. Without this a pipeline rank
// held a whole model's parameters beside its stages' gradients and
// optimizer states.
void release_other_stages(torch::nn::Sequential& model, const std::map<int, torch::nn::Sequential>& local) {
  std::set<const c10::TensorImpl*> kept;
  for (const auto& [stage, chunk] : local) {
    for (const auto& p : chunk->parameters()) kept.insert(p.unsafeGetTensorImpl());
    for (const auto& b : chunk->buffers()) kept.insert(b.unsafeGetTensorImpl());
  }
  auto release = [&](at::Tensor t) {
    if (!t.defined() || kept.count(t.unsafeGetTensorImpl()) || t.numel() == 0) return;
    t.mutable_grad() = at::Tensor();
    t.set_data(at::empty({0}, t.options()));
  };
  for (const auto& p : model->parameters()) release(p);
  for (const auto& b : model->buffers()) release(b);
}

}  // namespace

PipelineExecutor::PipelineExecutor(torch::nn::Sequential model, const context::ParallelContextPtr& ctx,
                                   PipelineLossFn loss, PipelineOptions options)
    : options_(std::move(options)), loss_(std::move(loss)), impl_(std::make_unique<Impl>()) {
  group_ = options_.group() ? options_.group() : ctx->comm(context::ParallelMode::kPipeline);
  TORCH_CHECK(loss_ != nullptr, "pipeline: a loss function is needed");
  schedule_ = make_schedule(options_.schedule(), group_->size(), options_.microbatches(), options_.chunks());
  forward_schedule_ =
      make_forward_schedule(group_->size(), options_.microbatches(), options_.chunks(), schedule_.v_shape);
  const int stages = schedule_.stages();
  const int64_t n = static_cast<int64_t>(model->size());
  switch (options_.partition()) {
    case PartitionMethod::kLayerCount:
      bounds_ = partition_by_count(n, stages);
      break;
    case PartitionMethod::kParameterCount: {
      std::vector<double> weights;
      for (const auto& child : model->children()) {
        double w = 0;
        for (const auto& p : child->parameters()) w += static_cast<double>(p.numel());
        weights.push_back(w);
      }
      bounds_ = partition_by_weight(weights, stages);
      break;
    }
    case PartitionMethod::kSizes:
      bounds_ = partition_by_sizes(options_.stage_sizes(), n, stages);
      break;
    case PartitionMethod::kWeights:
      TORCH_CHECK(static_cast<int64_t>(options_.layer_weights().size()) == n,
                  "pipeline: ", options_.layer_weights().size(), " layer weights given for a model of ", n, " layers");
      bounds_ = partition_by_weight(options_.layer_weights(), stages);
      break;
    case PartitionMethod::kMeasuredTime: {
      TORCH_CHECK(options_.sample().defined(),
                  "pipeline: PartitionMethod::kMeasuredTime needs a sample micro-batch "
                  "(PipelineOptions().sample(inputs))");
      // Every rank measures (tensor-parallel layers communicate); rank 0's
      // times decide, so that all ranks cut the model alike.
      const auto seconds = measure_layer_seconds(model, options_.sample());
      at::Tensor t = at::tensor(seconds, at::kDouble);
      group_->broadcast(t);
      bounds_ = partition_by_weight(std::vector<double>(t.data_ptr<double>(), t.data_ptr<double>() + n), stages);
      break;
    }
  }
  const auto names = model->named_children().keys();
  auto stage_params = [&](int s) {
    std::set<const c10::TensorImpl*> out;
    for (int64_t i = bounds_[s]; i < bounds_[s + 1]; ++i)
      for (const auto& p : model->ptr(i)->parameters()) out.insert(p.unsafeGetTensorImpl());
    return out;
  };
  for (int s = 0; s < stages; ++s) {
    if (schedule_.rank_of(s) != group_->rank()) continue;
    torch::nn::Sequential chunk;
    for (int64_t i = bounds_[s]; i < bounds_[s + 1]; ++i) chunk->push_back(names[i], *(model->begin() + i));
    chunks_.emplace(s, chunk);
  }
  // Note [Pipeline loss and tied weights]: parameters of both end stages.
  if (stages > 1) {
    const auto last = stage_params(stages - 1);
    for (int64_t i = bounds_[0]; i < bounds_[1]; ++i)
      for (const auto& p : model->ptr(i)->parameters())
        if (last.count(p.unsafeGetTensorImpl())) tied_.push_back(p);
    const int first_rank = schedule_.rank_of(0), last_rank = schedule_.rank_of(stages - 1);
    const bool holder = group_->rank() == first_rank || group_->rank() == last_rank;
    if (first_rank != last_rank) tied_group_ = group_->split(holder ? 0 : -1, group_->rank(), "pipeline.tied");
    if (!holder) tied_.clear();
  }
  for (const auto& p : parameters()) {
    impl_->device = p.device();
    break;
  }
  release_other_stages(model, chunks_);
  impl_->control = group_->control();
  // The generators' messages pair without tags (Note [Pipeline message batches]).
  bool completes = true;
  batches_ = message_batches(schedule_, &completes);
  forward_batches_ = message_batches(forward_schedule_);
  impl_->paired = group_->sends_wait_for_receiver();
  impl_->sends_block = impl_->paired && !completes;
  TORCH_CHECK(completes || group_->backend().find("nccl") == std::string::npos, "pipeline: the ",
              schedule_.name, " schedule with pp ", schedule_.pp, " and ", options_.microbatches(),
              " micro-batches has message batches that deadlock when sends block until received, as NCCL's do "
              "(Note [Pipeline message batches]); use gpipe, 1f1b or zb-h1, another number of micro-batches, or "
              "the mpi backend");
  if (options_.shard()) {
    // Note [ZeRO-3 under a pipeline]: the gather hook, once; the function is not kept.
    impl_->sharded = options_.shard()(local_layers());
    options_.shard(nullptr);
    if (impl_->sharded)
      for (const auto& [stage, chunk] : chunks_)
        impl_->stage_units[stage] = impl_->sharded->units_holding(chunk->parameters());
  }
}

PipelineExecutor::~PipelineExecutor() = default;

std::vector<double> measure_layer_seconds(torch::nn::Sequential model, const at::Tensor& sample, int repeats) {
  TORCH_CHECK(repeats >= 1, "measure_layer_seconds: repeats must be >= 1, got ", repeats);
  std::vector<double> best(model->size(), std::numeric_limits<double>::infinity());
  for (int rep = 0; rep < repeats; ++rep) {
    at::Tensor x = sample;
    for (size_t i = 0; i < model->size(); ++i) {
      at::Tensor in = x.detach();
      if (in.is_floating_point()) in.requires_grad_(true);
      const auto t0 = std::chrono::steady_clock::now();
      at::Tensor out = (model->begin() + static_cast<std::ptrdiff_t>(i))->forward(in);
      if (out.requires_grad()) out.backward(at::ones_like(out));
      best[i] = std::min(best[i], seconds_since(t0));
      x = out.detach();
    }
  }
  for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
  return best;
}

std::vector<at::Tensor> PipelineExecutor::parameters() const {
  std::vector<at::Tensor> out;
  std::set<const c10::TensorImpl*> seen;
  for (const auto& [s, chunk] : chunks_)
    for (const auto& p : chunk->parameters())
      if (seen.insert(p.unsafeGetTensorImpl()).second) out.push_back(p);
  return out;
}

std::vector<at::Tensor> PipelineExecutor::tied_copies() const {
  return chunks_.count(0) ? std::vector<at::Tensor>{} : tied_;
}

std::vector<at::Tensor> PipelineExecutor::unique_parameters() const {
  std::set<const c10::TensorImpl*> tied;
  for (const auto& p : tied_copies()) tied.insert(p.unsafeGetTensorImpl());
  std::vector<at::Tensor> out;
  for (const auto& p : parameters())
    if (!tied.count(p.unsafeGetTensorImpl())) out.push_back(p);
  return out;
}

LocalLayers PipelineExecutor::local_layers() const {
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> out;
  for (const auto& [s, chunk] : chunks_)
    for (const auto& item : chunk->named_children()) out.emplace_back(item.key(), item.value());
  return out;
}

double PipelineExecutor::run(const at::Tensor& inputs, const at::Tensor& targets, double loss_scale) {
  TORCH_CHECK(std::isfinite(loss_scale) && loss_scale > 0, "pipeline: the loss scale must be positive and finite, got ",
              loss_scale);
  impl_->loss_scale = loss_scale;
  impl_->forward_only = false;
  return run_schedule(schedule_, inputs, targets);
}

double PipelineExecutor::evaluate(const at::Tensor& inputs, const at::Tensor& targets) {
  at::NoGradGuard no_grad;
  impl_->loss_scale = 1.0;
  impl_->forward_only = true;
  return run_schedule(forward_schedule_, inputs, targets);
}

double PipelineExecutor::run_schedule(const Schedule& schedule, const at::Tensor& inputs, const at::Tensor& targets) {
  Impl& st = *impl_;
  const int m = options_.microbatches(), stages = schedule.stages(), me = group_->rank();
  auto split = [&](const at::Tensor& t, const char* what) {
    std::vector<at::Tensor> out;
    if (!t.defined()) return out;
    TORCH_CHECK(t.dim() >= 1 && t.size(0) % m == 0, "pipeline: the batch's ", what, " have ",
                t.dim() >= 1 ? t.size(0) : 0, " rows, which do not split into ", m,
                " equal micro-batches; use a batch size divisible by the number of micro-batches");
    for (int i = 0; i < m; ++i) out.push_back(t.narrow(0, i * (t.size(0) / m), t.size(0) / m));
    return out;
  };
  st.inputs = split(inputs, "inputs");
  st.targets = split(targets, "targets");
  TORCH_CHECK(!chunks_.count(0) || !st.inputs.empty(), "pipeline: the first stage needs the inputs");
  TORCH_CHECK(!chunks_.count(stages - 1) || !st.targets.empty(), "pipeline: the last stage needs the targets");
  st.loss = 0;
  stats_ = PipelineRunStats();

  const auto& actions = schedule.ranks[me];
  const std::vector<int>& batch_of = (&schedule == &schedule_ ? batches_ : forward_batches_)[me];
  size_t i = 0;
  while (i < actions.size()) {
    if (!actions[i].is_compute()) {
      const auto t0 = std::chrono::steady_clock::now();
      i = run_messages(actions, i, batch_of);
      stats_.wait_seconds += seconds_since(t0);
      continue;
    }
    const auto t0 = std::chrono::steady_clock::now();
    run_action(actions[i]);
    const double dt = seconds_since(t0);
    stats_.compute_seconds += dt;
    stats_.seconds[static_cast<int>(actions[i].kind)] += dt;
    ++stats_.count[static_cast<int>(actions[i].kind)];
    ++i;
  }
  return finish_run();
}

// A run of consecutive messages from actions[first]: its sends are taken
// from their slots, then it is exchanged whole, or batch by batch where
// sends wait for their receivers, each exchange in two phases: headers on
// the control channel, payloads on the device channel (Note [Pipeline
// message batches]). Returns the index after the run.
size_t PipelineExecutor::run_messages(const std::vector<Action>& actions, size_t first,
                                      const std::vector<int>& batch_of) {
  Impl& st = *impl_;
  const int me = group_->rank();
  std::vector<Message> run;                     // in action order
  std::map<int, std::vector<Message>> batches;  // batch number -> its messages, in action order
  std::vector<Action> local;                    // hand-overs between this rank's own stages
  size_t i = first;
  for (; i < actions.size() && !actions[i].is_compute(); ++i) {
    const Action& a = actions[i];
    const bool act = a.kind == ActionKind::kSendActivation || a.kind == ActionKind::kRecvActivation;
    auto& to_post = st.paired ? batches[batch_of[i]] : run;
    if (a.kind == ActionKind::kSendActivation || a.kind == ActionKind::kSendGrad) {
      Impl::Slot& slot = st.slots[{a.microbatch, a.stage}];
      at::Tensor t = (act ? slot.output : slot.input_grad).detach().contiguous();
      const int to = act ? a.stage + 1 : a.stage - 1;
      if (schedule_.rank_of(to) == me) {
        st.mailbox[{act, a.microbatch, to}] = t;
      } else {
        to_post.push_back({a, t, schedule_.rank_of(to)});
      }
      if (!act) slot.input_grad = at::Tensor();
      if (act && st.forward_only) st.slots.erase({a.microbatch, a.stage});  // nothing to keep for a backward
    } else {
      const int from = act ? a.stage - 1 : a.stage + 1;
      if (schedule_.rank_of(from) == me) {
        local.push_back(a);
      } else {
        to_post.push_back({a, at::Tensor(), schedule_.rank_of(from)});
      }
    }
  }
  // Where sends may be posted apart (they do not wait for their receivers,
  // or the batches would not complete with them), they go first and are
  // waited at the end of the step; otherwise each phase is one batch with
  // the receives.
  const bool sends_apart = !st.paired || st.sends_block;
  if (sends_apart)
    st.sends.erase(std::remove_if(st.sends.begin(), st.sends.end(), [](auto& w) { return w->is_completed(); }),
                   st.sends.end());
  if (!run.empty()) st.exchange(run, sends_apart, *group_);
  for (auto& [number, messages] : batches) st.exchange(messages, sends_apart, *group_);
  for (const auto& a : local) {
    auto it = st.mailbox.find({a.kind == ActionKind::kRecvActivation, a.microbatch, a.stage});
    TORCH_INTERNAL_ASSERT(it != st.mailbox.end(), "pipeline: local message missing for ", a.to_string());
    st.deliver(a, it->second);
    st.mailbox.erase(it);
  }
  return i;
}

// The step's end: the sends posted apart, the tied weights' gradients, and
// the loss from the last stage to every rank.
double PipelineExecutor::finish_run() {
  Impl& st = *impl_;
  for (auto& w : st.sends) w->wait();
  st.sends.clear();
  TORCH_INTERNAL_ASSERT(st.mailbox.empty(), "pipeline: ", st.mailbox.size(), " local messages never received");
  st.slots.clear();
  if (tied_group_ && !tied_.empty() && !st.forward_only) {
    for (auto& p : tied_) {
      if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
      at::Tensor g = p.mutable_grad();
      tied_group_->all_reduce(g);
    }
  }
  at::Tensor loss = at::tensor({st.loss}, at::kDouble);
  comm::BroadcastOptions b;
  b.root = schedule_.rank_of(schedule_.stages() - 1);
  st.control->broadcast(loss, b);
  return loss.item<double>();
}

void PipelineExecutor::Impl::deliver(const Action& a, const at::Tensor& payload) {
  Slot& slot = slots[{a.microbatch, a.stage}];
  if (a.kind == ActionKind::kRecvActivation) {
    slot.input = payload.detach();
    if (slot.input.is_floating_point() && !forward_only) slot.input.requires_grad_(true);
  } else {
    slot.grad_output = payload;
  }
}

// One exchange: headers, then payloads (Note [Pipeline message batches]).
void PipelineExecutor::Impl::exchange(std::vector<Message>& messages, bool sends_apart, comm::Communicator& payload_group) {
  std::vector<comm::P2POp> headers, payloads, header_sends, payload_sends;
  for (const auto& msg : messages) {
    if (!msg.payload.defined()) continue;
    const bool act = msg.action.kind == ActionKind::kSendActivation;
    const int to = act ? msg.action.stage + 1 : msg.action.stage - 1;
    header_sends.push_back({comm::P2POp::Kind::kSend, make_header(msg.payload, act, msg.action.microbatch, to), msg.peer});
    payload_sends.push_back({comm::P2POp::Kind::kSend, msg.payload, msg.peer});
  }
  if (sends_apart && !header_sends.empty()) {
    sends.push_back(control->batch_isend_irecv(header_sends));
    sends.push_back(payload_group.batch_isend_irecv(payload_sends));
  } else {
    headers = std::move(header_sends);
    payloads = std::move(payload_sends);
  }
  std::vector<std::pair<Message*, size_t>> receiving;  // the message, its header's index
  for (auto& msg : messages) {
    if (msg.payload.defined()) continue;
    receiving.emplace_back(&msg, headers.size());
    headers.push_back({comm::P2POp::Kind::kRecv, at::empty({kHeaderFields}, at::kLong), msg.peer});
  }
  if (!headers.empty()) control->batch_isend_irecv(headers)->wait();
  for (auto& [msg, k] : receiving) {
    msg->payload = empty_from_header(headers[k].tensor, msg->action, device);
    payloads.push_back({comm::P2POp::Kind::kRecv, msg->payload, msg->peer});
  }
  if (!payloads.empty()) payload_group.batch_isend_irecv(payloads)->wait();
  for (auto& [msg, k] : receiving) deliver(msg->action, msg->payload);
}

void PipelineExecutor::run_action(const Action& a) {
  Impl& st = *impl_;
  const int last = schedule_.stages() - 1;
  Impl::Slot& slot = st.slots[{a.microbatch, a.stage}];
  const bool is_last = a.stage == last;
  std::optional<ShardedModule::GatheredUnits> gathered;  // Note [ZeRO-3 under a pipeline]
  if (st.sharded) gathered.emplace(*st.sharded, st.stage_units.at(a.stage));
  // The tensor the backward starts from and its gradient (none for the loss).
  auto roots = [&] {
    return std::make_pair(
        torch::autograd::variable_list{slot.output},
        is_last ? torch::autograd::variable_list{} : torch::autograd::variable_list{slot.grad_output});
  };
  switch (a.kind) {
    case ActionKind::kForward: {
      at::Tensor in = a.stage == 0 ? st.inputs[a.microbatch] : slot.input;
      at::Tensor out = chunks_.at(a.stage)->forward(in);
      if (is_last) {
        out = loss_(out, st.targets[a.microbatch]) / options_.microbatches();
        st.loss += out.item<double>();
        if (st.forward_only) {
          st.slots.erase({a.microbatch, a.stage});
          break;
        }
        if (st.loss_scale != 1.0) out = out * st.loss_scale;
      }
      slot.output = out;
      break;
    }
    case ActionKind::kBackward: {
      auto [outputs, grads] = roots();
      torch::autograd::backward(outputs, grads);
      if (a.stage > 0) slot.input_grad = slot.input.grad();
      slot.output = slot.grad_output = slot.input = at::Tensor();
      break;
    }
    case ActionKind::kBackwardInput: {
      // Note [Split backward]: only the input's gradient now; what W needs
      // stays in slot.split, the rest of the graph goes.
      slot.input_grad = slot.split.input_part(slot.output, is_last ? at::Tensor() : slot.grad_output,
                                              a.stage == 0 ? at::Tensor() : slot.input);
      slot.output = slot.grad_output = slot.input = at::Tensor();
      break;
    }
    case ActionKind::kBackwardWeight: {
      slot.split.weight_part();
      st.slots.erase({a.microbatch, a.stage});
      break;
    }
    default:
      TORCH_INTERNAL_ASSERT(false, "pipeline: ", a.to_string(), " is not a compute action");
  }
}

}  // namespace parallel
}  // namespace tessera
