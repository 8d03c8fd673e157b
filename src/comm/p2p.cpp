#include "tessera/comm/p2p.h"

#include <c10/util/Exception.h>

#include <chrono>
#include <utility>
#include <vector>

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

namespace {

using Clock = std::chrono::steady_clock;
using RingStep = std::function<void(int src, const at::Tensor& block, const RingProgress& progress)>;

// Note [Ring progress]: the longest a step's progress waits between two tests.
constexpr auto kTestInterval = std::chrono::milliseconds(5);

// One step's progress: tests the works in flight (null ones skipped) at most
// once per kTestInterval, the first call at once; true once all completed.
class StepProgress {
 public:
  explicit StepProgress(std::vector<Work*> works) : works_(std::move(works)) {}

  bool operator()() {
    if (done_) return true;
    const auto now = Clock::now();
    if (tested_ && now - last_ < kTestInterval) return false;
    tested_ = true;
    last_ = now;
    bool all = true;
    for (Work* w : works_)
      if (w != nullptr) all = w->is_completed() && all;  // test each, so that each moves
    done_ = all;
    return done_;
  }

 private:
  std::vector<Work*> works_;
  Clock::time_point last_;
  bool tested_ = false, done_ = false;
};

// ring_pass; each step's progress also tests *also (when set), the
// caller's own work in flight beside the ring's shift.
void ring_pass_testing(Communicator& comm, const at::Tensor& local, const WorkPtr* also, const RingStep& step) {
  const int n = comm.size(), r = comm.rank();
  at::Tensor current = local.contiguous();
  for (int t = 0; t < n; ++t) {
    at::Tensor next;
    WorkPtr shift;
    if (t + 1 < n) {
      next = at::empty_like(current);
      shift = ring_shift(comm, current, next);
    }
    StepProgress progress({shift.get(), also != nullptr ? also->get() : nullptr});
    step((r - t + n) % n, current, std::ref(progress));
    if (shift) {
      shift->wait();
      current = next;
    }
  }
}

}  // namespace

void ring_pass(Communicator& comm, const at::Tensor& local, const RingStep& step) {
  ring_pass_testing(comm, local, nullptr, step);
}

at::Tensor ring_pass_reduce(
    Communicator& comm, const at::Tensor& local,
    const std::function<at::Tensor(int src, const at::Tensor& block, const RingProgress& progress)>& step) {
  const int n = comm.size();
  at::Tensor arriving;  // the sum for this step's block, from the previous rank
  WorkPtr pending;      // its shift: in flight while the next step computes
  at::Tensor sending;   // kept alive while its shift runs
  ring_pass_testing(comm, local, &pending, [&](int src, const at::Tensor& block, const RingProgress& progress) {
    at::Tensor mine = step(src, block, progress);
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
