#include "tessera/parallel/sharded_optimizer.h"

#include "tessera/core/error.h"
#include "tessera/parallel/flat_bucket.h"

#include "storage.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

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
  TORCH_CHECK(module_ && optimizer_, "ShardedOptimizer: the module and the optimizer must not be null");
  for (const auto& g : optimizer_->param_groups()) synced_lr_.push_back(g.options().get_lr());
  TORCH_CHECK(optimizer_->state().empty(),
              "ShardedOptimizer: the optimizer has already stepped; wrap it before "
              "the first step so that its state is created for the local shard only");
  TORCH_CHECK(options_.offload_threads() >= 1, "ShardedOptimizer: offload_threads must be >= 1, got ",
              options_.offload_threads());
  TORCH_CHECK(options_.offload() || !module_->options().offload_params(),
              "ShardedOptimizer: the module keeps its parameter shards in CPU memory (offload_params), so the "
              "optimizer must step there too; set ShardedOptimizerOptions().offload(true)");
  // Each bucket's optimizer degree, over the group its layout spans.
  auto optim_degree = [&](size_t b) { return module_->bucket(b).layout().degrees().optim; };

  std::map<const void*, std::pair<size_t, size_t>> where;  // TensorImpl -> (bucket, slot)
  for (size_t b = 0; b < module_->num_buckets(); ++b) {
    const auto& slots = module_->bucket(b).slots();
    for (size_t i = 0; i < slots.size(); ++i) where[slots[i].param.unsafeGetTensorImpl()] = {b, i};
  }
  bool other_dtype = false;
  for (size_t b = 0; b < module_->num_buckets(); ++b)
    other_dtype |= module_->bucket(b).param_chunk(optim_degree(b)).scalar_type() != options_.master_dtype();
  if (options_.offload() || other_dtype) {  // Note [Master copies]
    at::NoGradGuard no_grad;
    for (size_t b = 0; b < module_->num_buckets(); ++b) {
      FlatBucket& bucket = module_->bucket(b);
      at::Tensor chunk = bucket.param_chunk(optim_degree(b));
      auto where_to = chunk.options().dtype(options_.master_dtype());
      if (options_.offload()) where_to = where_to.device(at::kCPU).pinned_memory(bucket.device().is_cuda());
      Master o;
      if (options_.offload() && bucket.materialized() && chunk.device().is_cpu() && bucket.device().is_cuda() &&
          chunk.scalar_type() == options_.master_dtype()) {
        o.master = chunk;  // the parameter shard already lives on the CPU
      } else {
        o.master = at::empty({chunk.numel()}, where_to);
        o.master.copy_(chunk);
      }
      o.master_grad = at::zeros({chunk.numel()}, where_to);
      masters_.push_back(std::move(o));
    }
  }

  // Rows of the whole-norm table: the module's parameters in bucket order,
  // the same on every data rank (Note [Whole-parameter norms]).
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
      const int d = optim_degree(b);
      const int64_t chunk_begin = bucket.layout().chunk_offset(bucket.numel(), d);
      const int64_t chunk_size = bucket.numel() / d;
      const int64_t begin = std::max(slot.offset, chunk_begin);
      const int64_t end = std::min(slot.offset + slot.numel, chunk_begin + chunk_size);
      if (begin >= end) continue;
      at::Tensor param_chunk = masters_.empty() ? bucket.param_chunk(d) : masters_[b].master;
      at::Tensor grad_chunk = masters_.empty() ? bucket.grad_chunk(d) : masters_[b].master_grad;
      at::Tensor piece = param_chunk.narrow(0, begin - chunk_begin, end - begin);
      piece.mutable_grad() = grad_chunk.narrow(0, begin - chunk_begin, end - begin);
      pieces.push_back(piece);
      pieces_.push_back(Piece{b, piece, slot.param, begin - slot.offset});
      piece_row[piece.unsafeGetTensorImpl()] = param_row.at(slot.param.unsafeGetTensorImpl());
    }
    group.params() = std::move(pieces);
  }

  skip_step();  // the pieces' gradient views exist; the master gradients' memory waits for a step
  norms_ = std::make_shared<PieceNorms>(std::move(piece_row), std::move(module_params), std::move(norm_groups),
                                        row_group, row_replicas,
                                        options_.whole_norms());
  if (auto* aware = dynamic_cast<NormAware*>(optimizer_.get())) aware->set_whole_norms(norms_);
}

void ShardedOptimizer::load_master_grads() {
  module_->finish_gradient_sync();
  if (masters_.empty() || master_grads_ready_) return;
  at::NoGradGuard no_grad;
  for (size_t b = 0; b < masters_.size(); ++b) {
    FlatBucket& bucket = module_->bucket(b);
    at::Tensor& g = masters_[b].master_grad;
    detail::restore_storage(g, g.numel() * static_cast<int64_t>(g.element_size()));
    g.copy_(bucket.grad_chunk(bucket.layout().degrees().optim), /*non_blocking=*/options_.offload() && bucket.device().is_cuda());
  }
  if (options_.offload())
    for (size_t b = 0; b < masters_.size(); ++b) sync_device(module_->bucket(b).device());
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
  if (!options_.offload())
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
  if (masters_.empty()) {
    optimizer_->step();
  } else {
    const int threads = at::get_num_threads();
    if (options_.offload()) at::set_num_threads(options_.offload_threads());
    try {
      optimizer_->step();
    } catch (...) {
      at::set_num_threads(threads);
      throw;
    }
    at::set_num_threads(threads);
    copy_masters_to_params();
    skip_step();  // the master gradients are spent
  }
  master_grads_ready_ = false;
  module_->sync_params_after_step();
  return loss;
}

void ShardedOptimizer::copy_masters_to_params() {
  at::NoGradGuard no_grad;
  for (size_t b = 0; b < masters_.size(); ++b) {
    FlatBucket& bucket = module_->bucket(b);
    at::Tensor chunk = bucket.param_chunk(bucket.layout().degrees().optim);
    if (!chunk.is_same(masters_[b].master))
      chunk.copy_(masters_[b].master, options_.offload() && bucket.device().is_cuda());
  }
}

std::vector<ShardedOptimizer::PieceView> ShardedOptimizer::piece_views() const {
  std::vector<PieceView> out;
  for (const auto& p : pieces_) out.push_back(PieceView{p.owner, p.begin, p.begin + p.param.numel(), p.param});
  return out;
}

void ShardedOptimizer::sync_params_from_pieces() {
  copy_masters_to_params();
  for (size_t b = 0; b < masters_.size(); ++b) sync_device(module_->bucket(b).device());
  module_->sync_params_after_step();
}

void ShardedOptimizer::zero_grad() {
  module_->zero_grad();  // master gradients are overwritten before every step
  master_grads_ready_ = false;
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
    } else if (dynamic_cast<const StateTensors*>(optimizer_.get()) == nullptr) {
      TORCH_CHECK(false,
                  "ShardedOptimizer::state_bytes: unknown optimizer state type; it knows Adam, AdamW, SGD, "
                  "RMSprop, Adagrad and optimizers that list their StateTensors");
    }
  }
  if (auto* listed = dynamic_cast<const StateTensors*>(optimizer_.get()))
    for (const auto& t : listed->state_tensors()) add_storage(seen, bytes, t);
  for (size_t b = 0; b < masters_.size(); ++b) {
    // Master copies that are not the parameter shard itself count as optimizer state.
    const FlatBucket& bucket = module_->bucket(b);
    if (!masters_[b].master.is_same(bucket.param_chunk(bucket.layout().degrees().optim)))
      add_storage(seen, bytes, masters_[b].master);
    add_storage(seen, bytes, masters_[b].master_grad);
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
