#pragma once
// ShardedModule: data parallelism over any torch::nn::Module, with the
// parameters, gradients and optimizer states placed as a ShardingSpec says
// (DDP, ZeRO-1/2/3, MiCS/HSDP, hpZ and every mix; docs/data-parallel.md).
//
//   auto sharded = std::make_shared<parallel::ShardedModule>(net, ctx,
//       parallel::ShardedModuleOptions().spec(parallel::ShardingSpec::zero3()));
//   parallel::ShardedOptimizer opt(sharded, std::make_shared<torch::optim::AdamW>(
//       net->parameters(), torch::optim::AdamWOptions(1e-3)));
//   auto loss = sharded->run([&] { return loss_fn(net->forward(x), y); });
//   loss.backward();          // gradients reduced in buckets while it runs
//   opt.step();               // steps the local shard, re-gathers parameters
//   opt.zero_grad();
//
// Note [Units and gathering]
// LibTorch modules have no forward hooks, so a sharded module cannot notice
// on its own when a submodule starts. Parameters that must be materialized
// (sharded, or offloaded to the CPU) are grouped in units: by default the
// children of a torch::nn::Sequential, otherwise the whole module; or named
// submodules (options.units). forward() of a Sequential runs unit by unit;
// for other modules the user's forward calls run_unit("name", fn) around the
// code that uses that unit (a module deriving from UnitHost calls unit("name",
// fn), which finds its wrapper), or run(fn) around everything. Parameters
// outside every named unit form the root unit, which stays gathered (as
// FSDP's root does), so the code between units may use them. A unit is gathered before
// fn, the next unit is prefetched (all-gather in flight while fn computes),
// and the unit's full parameters are freed when fn returns. An autograd node
// on fn's output gathers the unit again before its backward and prefetches
// the unit before it; once every gradient of the unit has accumulated, the
// unit's full parameters and full gradients are freed after the reduction.
// Freeing releases the storage (its data pointer and bytes), so the tensors
// saved for backward stay the same objects and see the re-gathered values.
//
// Replicated parameters need no units: their gradients are reduced in
// buckets of options.bucket_bytes in reverse registration order, as DDP does.
#include "tessera/comm/communicator.h"
#include "tessera/context/parallel_context.h"
#include "tessera/nn/placement.h"
#include "tessera/parallel/shard_layout.h"
#include "tessera/parallel/sharding_spec.h"

#include <torch/arg.h>
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace tessera {
namespace parallel {

class FlatBucket;
struct ShardState;
class UnitHost;

struct ShardedModuleOptions {
  TORCH_ARG(ShardingSpec, spec) = ShardingSpec::ddp();
  // Bucket size for replicated parameters (bytes of gradient per bucket);
  // 0: 25 MiB, or a sixteenth of the gradient where the group reduces by
  // host (parallel/bucket_size.h, Note [Buckets across hosts]).
  TORCH_ARG(int64_t, bucket_bytes) = 0;
  // Submodule names (as in named_modules()) that form units; empty: the
  // children of a Sequential, else the whole module (Note [Units and gathering]).
  TORCH_ARG(std::vector<std::string>, units) = {};
  // Keep each rank's parameter shard in CPU memory; gathered to the device per unit.
  TORCH_ARG(bool, offload_params) = false;
  // Start the all-gather of the next unit before running the current one.
  TORCH_ARG(bool, prefetch) = true;
  // Reduce gradients from the backward hooks as buckets fill; false waits for
  // the end of backward (for measuring what overlap gains).
  TORCH_ARG(bool, overlap) = true;
  // Divide reduced gradients by the data size (the mean over the global
  // batch; sequence ranks share their sequences, so they are not counted).
  TORCH_ARG(bool, average) = true;
  // Broadcast parameters and buffers from data rank 0 at construction.
  TORCH_ARG(bool, sync_module_states) = true;
  // Broadcast the module's buffers (BatchNorm's running statistics) from
  // rank 0 of the group after every synchronized gradient reduction, so each
  // forward starts from rank 0's buffers as under PyTorch DDP's default, and
  // every rank holds rank 0's after training (Note [Buffers]).
  TORCH_ARG(bool, broadcast_buffers) = true;
  // The group to shard over; default: the context's data group, or its
  // data x sequence group when the sequence size is > 1 (Note [Sequence
  // ranks in the data reduction] in sharded_module.cpp).
  TORCH_ARG(comm::CommunicatorPtr, group) = nullptr;
  // Placements of the module's parameters (a tensor-parallel model's
  // placements(), nn/placement.h); parameters not listed are whole and
  // replicated. Parameters whose gradients are partial over other groups
  // (gradient_groups()) go into buckets per set of such groups, and their
  // reduced gradient chunks are summed over those groups too. Parameters
  // whose replica group is a sub-group of the wrapper's (expert parameters:
  // the expert-data group) are broadcast, sharded and reduced within it
  // (Note [Replica groups] in sharded_module.cpp).
  TORCH_ARG(nn::NamedPlacements, placements) = {};

 public:
  ShardedModuleOptions() = default;
};

// Bytes held by live storages, counted once each.
struct ModelStateBytes {
  int64_t params = 0;
  int64_t grads = 0;
  int64_t optim = 0;  // optimizer states, and fp32 master copies when offloaded
  int64_t total() const { return params + grads + optim; }
};

// Where one parameter lives in a bucket: [offset, offset + numel) of the flat.
struct ParamSlot {
  std::string name;
  at::Tensor param;
  int64_t offset = 0;
  int64_t numel = 0;
  std::vector<int64_t> shape;
};

class ShardedModule {
 public:
  // Collective over the data group: every data rank wraps the same module
  // structure with the same options. The module's parameters keep their
  // identity (optimizers and user code holding them stay valid) but their
  // storage moves into flat buffers.
  ShardedModule(std::shared_ptr<torch::nn::Module> module, context::ParallelContextPtr ctx,
                ShardedModuleOptions options = {});
  ~ShardedModule();
  ShardedModule(const ShardedModule&) = delete;
  ShardedModule& operator=(const ShardedModule&) = delete;

  const std::shared_ptr<torch::nn::Module>& module() const { return module_; }
  const ShardedModuleOptions& options() const { return options_; }
  // The wrapper group's degrees and layout; a bucket of parameters with
  // another replica group has its own (bucket(i).layout()).
  const ShardDegrees& degrees() const;
  const ShardLayout& layout() const;
  const comm::CommunicatorPtr& group() const { return group_; }

  // Runs fn (which uses unit `unit`'s parameters) as Note [Units and gathering] says.
  // A parameter of another unit used inside fn is named in the error.
  at::Tensor run_unit(size_t unit, const std::function<at::Tensor()>& fn);
  // The same by name: one of units().
  at::Tensor run_unit(const std::string& name, const std::function<at::Tensor()>& fn);
  // Runs fn with every unit gathered; frees them after, gathers for backward.
  at::Tensor run(const std::function<at::Tensor()>& fn);
  // The module must be a Sequential: its children run one unit each.
  at::Tensor forward(const at::Tensor& input);
  size_t num_units() const;
  // Names of the units, in order (the root unit is not one).
  std::vector<std::string> units() const;

  // The mean of a per-rank value (the loss) over the data replicas: for
  // logging. Collective over the group; returns the same on every rank.
  double global_mean(const at::Tensor& value) const;
  // Broadcasts the module's buffers from rank 0 of the group now.
  void broadcast_buffers();

  // While false, backward accumulates gradients locally (no communication);
  // the backward after setting it true reduces everything accumulated.
  void set_gradient_sync(bool sync);
  bool gradient_sync() const;

  // Reduces now what backward passes accumulated with gradient sync off, as
  // a synchronized backward would have: for callers whose gradients come
  // from several autograd passes rather than one (a pipeline stage's
  // micro-batches). Collective over the data group.
  void reduce_gradients();
  // Waits for the reductions of the last backward (ShardedOptimizer::step calls it).
  void finish_gradient_sync();
  // Zeroes the gradients (full and sharded); never sets them to none.
  void zero_grad();
  // After an optimizer step on the local optimizer shards: all-gathers them
  // into the parameter placement.
  void sync_params_after_step();

  // RAII: every unit gathered while it lives (to read or save full parameters).
  class FullParams {
   public:
    explicit FullParams(ShardedModule& owner);
    ~FullParams();
    FullParams(const FullParams&) = delete;
    FullParams& operator=(const FullParams&) = delete;

   private:
    ShardedModule& owner_;
  };
  std::unique_ptr<FullParams> full_params() { return std::make_unique<FullParams>(*this); }

  // RAII: `units` gathered while it lives and released after (the root
  // unit's parameters stay: Note [Units and gathering]), whether gradient
  // sync is on or not. For callers that run a unit's forward and backward
  // themselves instead of through run_unit: a pipeline stage's actions
  // (Note [ZeRO-3 under a pipeline] in pipeline_executor.cpp). Collective
  // over the group, like run_unit.
  class GatheredUnits {
   public:
    GatheredUnits(ShardedModule& owner, std::vector<size_t> units);
    ~GatheredUnits();
    GatheredUnits(const GatheredUnits&) = delete;
    GatheredUnits& operator=(const GatheredUnits&) = delete;

   private:
    ShardedModule& owner_;
    std::vector<size_t> units_;
  };
  // The units (the root unit included) that hold `params`; parameters that
  // do not require grad are held by none. A trained parameter that is not
  // this module's is an error.
  std::vector<size_t> units_holding(const std::vector<at::Tensor>& params) const;

  // Buckets, in reduction order.
  size_t num_buckets() const;
  const FlatBucket& bucket(size_t i) const;
  FlatBucket& bucket(size_t i);
  // Padded flat sizes of the buckets (elements), for analytical volumes.
  std::vector<int64_t> bucket_numels() const;
  // Parameters, gradients (optimizer states: see ShardedOptimizer::memory()).
  ModelStateBytes memory() const;
  // The most parameter + gradient buffer bytes held at once (full copies
  // while gathered or reducing included) since construction or the last reset.
  int64_t peak_bytes() const;
  void reset_peak_bytes();

 private:
  friend struct ShardState;
  void explain_missing_params(size_t unit, const std::function<at::Tensor()>& fn);
  std::shared_ptr<torch::nn::Module> module_;
  context::ParallelContextPtr ctx_;
  ShardedModuleOptions options_;
  comm::CommunicatorPtr group_;
  std::shared_ptr<ShardState> state_;
  UnitHost* host_ = nullptr;  // the module, when it is a UnitHost
};

using ShardedModulePtr = std::shared_ptr<ShardedModule>;

}  // namespace parallel
}  // namespace tessera
