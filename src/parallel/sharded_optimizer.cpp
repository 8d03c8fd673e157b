#include "tessera/parallel/sharded_optimizer.h"

#include "tessera/core/error.h"
#include "tessera/parallel/flat_bucket.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <map>
#include <set>

namespace tessera {
namespace parallel {
namespace {

void sync_device(at::Device device) {
  if (!device.is_cuda()) return;
  c10::impl::VirtualGuardImpl impl(device.type());
  impl.getStream(device).synchronize();
}

void add_storage(std::set<const void*>& seen, int64_t& bytes, const at::Tensor& t) {
  if (!t.defined()) return;
  const void* key = t.storage().unsafeGetStorageImpl();
  if (seen.insert(key).second) bytes += static_cast<int64_t>(t.storage().nbytes());
}

}  // namespace

ShardedOptimizer::ShardedOptimizer(ShardedModulePtr module, std::shared_ptr<torch::optim::Optimizer> optimizer,
                                   ShardedOptimizerOptions options)
    : module_(std::move(module)), optimizer_(std::move(optimizer)), options_(options) {
  TORCH_CHECK(module_ && optimizer_, "ShardedOptimizer: the module and the optimizer must not be null");
  TORCH_CHECK(optimizer_->state().empty(),
              "ShardedOptimizer: the optimizer has already stepped; wrap it before "
              "the first step so that its state is created for the local shard only");
  TORCH_CHECK(options_.offload_threads() >= 1, "ShardedOptimizer: offload_threads must be >= 1, got ",
              options_.offload_threads());
  TORCH_CHECK(options_.offload() || !module_->options().offload_params(),
              "ShardedOptimizer: the module keeps its parameter shards in CPU memory (offload_params), so the "
              "optimizer must step there too; set ShardedOptimizerOptions().offload(true)");
  const int d = module_->degrees().optim;
  const ShardLayout& layout = module_->layout();

  std::map<const void*, std::pair<size_t, size_t>> where;  // TensorImpl -> (bucket, slot)
  for (size_t b = 0; b < module_->num_buckets(); ++b) {
    const auto& slots = module_->bucket(b).slots();
    for (size_t i = 0; i < slots.size(); ++i) where[slots[i].param.unsafeGetTensorImpl()] = {b, i};
  }
  if (options_.offload()) {
    at::NoGradGuard no_grad;
    for (size_t b = 0; b < module_->num_buckets(); ++b) {
      FlatBucket& bucket = module_->bucket(b);
      at::Tensor chunk = bucket.param_chunk(d);
      auto cpu = chunk.options().device(at::kCPU).pinned_memory(bucket.device().is_cuda());
      Offloaded o;
      if (bucket.materialized() && chunk.device().is_cpu() && bucket.device().is_cuda()) {
        o.master = chunk;  // the parameter shard already lives on the CPU
      } else {
        o.master = at::empty({chunk.numel()}, cpu);
        o.master.copy_(chunk);
      }
      o.master_grad = at::zeros({chunk.numel()}, cpu);
      offloaded_.push_back(std::move(o));
    }
  }

  for (auto& group : optimizer_->param_groups()) {
    std::vector<at::Tensor> pieces;
    for (const auto& p : group.params()) {
      auto it = where.find(p.unsafeGetTensorImpl());
      TORCH_CHECK(it != where.end(), "ShardedOptimizer: a parameter of shape ", p.sizes(),
                  " is not a trainable parameter of the sharded module; build the optimizer from "
                  "module->parameters() after wrapping");
      const size_t b = it->second.first;
      FlatBucket& bucket = module_->bucket(b);
      const ParamSlot& slot = bucket.slots()[it->second.second];
      const int64_t chunk_begin = layout.chunk_offset(bucket.numel(), d);
      const int64_t chunk_size = bucket.numel() / d;
      const int64_t begin = std::max(slot.offset, chunk_begin);
      const int64_t end = std::min(slot.offset + slot.numel, chunk_begin + chunk_size);
      if (begin >= end) continue;
      at::Tensor param_chunk = options_.offload() ? offloaded_[b].master : bucket.param_chunk(d);
      at::Tensor grad_chunk = options_.offload() ? offloaded_[b].master_grad : bucket.grad_chunk(d);
      at::Tensor piece = param_chunk.narrow(0, begin - chunk_begin, end - begin);
      piece.mutable_grad() = grad_chunk.narrow(0, begin - chunk_begin, end - begin);
      pieces.push_back(piece);
      pieces_.push_back(Piece{b, piece});
    }
    group.params() = std::move(pieces);
  }
}

void ShardedOptimizer::step() {
  module_->finish_gradient_sync();
  const int d = module_->degrees().optim;
  at::NoGradGuard no_grad;
  if (!options_.offload()) {
    optimizer_->step();
  } else {
    for (size_t b = 0; b < offloaded_.size(); ++b) {
      FlatBucket& bucket = module_->bucket(b);
      offloaded_[b].master_grad.copy_(bucket.grad_chunk(d), /*non_blocking=*/bucket.device().is_cuda());
    }
    for (size_t b = 0; b < offloaded_.size(); ++b) sync_device(module_->bucket(b).device());
    const int threads = at::get_num_threads();
    at::set_num_threads(options_.offload_threads());
    try {
      optimizer_->step();
    } catch (...) {
      at::set_num_threads(threads);
      throw;
    }
    at::set_num_threads(threads);
    for (size_t b = 0; b < offloaded_.size(); ++b) {
      FlatBucket& bucket = module_->bucket(b);
      at::Tensor chunk = bucket.param_chunk(d);
      if (!chunk.is_same(offloaded_[b].master)) chunk.copy_(offloaded_[b].master, bucket.device().is_cuda());
    }
  }
  module_->sync_params_after_step();
}

void ShardedOptimizer::zero_grad() {
  module_->zero_grad();
  for (auto& o : offloaded_) o.master_grad.zero_();
}

int64_t ShardedOptimizer::state_bytes() const {
  std::set<const void*> seen;
  int64_t bytes = 0;
  for (const auto& entry : optimizer_->state()) {
    const torch::optim::OptimizerParamState* s = entry.second.get();
    if (auto* a = dynamic_cast<const torch::optim::AdamParamState*>(s)) {
      add_storage(seen, bytes, a->exp_avg());
      add_storage(seen, bytes, a->exp_avg_sq());
      add_storage(seen, bytes, a->max_exp_avg_sq());
    } else if (auto* w = dynamic_cast<const torch::optim::AdamWParamState*>(s)) {
      add_storage(seen, bytes, w->exp_avg());
      add_storage(seen, bytes, w->exp_avg_sq());
      add_storage(seen, bytes, w->max_exp_avg_sq());
    } else if (auto* g = dynamic_cast<const torch::optim::SGDParamState*>(s)) {
      add_storage(seen, bytes, g->momentum_buffer());
    } else if (auto* r = dynamic_cast<const torch::optim::RMSpropParamState*>(s)) {
      add_storage(seen, bytes, r->square_avg());
      add_storage(seen, bytes, r->momentum_buffer());
      add_storage(seen, bytes, r->grad_avg());
    } else if (auto* ad = dynamic_cast<const torch::optim::AdagradParamState*>(s)) {
      add_storage(seen, bytes, ad->sum());
    } else {
      TORCH_CHECK(false,
                  "ShardedOptimizer::state_bytes: unknown optimizer state type; it knows Adam, AdamW, SGD, "
                  "RMSprop and Adagrad");
    }
  }
  for (size_t b = 0; b < offloaded_.size(); ++b) {
    // Master copies that are not the parameter shard itself count as optimizer state.
    if (!offloaded_[b].master.is_same(module_->bucket(b).param_chunk(module_->degrees().optim)))
      add_storage(seen, bytes, offloaded_[b].master);
    add_storage(seen, bytes, offloaded_[b].master_grad);
  }
  return bytes;
}

ModelStateBytes ShardedOptimizer::memory() const {
  ModelStateBytes m = module_->memory();
  m.optim = state_bytes();
  return m;
}

}  // namespace parallel
}  // namespace tessera
