#include "tessera/nn/activation_checkpoint.h"

#include "tessera/nn/parallel_dropout.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/variable.h>

#include <mutex>
#include <unordered_set>
#include <utility>
#include <vector>

namespace tessera {
namespace nn {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor generator_state(at::Generator gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_generator_state(at::Generator gen, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

// Where every stream of Note [Activation checkpointing and RNG] stands.
struct RngState {
  at::Tensor cpu;
  at::Tensor cuda;  // undefined unless the input is on CUDA
  std::vector<ParallelDropoutImpl::RngState> dropouts;
};

// What the backward needs besides the saved input; it lives in the node.
struct CheckpointState : torch::CustomClassHolder {
  CheckpointFunction fn;
  // Parameters that are inputs of the node (Note [Checkpoint gradients]);
  // with accumulate = true there are none and backward accumulates into .grad.
  std::vector<at::Tensor> params;
  bool accumulate = false;
  std::vector<ParallelDropoutImpl*> dropouts;
  c10::optional<c10::Device> cuda;
  RngState before;  // as the forward found it

  RngState capture() const {
    RngState s;
    s.cpu = generator_state(at::globalContext().defaultGenerator(c10::Device(c10::kCPU)));
    // Only reached with a CUDA input, so CPU-only builds never ask for a CUDA generator.
    if (cuda) s.cuda = generator_state(at::globalContext().defaultGenerator(*cuda));
    s.dropouts.reserve(dropouts.size());
    for (auto* d : dropouts) s.dropouts.push_back(d->rng_state());
    return s;
  }

  void restore(const RngState& s) const {
    set_generator_state(at::globalContext().defaultGenerator(c10::Device(c10::kCPU)), s.cpu);
    if (cuda) set_generator_state(at::globalContext().defaultGenerator(*cuda), s.cuda);
    for (size_t i = 0; i < dropouts.size(); ++i) dropouts[i]->set_rng_state(s.dropouts[i]);
  }
};

// Throws if the recomputed graph reaches a leaf that requires grad and is not
// among `wrt`: torch::autograd::grad would drop its gradient silently.
void check_leaves(const at::Tensor& out, const variable_list& wrt) {
  std::unordered_set<const torch::autograd::Node*> allowed;
  for (const auto& t : wrt) allowed.insert(torch::autograd::impl::gradient_edge(t).function.get());
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack = {out.grad_fn().get()};
  while (!stack.empty()) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    if (node == nullptr || allowed.count(node) || !seen.insert(node).second) continue;
    TORCH_CHECK(node->name().find("AccumulateGrad") == std::string::npos,
                "checkpoint: the checkpointed function uses a tensor that requires grad and is not a parameter of the "
                "module passed to checkpoint(); its gradient would be lost. Pass a module that owns it, or use "
                "checkpoint(fn, input)");
    for (const auto& edge : node->next_edges()) stack.push_back(edge.function.get());
  }
}

struct Checkpoint : torch::autograd::Function<Checkpoint> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, at::TensorList /*params*/,
                            c10::intrusive_ptr<CheckpointState> state) {
    // Grad mode is off here: fn builds no graph and keeps no activations.
    state->before = state->capture();
    at::Tensor out = state->fn(input);
    TORCH_CHECK(out.defined(), "checkpoint: the checkpointed function returned an undefined tensor");
    ctx->save_for_backward({input});
    ctx->saved_data["state"] = at::IValue::make_capsule(std::move(state));
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto holder = ctx->saved_data["state"].toCapsule();
    const auto& state = *static_cast<CheckpointState*>(holder.get());
    const at::Tensor input = ctx->get_saved_variables()[0];
    at::Tensor x = input.detach();
    if (input.requires_grad()) x.requires_grad_(true);

    // Replay the forward's random numbers, then hand back the streams as found.
    const RngState found = state.capture();
    state.restore(state.before);
    at::Tensor out;
    try {
      at::AutoGradMode enable_grad(true);
      out = state.fn(x);
    } catch (...) {
      state.restore(found);
      throw;
    }
    state.restore(found);

    // One gradient per forward argument: input, each parameter, the state.
    variable_list result(state.params.size() + 2);
    if (!out.requires_grad()) return result;
    if (state.accumulate) {
      torch::autograd::backward({out}, {grads[0]});
      result[0] = x.grad();
      return result;
    }
    variable_list all;
    if (x.requires_grad()) all.push_back(x);
    all.insert(all.end(), state.params.begin(), state.params.end());
    check_leaves(out, all);
    // Only what the outer backward wants: a zero-bubble input pass wants the
    // input alone, its weight pass the parameters alone (Note [Split backward]).
    variable_list wrt;
    std::vector<size_t> slot;
    if (x.requires_grad() && ctx->needs_input_grad(0)) {
      wrt.push_back(x);
      slot.push_back(0);
    }
    for (size_t i = 0; i < state.params.size(); ++i) {
      if (!ctx->needs_input_grad(i + 1)) continue;
      wrt.push_back(state.params[i]);
      slot.push_back(i + 1);
    }
    if (wrt.empty()) return result;
    variable_list g = torch::autograd::grad({out}, wrt, {grads[0]}, /*retain_graph=*/false, /*create_graph=*/false,
                                            /*allow_unused=*/true);
    for (size_t k = 0; k < g.size(); ++k) result[slot[k]] = g[k];
    return result;
  }
};

at::Tensor run(c10::intrusive_ptr<CheckpointState> state, const at::Tensor& input) {
  TORCH_CHECK(input.defined(), "checkpoint: the input is undefined");
  if (input.is_cuda()) state->cuda = input.device();
  std::vector<at::Tensor> params = state->params;  // the node's inputs; the state keeps its own handles
  return Checkpoint::apply(input, at::TensorList(params), std::move(state));
}

}  // namespace

at::Tensor checkpoint(torch::nn::Module& module, const CheckpointFunction& fn, const at::Tensor& input) {
  TORCH_CHECK(fn, "checkpoint: the function is empty");
  auto state = c10::make_intrusive<CheckpointState>();
  for (const auto& p : module.parameters())
    if (p.requires_grad()) state->params.push_back(p);
  if (!at::GradMode::is_enabled() || (!input.requires_grad() && state->params.empty())) return fn(input);
  state->fn = fn;
  // modules(false) does not need the module to be held by a shared_ptr; look at the module itself apart.
  if (auto* self = dynamic_cast<ParallelDropoutImpl*>(&module)) state->dropouts.push_back(self);
  for (const auto& m : module.modules(/*include_self=*/false))
    if (auto* d = dynamic_cast<ParallelDropoutImpl*>(m.get())) state->dropouts.push_back(d);
  return run(std::move(state), input);
}

at::Tensor checkpoint(const CheckpointFunction& fn, const at::Tensor& input) {
  TORCH_CHECK(fn, "checkpoint: the function is empty");
  if (!at::GradMode::is_enabled()) return fn(input);
  auto state = c10::make_intrusive<CheckpointState>();
  state->fn = fn;
  state->accumulate = true;
  // Without an input that requires grad the node would not be recorded and
  // parameters inside fn would get no gradient: an empty leaf anchors it.
  if (!input.requires_grad())
    state->params.push_back(at::empty({0}, input.options().dtype(at::kFloat)).requires_grad_());
  return run(std::move(state), input);
}

}  // namespace nn
}  // namespace tessera
