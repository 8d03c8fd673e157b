#pragma once
// ShardedOptimizer: any torch::optim::Optimizer (Adam, AdamW, SGD, ... or
// tessera's) stepping only this rank's optimizer shard of a ShardedModule.
//
// Note [Optimizer pieces]
// The optimizer is built by the user over the module's parameters, in as
// many param groups as they like. ShardedOptimizer replaces every parameter
// of every group by its piece: the part of the parameter that falls in this
// rank's optimizer chunk of its bucket, a 1-D view into the parameter
// storage whose .grad is the matching view into the reduced gradient. A
// parameter outside the chunk has no piece and leaves its group. Per-element
// optimizers (Adam, AdamW, SGD, RMSprop, Adagrad) then compute exactly the
// unsharded update, with each group's options kept; optimizer state is
// created for pieces only, so it takes 1/s_optim of the memory. Optimizers
// that need whole-parameter norms (LAMB, LARS: NormAware) are given a
// WholeNorms that sums their pieces' squares over the data group, then over
// the groups of ShardedOptimizerOptions::whole_norms (Note [Whole-parameter
// norms]).
//
// Note [Master copies]
// With offload, or parameters of another dtype than master_dtype (bf16 or
// fp16 models, fp32 masters), the pieces are views into master copies of
// this rank's optimizer chunks: in CPU memory when offloading (pinned on CUDA
// machines), on the parameters' device otherwise. Before a step the reduced
// gradients are copied (and converted) into master gradients, the optimizer
// steps the masters, and the updated chunks are copied back (rounded to the
// parameter dtype) before the parameters are re-gathered. Without offload the
// master gradients exist only during clip/step, so the memory after a step
// is 2Ψ/s_p + 2Ψ/s_g + 12Ψ/s_os for bf16 parameters and fp32 AdamW.
//
// Note [A torch::optim::Optimizer]
// ShardedOptimizer is a torch::optim::Optimizer, so code written for one
// (LibTorch's learning-rate schedulers, a training loop taking Optimizer&)
// takes it. Its own param groups mirror the inner optimizer's: one per
// group, with a copy of its options and no parameters (the pieces belong to
// the inner optimizer). step() carries the options over: the inner group
// takes this side's options, unless its learning rate was changed on the
// inner side since the last step (code setting inner()'s lr directly), in
// which case this side takes the inner's. LibTorch's Optimizer::zero_grad is
// not virtual: through an Optimizer& it sees no parameters and does nothing,
// so call ShardedOptimizer::zero_grad (or ShardedModule::zero_grad).
// Optimizer::save/load would see none of the sharded state and are refused:
// use train::save_checkpoint.
#include "tessera/parallel/sharded_module.h"
#include "tessera/parallel/whole_norms.h"

#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include <memory>
#include <vector>

namespace tessera {
namespace parallel {

struct ShardedOptimizerOptions {
  TORCH_ARG(bool, offload) = false;
  TORCH_ARG(int, offload_threads) = 1;
  // The dtype the optimizer steps in (Note [Master copies]).
  TORCH_ARG(at::ScalarType, master_dtype) = at::kFloat;
  // Whole-parameter norms over groups beyond the data group, applied to the
  // module's parameters (a PlacementNorms for a tensor-parallel model).
  TORCH_ARG(WholeNormsPtr, whole_norms) = nullptr;

 public:
  ShardedOptimizerOptions() = default;
};

class ShardedOptimizer : public torch::optim::Optimizer {
 public:
  // The optimizer must not have stepped yet (its state would belong to the
  // full parameters). Every parameter in it must belong to `module`.
  ShardedOptimizer(ShardedModulePtr module, std::shared_ptr<torch::optim::Optimizer> optimizer,
                   ShardedOptimizerOptions options = {});

  // Waits for the gradient reductions, steps the local pieces, re-gathers
  // the parameters into their placement. A closure is called first, with
  // gradients enabled (its backward reduces the gradients); its loss is returned.
  at::Tensor step(LossClosure closure = nullptr) override;
  // Zeroes gradients in place (never to none; see docs/latest-libtorch.md, difference 3).
  void zero_grad();
  // Refused (Note [A torch::optim::Optimizer]).
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  // Clips the reduced gradients of all pieces by their global norm
  // (parallel::clip_grad_norm with this optimizer's WholeNorms); call it
  // between backward and step. `across`: groups holding other parameters
  // (the pipeline group); `uncounted`: module parameters scaled but not
  // counted (a tied weight's second holder: PipelineExecutor::tied_copies()).
  // Returns the norm before clipping.
  double clip_grad_norm(double max_norm, const std::vector<comm::CommunicatorPtr>& across = {},
                        const std::vector<at::Tensor>& uncounted = {});
  // The tensors the optimizer steps, with their gradients ready (copied into
  // the masters when there are masters): for a loss scaler's unscale and
  // overflow check before step().
  std::vector<at::Tensor> pieces_for_step();
  // Drops the gradients prepared for a step that is skipped (an overflow).
  void skip_step();
  // Whole-parameter norms of the pieces (Note [Whole-parameter norms]).
  const WholeNormsPtr& whole_norms() const { return norms_; }

  torch::optim::Optimizer& inner() { return *optimizer_; }
  const ShardedModulePtr& module() const { return module_; }
  // The pieces this rank steps, with the bucket each comes from.
  size_t num_pieces() const { return pieces_.size(); }
  // A piece as a checkpoint sees it: the module parameter, the flat range
  // [begin, end) of it that the piece covers, and the tensor the optimizer
  // steps (its state is keyed by it; a view into a master copy when there
  // are masters).
  struct PieceView {
    at::Tensor param;
    int64_t begin = 0;
    int64_t end = 0;
    at::Tensor value;
  };
  std::vector<PieceView> piece_views() const;
  // After the pieces' values were overwritten (a checkpoint loaded): copies
  // masters into the parameters and re-gathers them, as step() does.
  void sync_params_from_pieces();

  // Optimizer states (and offloaded master copies) held by this rank, by
  // live storage. Knows the states of LibTorch's Adam, AdamW, SGD, RMSprop
  // and Adagrad; throws for other optimizers.
  int64_t state_bytes() const;
  // module()->memory() with optim filled in.
  ModelStateBytes memory() const;

 private:
  struct Piece {
    size_t bucket;
    at::Tensor param;   // view the optimizer steps
    at::Tensor owner;   // the module parameter it is part of
    int64_t begin = 0;  // flat offset in owner
  };
  void copy_masters_to_params();
  struct Master {
    at::Tensor master;       // the bucket's optimizer chunk, in master_dtype (CPU when offloading)
    at::Tensor master_grad;  // its gradient; memory held only around a step unless offloading
  };
  void load_master_grads();
  void sync_options();

  ShardedModulePtr module_;
  std::shared_ptr<torch::optim::Optimizer> optimizer_;
  ShardedOptimizerOptions options_;
  std::vector<Piece> pieces_;
  std::vector<Master> masters_;  // per bucket, when there are masters
  bool master_grads_ready_ = false;
  WholeNormsPtr norms_;
  std::vector<double> synced_lr_;  // per group, at the last sync_options()
};

}  // namespace parallel
}  // namespace tessera
