#include "tessera/parallel/flat_bucket.h"

#include "tessera/core/error.h"
#include "tessera/parallel/sharded_module.h"

#include "storage.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/StorageImpl.h>

namespace tessera {
namespace parallel {
namespace {

using detail::release_storage;
using detail::adopt_storage;

int64_t storage_bytes(const at::Tensor& t) { return t.defined() ? static_cast<int64_t>(t.storage().nbytes()) : 0; }

}  // namespace

FlatBucket::FlatBucket(size_t index, std::vector<ParamSlot> slots, const ShardLayout& layout, bool materialize,
                       bool offload_params, std::shared_ptr<MemoryCounter> counter)
    : index_(index),
      slots_(std::move(slots)),
      layout_(layout),
      materialize_(materialize),
      offload_params_(offload_params),
      device_(slots_.at(0).param.device()),
      counter_(std::move(counter)) {
  at::NoGradGuard no_grad;
  const auto options = slots_[0].param.options();
  for (auto& slot : slots_) {
    TORCH_INTERNAL_ASSERT(slot.param.options().dtype() == options.dtype() && slot.param.device() == device_);
    slot.offset = used_;
    slot.numel = slot.param.numel();
    slot.shape = slot.param.sizes().vec();
    used_ += slot.numel;
  }
  const int64_t multiple = layout_.max_degree();
  numel_ = (used_ + multiple - 1) / multiple * multiple;
  if (numel_ == 0) numel_ = multiple;  // keep every rank's chunk non-empty
  full_param_ = at::zeros({numel_}, options);
  full_param_bytes_ = storage_bytes(full_param_);
  for (auto& slot : slots_) {
    full_param_.narrow(0, slot.offset, slot.numel).copy_(slot.param.reshape({-1}));
    slot.param.set_data(full_param_.narrow(0, slot.offset, slot.numel).view(slot.shape));
  }
  const ShardDegrees& d = layout_.degrees();
  if (d.grads == 1) {
    full_grad_ = at::zeros({numel_}, options);
    for (auto& slot : slots_)
      slot.param.mutable_grad() = full_grad_.narrow(0, slot.offset, slot.numel).view(slot.shape);
  } else {
    grad_shard_ = at::zeros({numel_ / d.grads}, options);
  }
  if (materialize_) {
    at::Tensor chunk = full_param_.narrow(0, layout_.chunk_offset(numel_, d.params), numel_ / d.params);
    auto shard_options = options;
    if (offload_params_ && device_.is_cuda()) shard_options = shard_options.device(at::kCPU).pinned_memory(true);
    if (offload_params_) shard_options = shard_options.device(at::kCPU);
    param_shard_ = at::empty({chunk.numel()}, shard_options);
    param_shard_.copy_(chunk);
  }
  track(full_param_, 1);
  track(full_grad_, 1);
  track(grad_shard_, 1);
  track(param_shard_, 1);
  if (materialize_) free_params();
}

void FlatBucket::track(const at::Tensor& t, int sign) const {
  if (t.defined()) counter_->add(sign * static_cast<int64_t>(t.storage().nbytes()));
}

int64_t FlatBucket::element_size() const { return static_cast<int64_t>(full_param_.element_size()); }

void FlatBucket::start_gather() {
  if (!materialize_ || gathered_ || gathering_) return;
  // Gathered into a staging buffer that the parameters take over in
  // wait_gather: until then they have no memory, so code that reads a
  // prefetched unit early fails (and is named: Note [Units and gathering])
  // instead of reading a gather in flight.
  staging_ = at::empty({numel_}, full_param_.options());
  counter_->add(full_param_bytes_);
  at::Tensor source = param_shard_.device() == device_ ? param_shard_ : param_shard_.to(device_, /*non_blocking=*/true);
  gather_task_ = layout_.gather(staging_, numel_, layout_.degrees().params, 1, source);
  gather_task_.start();
  gathering_ = true;
}

void FlatBucket::wait_gather() {
  if (!materialize_ || gathered_) return;
  start_gather();
  gather_task_.wait();
  gather_task_ = CommTask();
  adopt_storage(full_param_, staging_);
  gathering_ = false;
  gathered_ = true;
}

void FlatBucket::free_params() {
  if (!materialize_) return;
  if (gathering_) wait_gather();  // never free under an operation in flight
  if (gathered_) counter_->add(-full_param_bytes_);
  release_storage(full_param_);
  gathered_ = false;
}

void FlatBucket::ensure_full_grads() {
  if (!full_grad_.defined()) {
    full_grad_ = at::zeros({numel_}, full_param_.options());
    track(full_grad_, 1);
  }
  for (size_t i = 0; i < slots_.size(); ++i) adopt_grad(i);
}

void FlatBucket::adopt_grad(size_t slot_index) {
  if (!full_grad_.defined()) {
    ensure_full_grads();
    return;
  }
  ParamSlot& slot = slots_[slot_index];
  const at::Tensor& g = slot.param.grad();
  if (g.defined() && g.is_alias_of(full_grad_)) return;
  // First gradient of a lazily allocated buffer, or a .grad that was reset
  // (LibTorch 2.x zero_grad() sets it to none): move it into the bucket.
  at::NoGradGuard no_grad;
  at::Tensor view = full_grad_.narrow(0, slot.offset, slot.numel).view(slot.shape);
  if (g.defined()) view.copy_(g);
  slot.param.mutable_grad() = view;
}

void FlatBucket::release_full_grads() {
  if (layout_.degrees().grads == 1 || !full_grad_.defined()) return;
  for (auto& slot : slots_) slot.param.mutable_grad().reset();
  track(full_grad_, -1);
  full_grad_ = at::Tensor();
}

CommTask FlatBucket::reduce_grads() {
  ensure_full_grads();
  const int g = layout_.degrees().grads;
  at::Tensor out = g == 1 ? full_grad_ : grad_shard_;
  return layout_.reduce(full_grad_, out, g);
}

void FlatBucket::reduce_partial() {
  at::Tensor out = layout_.degrees().grads == 1 ? full_grad_ : grad_shard_;
  for (const auto& group : partial_groups_)
    if (group->size() > 1) group->all_reduce(out);
}

void FlatBucket::scale_grads(double factor) {
  at::NoGradGuard no_grad;
  if (layout_.degrees().grads == 1) {
    full_grad_.mul_(factor);
  } else {
    grad_shard_.mul_(factor);
  }
}

void FlatBucket::zero_grads() {
  at::NoGradGuard no_grad;
  if (grad_shard_.defined()) grad_shard_.zero_();
  if (layout_.degrees().grads == 1) {
    ensure_full_grads();
    full_grad_.zero_();
  } else {
    release_full_grads();
  }
}

at::Tensor FlatBucket::param_store() const { return materialize_ ? param_shard_ : full_param_; }

at::Tensor FlatBucket::param_chunk(int degree) const {
  const int p = layout_.degrees().params;
  TORCH_INTERNAL_ASSERT(degree % p == 0);
  const int64_t base = materialize_ ? layout_.chunk_offset(numel_, p) : 0;
  return param_store().narrow(0, layout_.chunk_offset(numel_, degree) - base, numel_ / degree);
}

at::Tensor FlatBucket::grad_chunk(int degree) const {
  const int g = layout_.degrees().grads;
  TORCH_INTERNAL_ASSERT(degree % g == 0);
  if (g == 1) return full_grad_.narrow(0, layout_.chunk_offset(numel_, degree), numel_ / degree);
  return grad_shard_.narrow(0, layout_.chunk_offset(numel_, degree) - layout_.chunk_offset(numel_, g), numel_ / degree);
}

void FlatBucket::regather_params() {
  const ShardDegrees& d = layout_.degrees();
  if (gathered_) free_params();  // the full copy is stale now
  if (d.optim == d.params) return;
  at::Tensor store = param_store();
  at::Tensor work = store.device() == device_ ? store : store.to(device_);
  layout_.gather(work, numel_, d.optim, d.params).wait();
  if (!work.is_same(store)) store.copy_(work);
}

int64_t FlatBucket::param_bytes() const { return storage_bytes(full_param_) + storage_bytes(param_shard_); }

int64_t FlatBucket::grad_bytes() const { return storage_bytes(full_grad_) + storage_bytes(grad_shard_); }

}  // namespace parallel
}  // namespace tessera
