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
//
// Note [Ring progress]
// Posting the shift is not enough for it to move: MPI advances a message
// only inside an MPI call of the process (a message over TCP past the eager
// size waits for the receiver's answer and then goes a fragment at a time),
// so during a step that makes none the shift waits, and all of it is paid
// at wait(). A step is therefore given `progress`, which tests the shifts in
// flight (Work::is_completed, which never blocks); a step that computes in
// pieces calls it between them, as the tiled attention does per tile.
// It tests at most once per 5 ms and otherwise returns at once: a test is
// an MPI call, which may yield the core (Open MPI's mpi_yield_when_idle)
// and wakes the TCP stack, while the link needs one only about as often as
// its socket buffers drain. On the emulated cluster at 16k tokens
// (docs/sequence-parallel.md, "Progress during the tiles") a test per tile
// gained little over none, a test per 5 ms up to a fifth of the step.

// Tests the ring's shifts in flight, so that they move; true once all of
// them have completed. Callable any number of times (Note [Ring progress]).
using RingProgress = std::function<bool()>;

// Calls step(src, block, progress) for every rank's block (src = its
// owner), this rank's own first.
void ring_pass(Communicator& comm, const at::Tensor& local,
               const std::function<void(int src, const at::Tensor& block, const RingProgress& progress)>& step);

// As ring_pass; step returns this rank's contribution to src's block (the
// local block's shape and dtype, or an undefined tensor for none). Returns
// the sum of every rank's contribution to this rank's own block.
at::Tensor ring_pass_reduce(
    Communicator& comm, const at::Tensor& local,
    const std::function<at::Tensor(int src, const at::Tensor& block, const RingProgress& progress)>& step);

}  // namespace comm
}  // namespace tessera
