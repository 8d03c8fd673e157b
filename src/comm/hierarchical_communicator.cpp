#include "tessera/comm/hierarchical_communicator.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "stage_driver.h"
#include "tessera/comm/mpi_check.h"
#include "tessera/comm/mpi_communicator.h"
#include "tessera/core/logging.h"

#include <mpi.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

namespace tessera {
namespace comm {
namespace detail {

// The communicator a stage issues on; kLocal stages touch only their
// reduction's own tensors (Note [Reductions in bucket order per link]).
enum class Lane : uint8_t { kLocal, kHostReduce, kCross, kHostGather };
constexpr size_t kLanes = 4;

struct Stage {
  Lane lane;
  std::function<WorkPtr()> issue;
};

}  // namespace detail

namespace {

using detail::kLanes;
using detail::Lane;
using Stages = std::vector<detail::Stage>;

// Runs its stages one after the other: each starts when the one before has
// completed, found by wait(), by an is_completed() that sees it done, or by
// the group's stage driver (Note [Stages advanced beside the caller]). A
// stage on a lane starts only once the group's earlier reductions (`after`
// and its chain) have issued all theirs on that lane: Note [Reductions in
// bucket order per link]. Every advance holds the group's mutex, so the
// stages of the group's operations are issued in one order per
// communicator whichever thread issues them.
class StagedWork : public Work {
 public:
  StagedWork(Stages stages, std::shared_ptr<StagedWork> after, std::shared_ptr<std::mutex> mutex)
      : stages_(std::move(stages)), after_(std::move(after)), mutex_(std::move(mutex)) {
    for (size_t i = 0; i < stages_.size(); ++i) end_[static_cast<size_t>(stages_[i].lane)] = i + 1;
    std::lock_guard<std::mutex> lock(*mutex_);
    completed_locked();
  }
  ~StagedWork() override {
    if (completed_.load(std::memory_order_acquire)) return;
    try {
      wait();
    } catch (...) {  // a destructor must not throw; the error was the waiter's to see
    }
  }

  void wait() override {
    if (completed_.load(std::memory_order_acquire)) return;
    std::lock_guard<std::mutex> lock(*mutex_);
    wait_locked();
  }

  bool is_completed() override {
    if (completed_.load(std::memory_order_acquire)) return true;
    std::lock_guard<std::mutex> lock(*mutex_);
    return completed_locked();
  }

  // The driver's poll: never waits for the mutex (the caller may hold it in wait()).
  bool try_advance() {
    if (completed_.load(std::memory_order_acquire)) return true;
    std::unique_lock<std::mutex> lock(*mutex_, std::try_to_lock);
    return lock.owns_lock() && completed_locked();
  }

 private:
  // Earlier reductions first: they may still hold a lane this one needs.
  void wait_locked() {
    if (after_) {
      after_->wait_locked();
      after_.reset();  // completed: its destructor takes no lock
    }
    for (;;) {
      if (current_) current_->wait();
      current_.reset();
      if (next_ == stages_.size()) break;
      current_ = stages_[next_++].issue();
    }
    completed_.store(true, std::memory_order_release);
  }
  bool completed_locked() {
    if (after_ && after_->completed_locked()) after_.reset();  // its destructor takes no lock
    for (;;) {
      if (current_ && !current_->is_completed()) return false;
      current_.reset();
      if (next_ == stages_.size()) break;
      const Lane lane = stages_[next_].lane;
      if (lane != Lane::kLocal && after_ && !after_->issued_all(lane)) return false;
      current_ = stages_[next_++].issue();
    }
    // Completes after the earlier ones: a dropped work then never hides a
    // pending one from the next reduction.
    if (after_) return false;
    completed_.store(true, std::memory_order_release);
    return true;
  }
  // This reduction and every one before it have issued their stages on `lane`.
  bool issued_all(Lane lane) const {
    return next_ >= end_[static_cast<size_t>(lane)] && (!after_ || after_->issued_all(lane));
  }

  Stages stages_;
  std::array<size_t, kLanes> end_{};  // one past each lane's last stage; 0: none
  std::shared_ptr<StagedWork> after_;
  std::shared_ptr<std::mutex> mutex_;
  size_t next_ = 0;
  WorkPtr current_;
  std::atomic<bool> completed_{false};
};

// Note [A ring across hosts]
// Open MPI's collectives over two ranks (all_reduce, reduce_scatter,
// all_gather; blocking or not) move their data one direction at a time:
// 1 MiB took 833, 612 and 411 ms over a 20 Mbit/s link where sending both
// ways at once takes 420, 210 and 210. A ring on batched sends and
// receives keeps both directions of every link busy: p-1 steps in which
// each rank sends one of p pieces to the next rank and receives one from
// the previous, adding it in (reduce-scatter), then p-1 steps passing the
// reduced pieces on (all-gather). The reductions run on this rank, in ring
// order, so every rank ends with the same values.
// Afterwards piece r of `data` (p pieces), r this rank's index in the ring,
// holds the reduction over every rank of the ring.
void append_ring_reduce_scatter(Stages& stages, const CommunicatorPtr& ring, const at::Tensor& data, ReduceOp op) {
  const int p = ring->size();
  const int r = ring->rank();
  TORCH_INTERNAL_ASSERT(data.numel() % p == 0);
  const int64_t piece = data.numel() / p;
  const int next = (r + 1) % p, prev = (r + p - 1) % p;
  auto slice = [data, piece, p](int i) { return data.narrow(0, ((i % p) + p) % p * piece, piece); };
  at::Tensor incoming = at::empty({piece}, data.options());
  for (int step = 0; step < p - 1; ++step) {
    // Send piece r - 1 - step, receive piece r - 2 - step and reduce into it.
    stages.push_back({Lane::kCross, [ring, slice, incoming, next, prev, r, step]() {
                        return ring->batch_isend_irecv(
                            {{P2POp::Kind::kSend, slice(r - 1 - step), next}, {P2POp::Kind::kRecv, incoming, prev}});
                      }});
    stages.push_back({Lane::kLocal, [slice, incoming, r, step, op]() {
                        at::Tensor target = slice(r - 2 - step);
                        switch (op) {
                          case ReduceOp::kSum:
                          case ReduceOp::kAvg:
                            target.add_(incoming);
                            break;
                          case ReduceOp::kProduct:
                            target.mul_(incoming);
                            break;
                          case ReduceOp::kMin:
                            at::minimum_out(target, target, incoming);
                            break;
                          case ReduceOp::kMax:
                            at::maximum_out(target, target, incoming);
                            break;
                        }
                        return completed_work();
                      }});
  }
  if (op == ReduceOp::kAvg) {
    stages.push_back({Lane::kLocal, [slice, r, p]() {
                        slice(r).div_(p);
                        return completed_work();
                      }});
  }
}

// Piece r of `data` is complete on rank r of the ring; afterwards every piece is.
void append_ring_all_gather(Stages& stages, const CommunicatorPtr& ring, const at::Tensor& data) {
  const int p = ring->size();
  const int r = ring->rank();
  const int64_t piece = data.numel() / p;
  const int next = (r + 1) % p, prev = (r + p - 1) % p;
  auto slice = [data, piece, p](int i) { return data.narrow(0, ((i % p) + p) % p * piece, piece); };
  for (int step = 0; step < p - 1; ++step) {
    stages.push_back({Lane::kCross, [ring, slice, next, prev, r, step]() {
                        at::Tensor into = slice(r - 1 - step);
                        return ring->batch_isend_irecv(
                            {{P2POp::Kind::kSend, slice(r - step), next}, {P2POp::Kind::kRecv, into, prev}});
                      }});
  }
}

// Reductions under kMinElements stay flat; ZeRO's scatters and gathers are
// staged at any size (Note [Scatters and gathers by host]).
bool staged(const at::Tensor& t, int64_t min_elements) {
  return t.numel() >= min_elements && t.is_contiguous() && at::isFloatingType(t.scalar_type());
}

}  // namespace

HierarchicalCommunicator::HierarchicalCommunicator(CommunicatorPtr inner, CommunicatorPtr host,
                                                   CommunicatorPtr host_gather, CommunicatorPtr cross,
                                                   at::Tensor by_local_index, int host_id)
    : inner_(std::move(inner)),
      host_(std::move(host)),
      host_gather_(std::move(host_gather)),
      cross_(std::move(cross)),
      by_local_index_(std::move(by_local_index)),
      host_id_(host_id) {}

CommunicatorPtr HierarchicalCommunicator::wrap(CommunicatorPtr inner, int host) {
  const char* set = std::getenv("TESSERA_PROGRESS_US");
  if (set != nullptr && *set != '\0') return wrap(std::move(inner), host, MpiOptions::progress_from_env());
  // Unset: the driver by default, where MPI lets a second thread call it.
  int provided = MPI_THREAD_SINGLE;
  TESSERA_MPI_CHECK(MPI_Query_thread(&provided));
  const bool threads = provided == MPI_THREAD_MULTIPLE;
  auto wrapped = wrap(std::move(inner), host, threads ? kDefaultDrive : std::chrono::microseconds(0));
  if (!threads && wrapped->rank() == 0 && dynamic_cast<HierarchicalCommunicator*>(wrapped.get()) != nullptr)
    log_warning(0,
                "{}: its reductions by host advance only when the caller looks at them (no stage driver): MPI runs "
                "with thread level {}, not MPI_THREAD_MULTIPLE; let tessera::comm::MpiRuntime initialize MPI, or "
                "set TESSERA_PROGRESS_US=0 to silence this",
                wrapped->name(), provided);
  return wrapped;
}

CommunicatorPtr HierarchicalCommunicator::wrap(CommunicatorPtr inner, int host, std::chrono::microseconds drive) {
  auto wrapped = wrap_with(std::move(inner), host, nullptr);
  auto* h = dynamic_cast<HierarchicalCommunicator*>(wrapped.get());
  if (h != nullptr && drive.count() > 0) h->driver_ = std::make_shared<detail::StageDriver>(drive);
  return wrapped;
}

CommunicatorPtr HierarchicalCommunicator::wrap_with(CommunicatorPtr inner, int host,
                                                    std::shared_ptr<detail::StageDriver> driver) {
  TORCH_CHECK(inner != nullptr, "HierarchicalCommunicator::wrap needs a communicator");
  const int n = inner->size();
  if (n < 4) return inner;  // two hosts of two ranks at the least
  at::Tensor mine = at::full({1}, static_cast<int64_t>(host), at::kLong);
  at::Tensor all = at::empty({n}, at::kLong);
  inner->control()->all_gather(all, mine)->wait();
  const int64_t* h = all.data_ptr<int64_t>();
  // Hosts in the order of their lowest rank; each rank's index among its host's ranks.
  std::map<int64_t, int> count;
  std::vector<int64_t> order;
  std::vector<int> local_of(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    if (count[h[r]] == 0) order.push_back(h[r]);
    local_of[static_cast<size_t>(r)] = count[h[r]]++;
  }
  const int local = local_of[static_cast<size_t>(inner->rank())];
  const int hosts = static_cast<int>(order.size());
  const int per_host = n / hosts;
  const bool even = std::all_of(count.begin(), count.end(), [&](const auto& c) { return c.second == per_host; });
  if (hosts == 1 || per_host == 1 || !even) return inner;  // the same on every rank: they saw the same table
  const int host_index = static_cast<int>(std::find(order.begin(), order.end(), host) - order.begin());
  CommunicatorPtr host_group = inner->split(host_index, inner->rank(), inner->name() + ".host");
  // The all-gathers' lane (Note [Reductions in bucket order per link]).
  CommunicatorPtr host_gather = inner->split(host_index, inner->rank(), inner->name() + ".host");
  CommunicatorPtr cross_group = inner->split(local, host_index, inner->name() + ".cross");
  TORCH_INTERNAL_ASSERT(host_group->size() == per_host && cross_group->size() == hosts, "host split of ", inner->name(),
                        " gave ", host_group->size(), " x ", cross_group->size(), " ranks, expected ", per_host, " x ",
                        hosts);
  at::Tensor by_local_index = at::empty({n}, at::kLong);
  for (int r = 0; r < n; ++r) {
    const auto index = std::find(order.begin(), order.end(), h[r]) - order.begin();
    by_local_index.data_ptr<int64_t>()[local_of[static_cast<size_t>(r)] * hosts + index] = r;
  }
  auto wrapped = std::shared_ptr<HierarchicalCommunicator>(
      new HierarchicalCommunicator(std::move(inner), std::move(host_group), std::move(host_gather),
                                   std::move(cross_group), std::move(by_local_index), host));
  wrapped->driver_ = std::move(driver);
  return wrapped;
}

int64_t HierarchicalCommunicator::driver_polls() const { return driver_ ? driver_->polls() : -1; }

CommunicatorPtr HierarchicalCommunicator::split(int color, int key, const std::string& name) {
  CommunicatorPtr group = inner_->split(color, key, name);
  return group ? wrap_with(std::move(group), host_id_, driver_) : nullptr;
}

WorkPtr HierarchicalCommunicator::all_reduce(at::Tensor& tensor, const AllReduceOptions& options) {
  // Integers stay flat: an average in two steps would round twice.
  if (!staged(tensor, kMinElements)) return inner_->all_reduce(tensor, options);
  const int64_t n = tensor.numel();
  const int64_t per = host_->size(), hosts = cross_->size();
  const int64_t piece = (n + per * hosts - 1) / (per * hosts);
  const int64_t chunk = piece * hosts;
  // Padded to a multiple of the group's size (the padding's zeros reduce to
  // zeros and are dropped); a tensor that divides is used in place.
  at::Tensor flat = tensor.view({-1});
  const bool padded = chunk * per != n;
  at::Tensor buffer = padded ? at::zeros({chunk * per}, tensor.options()) : flat;
  at::Tensor part = at::empty({chunk}, tensor.options());
  const ReduceOp op = options.op;
  Stages stages;
  if (padded) {
    stages.push_back({Lane::kLocal, [buffer, flat, n]() mutable {
                        buffer.narrow(0, 0, n).copy_(flat);
                        return completed_work();
                      }});
  }
  CommunicatorPtr host = host_, gather = host_gather_;
  stages.push_back({Lane::kHostReduce, [host, buffer, part, op]() mutable {
                      ReduceScatterOptions o;
                      o.op = op;
                      o.async = true;
                      return host->reduce_scatter(part, buffer, o);
                    }});
  // Across hosts: a ring on point-to-point messages (Note [A ring across hosts]).
  append_ring_reduce_scatter(stages, cross_, part, op);
  append_ring_all_gather(stages, cross_, part);
  stages.push_back({Lane::kHostGather, [gather, buffer, part]() mutable {
                      AllGatherOptions o;
                      o.async = true;
                      return gather->all_gather(buffer, part, o);
                    }});
  if (padded) {
    stages.push_back({Lane::kLocal, [buffer, flat, n]() mutable {
                        flat.copy_(buffer.narrow(0, 0, n));
                        return completed_work();
                      }});
  }
  return submit(std::move(stages), options.async);
}

WorkPtr HierarchicalCommunicator::reduce_scatter(at::Tensor& output, const at::Tensor& input,
                                                 const ReduceScatterOptions& options) {
  if (!staged(input, 1) || !output.is_contiguous() || output.scalar_type() != input.scalar_type())
    return inner_->reduce_scatter(output, input, options);
  const int64_t n = size(), c = output.numel(), hosts = cross_->size();
  TORCH_CHECK(input.numel() == n * c, "reduce_scatter on ", name(), ": input has ", input.numel(),
              " elements, expected ", n, " x the output's ", c);
  at::Tensor reordered = at::empty({n, c}, input.options());
  at::Tensor part = at::empty({hosts * c}, input.options());
  at::Tensor order = by_local_index_;
  CommunicatorPtr host = host_;
  const ReduceOp op = options.op;
  Stages stages;
  stages.push_back({Lane::kHostReduce, [host, input, reordered, part, order, n, c, op]() mutable {
                      at::index_select_out(reordered, input.reshape({n, c}), 0, order);
                      ReduceScatterOptions o;
                      o.op = op;
                      o.async = true;
                      return host->reduce_scatter(part, reordered.view({-1}), o);
                    }});
  append_ring_reduce_scatter(stages, cross_, part, op);
  const int64_t mine = cross_->rank();
  stages.push_back({Lane::kLocal, [output, part, mine, c]() mutable {
                      output.view({-1}).copy_(part.narrow(0, mine * c, c));
                      return completed_work();
                    }});
  return submit(std::move(stages), options.async);
}

WorkPtr HierarchicalCommunicator::all_gather(at::Tensor& output, const at::Tensor& input,
                                             const AllGatherOptions& options) {
  if (!staged(output, 1) || !input.is_contiguous() || output.scalar_type() != input.scalar_type())
    return inner_->all_gather(output, input, options);
  const int64_t n = size(), c = input.numel(), hosts = cross_->size();
  TORCH_CHECK(output.numel() == n * c, "all_gather on ", name(), ": output has ", output.numel(),
              " elements, expected ", n, " x the input's ", c);
  at::Tensor part = at::empty({hosts * c}, input.options());
  at::Tensor gathered = at::empty({n * c}, input.options());
  at::Tensor order = by_local_index_;
  CommunicatorPtr gather = host_gather_;
  const int64_t mine = cross_->rank();
  Stages stages;
  stages.push_back({Lane::kLocal, [input, part, mine, c]() mutable {
                      part.narrow(0, mine * c, c).copy_(input.view({-1}));
                      return completed_work();
                    }});
  append_ring_all_gather(stages, cross_, part);
  stages.push_back({Lane::kHostGather, [gather, gathered, part]() mutable {
                      AllGatherOptions o;
                      o.async = true;
                      return gather->all_gather(gathered, part, o);
                    }});
  stages.push_back({Lane::kLocal, [output, gathered, order, n, c]() mutable {
                      output.view({n, c}).index_copy_(0, order, gathered.view({n, c}));
                      return completed_work();
                    }});
  return submit(std::move(stages), options.async);
}

WorkPtr HierarchicalCommunicator::submit(std::vector<detail::Stage> stages, bool async) {
  // Note [Reductions in bucket order per link]
  // Several reductions may be in flight (ShardedModule posts one per bucket
  // during backward), each advancing whenever its caller or the driver
  // polls it. MPI needs one order of collectives per communicator, the same
  // on every rank, and point-to-point messages without tags pair in posting
  // order: were stages free to interleave, one rank could issue bucket 0's
  // all-gather inside the host before bucket 1's reduce-scatter and another
  // after it (Open MPI aborted with MPI_ERR_TRUNCATE with 0.25 MiB buckets
  // when the ring's messages of two buckets paired with each other's
  // receives). Running one reduction at a time kept that order but left the
  // slow link idle while each bucket passed through its stages inside the
  // host. So each kind of stage has a communicator of its own, its lane:
  // the reduce-scatter inside the host, the ring across hosts, and the
  // all-gather inside the host (a second communicator over the host's
  // ranks, also named "<name>.host"). A stage on a lane is issued only once
  // every earlier reduction has issued all its stages on that lane. Each
  // communicator then sees the reductions in submission order on every
  // rank, whatever the timing, while bucket k + 1 reduces inside its host
  // as bucket k crosses the link. Local stages (copies, the ring's
  // additions) touch only their reduction's tensors and wait for nobody.
  // Each reduction waits only on earlier ones, so the first pending one
  // always moves and none waits forever. A reduction completes only after
  // the earlier ones have, so dropping a completed work never hides a
  // pending one from the next.
  // That needs issuing to never block. Over a communicator whose issue
  // waits for the group (CheckedCommunicator: issue_waits_for_group), two
  // ranks could each wait in a different lane for the other, so there all
  // stages share one lane: every rank issues them in one order, each
  // reduction's after the last of the one before.
  if (inner_->issue_waits_for_group()) {
    for (auto& stage : stages)
      if (stage.lane != Lane::kLocal) stage.lane = Lane::kHostReduce;
  }
  auto work =
      std::make_shared<StagedWork>(std::move(stages), std::static_pointer_cast<StagedWork>(last_.lock()), stage_mutex_);
  last_ = work;
  if (!async) {
    work->wait();
  } else if (driver_ && !work->is_completed()) {
    driver_->add([weak = std::weak_ptr<StagedWork>(work)] {
      auto w = weak.lock();
      return !w || w->try_advance();
    });
  }
  return work;
}

}  // namespace comm
}  // namespace tessera
