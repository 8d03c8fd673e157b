#include "tessera/comm/p2p.h"

#include <c10/util/Exception.h>

#include <utility>

namespace tessera {
namespace comm {

WorkPtr ring_shift(Communicator& comm, const at::Tensor& send, at::Tensor& recv) {
  TORCH_CHECK(send.sizes() == recv.sizes() && send.scalar_type() == recv.scalar_type(),
              "ring_shift: the send and receive buffers must have one shape and dtype, got ", send.sizes(), " ",
              send.scalar_type(), " and ", recv.sizes(), " ", recv.scalar_type());
  const int n = comm.size();
  if (n == 1) {
    recv.copy_(send);
    return completed_work();
  }
  const int r = comm.rank();
  return comm.batch_isend_irecv({{P2POp::Kind::kSend, send, (r + 1) % n}, {P2POp::Kind::kRecv, recv, (r + n - 1) % n}});
}

void ring_pass(Communicator& comm, const at::Tensor& local,
               const std::function<void(int src, const at::Tensor& block)>& step) {
  const int n = comm.size(), r = comm.rank();
  at::Tensor current = local.contiguous();
  for (int t = 0; t < n; ++t) {
    at::Tensor next;
    WorkPtr shift;
    if (t + 1 < n) {
      next = at::empty_like(current);
      shift = ring_shift(comm, current, next);
    }
    step((r - t + n) % n, current);
    if (shift) {
      shift->wait();
      current = next;
    }
  }
}

at::Tensor ring_pass_reduce(Communicator& comm, const at::Tensor& local,
                            const std::function<at::Tensor(int src, const at::Tensor& block)>& step) {
  const int n = comm.size();
  at::Tensor arriving;  // the sum for this step's block, from the previous rank
  WorkPtr pending;
  at::Tensor sending;   // kept alive while its shift runs
  ring_pass(comm, local, [&](int src, const at::Tensor& block) {
    at::Tensor mine = step(src, block);
    TORCH_INTERNAL_ASSERT(!mine.defined() || (mine.sizes() == local.sizes() && mine.scalar_type() == local.scalar_type()),
                          "ring_pass_reduce: a contribution must have the block's shape and dtype");
    at::Tensor sum;
    if (pending) {
      pending->wait();
      sum = mine.defined() ? arriving.add_(mine) : arriving;
    } else {
      sum = mine.defined() ? mine.contiguous() : at::zeros_like(local);
    }
    if (n == 1) {
      arriving = sum;
      return;
    }
    sending = sum;
    arriving = at::empty_like(sum);
    pending = ring_shift(comm, sending, arriving);
  });
  if (pending) pending->wait();
  return arriving;
}

}  // namespace comm
}  // namespace tessera
