// The sequence-parallel layer factory: 1D tensor-parallel layers on the
// tokens of this sequence rank, and a sequence-parallel core_attention.
#include "tessera/comm/functional.h"
#include "tessera/core/hash.h"
#include "tessera/nn/layer_factory.h"
#include "tessera/nn/sequence_attention.h"
#include "tessera/nn/vocab_parallel_cross_entropy.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

namespace tessera {
namespace nn {
namespace {

// Note [Sequence-parallel data path]
// Every rank of a sequence group receives its data rank's whole batch of
// token ids and targets [b, S] (a few bytes per token) and keeps the tokens
// at its positions (SequenceLayout): the embedding selects the ids, the loss
// the targets. Block-layout activations are [b, n, h] with n = S/P. Each
// rank's loss is the cross entropy summed over its tokens, summed over the
// group by reduce_from_group (identity in backward) and divided by the
// number of targets of the whole batch that are not ignored, so every rank
// holds the batch's loss and each rank's gradient is its tokens' share. A
// parameter's gradient is therefore partial over the sequence group: its
// placement says so, and ShardedModule sums it over data x sequence (one
// reduction) while averaging over data only.

// The vocabulary embedding of the inner factory behind a selection of this
// rank's token ids. It registers the inner module's parameters under their
// own names (not the module), so parameter names stay "weight".
class SequenceEmbeddingImpl : public torch::nn::Module, public PlacedModule {
 public:
  SequenceEmbeddingImpl(torch::nn::AnyModule inner, SequenceLayout layout)
      : inner_(std::move(inner)), layout_(layout) {
    for (const auto& p : inner_.ptr()->named_parameters(/*recurse=*/false)) register_parameter(p.key(), p.value());
  }
  at::Tensor forward(const at::Tensor& ids) {
    TORCH_CHECK(ids.dim() == 2, "the sequence-parallel embedding expects token ids [batch, sequence], got ",
                ids.sizes());
    return inner_.forward(ids.index_select(1, layout_.positions(ids.size(1)).to(ids.device())));
  }
  NamedPlacements local_placements() override {
    auto placed = std::dynamic_pointer_cast<PlacedModule>(inner_.ptr());
    return placed ? placed->local_placements() : NamedPlacements{};
  }
  torch::nn::AnyModule& inner() { return inner_; }

 private:
  torch::nn::AnyModule inner_;
  SequenceLayout layout_;
};
TORCH_MODULE(SequenceEmbedding);

class SequenceFactory : public LayerFactory {
 public:
  SequenceFactory(std::shared_ptr<LayerFactory> inner, SequenceGroups groups, context::SequenceMode mode,
                  context::SequenceSplit split)
      : inner_(std::move(inner)),
        group_(groups.sequence),
        ulysses_(groups.ulysses),
        ring_(groups.ring),
        mode_(mode),
        layout_(group_->size(), group_->rank(), split, ulysses_ ? ulysses_->size() : 1) {}

  std::string mode() const override { return inner_->mode() + "+" + context::sequence_mode_name(mode_); }
  const comm::CommunicatorPtr& tensor_group() const override { return inner_->tensor_group(); }

  at::Tensor scatter_activation(const at::Tensor& full) const override {
    return inner_->scatter_activation(full.index_select(1, positions(full.size(1)).to(full.device())));
  }
  at::Tensor gather_activation(const at::Tensor& local) const override {
    at::Tensor gathered = comm::all_gather_along_dim(inner_->gather_activation(local), 1, group_);
    // Rank order -> sequence order.
    const at::Tensor order = at::argsort(layout_.gathered_positions(gathered.size(1)));
    return gathered.index_select(1, order.to(gathered.device()));
  }
  at::Tensor positions(int64_t seq_len) const override { return layout_.positions(seq_len); }
  int64_t local_heads(int64_t heads) const override { return inner_->local_heads(heads); }
  int64_t head_split() const override { return inner_->head_split(); }
  at::Tensor attention_positions(int64_t tokens) const override {
    return layout_.positions(tokens * layout_.size());
  }

  torch::nn::AnyModule linear(int64_t in, int64_t out, LinearRole role, bool bias) override {
    return inner_->linear(in, out, role, bias);
  }
  std::function<at::Tensor(const at::Tensor&)> column_entry() const override { return inner_->column_entry(); }
  torch::nn::AnyModule vocab_embedding(int64_t vocab, int64_t dim) override {
    return torch::nn::AnyModule(SequenceEmbedding(inner_->vocab_embedding(vocab, dim), layout_));
  }
  torch::nn::AnyModule norm(int64_t dim, NormKind kind, double eps) override { return inner_->norm(dim, kind, eps); }
  torch::nn::AnyModule kv_linear(int64_t in, int64_t kv_heads, int64_t rows_per_head, bool bias) override {
    return inner_->kv_linear(in, kv_heads, rows_per_head, bias);
  }
  torch::nn::AnyModule position_embedding(int64_t context, int64_t dim) override {
    return inner_->position_embedding(context, dim);
  }
  torch::nn::AnyModule dropout(double p, DropoutSite site) override { return inner_->dropout(p, site); }

  torch::nn::AnyModule core_attention(int64_t heads, int64_t head_dim, double p) override {
    switch (mode_) {
      case context::SequenceMode::kUlysses:
        return torch::nn::AnyModule(
            UlyssesAttention(head_dim, dropout(p, DropoutSite::kSharded), group_, layout_));
      case context::SequenceMode::kRsa:
        return torch::nn::AnyModule(
            RingSelfAttention(head_dim, dropout(p, DropoutSite::kSharded), group_, layout_));
      case context::SequenceMode::kRing:
        (void)heads;
        return torch::nn::AnyModule(
            RingAttention(head_dim, dropout(p, DropoutSite::kSharded).get<ParallelDropout>(), group_, layout_));
      case context::SequenceMode::kHybrid:
        return torch::nn::AnyModule(HybridAttention(head_dim, dropout(p, DropoutSite::kSharded).get<ParallelDropout>(),
                                                    ulysses_, ring_, layout_));
    }
    TORCH_INTERNAL_ASSERT(false, "unknown sequence mode");
  }

  // Token-wise: the experts see this rank's tokens of the sequence; their
  // gradients become partial over the group through placements().
  torch::nn::AnyModule moe(const MoEOptions& options, std::shared_ptr<MoELossScale> loss_scale) override {
    return inner_->moe(options, std::move(loss_scale));
  }
  int64_t expert_size() const override { return inner_->expert_size(); }

  ParamPlacement replicated_param(const at::Tensor& param) const override {
    return inner_->replicated_param(param).partial("sequence", group_);
  }
  // placements() adds the sequence axis to it.
  ParamPlacement head_param(const at::Tensor& param) const override { return inner_->head_param(param); }
  NamedPlacements placements(torch::nn::Module& module) const override {
    NamedPlacements result = inner_->placements(module);
    for (auto& entry : result) entry.second.partial("sequence", group_);
    return result;
  }

  at::Tensor lm_logits(const at::Tensor& hidden, torch::nn::AnyModule& vocab_embedding) override {
    auto e = std::dynamic_pointer_cast<SequenceEmbeddingImpl>(vocab_embedding.ptr());
    TORCH_CHECK(e != nullptr, "lm_logits needs a vocabulary embedding made by this factory");
    return inner_->lm_logits(hidden, e->inner());
  }

  at::Tensor loss(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab) override {
    TORCH_CHECK(targets.dim() == 2, "the sequence-parallel loss expects targets [batch, sequence], got ",
                targets.sizes());
    const at::Tensor local = targets.index_select(1, positions(targets.size(1)).to(targets.device()));
    const at::Tensor sum = vocab_parallel_cross_entropy(
        logits.reshape({-1, logits.size(-1)}), local.reshape({-1}), inner_->tensor_group(),
        VocabParallelCrossEntropyOptions().vocab_size(vocab).reduction(Reduction::kSum));
    // Every rank has the whole batch's targets: the count needs no communication.
    const at::Tensor count = (targets != -100).sum();
    return comm::reduce_from_group(sum, group_) / count.to(sum.scalar_type());
  }

 private:
  std::shared_ptr<LayerFactory> inner_;
  comm::CommunicatorPtr group_;
  comm::CommunicatorPtr ulysses_, ring_;  // hybrid only
  context::SequenceMode mode_;
  SequenceLayout layout_;
};

}  // namespace

std::shared_ptr<LayerFactory> make_sequence_factory(std::shared_ptr<LayerFactory> inner, SequenceGroups groups,
                                                    context::SequenceMode mode, context::SequenceSplit split) {
  TORCH_CHECK(inner != nullptr && inner->mode() == "1d",
              "sequence parallelism runs on the 1D tensor-parallel layers (tensor mode 1d without its "
              "sequence-parallel variant); got an inner factory of mode '", inner ? inner->mode() : "null", "'");
  TORCH_CHECK(groups.sequence != nullptr, "make_sequence_factory: the sequence group is null");
  const bool hybrid = mode == context::SequenceMode::kHybrid;
  TORCH_CHECK(hybrid == (groups.ulysses != nullptr && groups.ring != nullptr),
              "make_sequence_factory: the Ulysses and ring groups are given exactly in sequence mode hybrid; mode is ",
              context::sequence_mode_name(mode));
  TORCH_CHECK(!hybrid || groups.ulysses->size() * groups.ring->size() == groups.sequence->size(),
              "make_sequence_factory: a Ulysses group of ", groups.ulysses->size(), " and a ring of ",
              groups.ring->size(), " do not make the sequence group of ", groups.sequence->size());
  return std::make_shared<SequenceFactory>(std::move(inner), std::move(groups), mode, split);
}

}  // namespace nn
}  // namespace tessera
