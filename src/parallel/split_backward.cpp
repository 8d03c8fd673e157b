#include "split_backward.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <unordered_map>

namespace tessera {
namespace parallel {
namespace detail {

// Note [Split backward]
// Zero-bubble schedules run a stage's backward in two passes: I, the
// gradient of the stage's input, which the previous stage waits for, and
// W, the parameters' gradients, which can wait. Each pass must do only its
// own products (B = I + W in time), so W cannot be a second backward
// restricted to the parameters: that re-traverses the input path.
//
// The autograd graph of a stage splits into the input path (the nodes from
// which the input's gradient is reached) and weight branches (nodes that
// reach parameters but not the input). A frontier node is an input-path
// node with an edge into a weight branch: a linear's AddmmBackward (edges
// to its input, to the weight's transpose and to the bias), a layer norm's
// backward, and so on.
//   I  runs the engine from the output with the input as its only wanted
//      result, so a frontier computes only its input-side products (the
//      generated backward formulas and custom functions honour
//      task_should_compute_output / needs_input_grad). A pre-hook on each
//      frontier keeps the gradient flowing into it. Then the frontiers'
//      edges into the input path are cut: the rest of the input path and
//      its saved activations are freed, and a frontier can no longer
//      reach anything but its weight branches.
//   W  runs the engine once from all frontiers, fed the kept gradients,
//      accumulating into .grad: each frontier computes only its weight-side
//      products (its other edges are gone) and the branches finish.
// Every path from the output to a parameter leaves the input path at
// exactly one frontier edge, and the kept gradient at a frontier is the
// full gradient of the output there, so the sum over frontiers is the
// whole gradient, each part once. A stage whose input has no gradient
// (token ids) has no input path: W is its whole backward and I is empty.

namespace {

using torch::autograd::Edge;
using torch::autograd::Node;
using torch::autograd::variable_list;

constexpr unsigned char kReachesInput = 1;
constexpr unsigned char kReachesLeaf = 2;

struct NodeInfo {
  unsigned char flags = 0;
  SplitBackward::NodePtr owner;  // from the edge that reached it
};

// For every node reachable from `root`: does it reach `input`'s
// accumulator, does it reach another leaf's. Iterative post-order, as a
// deep model's graph can be deeper than the stack.
std::unordered_map<Node*, NodeInfo> classify(const Edge& root, const Node* input) {
  std::unordered_map<Node*, NodeInfo> info;
  std::vector<std::pair<Node*, uint32_t>> stack;
  info.emplace(root.function.get(), NodeInfo{0, root.function});
  stack.emplace_back(root.function.get(), 0);
  while (!stack.empty()) {
    auto& top = stack.back();
    Node* n = top.first;
    if (top.second < n->num_outputs()) {
      const Edge& e = n->next_edge(top.second++);
      Node* child = e.function.get();
      if (child != nullptr && info.emplace(child, NodeInfo{0, e.function}).second) stack.emplace_back(child, 0);
      continue;
    }
    unsigned char f = 0;
    if (n == input) {
      f = kReachesInput;
    } else if (dynamic_cast<torch::autograd::AccumulateGrad*>(n) != nullptr) {
      f = kReachesLeaf;
    }
    for (const Edge& e : n->next_edges())
      if (e.function) f |= info.at(e.function.get()).flags;
    info[n].flags = f;
    stack.pop_back();
  }
  return info;
}

struct Keep : torch::autograd::FunctionPreHook {
  explicit Keep(std::shared_ptr<variable_list> into) : into_(std::move(into)) {}
  variable_list operator()(const variable_list& grads) override {
    *into_ = grads;
    return grads;
  }
  std::shared_ptr<variable_list> into_;
};

}  // namespace

SplitBackward::SplitBackward(SplitBackward&&) noexcept = default;
SplitBackward& SplitBackward::operator=(SplitBackward&&) noexcept = default;
SplitBackward::~SplitBackward() = default;

at::Tensor SplitBackward::input_part(const at::Tensor& output, const at::Tensor& grad_output,
                                     const at::Tensor& input) {
  TORCH_INTERNAL_ASSERT(!pending_, "split backward: input_part twice without weight_part");
  frontiers_.clear();
  pending_ = true;
  const bool wants_input = input.defined() && input.requires_grad();
  if (!output.requires_grad()) return wants_input ? at::zeros_like(input) : at::Tensor();
  const Edge root = torch::autograd::impl::gradient_edge(output);
  at::Tensor seed = grad_output.defined() ? grad_output : at::ones_like(output);
  const Edge input_edge = wants_input ? torch::autograd::impl::gradient_edge(input) : Edge();
  const auto info = classify(root, input_edge.function.get());

  if (!(info.at(root.function.get()).flags & kReachesInput)) {
    // No input path: W is the whole backward.
    Frontier f{root.function, std::make_shared<variable_list>(root.function->num_inputs())};
    (*f.grads)[root.input_nr] = seed;
    frontiers_.push_back(std::move(f));
    return wants_input ? at::zeros_like(input) : at::Tensor();
  }

  std::vector<const torch::autograd::FunctionPreHook*> hooks;
  for (const auto& [node, ni] : info) {
    if (!(ni.flags & kReachesInput) || node == input_edge.function.get()) continue;
    bool frontier = false;
    for (const Edge& e : node->next_edges()) {
      if (!e.function) continue;
      const unsigned char cf = info.at(e.function.get()).flags;
      frontier = frontier || (!(cf & kReachesInput) && (cf & kReachesLeaf));
    }
    if (!frontier) continue;
    Frontier fr{ni.owner, std::make_shared<variable_list>()};
    auto hook = std::make_unique<Keep>(fr.grads);
    hooks.push_back(hook.get());
    node->add_pre_hook(std::move(hook));
    frontiers_.push_back(std::move(fr));
  }

  auto& engine = torch::autograd::Engine::get_default_engine();
  variable_list result;
  try {
    result = engine.execute({root}, {seed}, /*keep_graph=*/true, /*create_graph=*/false,
                            /*accumulate_grad=*/false, {input_edge});
  } catch (...) {
    remove_hooks(hooks);
    frontiers_.clear();
    pending_ = false;
    throw;
  }
  remove_hooks(hooks);
  for (auto& fr : frontiers_) {
    // Cut the edges into the input path (and into branches that reach no
    // parameter): W must not run them again, and the input path's saved
    // activations can go now.
    for (uint32_t i = 0; i < fr.node->num_outputs(); ++i) {
      const Edge& e = fr.node->next_edge(i);
      if (!e.function) continue;
      const unsigned char cf = info.at(e.function.get()).flags;
      if ((cf & kReachesInput) || !(cf & kReachesLeaf)) fr.node->next_edges()[i] = Edge();  // no set_next_edge: it asserts on nodes with parents
    }
  }
  return result.at(0);
}

void SplitBackward::remove_hooks(const std::vector<const torch::autograd::FunctionPreHook*>& hooks) {
  for (auto& fr : frontiers_) {
    auto& ph = fr.node->pre_hooks();
    ph.erase(std::remove_if(ph.begin(), ph.end(),
                            [&](const auto& h) { return std::count(hooks.begin(), hooks.end(), h.get()) > 0; }),
             ph.end());
  }
}

void SplitBackward::weight_part() {
  TORCH_INTERNAL_ASSERT(pending_, "split backward: weight_part without input_part");
  pending_ = false;
  torch::autograd::edge_list roots;
  variable_list grads;
  for (const auto& fr : frontiers_) {
    for (uint32_t k = 0; k < fr.grads->size(); ++k) {
      if (!(*fr.grads)[k].defined()) continue;
      roots.emplace_back(fr.node, k);
      grads.push_back((*fr.grads)[k]);
    }
  }
  frontiers_.clear();
  if (roots.empty()) return;
  torch::autograd::Engine::get_default_engine().execute(roots, grads, /*keep_graph=*/false, /*create_graph=*/false,
                                                        /*accumulate_grad=*/true);
}

}  // namespace detail
}  // namespace parallel
}  // namespace tessera
