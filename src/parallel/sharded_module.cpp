#include "tessera/parallel/sharded_module.h"

#include "tessera/core/error.h"
#include "tessera/parallel/flat_bucket.h"
#include "tessera/parallel/module_layout.h"
#include "tessera/parallel/spec_on_hosts.h"
#include "tessera/parallel/unit_host.h"

#include "shard_state.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/modules/container/sequential.h>

#include <algorithm>
#include <map>
#include <set>
#include <utility>

namespace tessera {
namespace parallel {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct GradReadyHook : torch::autograd::FunctionPostHook {
  GradReadyHook(std::weak_ptr<ShardState> state, size_t bucket, size_t slot)
      : state_(std::move(state)), bucket_(bucket), slot_(slot) {}
  variable_list operator()(const variable_list& outputs, const variable_list& /*inputs*/) override {
    if (auto s = state_.lock()) s->on_grad_ready(bucket_, slot_, s);
    return outputs;
  }
  std::weak_ptr<ShardState> state_;
  size_t bucket_;
  size_t slot_;
};

struct StateCapsule : torch::CustomClassHolder {
  std::weak_ptr<ShardState> state;
  std::vector<size_t> units;
  size_t prefetch_unit;
};

// Identity in forward; in backward, gathers the units whose backward follows.
struct PreBackward : torch::autograd::Function<PreBackward> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, c10::intrusive_ptr<StateCapsule> capsule) {
    ctx->saved_data["state"] = at::IValue::make_capsule(std::move(capsule));
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto holder = ctx->saved_data["state"].toCapsule();
    auto* capsule = static_cast<StateCapsule*>(holder.get());
    if (auto s = capsule->state.lock()) s->pre_backward(capsule->units, capsule->prefetch_unit, s);
    return {grads[0], at::Tensor()};
  }
};

}  // namespace

ShardedModule::ShardedModule(std::shared_ptr<torch::nn::Module> module, context::ParallelContextPtr ctx,
                             ShardedModuleOptions options)
    : module_(std::move(module)), ctx_(std::move(ctx)), options_(std::move(options)) {
  TORCH_CHECK(module_ != nullptr, "ShardedModule: the module is null");
  TORCH_CHECK(ctx_ != nullptr, "ShardedModule: the ParallelContext is null");
  host_ = dynamic_cast<UnitHost*>(module_.get());
  TORCH_CHECK(host_ == nullptr || host_->sharded_ == nullptr, "ShardedModule: module ", module_->name(),
              " is already wrapped by another ShardedModule; a module is wrapped once (destroy the other first)");
  // Note [Sequence ranks in the data reduction]
  // Sequence ranks hold parts of the same sequences: a parameter's gradient
  // is partial over the sequence group (its placement says so). By default
  // the wrapper reduces over data x sequence, which sums over the sequence
  // group within the same reduction, and averages over data only; the
  // sequence group is then dropped from the buckets' partial groups (of the
  // parameters reduced over the wrapper's group: Note [Replica groups]).
  const context::ParallelMode tokens = ctx_->grid().token_mode();
  const bool sequence = !options_.group() && tokens == context::ParallelMode::kDataSequence;
  group_ = options_.group() ? options_.group() : ctx_->comm(tokens);
  options_.spec(spec_on_hosts(options_.spec(), *group_));  // P(host): the group's ranks per host
  const comm::CommunicatorPtr covered = sequence ? ctx_->comm(context::ParallelMode::kSequence) : nullptr;
  const int replicas = group_->size() / (covered ? covered->size() : 1);
  TORCH_CHECK(options_.bucket_bytes() >= 0,
              "ShardedModule: bucket_bytes must be positive, or 0 for the default "
              "(Note [Buckets across hosts]), got ",
              options_.bucket_bytes());

  // Note [Replica groups]
  // A parameter whose placement names a replica group smaller than the
  // wrapper's (an expert's parameters: the expert-data group) holds other
  // values on the ranks outside it, so everything the wrapper does with it
  // stays inside that group: the initial broadcast, the shard layout (the
  // spec resolved over the group's size) and the gradient sum. The mean is
  // still over the wrapper's group: each rank's loss covers its own batch,
  // and an expert's gradient already gathers the tokens that the other
  // ranks of its expert group sent it, so the sum over its replica group is
  // the sum over all data ranks. Its placement names the axis over which the
  // values differ (Shard(0) over the expert group for stacked experts), so
  // norms and checkpoints see the whole tensor.
  ModuleLayout plan = plan_module_layout(*module_, group_, covered, options_);
  state_ = std::make_shared<ShardState>();
  ShardState& s = *state_;
  for (const auto& l : plan.layouts) s.layouts.push_back(std::make_unique<ShardLayout>(l.group, l.degrees));
  s.prefetch = options_.prefetch();
  s.overlap = options_.overlap();
  s.scale = options_.average() ? 1.0 / replicas : 1.0;
  if (options_.sync_module_states() && group_->size() > 1) {
    at::NoGradGuard no_grad;
    auto states = module_->parameters();
    for (auto& b : module_->buffers()) states.push_back(b);
    for (auto& t : states) {
      at::Tensor buf = t.is_contiguous() ? t.detach() : t.detach().contiguous();
      s.layouts[plan.layout_index(t)]->group()->broadcast(buf);
      if (!buf.is_same(t)) t.detach().copy_(buf);
    }
  }
  for (auto& b : plan.buckets) {
    s.buckets.push_back(std::make_unique<FlatBucket>(s.buckets.size(), std::move(b.slots), *s.layouts[b.layout],
                                                     plan.materialize, options_.offload_params(), s.counter));
    s.buckets.back()->set_partial_groups(b.partial_groups);
  }
  s.unit_names = std::move(plan.unit_names);
  s.unit_buckets = std::move(plan.unit_buckets);
  s.has_root_unit = plan.has_root_unit;

  const size_t n = s.buckets.size();
  // With named units, the root unit stays gathered (Note [Units and gathering]).
  s.pinned.assign(n, false);
  if (s.has_root_unit && s.unit_names.size() > 1)
    for (size_t b : s.unit_buckets.back()) s.pinned[b] = true;
  s.gather_pinned();
  if (options_.broadcast_buffers() && group_->size() > 1) {
    s.buffers = module_->buffers();
    if (!s.buffers.empty()) s.buffer_group = group_;
  }
  s.expected.assign(n, 0);
  s.arrived.assign(n, 0);
  s.ready.assign(n, false);
  s.finalized.assign(n, false);
  s.tasks.resize(n);
  std::weak_ptr<ShardState> weak = state_;
  for (size_t b = 0; b < n; ++b) {
    const auto& slots = s.buckets[b]->slots();
    for (size_t i = 0; i < slots.size(); ++i) {
      auto acc = torch::autograd::impl::grad_accumulator(slots[i].param);
      TORCH_INTERNAL_ASSERT(acc, "no grad accumulator for ", slots[i].name);
      acc->add_post_hook(std::make_unique<GradReadyHook>(weak, b, i));
      s.keep_alive.push_back(acc);
      ++s.expected[b];
    }
  }
  if (host_ != nullptr) host_->sharded_ = this;  // last: a constructor that threw leaves it unwrapped
}

ShardedModule::~ShardedModule() {
  if (host_ != nullptr && host_->sharded_ == this) host_->sharded_ = nullptr;
}

const ShardDegrees& ShardedModule::degrees() const { return state_->layouts[0]->degrees(); }
const ShardLayout& ShardedModule::layout() const { return *state_->layouts[0]; }
size_t ShardedModule::num_units() const { return state_->unit_names.size() - (state_->has_root_unit ? 1 : 0); }

std::vector<std::string> ShardedModule::units() const {
  const auto& names = state_->unit_names;
  std::vector<std::string> out(names.begin(), names.begin() + static_cast<std::ptrdiff_t>(num_units()));
  if (out.size() == 1 && out[0].empty()) out.clear();  // no units: the whole module
  return out;
}
size_t ShardedModule::num_buckets() const { return state_->buckets.size(); }
const FlatBucket& ShardedModule::bucket(size_t i) const { return *state_->buckets.at(i); }
FlatBucket& ShardedModule::bucket(size_t i) { return *state_->buckets.at(i); }

std::vector<int64_t> ShardedModule::bucket_numels() const {
  std::vector<int64_t> out;
  for (const auto& b : state_->buckets) out.push_back(b->numel());
  return out;
}

at::Tensor ShardedModule::run_unit(size_t unit, const std::function<at::Tensor()>& fn) {
  ShardState& s = *state_;
  TORCH_CHECK(unit < num_units() || (unit == 0 && num_units() == 0), "ShardedModule::run_unit: unit ", unit,
              " does not exist; this module has ", num_units(), " unit(s)");
  s.ensure_root();
  if (unit < s.unit_buckets.size()) s.gather_unit(unit, false);
  if (s.prefetch && unit + 1 < num_units()) s.gather_unit(unit + 1, false);
  if (unit < s.unit_buckets.size()) s.gather_unit(unit, true);
  at::Tensor out;
  try {
    out = fn();
  } catch (const c10::Error& e) {
    // LibTorch's words for a tensor whose storage has no memory: reading it,
    // or taking a view of it.
    const std::string& m = e.msg();
    if (m.find("data is not allocated") == std::string::npos &&
        m.find("out of bounds for storage of size 0") == std::string::npos)
      throw;
    explain_missing_params(unit, fn);
    throw;
  }
  if (s.sync && unit < num_units()) s.free_unit(unit);
  if (!out.requires_grad() || !at::GradMode::is_enabled()) return out;
  auto capsule = c10::make_intrusive<StateCapsule>();
  capsule->state = state_;
  capsule->units = {unit};
  capsule->prefetch_unit = unit == 0 ? static_cast<size_t>(-1) : unit - 1;
  return PreBackward::apply(out, capsule);
}

at::Tensor ShardedModule::run_unit(const std::string& name, const std::function<at::Tensor()>& fn) {
  const auto names = units();
  auto it = std::find(names.begin(), names.end(), name);
  if (it == names.end()) {
    std::string list;
    for (const auto& n : names) list += (list.empty() ? "'" : ", '") + n + "'";
    TORCH_CHECK(false, "ShardedModule::run_unit: '", name, "' is not a unit of this module; its units are ",
                list.empty() ? std::string("none (ShardedModuleOptions::units is empty)") : list,
                "; name the submodule in ShardedModuleOptions().units({...})");
  }
  return run_unit(static_cast<size_t>(it - names.begin()), fn);
}

// fn (unit `unit`) used a parameter whose storage is released: gathers every
// unit, runs fn again and asks autograd which of the released parameters it
// used, to name them. Buffers fn updates (running statistics) are updated a
// second time, which does not matter: the caller gets an error.
void ShardedModule::explain_missing_params(size_t unit, const std::function<at::Tensor()>& fn) {
  ShardState& s = *state_;
  std::vector<at::Tensor> candidates;
  std::vector<std::string> names, owners;
  for (size_t u = 0; u < s.unit_buckets.size(); ++u) {
    for (size_t b : s.unit_buckets[u]) {
      if (s.buckets[b]->gathered()) continue;
      for (const auto& slot : s.buckets[b]->slots()) {
        candidates.push_back(slot.param);
        names.push_back(slot.name);
        owners.push_back(s.unit_names[u]);
      }
    }
  }
  if (candidates.empty()) return;
  std::vector<size_t> used;
  try {
    FullParams all(*this);
    at::AutoGradMode grad(true);
    at::Tensor out = fn();
    if (out.defined() && out.requires_grad()) {
      auto grads = torch::autograd::grad({out.sum()}, candidates, {}, /*retain_graph=*/false,
                                         /*create_graph=*/false, /*allow_unused=*/true);
      for (size_t i = 0; i < grads.size(); ++i)
        if (grads[i].defined()) used.push_back(i);
    }
  } catch (const c10::Error&) {
    used.clear();
  }
  const std::string here = unit < num_units() ? "run_unit('" + s.unit_names[unit] + "')" : "run_unit(" +
                                                    std::to_string(unit) + ")";
  std::string what;
  if (!used.empty()) {
    for (size_t i : used)
      what += (what.empty() ? "" : ", ") + ("'" + names[i] + "' (unit '" + owners[i] + "')");
  } else {  // autograd could not tell: name every released parameter
    for (size_t i = 0; i < names.size(); ++i)
      what += (what.empty() ? "one of " : ", ") + ("'" + names[i] + "' (unit '" + owners[i] + "')");
  }
  TORCH_CHECK(false, "ShardedModule: parameter ", what, " was used inside ", here, ", outside its own unit: under ",
              "sharding spec ", options_.spec().to_string(),
              " a unit's parameters exist only while that unit runs (Note [Units and gathering] in "
              "sharded_module.h). Use it inside its own unit, or leave its submodule out of "
              "ShardedModuleOptions::units (parameters outside every unit stay gathered)");
}

at::Tensor ShardedModule::run(const std::function<at::Tensor()>& fn) {
  ShardState& s = *state_;
  std::vector<size_t> all(s.unit_buckets.size());
  for (size_t u = 0; u < all.size(); ++u) all[u] = u;
  for (size_t u : all) s.gather_unit(u, false);
  for (size_t u : all) s.gather_unit(u, true);
  at::Tensor out = fn();
  if (s.sync)
    for (size_t u : all) s.free_unit(u);
  if (!out.requires_grad() || !at::GradMode::is_enabled()) return out;
  auto capsule = c10::make_intrusive<StateCapsule>();
  capsule->state = state_;
  capsule->units = all;
  capsule->prefetch_unit = static_cast<size_t>(-1);
  return PreBackward::apply(out, capsule);
}

at::Tensor ShardedModule::forward(const at::Tensor& input) {
  auto seq = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(module_);
  TORCH_CHECK(seq != nullptr, "ShardedModule::forward(input) needs a torch::nn::Sequential; for module type ",
              module_->name(), " call run(fn) or run_unit(i, fn) from its forward");
  const bool per_child = num_units() == seq->size() && options_.units().empty();
  if (!per_child) return run([&] { return seq->forward(input); });
  at::Tensor x = input;
  size_t i = 0;
  for (auto& child : *seq) {
    x = run_unit(i++, [&] { return child.forward(x); });
  }
  return x;
}

void ShardedModule::set_gradient_sync(bool sync) { state_->sync = sync; }
bool ShardedModule::gradient_sync() const { return state_->sync; }
void ShardedModule::reduce_gradients() {
  ShardState& s = *state_;
  s.finish();  // anything a synchronized backward left running
  s.reductions_pending = true;
  s.finish();
}

void ShardedModule::finish_gradient_sync() { state_->finish(); }

void ShardedModule::zero_grad() {
  state_->finish();
  for (auto& b : state_->buckets) b->zero_grads();
}

void ShardedModule::sync_params_after_step() {
  for (auto& b : state_->buckets) b->regather_params();
  state_->gather_pinned();
}

double ShardedModule::global_mean(const at::Tensor& value) const {
  TORCH_CHECK(value.defined() && value.numel() == 1, "ShardedModule::global_mean: needs a one-element tensor, got ",
              value.defined() ? value.sizes() : at::IntArrayRef{});
  at::Tensor total = at::tensor({value.detach().to(at::kDouble).item<double>()}, at::kDouble);
  group_->control()->all_reduce(total);
  return total.item<double>() / group_->size();
}

void ShardedModule::broadcast_buffers() {
  if (group_->size() > 1) ShardState::broadcast_buffers(module_->buffers(), *group_);
}

ShardedModule::FullParams::FullParams(ShardedModule& owner) : owner_(owner) {
  for (auto& b : owner_.state_->buckets) b->start_gather();
  for (auto& b : owner_.state_->buckets) b->wait_gather();
}

ShardedModule::FullParams::~FullParams() {
  for (size_t b = 0; b < owner_.state_->buckets.size(); ++b) owner_.state_->release(b);
}

ShardedModule::GatheredUnits::GatheredUnits(ShardedModule& owner, std::vector<size_t> units)
    : owner_(owner), units_(std::move(units)) {
  ShardState& s = *owner_.state_;
  for (size_t u : units_) TORCH_INTERNAL_ASSERT(u < s.unit_buckets.size(), "GatheredUnits: no unit ", u);
  for (size_t u : units_) s.gather_unit(u, false);
  for (size_t u : units_) s.gather_unit(u, true);
}

ShardedModule::GatheredUnits::~GatheredUnits() {
  for (size_t u : units_) owner_.state_->free_unit(u);
}

std::vector<size_t> ShardedModule::units_holding(const std::vector<at::Tensor>& params) const {
  const ShardState& s = *state_;
  // Every bucket's parameters; those of buckets that are never materialized
  // (always whole) belong to no unit.
  constexpr size_t kNoUnit = static_cast<size_t>(-1);
  std::map<const c10::TensorImpl*, size_t> unit_of;
  for (const auto& bucket : s.buckets)
    for (const auto& slot : bucket->slots()) unit_of.emplace(slot.param.unsafeGetTensorImpl(), kNoUnit);
  for (size_t u = 0; u < s.unit_buckets.size(); ++u)
    for (size_t b : s.unit_buckets[u])
      for (const auto& slot : s.buckets[b]->slots()) unit_of[slot.param.unsafeGetTensorImpl()] = u;
  std::set<size_t> out;
  for (const auto& p : params) {
    if (!p.requires_grad()) continue;
    auto it = unit_of.find(p.unsafeGetTensorImpl());
    TORCH_CHECK(it != unit_of.end(), "ShardedModule::units_holding: a parameter of shape ", p.sizes(),
                " is not one of this module's; pass the parameters of the module it wraps");
    if (it->second != kNoUnit) out.insert(it->second);
  }
  return {out.begin(), out.end()};
}

int64_t ShardedModule::peak_bytes() const { return state_->counter->peak; }
void ShardedModule::reset_peak_bytes() { state_->counter->peak = state_->counter->current; }

ModelStateBytes ShardedModule::memory() const {
  ModelStateBytes m;
  for (const auto& b : state_->buckets) {
    m.params += b->param_bytes();
    m.grads += b->grad_bytes();
  }
  return m;
}

}  // namespace parallel
}  // namespace tessera
