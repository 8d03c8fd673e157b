#pragma once
// The backward of one pipeline stage split into an input part (I: the
// gradient of the stage's input, what the previous stage waits for) and a
// weight part (W: the parameters' gradients), each doing only its own
// products. See Note [Split backward].
#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/edge.h>

#include <memory>
#include <vector>

namespace torch {
namespace autograd {
struct FunctionPreHook;
}
}  // namespace torch

namespace tessera {
namespace parallel {
namespace detail {

class SplitBackward {
 public:
  // shared_ptr in LibTorch 1.x, intrusive_ptr in 2.x: whatever an Edge holds.
  using NodePtr = decltype(torch::autograd::Edge::function);

  SplitBackward() = default;
  SplitBackward(SplitBackward&&) noexcept;
  SplitBackward& operator=(SplitBackward&&) noexcept;
  ~SplitBackward();

  // I: the gradient of `input` (a leaf that requires grad, or undefined for
  // a stage whose input has no gradient) from `output` seeded with
  // `grad_output` (undefined: `output` is a scalar loss, seeded with one).
  // The graph is kept and the gradients at the boundary between the input
  // path and the weight-only branches are kept for weight_part(). Returns
  // undefined when `input` is undefined.
  at::Tensor input_part(const at::Tensor& output, const at::Tensor& grad_output, const at::Tensor& input);

  // W: accumulates the parameters' gradients into their .grad from what
  // input_part() kept; frees the graph's weight branches. Once.
  void weight_part();

 private:
  struct Frontier {
    NodePtr node;
    std::shared_ptr<std::vector<at::Tensor>> grads;  // flowing into node, per input
  };
  void remove_hooks(const std::vector<const torch::autograd::FunctionPreHook*>& hooks);
  std::vector<Frontier> frontiers_;
  bool pending_ = false;
};

}  // namespace detail
}  // namespace parallel
}  // namespace tessera
