#pragma once
// Point-to-point operations issued together (c10d's batch_isend_irecv), and
// the ring shift built on them: one implementation that the ring attentions
// of nn/ use.
//
// Every operation of a batch is posted before any is waited on, receives
// first, so a batch in which every rank both sends and receives cannot
// deadlock however the ranks are ordered. Messages between one pair of ranks
// match in the order they were posted (MPI's non-overtaking rule; the NCCL
// backend issues a batch as one group), so no tags are needed.
#include "tessera/comm/communicator.h"

#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

namespace tessera {
namespace comm {

struct P2POp {
  enum class Kind { kSend, kRecv };
  Kind kind = Kind::kSend;
  at::Tensor tensor;  // the data sent, or the buffer received into
  int peer = 0;       // rank in the communicator
};

// Posts every op (receives first) and returns one Work whose wait() returns
// once all of them have completed; the received tensors hold their data then.
WorkPtr batch_isend_irecv(Communicator& comm, const std::vector<P2POp>& ops);

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
