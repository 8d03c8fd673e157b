#include "tessera/parallel/sharded_optimizer.h"

#include "tessera/core/error.h"
#include "tessera/parallel/flat_bucket.h"

#include "storage.h"
#include "tile_swapper.h"

#include "tessera/comm/agree.h"
#include "tessera/core/async_file.h"
#include "tessera/core/optimizer_state.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
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

namespace {

// Note [Whole-parameter norms] for pieces: each piece's local squares go to
// its parameter's row of a [P, k] table over all the module's parameters
// (the same order on every data rank), each row is summed over the group its
// bucket's layout spans (the data group, or the parameter's replica group;
// replicas of the optimizer chunks scaled by 1/r so that each element counts
// once), made whole over further groups by `outer`, and read back.
class PieceNorms : public WholeNorms {
 public:
  // Row i is summed over groups[row_group[i]] after division by replicas[i].
  PieceNorms(std::map<const c10::TensorImpl*, int64_t> index, std::vector<at::Tensor> module_params,
             std::vector<comm::CommunicatorPtr> groups, const std::vector<size_t>& row_group,
             const std::vector<double>& replicas, WholeNormsPtr outer)
      : index_(std::move(index)),
        module_params_(std::move(module_params)),
        groups_(std::move(groups)),
        outer_(std::move(outer)) {
    const auto rows = static_cast<int64_t>(module_params_.size());
    replicas_ = at::ones({rows, 1}, at::kDouble);
    for (size_t g = 0; g < groups_.size(); ++g) masks_.push_back(at::zeros({rows, 1}, at::kDouble));
    for (int64_t i = 0; i < rows; ++i) {
      replicas_[i] = replicas.at(static_cast<size_t>(i));
      masks_.at(row_group.at(static_cast<size_t>(i)))[i] = 1.0;
    }
  }

  void reduce(const std::vector<at::Tensor>& pieces, at::Tensor& squares) const override {
    at::Tensor table = whole_table(pieces, squares);
    for (size_t i = 0; i < pieces.size(); ++i) squares[static_cast<int64_t>(i)].copy_(table[row(pieces[i])]);
  }
  at::Tensor total(const std::vector<at::Tensor>& pieces, at::Tensor squares) const override {
    return whole_table(pieces, squares).select(1, 0).sum().view({1});
  }

 private:
  int64_t row(const at::Tensor& piece) const {
    auto it = index_.find(piece.unsafeGetTensorImpl());
    TORCH_CHECK(it != index_.end(), "ShardedOptimizer: whole norms asked for a tensor that is not one of its pieces");
    return it->second;
  }
  at::Tensor whole_table(const std::vector<at::Tensor>& pieces, const at::Tensor& squares) const {
    // On the squares' device (Note [One host sync per step] in whole_norms.cpp).
    at::Tensor table = at::zeros({static_cast<int64_t>(module_params_.size()), squares.size(1)}, squares.options());
    for (size_t i = 0; i < pieces.size(); ++i) table[row(pieces[i])] += squares[static_cast<int64_t>(i)];
    table.div_(replicas_.to(squares.device()));
    if (groups_.size() == 1) {
      groups_[0]->all_reduce(table);
    } else {  // each row over its own group, the groups in the same order on every rank
      at::Tensor summed = at::zeros_like(table);
      for (size_t g = 0; g < groups_.size(); ++g) {
        at::Tensor part = table * masks_[g].to(squares.device());
        groups_[g]->all_reduce(part);
        summed += part;
      }
      table = summed;
    }
    if (outer_) outer_->reduce(module_params_, table);
    return table;
  }

  std::map<const c10::TensorImpl*, int64_t> index_;  // piece -> row of its module parameter
  std::vector<at::Tensor> module_params_;
  std::vector<comm::CommunicatorPtr> groups_;
  std::vector<at::Tensor> masks_;  // [P, 1] per group: its rows
  at::Tensor replicas_;            // [P, 1]
  WholeNormsPtr outer_;
};

// Note [A torch::optim::Optimizer]: one group per inner group, no parameters.
std::vector<torch::optim::OptimizerParamGroup> mirror_groups(const torch::optim::Optimizer* inner) {
  TORCH_CHECK(inner != nullptr, "ShardedOptimizer: the module and the optimizer must not be null");
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (const auto& g : inner->param_groups())
    groups.emplace_back(std::vector<at::Tensor>{}, g.options().clone());
  return groups;
}

std::unique_ptr<torch::optim::OptimizerOptions> inner_defaults(const torch::optim::Optimizer* inner) {
  TORCH_CHECK(inner != nullptr, "ShardedOptimizer: the module and the optimizer must not be null");
  return inner->defaults().clone();
}

}  // namespace

ShardedOptimizer::ShardedOptimizer(ShardedModulePtr module, std::shared_ptr<torch::optim::Optimizer> optimizer,
                                   ShardedOptimizerOptions options)
    : torch::optim::Optimizer(mirror_groups(optimizer.get()), inner_defaults(optimizer.get())),
      module_(std::move(module)),
      optimizer_(std::move(optimizer)),
      options_(options) {
  check_options();
  for (const auto& g : optimizer_->param_groups()) synced_lr_.push_back(g.options().get_lr());
  const bool to_disk = options_.offload() == Offload::kDisk;
  // Under disk offload a piece is at most a tile, so that a tile's buffer is
  // bounded by tile_bytes whatever the parameter sizes (per-element
  // optimizers do not see where a parameter is cut).
  const int64_t tile_elems = std::max<int64_t>(
      1, options_.disk().tile_bytes() / static_cast<int64_t>(c10::elementSize(options_.master_dtype())));
  const std::vector<Range> ranges = chunk_ranges(to_disk ? tile_elems : 0);
  at::NoGradGuard no_grad;
  make_pieces(ranges, to_disk ? place_tiles(ranges, tile_elems) : place_masters(ranges));
  make_norms();
  skip_step();  // the pieces' gradient views exist; the master gradients' memory waits for a step
  if (to_disk) open_disk();
}

void ShardedOptimizer::check_options() const {
  TORCH_CHECK(module_ && optimizer_, "ShardedOptimizer: the module and the optimizer must not be null");
  TORCH_CHECK(optimizer_->state().empty(),
              "ShardedOptimizer: the optimizer has already stepped; wrap it before "
              "the first step so that its state is created for the local shard only");
  TORCH_CHECK(options_.offload_threads() >= 1, "ShardedOptimizer: offload_threads must be >= 1, got ",
              options_.offload_threads());
  const DiskOffloadOptions& disk = options_.disk();
  const bool to_disk = options_.offload() == Offload::kDisk;
  TORCH_CHECK(options_.offload() != Offload::kHost || disk.dir().empty(),
              "ShardedOptimizer: offload host (CPU memory) and disk.dir (disk) are both set; choose one: "
              "offload(Offload::kDisk) with disk.dir, or offload(Offload::kHost) without it");
  TORCH_CHECK(to_disk == !disk.dir().empty(),
              to_disk ? "ShardedOptimizer: offload disk needs disk().dir(), a directory on a local disk"
                      : "ShardedOptimizer: disk.dir is set but offload is none; set offload(Offload::kDisk)");
  TORCH_CHECK(on_cpu_step() || !module_->options().offload_params(),
              "ShardedOptimizer: the module keeps its parameter shards in CPU memory (offload_params), so the "
              "optimizer must step there too; set ShardedOptimizerOptions().offload(Offload::kHost)");
  if (!to_disk) return;
  TORCH_CHECK(dynamic_cast<NormAware*>(optimizer_.get()) == nullptr,
              "ShardedOptimizer: disk offload steps the optimizer one tile of pieces at a time, and LAMB and LARS "
              "need the norms of all pieces at once; use offload(Offload::kHost) (CPU memory) for them");
  TORCH_CHECK(disk.tile_bytes() > 0, "ShardedOptimizer: disk.tile_bytes must be > 0, got ", disk.tile_bytes());
  TORCH_CHECK(disk.buffers() >= 1, "ShardedOptimizer: disk.buffers must be >= 1, got ", disk.buffers());
  TORCH_CHECK(disk.io_threads() >= 1, "ShardedOptimizer: disk.io_threads must be >= 1, got ", disk.io_threads());
}

int ShardedOptimizer::optim_degree(size_t bucket) const { return module_->bucket(bucket).layout().degrees().optim; }

std::vector<ShardedOptimizer::Range> ShardedOptimizer::chunk_ranges(int64_t max_piece) const {
  std::map<const void*, std::pair<size_t, size_t>> where;  // TensorImpl -> (bucket, slot)
  for (size_t b = 0; b < module_->num_buckets(); ++b) {
    const auto& slots = module_->bucket(b).slots();
    for (size_t i = 0; i < slots.size(); ++i) where[slots[i].param.unsafeGetTensorImpl()] = {b, i};
  }
  std::vector<Range> ranges;
  size_t g = 0;
  for (auto& group : optimizer_->param_groups()) {
    for (const auto& p : group.params()) {
      auto it = where.find(p.unsafeGetTensorImpl());
      TORCH_CHECK(it != where.end(), "ShardedOptimizer: a parameter of shape ", p.sizes(),
                  " is not a trainable parameter of the sharded module; build the optimizer from "
                  "module->parameters() after wrapping");
      const size_t b = it->second.first;
      const FlatBucket& bucket = module_->bucket(b);
      const ParamSlot& slot = bucket.slots()[it->second.second];
      const int d = optim_degree(b);
      const int64_t chunk_begin = bucket.layout().chunk_offset(bucket.numel(), d);
      const int64_t begin = std::max(slot.offset, chunk_begin);
      const int64_t end = std::min(slot.offset + slot.numel, chunk_begin + bucket.numel() / d);
      const int64_t most = max_piece > 0 ? max_piece : end - begin;
      for (int64_t at = begin; at < end; at += most)
        ranges.push_back(Range{g, b, &slot, at - chunk_begin, std::min(end, at + most) - chunk_begin});
    }
    ++g;
  }
  return ranges;
}

// Note [Master copies]
int64_t ShardedOptimizer::add_master(size_t b, int64_t offset, int64_t numel) {
  FlatBucket& bucket = module_->bucket(b);
  at::Tensor chunk = bucket.param_chunk(optim_degree(b));
  auto where_to = chunk.options().dtype(options_.master_dtype());
  if (host_offload()) where_to = where_to.device(at::kCPU).pinned_memory(bucket.device().is_cuda());
  if (options_.offload() == Offload::kDisk) where_to = where_to.device(at::kCPU);
  Master o;
  o.bucket = b;
  o.offset = offset;
  if (host_offload() && bucket.materialized() && chunk.device().is_cpu() && bucket.device().is_cuda() &&
      chunk.scalar_type() == options_.master_dtype()) {
    o.master = chunk;  // the parameter shard already lives on the CPU
  } else {
    o.master = at::empty({numel}, where_to);
    o.master.copy_(chunk.narrow(0, offset, numel));
  }
  o.master_grad = at::zeros({numel}, where_to);
  masters_.push_back(std::move(o));
  return static_cast<int64_t>(masters_.size()) - 1;
}

// Note [Optimizer storage]
// Where the optimizer's chunk lives follows options().offload(): none steps
// views of the bucket's chunk in place, with a master per bucket only where
// master_dtype differs from the parameters'; host keeps a master per bucket
// in host memory; disk keeps a master per tile where one is needed, and the
// tiles in a file (place_tiles, open_disk: src/parallel/disk_offload.cpp).
std::vector<int64_t> ShardedOptimizer::place_masters(const std::vector<Range>& ranges) {
  bool other_dtype = false;
  for (size_t b = 0; b < module_->num_buckets(); ++b)
    other_dtype |= module_->bucket(b).param_chunk(optim_degree(b)).scalar_type() != options_.master_dtype();
  std::vector<int64_t> master_of(ranges.size(), -1);
  if (!host_offload() && !other_dtype) return master_of;
  std::vector<int64_t> of_bucket;
  for (size_t b = 0; b < module_->num_buckets(); ++b)
    of_bucket.push_back(add_master(b, 0, module_->bucket(b).param_chunk(optim_degree(b)).numel()));
  for (size_t i = 0; i < ranges.size(); ++i) master_of[i] = of_bucket[ranges[i].bucket];
  return master_of;
}

void ShardedOptimizer::make_pieces(const std::vector<Range>& ranges, const std::vector<int64_t>& master_of) {
  std::vector<std::vector<at::Tensor>> group_pieces(optimizer_->param_groups().size());
  for (size_t i = 0; i < ranges.size(); ++i) {
    const Range& r = ranges[i];
    FlatBucket& bucket = module_->bucket(r.bucket);
    at::Tensor piece, grad;
    if (master_of[i] >= 0) {
      const Master& m = masters_[static_cast<size_t>(master_of[i])];
      piece = m.master.narrow(0, r.begin - m.offset, r.end - r.begin);
      grad = m.master_grad.narrow(0, r.begin - m.offset, r.end - r.begin);
    } else {
      piece = bucket.param_chunk(optim_degree(r.bucket)).narrow(0, r.begin, r.end - r.begin);
      grad = bucket.grad_chunk(optim_degree(r.bucket)).narrow(0, r.begin, r.end - r.begin);
    }
    piece.mutable_grad() = grad;
    group_pieces[r.group].push_back(piece);
    const int64_t chunk_begin = bucket.layout().chunk_offset(bucket.numel(), optim_degree(r.bucket));
    pieces_.push_back(Piece{r.bucket, piece, r.slot->param, r.begin + chunk_begin - r.slot->offset, r.group});
  }
  for (size_t g = 0; g < group_pieces.size(); ++g) optimizer_->param_groups()[g].params() = std::move(group_pieces[g]);
}

// Rows of the whole-norm table: the module's parameters in bucket order, the
// same on every data rank (Note [Whole-parameter norms]).
void ShardedOptimizer::make_norms() {
  std::vector<at::Tensor> module_params;
  std::map<const c10::TensorImpl*, int64_t> param_row, piece_row;
  std::vector<comm::CommunicatorPtr> norm_groups;
  std::vector<size_t> row_group;
  std::vector<double> row_replicas;
  for (size_t b = 0; b < module_->num_buckets(); ++b) {
    const ShardLayout& layout = module_->bucket(b).layout();
    auto g = std::find(norm_groups.begin(), norm_groups.end(), layout.group());
    if (g == norm_groups.end()) g = norm_groups.insert(norm_groups.end(), layout.group());
    for (const ParamSlot& slot : module_->bucket(b).slots()) {
      param_row[slot.param.unsafeGetTensorImpl()] = static_cast<int64_t>(module_params.size());
      module_params.push_back(slot.param);
      row_group.push_back(static_cast<size_t>(g - norm_groups.begin()));
      row_replicas.push_back(static_cast<double>(layout.dp()) / optim_degree(b));
    }
  }
  if (norm_groups.empty()) norm_groups.push_back(module_->group());
  for (const auto& piece : pieces_)
    piece_row[piece.param.unsafeGetTensorImpl()] = param_row.at(piece.owner.unsafeGetTensorImpl());
  norms_ = std::make_shared<PieceNorms>(std::move(piece_row), std::move(module_params), std::move(norm_groups),
                                        row_group, row_replicas, options_.whole_norms());
  if (auto* aware = dynamic_cast<NormAware*>(optimizer_.get())) aware->set_whole_norms(norms_);
}

ShardedOptimizer::~ShardedOptimizer() = default;

void ShardedOptimizer::step_pieces(const std::vector<size_t>& pieces) {
  auto& groups = optimizer_->param_groups();
  std::vector<std::vector<at::Tensor>> all;
  for (auto& g : groups) {
    all.push_back(std::move(g.params()));
    g.params().clear();
  }
  for (size_t i : pieces) groups[pieces_[i].group].params().push_back(pieces_[i].param);
  try {
    optimizer_->step();
  } catch (...) {
    for (size_t g = 0; g < groups.size(); ++g) groups[g].params() = std::move(all[g]);
    throw;
  }
  for (size_t g = 0; g < groups.size(); ++g) groups[g].params() = std::move(all[g]);
}

void ShardedOptimizer::load_master_grads() {
  module_->finish_gradient_sync();
  if (masters_.empty() || master_grads_ready_) return;
  at::NoGradGuard no_grad;
  for (auto& m : masters_) {
    FlatBucket& bucket = module_->bucket(m.bucket);
    at::Tensor& g = m.master_grad;
    detail::restore_storage(g, g.numel() * static_cast<int64_t>(g.element_size()));
    g.copy_(bucket.grad_chunk(bucket.layout().degrees().optim).narrow(0, m.offset, g.numel()),
            /*non_blocking=*/host_offload() && bucket.device().is_cuda());
  }
  if (host_offload())
    for (const auto& m : masters_) sync_device(module_->bucket(m.bucket).device());
  master_grads_ready_ = true;
}

std::vector<at::Tensor> ShardedOptimizer::pieces_for_step() {
  load_master_grads();
  std::vector<at::Tensor> pieces;
  for (const auto& p : pieces_) pieces.push_back(p.param);
  return pieces;
}

void ShardedOptimizer::skip_step() {
  module_->finish_gradient_sync();
  if (!host_offload())
    for (auto& m : masters_) detail::release_storage(m.master_grad);
  master_grads_ready_ = false;
}

double ShardedOptimizer::clip_grad_norm(double max_norm, const std::vector<comm::CommunicatorPtr>& across,
                                        const std::vector<at::Tensor>& uncounted) {
  load_master_grads();
  std::set<const c10::TensorImpl*> skip;
  for (const auto& p : uncounted) skip.insert(p.unsafeGetTensorImpl());
  std::vector<at::Tensor> counted, scaled_only;
  for (const auto& p : pieces_) (skip.count(p.owner.unsafeGetTensorImpl()) ? scaled_only : counted).push_back(p.param);
  return parallel::clip_grad_norm(counted, max_norm, norms_.get(), across, scaled_only);
}

void ShardedOptimizer::sync_options() {
  auto& mine = param_groups();
  auto& inner = optimizer_->param_groups();
  TORCH_CHECK(mine.size() == inner.size(), "ShardedOptimizer: the inner optimizer has ", inner.size(),
              " param groups, this one ", mine.size(), "; add param groups before wrapping the optimizer");
  for (size_t i = 0; i < mine.size(); ++i) {
    if (inner[i].options().get_lr() != synced_lr_[i])
      mine[i].set_options(inner[i].options().clone());  // set on the inner side
    else
      inner[i].set_options(mine[i].options().clone());
    synced_lr_[i] = inner[i].options().get_lr();
  }
}

void ShardedOptimizer::save(torch::serialize::OutputArchive& /*archive*/) const {
  TORCH_CHECK(false, "ShardedOptimizer::save: LibTorch's optimizer archive would hold none of the sharded state; "
                     "save its pieces with train::optimizer_pieces and train::save_checkpoint, or train::Trainer::save "
                     "(docs/checkpoints.md)");
}

void ShardedOptimizer::load(torch::serialize::InputArchive& /*archive*/) {
  TORCH_CHECK(false, "ShardedOptimizer::load: LibTorch's optimizer archive holds none of the sharded state; "
                     "load them with train::load_optimizer_pieces, or train::Trainer::load (docs/checkpoints.md)");
}

at::Tensor ShardedOptimizer::step(LossClosure closure) {
  at::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode grad(true);
    loss = closure();
  }
  sync_options();
  load_master_grads();
  at::NoGradGuard no_grad;
  if (masters_.empty() && !swapper_) {
    optimizer_->step();
  } else {
    const int threads = at::get_num_threads();
    if (on_cpu_step()) at::set_num_threads(options_.offload_threads());
    try {
      if (swapper_) {  // Note [Disk offload]
        on_every_rank([&] {
          swapper_->run([&](size_t t) {
            step_pieces(tiles_[t].pieces);
            if (tiles_[t].master >= 0) copy_master_to_params(masters_[static_cast<size_t>(tiles_[t].master)]);
          });
        });
      } else {
        optimizer_->step();
      }
    } catch (...) {
      at::set_num_threads(threads);
      throw;
    }
    at::set_num_threads(threads);
    if (!swapper_) copy_masters_to_params();
    skip_step();  // the master gradients are spent
  }
  master_grads_ready_ = false;
  module_->sync_params_after_step();
  return loss;
}

void ShardedOptimizer::copy_master_to_params(const Master& m) {
  at::NoGradGuard no_grad;
  FlatBucket& bucket = module_->bucket(m.bucket);
  at::Tensor chunk = bucket.param_chunk(bucket.layout().degrees().optim);
  if (chunk.is_same(m.master)) return;
  // Asynchronous only from CPU memory that stays: a disk tile's buffer is reused at once.
  chunk.narrow(0, m.offset, m.master.numel()).copy_(m.master, host_offload() && bucket.device().is_cuda());
}

void ShardedOptimizer::copy_masters_to_params() {
  for (const auto& m : masters_) copy_master_to_params(m);
}

std::vector<ShardedOptimizer::PieceView> ShardedOptimizer::piece_views() const {
  TORCH_CHECK(!swapper_ || !swapper_->parked(), "ShardedOptimizer: the optimizer states are on disk (in '",
              swapper_ ? swapper_->path() : "", "'); call fetch_offloaded() before reading or writing the pieces "
              "and park_offloaded() after (Note [Disk offload])");
  std::vector<PieceView> out;
  for (const auto& p : pieces_) out.push_back(PieceView{p.owner, p.begin, p.begin + p.param.numel(), p.param});
  return out;
}

void ShardedOptimizer::sync_params_from_pieces() {
  TORCH_CHECK(!swapper_ || !swapper_->parked(),
              "ShardedOptimizer::sync_params_from_pieces: the master copies are on disk; call fetch_offloaded() first");
  copy_masters_to_params();
  for (const auto& m : masters_) sync_device(module_->bucket(m.bucket).device());
  module_->sync_params_after_step();
}

void ShardedOptimizer::zero_grad() {
  module_->zero_grad();  // master gradients are overwritten before every step
  master_grads_ready_ = false;
}

int64_t ShardedOptimizer::state_bytes() const {
  std::set<const void*> seen;
  int64_t bytes = 0;
  const bool listed_by_optimizer = dynamic_cast<const StateTensors*>(optimizer_.get()) != nullptr;
  for (const auto& entry : optimizer_->state()) {
    bool known = false;
    for (const auto& t : libtorch_state_tensors(*entry.second, known)) add_storage(seen, bytes, t);
    TORCH_CHECK(known || listed_by_optimizer,
                "ShardedOptimizer::state_bytes: unknown optimizer state type; it knows Adam, AdamW, SGD, "
                "RMSprop, Adagrad and optimizers that list their StateTensors");
  }
  if (auto* listed = dynamic_cast<const StateTensors*>(optimizer_.get()))
    for (const auto& t : listed->state_tensors()) add_storage(seen, bytes, t);
  for (const auto& m : masters_) {
    // Master copies that are not the parameter shard itself count as optimizer state.
    const FlatBucket& bucket = module_->bucket(m.bucket);
    if (!m.master.is_same(bucket.param_chunk(bucket.layout().degrees().optim))) add_storage(seen, bytes, m.master);
    add_storage(seen, bytes, m.master_grad);
  }
  if (swapper_) bytes += swapper_->buffer_bytes();
  return bytes;
}

ModelStateBytes ShardedOptimizer::memory() const {
  ModelStateBytes m = module_->memory();
  m.optim = state_bytes();
  return m;
}

}  // namespace parallel
}  // namespace tessera
