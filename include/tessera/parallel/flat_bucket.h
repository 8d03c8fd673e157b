#pragma once
// FlatBucket: a group of parameters of one dtype and device laid out in one
// flat buffer, padded to a multiple of the largest shard degree, and its
// gradient buffers and shards (Note [Nested shard layout] in shard_layout.h).
// ShardedModule owns the buckets; ShardedOptimizer steps slices of them.
#include "tessera/parallel/shard_layout.h"

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

namespace tessera {
namespace parallel {

struct ParamSlot;

// Bytes of parameter and gradient buffers the buckets of one module hold,
// and the most they held at once since reset.
struct MemoryCounter {
  int64_t current = 0;
  int64_t peak = 0;
  void add(int64_t bytes) {
    current += bytes;
    peak = current > peak ? current : peak;
  }
};

class FlatBucket {
 public:
  // Moves the parameters' storage into the flat buffer (values kept). With
  // `materialize`, keeps only this rank's parameter chunk (on the CPU with
  // offload_params) and frees the full buffer until gathered.
  FlatBucket(size_t index, std::vector<ParamSlot> slots, const ShardLayout& layout, bool materialize,
             bool offload_params, std::shared_ptr<MemoryCounter> counter);

  size_t index() const { return index_; }
  const std::vector<ParamSlot>& slots() const { return slots_; }
  int64_t numel() const { return numel_; }  // padded
  int64_t used() const { return used_; }    // sum of the parameters' sizes
  int64_t element_size() const;
  at::Device device() const { return device_; }
  bool materialized() const { return materialize_; }
  // The layout of the group the bucket's parameters are replicated over.
  const ShardLayout& layout() const { return layout_; }

  // Full parameters (materialized buckets only; others are always full).
  void start_gather();
  void wait_gather();
  bool gathered() const { return gathered_; }
  void free_params();

  // The full gradient buffer, allocated (zeroed) if it is not, with every
  // parameter's .grad a view into it (a .grad found elsewhere is moved in).
  void ensure_full_grads();
  // The same for one parameter: called when its gradient has accumulated.
  void adopt_grad(size_t slot_index);
  bool has_full_grads() const { return full_grad_.defined(); }
  // Drops the full gradient buffer when gradients are sharded.
  void release_full_grads();
  // Gradients of this bucket's parameters are partial over `groups` too
  // (nn::ParamPlacement::gradient_groups): reduce_partial() sums the reduced
  // chunk over each.
  void set_partial_groups(std::vector<comm::CommunicatorPtr> groups) { partial_groups_ = std::move(groups); }
  // Starts the reduction of the full gradients into this rank's gradient
  // shard over the layout's (data) groups.
  CommTask reduce_grads();
  // After reduce_grads() completed: sums the chunk over the partial groups,
  // blocking. Note [Partial sums after backward] in sharded_module.cpp says
  // why this is not a stage of reduce_grads().
  void reduce_partial();
  // After the reduction: divides the gradient shard.
  void scale_grads(double factor);
  void zero_grads();

  // This rank's chunk at `degree` (>= the parameters' / gradients' degree).
  at::Tensor param_chunk(int degree) const;
  at::Tensor grad_chunk(int degree) const;
  // All-gathers the optimizer chunks into the parameter placement.
  void regather_params();

  // Bytes of live storage: parameters (full if alive, plus the shard) and
  // gradients (full buffer if alive, plus the shard).
  int64_t param_bytes() const;
  int64_t grad_bytes() const;

 private:
  at::Tensor param_store() const;  // the tensor holding this rank's s_p chunk

  void track(const at::Tensor& t, int sign) const;

  size_t index_;
  std::vector<ParamSlot> slots_;
  const ShardLayout& layout_;
  bool materialize_;
  bool offload_params_;
  at::Device device_;
  int64_t numel_ = 0;
  int64_t used_ = 0;
  int64_t full_param_bytes_ = 0;

  at::Tensor full_param_;   // N; storage released while not gathered
  at::Tensor param_shard_;  // N / s_p (materialized only)
  at::Tensor full_grad_;    // N; persistent iff s_g == 1
  at::Tensor grad_shard_;   // N / s_g (s_g > 1)
  std::shared_ptr<MemoryCounter> counter_;
  std::vector<comm::CommunicatorPtr> partial_groups_;
  CommTask gather_task_;
  at::Tensor staging_;  // the gather in flight (start_gather)
  bool gathered_ = true;
  bool gathering_ = false;
};

}  // namespace parallel
}  // namespace tessera
