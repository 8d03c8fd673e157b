#include "tessera/parallel/shard_layout.h"

#include "tessera/core/error.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <string>

namespace tessera {
namespace parallel {

void CommTask::start() {
  if (next_ == 0 && !stages_.empty()) current_ = stages_[next_++]();
  if (stages_.empty()) done_ = true;
}

bool CommTask::poll(size_t max_issued) {
  start();
  while (!done_ && current_->is_completed()) {
    if (next_ < stages_.size() && next_ >= max_issued) break;
    current_->wait();
    if (next_ == stages_.size()) {
      done_ = true;
    } else {
      current_ = stages_[next_++]();
    }
  }
  return done_;
}

void CommTask::wait() {
  start();
  while (!done_) {
    current_->wait();
    if (next_ == stages_.size()) {
      done_ = true;
    } else {
      current_ = stages_[next_++]();
    }
  }
  current_.reset();
}

ShardLayout::ShardLayout(comm::CommunicatorPtr data, ShardDegrees degrees)
    : data_(std::move(data)), degrees_(degrees), dp_(data_->size()), rank_(data_->rank()) {
  chain_ = {1, degrees_.params, degrees_.grads, degrees_.optim};
  std::sort(chain_.begin(), chain_.end());
  chain_.erase(std::unique(chain_.begin(), chain_.end()), chain_.end());
  for (size_t i = 1; i < chain_.size(); ++i) {
    TORCH_INTERNAL_ASSERT(chain_[i] % chain_[i - 1] == 0 && dp_ % chain_[i] == 0, "shard degrees not nested");
    const int lo = chain_[i - 1];
    const int hi = chain_[i];
    const int color = (rank_ / hi) * lo + rank_ % lo;
    levels_.push_back(
        data_->split(color, rank_, data_->name() + ".shard" + std::to_string(lo) + "-" + std::to_string(hi)));
    TORCH_INTERNAL_ASSERT(levels_.back()->size() == hi / lo && levels_.back()->rank() == (rank_ % hi) / lo);
  }
  if (degrees_.grads > 1 && degrees_.grads < dp_) {
    grad_replicas_ =
        data_->split(rank_ % degrees_.grads, rank_, data_->name() + ".replica" + std::to_string(degrees_.grads));
  }
}

int ShardLayout::level_of(int degree) const {
  auto it = std::find(chain_.begin(), chain_.end(), degree);
  TORCH_INTERNAL_ASSERT(it != chain_.end(), "degree ", degree, " is not in the shard chain");
  return static_cast<int>(it - chain_.begin());
}

int64_t ShardLayout::chunk_offset(int64_t numel, int degree) const {
  TORCH_INTERNAL_ASSERT(numel % max_degree() == 0, "flat size ", numel, " not padded to ", max_degree());
  int64_t offset = 0;
  for (int i = 1; i <= level_of(degree); ++i) {
    const int digit = (rank_ % chain_[i]) / chain_[i - 1];
    offset += digit * (numel / chain_[i]);
  }
  return offset;
}

CommTask ShardLayout::gather(at::Tensor out, int64_t numel, int from, int to, at::Tensor source) const {
  const int hi = level_of(from);
  const int lo = level_of(to);
  TORCH_INTERNAL_ASSERT(lo <= hi && out.numel() == numel / to);
  const int64_t base = chunk_offset(numel, to);
  std::vector<CommTask::Stage> stages;
  if (hi == lo) {
    if (source.defined()) {
      stages.push_back([out, source]() mutable {
        out.copy_(source);
        return comm::completed_work();
      });
    }
    return CommTask(std::move(stages));
  }
  for (int i = hi; i > lo; --i) {
    const int64_t in_off = chunk_offset(numel, chain_[i]) - base;
    const int64_t out_off = chunk_offset(numel, chain_[i - 1]) - base;
    at::Tensor input = (i == hi && source.defined()) ? source : out.narrow(0, in_off, numel / chain_[i]);
    at::Tensor output = out.narrow(0, out_off, numel / chain_[i - 1]);
    comm::CommunicatorPtr group = levels_[i - 1];
    stages.push_back([group, input, output]() mutable {
      comm::AllGatherOptions opts;
      opts.async = true;
      return group->all_gather(output, input, opts);
    });
  }
  return CommTask(std::move(stages));
}

CommTask ShardLayout::reduce(at::Tensor full, at::Tensor out, int to) const {
  const int64_t numel = full.numel();
  TORCH_INTERNAL_ASSERT(out.numel() == numel / to);
  std::vector<CommTask::Stage> stages;
  if (to == 1) {
    if (dp_ > 1) {
      comm::CommunicatorPtr group = data_;
      stages.push_back([group, full]() mutable {
        comm::AllReduceOptions opts;
        opts.async = true;
        return group->all_reduce(full, opts);
      });
    }
    if (!out.is_same(full)) {
      stages.push_back([full, out]() mutable {
        out.copy_(full);
        return comm::completed_work();
      });
    }
    return CommTask(std::move(stages));
  }
  TORCH_INTERNAL_ASSERT(to == dp_ || to == degrees_.grads, "no replica group for degree ", to);
  const int top = level_of(to);
  // Each level writes a fresh buffer that the next level reads; the last writes `out`.
  auto carry = std::make_shared<at::Tensor>(full);
  for (int i = 1; i <= top; ++i) {
    comm::CommunicatorPtr group = levels_[i - 1];
    const int64_t out_numel = numel / chain_[i];
    const bool last = i == top;
    stages.push_back([group, carry, out, out_numel, last]() mutable {
      at::Tensor input = *carry;
      at::Tensor output = last ? out : at::empty({out_numel}, input.options());
      *carry = output;
      comm::ReduceScatterOptions opts;
      opts.async = true;
      return group->reduce_scatter(output, input, opts);
    });
  }
  if (to < dp_) {
    comm::CommunicatorPtr group = grad_replicas_;
    stages.push_back([group, out]() mutable {
      comm::AllReduceOptions opts;
      opts.async = true;
      return group->all_reduce(out, opts);
    });
  }
  return CommTask(std::move(stages));
}

}  // namespace parallel
}  // namespace tessera
