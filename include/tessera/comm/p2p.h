#pragma once
// The ring shift built on batched point-to-point
// (Communicator::batch_isend_irecv): one implementation that the ring
// attentions of nn/ use.
#include "tessera/comm/communicator.h"

#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

namespace tessera {
namespace comm {

// Sends `send` to rank + 1 and receives `recv` (same shape and dtype) from
// rank - 1, modulo the size, without blocking; wait() on the result.
WorkPtr ring_shift(Communicator& comm, const at::Tensor& send, at::Tensor& recv);

// Note [Ring pass]
// Each rank's block visits every rank once: at step t rank r holds the block
// of rank (r - t) mod P. The shift to the next step is posted before `step`
// runs and waited after it, so communication hides behind the block's
// compute; a rank holds its own block, the one it computes on and the one
// arriving. ring_pass_reduce also sends back what each step computed for
// the block's owner (a gradient): those contributions travel one step
// behind the blocks, each rank adding its own before passing the sum on,
// and after P shifts the owner receives the sum over all ranks. Collective
// over `comm`: P-1 shifts of the block, and P of the contributions.

// Calls step(src, block) for every rank's block (src = its owner), this
// rank's own first.
void ring_pass(Communicator& comm, const at::Tensor& local,
               const std::function<void(int src, const at::Tensor& block)>& step);

// As ring_pass; step returns this rank's contribution to src's block (the
// local block's shape and dtype, or an undefined tensor for none). Returns
// the sum of every rank's contribution to this rank's own block.
at::Tensor ring_pass_reduce(Communicator& comm, const at::Tensor& local,
                            const std::function<at::Tensor(int src, const at::Tensor& block)>& step);

}  // namespace comm
}  // namespace tessera
