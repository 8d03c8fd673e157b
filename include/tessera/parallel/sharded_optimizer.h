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
// Note [Disk offload]
// With Offload::kDisk (and DiskOffloadOptions::dir), the optimizer states, and the master
// copies where they differ from the parameter chunk (bf16/fp16 parameters,
// parameters on a GPU), live in one unlinked file per rank in that
// directory; in memory stay only `buffers` host buffers of about
// tile_bytes of masters plus their states. Each bucket's optimizer chunk
// is cut into tiles of at most tile_bytes of master elements (a parameter's
// piece longer than that is cut into several pieces), and step() steps the inner
// optimizer tile by tile (its param groups narrowed to the tile's pieces),
// reading the next tile and writing the previous one while a tile steps
// (Note [Tiles in slots] in src/parallel/tile_swapper.h). Per-element
// optimizers (Adam, AdamW, SGD, RMSprop, Adagrad) give the same result as
// one step over all pieces; LAMB and LARS, whose step needs whole-parameter
// norms of all pieces at once, are refused. Master gradients (only where
// there are master copies) exist during step() as without offload. Code
// that reads or writes the pieces between steps (checkpoints) calls
// fetch_offloaded() first and park_offloaded() after; piece_views() refuses
// while the states are on disk. The file goes with the ShardedOptimizer:
// the inner optimizer's states are not usable after it is destroyed.
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
#include "tessera/parallel/offload.h"
#include "tessera/parallel/sharded_module.h"
#include "tessera/parallel/whole_norms.h"

#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace tessera {
namespace parallel {
namespace detail {
class TileSwapper;
}

// Note [Disk offload]
struct DiskOffloadOptions {
  // A directory on a local disk; empty: no disk offload.
  TORCH_ARG(std::string, dir) = "";
  // Bytes of master copy (master_dtype elements) per tile; a parameter's
  // piece is cut at this size, so a buffer holds at most this many elements
  // of master and states.
  TORCH_ARG(int64_t, tile_bytes) = int64_t(16) << 20;
  // Host buffers of one tile each: 3 overlaps a read, a step and a write.
  TORCH_ARG(int, buffers) = 3;
  TORCH_ARG(int, io_threads) = 2;
  // O_DIRECT (Note [Direct I/O] in tessera/core/async_file.h).
  TORCH_ARG(bool, direct_io) = false;

 public:
  DiskOffloadOptions() = default;
};

struct ShardedOptimizerOptions {
  // Where optimizer states and masters live: with the parameters (none), in
  // host memory, stepped there (host), or on disk through host buffers
  // (disk, Note [Disk offload]; needs disk().dir()), stepped on the host too.
  TORCH_ARG(Offload, offload) = Offload::kNone;
  TORCH_ARG(DiskOffloadOptions, disk) = {};
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
  ~ShardedOptimizer() override;
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

  // Disk offload (Note [Disk offload]): brings every tile into memory of
  // its own, and sends them back to the file. No-ops without disk offload.
  void fetch_offloaded();
  void park_offloaded();
  bool offloaded_to_disk() const { return swapper_ != nullptr; }
  // Bytes of the offload file (0 without disk offload).
  int64_t disk_bytes() const;

  // Optimizer states (and offloaded master copies) held by this rank, by
  // live storage; with disk offload, the host buffers. Knows the states of LibTorch's Adam, AdamW, SGD, RMSprop
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
    size_t group = 0;   // inner param group
  };
  void copy_masters_to_params();
  struct Master {
    size_t bucket = 0;
    int64_t offset = 0;      // in the bucket's optimizer chunk
    at::Tensor master;       // that range of the chunk, in master_dtype (CPU when offloading)
    at::Tensor master_grad;  // its gradient; memory held only around a step unless offloading to CPU memory
  };
  // A range of pieces stepped together under disk offload.
  struct Tile {
    size_t bucket = 0;
    int64_t begin = 0, end = 0;  // in the bucket's optimizer chunk
    int64_t master = -1;         // index in masters_, or -1 when the pieces are views of the chunk
    std::vector<size_t> pieces;  // indices in pieces_
  };
  // The part of a parameter in this rank's optimizer chunk.
  struct Range {
    size_t group, bucket;  // inner param group, module bucket
    const ParamSlot* slot;
    int64_t begin, end;  // in the chunk
  };
  void check_options() const;
  int optim_degree(size_t bucket) const;
  // Every parameter's part of the chunk, in the inner groups' order, cut
  // into pieces of at most max_piece elements (0: whole).
  std::vector<Range> chunk_ranges(int64_t max_piece) const;
  int64_t add_master(size_t bucket, int64_t offset, int64_t numel);
  // Note [Optimizer storage] in the source: the master of each range (or -1).
  std::vector<int64_t> place_masters(const std::vector<Range>& ranges);
  std::vector<int64_t> place_tiles(const std::vector<Range>& ranges, int64_t tile_elems);
  void make_pieces(const std::vector<Range>& ranges, const std::vector<int64_t>& master_of);
  void make_norms();
  void open_disk();
  void load_master_grads();
  void sync_options();
  void copy_master_to_params(const Master& m);
  void step_pieces(const std::vector<size_t>& pieces);
  std::vector<at::Tensor> tile_tensors(size_t tile);
  // Runs fn, then tells every rank of the data group whether it threw on
  // any: a full disk on one rank stops all of them instead of leaving the
  // others waiting in the next collective.
  void on_every_rank(const std::function<void()>& fn);
  bool on_cpu_step() const { return options_.offload() != Offload::kNone; }
  bool host_offload() const { return options_.offload() == Offload::kHost; }

  ShardedModulePtr module_;
  std::shared_ptr<torch::optim::Optimizer> optimizer_;
  ShardedOptimizerOptions options_;
  std::vector<Piece> pieces_;
  std::vector<Master> masters_;  // per bucket (per tile under disk offload), when there are masters
  std::vector<Tile> tiles_;
  std::unique_ptr<detail::TileSwapper> swapper_;
  bool master_grads_ready_ = false;
  WholeNormsPtr norms_;
  std::vector<double> synced_lr_;  // per group, at the last sync_options()
};

}  // namespace parallel
}  // namespace tessera
