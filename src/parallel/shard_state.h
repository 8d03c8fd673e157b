#pragma once
// ShardState: what ShardedModule's autograd hooks and callbacks reach (the
// buckets, the units, the reductions of the current backward, the buffers);
// private to sharded_module.cpp, which owns it through a shared_ptr.
#include "tessera/comm/communicator.h"
#include "tessera/parallel/flat_bucket.h"
#include "tessera/parallel/shard_layout.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace tessera {
namespace parallel {

// Everything the autograd hooks reach; they hold it weakly so that a hook
// outliving its ShardedModule does nothing.
struct ShardState {
  // [0]: the wrapper's group; then one per replica group (Note [Replica groups]).
  std::vector<std::unique_ptr<ShardLayout>> layouts;
  std::shared_ptr<MemoryCounter> counter = std::make_shared<MemoryCounter>();
  std::vector<std::unique_ptr<FlatBucket>> buckets;  // in reduction order
  std::vector<std::string> unit_names;               // the root unit, if any, is last and named ""
  std::vector<std::vector<size_t>> unit_buckets;     // materialized buckets per unit
  bool has_root_unit = false;
  std::vector<bool> pinned;                          // per bucket: the root unit beside named units
  // Buffers broadcast after each synchronized reduction (Note [Buffers]).
  std::vector<at::Tensor> buffers;
  comm::CommunicatorPtr buffer_group;
  bool prefetch = true;
  bool overlap = true;
  double scale = 1.0;
  bool sync = true;

  // Per backward.
  std::vector<int> expected;  // parameters per bucket
  std::vector<int> arrived;
  std::vector<bool> ready;
  std::vector<bool> finalized;
  std::vector<CommTask> tasks;
  size_t launched = 0;  // buckets 0..launched-1 have their reduction started, in order
  bool callback_queued = false;
  bool reductions_pending = false;
  // Grad accumulators must be kept alive for their hooks to fire; a
  // shared_ptr up to LibTorch 2.11, an intrusive_ptr after (docs/latest-libtorch.md, difference 7).
  std::vector<decltype(torch::autograd::impl::grad_accumulator(std::declval<at::Tensor>()))> keep_alive;

  void gather_unit(size_t unit, bool wait) {
    for (size_t b : unit_buckets[unit]) buckets[b]->start_gather();
    if (wait)
      for (size_t b : unit_buckets[unit]) buckets[b]->wait_gather();
  }
  void free_unit(size_t unit) {
    for (size_t b : unit_buckets[unit]) release(b);
  }
  void release(size_t b) {
    if (!pinned[b]) buckets[b]->free_params();
  }
  void gather_pinned() {
    for (size_t b = 0; b < buckets.size(); ++b)
      if (pinned[b]) buckets[b]->start_gather();
    for (size_t b = 0; b < buckets.size(); ++b)
      if (pinned[b]) buckets[b]->wait_gather();
  }

  // Note [Buffers]
  // Buffers (BatchNorm's running statistics) are not trained: each rank
  // updates its own in forward. With broadcast_buffers, rank 0's are
  // broadcast after every synchronized reduction: the next forward starts
  // from rank 0's buffers on every rank, as under PyTorch DDP (which
  // broadcasts before each forward; LibTorch has no forward hook), and after
  // training every rank holds rank 0's, which evaluation and checkpoints then
  // use. Backward passes with gradient sync off leave them alone, as DDP's
  // no_sync() does. One broadcast per dtype.
  static void broadcast_buffers(const std::vector<at::Tensor>& list, comm::Communicator& group) {
    at::NoGradGuard no_grad;
    std::map<at::ScalarType, std::vector<at::Tensor>> by_dtype;
    for (const auto& b : list)
      if (b.defined() && b.numel() > 0) by_dtype[b.scalar_type()].push_back(b);
    for (auto& [dtype, list] : by_dtype) {
      std::vector<at::Tensor> flat;
      for (const auto& b : list) flat.push_back(b.reshape({-1}));
      at::Tensor all = at::cat(flat);
      group.broadcast(all);
      int64_t offset = 0;
      for (auto& b : list) {
        b.copy_(all.narrow(0, offset, b.numel()).view_as(b));
        offset += b.numel();
      }
    }
  }
  void ensure_root() {
    if (has_root_unit) gather_unit(unit_buckets.size() - 1, true);
  }

  void queue_end_callback(const std::shared_ptr<ShardState>& self) {
    if (callback_queued) return;
    callback_queued = true;
    std::weak_ptr<ShardState> weak = self;
    torch::autograd::Engine::get_default_engine().queue_callback([weak] {
      if (auto s = weak.lock()) s->end_backward();
    });
  }

  // Reductions start in bucket order on every rank (as DDP does), and a
  // later stage of a hierarchical reduction starts only after the bucket
  // before it started that stage, so every communicator sees the same order.
  void launch_ready(bool all) {
    while (launched < buckets.size() && (all || ready[launched])) {
      tasks[launched] = buckets[launched]->reduce_grads();
      tasks[launched].start();
      ++launched;
    }
    poll();
  }
  void poll() {
    size_t limit = static_cast<size_t>(-1);
    for (size_t b = 0; b < launched; ++b) {
      if (finalized[b]) {
        limit = static_cast<size_t>(-1);  // so every earlier bucket issued every stage
        continue;
      }
      if (tasks[b].poll(limit)) {
        finalize(b);
        limit = static_cast<size_t>(-1);
      } else {
        limit = tasks[b].issued();
      }
    }
  }

  // A bucket's reduction is complete: average, and free its full gradients
  // now rather than at the end of backward (this bounds ZeRO-2's peak).
  void finalize(size_t b) {
    tasks[b].wait();
    tasks[b] = CommTask();
    if (scale != 1.0) buckets[b]->scale_grads(scale);
    buckets[b]->release_full_grads();
    finalized[b] = true;
  }

  void on_grad_ready(size_t bucket, size_t slot, const std::shared_ptr<ShardState>& self) {
    queue_end_callback(self);
    buckets[bucket]->adopt_grad(slot);
    if (!sync) return;
    reductions_pending = true;
    if (++arrived[bucket] == expected[bucket]) {
      ready[bucket] = true;
      release(bucket);  // its backward is done (Note [Units and gathering])
      if (overlap) launch_ready(false);
    } else if (launched > 0) {
      poll();
    }
  }

  void pre_backward(const std::vector<size_t>& units, size_t prefetch_unit, const std::shared_ptr<ShardState>& self) {
    queue_end_callback(self);
    ensure_root();
    for (size_t u : units) gather_unit(u, false);
    if (prefetch && prefetch_unit < unit_buckets.size()) gather_unit(prefetch_unit, false);
    for (size_t u : units) gather_unit(u, true);
  }

  void end_backward() {
    callback_queued = false;
    if (!sync || !reductions_pending) return;
    launch_ready(true);
    finish();
    for (size_t b = 0; b < buckets.size(); ++b) release(b);
  }

  // Note [Partial sums after backward]
  // Gradients that are partial over tensor-parallel groups (2D's col, 2.5D's
  // depth, the 1D sequence-parallel variant's tensor group) are summed over
  // those groups here, after backward, in bucket order, blocking. Issued as
  // asynchronous stages during backward they would share a communicator
  // with the layers' own collectives (SUMMA's broadcasts on col), and ranks
  // could issue the two in different orders: MPI and NCCL both require one
  // order per communicator, and the 2D trainer test hung on it. The data
  // reductions stay asynchronous: no layer communicates over the data group.
  void finish() {
    if (!reductions_pending) return;
    launch_ready(true);
    for (size_t b = 0; b < buckets.size(); ++b)
      if (!finalized[b]) finalize(b);
    for (auto& bucket : buckets) bucket->reduce_partial();
    if (buffer_group) broadcast_buffers(buffers, *buffer_group);
    std::fill(arrived.begin(), arrived.end(), 0);
    std::fill(ready.begin(), ready.end(), false);
    std::fill(finalized.begin(), finalized.end(), false);
    launched = 0;
    reductions_pending = false;
  }
};

}  // namespace parallel
}  // namespace tessera
