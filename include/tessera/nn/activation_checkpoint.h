#pragma once
// Activation checkpointing: run a function without keeping its intermediate
// activations, and run it again in backward to get them back. Memory per
// checkpointed call drops to its input; the price is one more forward of it.
//
//   // in a block's forward
//   return nn::checkpoint(*this, [this](const at::Tensor& x) { return body(x); }, x);
//
// Note [Activation checkpointing and RNG]
// The recomputation must draw the random numbers the forward drew, or
// dropout masks differ between the output and its gradient. The forward
// snapshots every random stream the function may draw from and the backward
// restores that snapshot around the recomputation, then puts back the state
// it found, so code running after the checkpoint sees the stream it would
// have seen without it (and a second backward through a retained graph, as
// the zero-bubble pipeline's B and W passes do, replays the same masks again).
// The streams are:
// - the default CPU generator, and the default generator of the input's CUDA
//   device when the input is on CUDA (torch::dropout and friends draw there);
// - the private generators of every nn::ParallelDropout in the module given
//   (Note [Dropout seeds]): each layer snapshots its own per-device streams
//   through ParallelDropoutImpl::rng_state() / set_rng_state(). Passing the
//   module, rather than keeping a global registry of dropouts, keeps
//   ParallelContext's "no global state" rule and says exactly which streams a
//   checkpoint replays.
// A stream fn draws from that is in neither list (a generator of the user's)
// is not replayed.
//
// Note [Checkpoint gradients]
// The module overload makes the module's parameters inputs of the autograd
// node: backward recomputes, takes the gradients of the input and parameters
// with torch::autograd::grad, and returns them, so they reach the parameters'
// gradient accumulators through the outer backward. Gradient-ready hooks
// (ShardedModule) therefore fire inside the backward the user started, and a
// backward that asks for the input's gradient only (the pipeline's B pass)
// leaves .grad alone. fn must not read other tensors that require grad: the
// recomputed graph is checked, and such a tensor is an error rather than a
// lost gradient. The function-only overload knows no parameters: it
// back-propagates through the recomputed graph with torch::autograd::backward,
// so every leaf's .grad accumulates inside the recomputation (as PyTorch's
// reentrant checkpoint does); prefer the module overload under ShardedModule
// or split backward passes.
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <functional>

namespace tessera {
namespace nn {

using CheckpointFunction = std::function<at::Tensor(const at::Tensor&)>;

// fn(input), recomputed in backward. fn uses `module`'s parameters and
// random streams (Notes above); the module must outlive the backward. Without
// grad mode, or with nothing requiring grad, it is just fn(input).
at::Tensor checkpoint(torch::nn::Module& module, const CheckpointFunction& fn, const at::Tensor& input);

// fn(input), recomputed in backward; replays the default generators only.
at::Tensor checkpoint(const CheckpointFunction& fn, const at::Tensor& input);

}  // namespace nn
}  // namespace tessera
