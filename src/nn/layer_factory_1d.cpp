// The 1D (Megatron) layer factory and its sequence-parallel variant.
#include "tessera/comm/functional.h"
#include "tessera/context/layout.h"
#include "tessera/core/hash.h"
#include "tessera/nn/column_parallel_linear.h"
#include "tessera/nn/init.h"
#include "tessera/nn/layer_factory.h"
#include "tessera/nn/parallel_dropout.h"
#include "tessera/nn/rms_norm.h"
#include "tessera/nn/row_parallel_linear.h"
#include "tessera/nn/shard.h"
#include "tessera/nn/vocab_parallel_cross_entropy.h"
#include "tessera/nn/vocab_parallel_embedding.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/normalization.h>

#include <map>

namespace tessera {
namespace nn {
namespace {

// Note [Replicated key/value heads]
// Grouped-query attention with fewer kv heads K than tensor ranks n (n a
// multiple of K; Megatron's choice): the query heads of rank r all belong to
// kv group g = r / (n/K), so the rank holds that one kv head's rows of the
// [2·K·d, in] projection. Its placement: Shard(0) over the K ranks that hold
// different kv heads, Partial over the n/K that hold the same one. The
// replicas compute the same k and v; each backpropagates only its own query
// heads' share, so their weight gradients are partial sums (summed over the
// replica group like any Partial axis), and their input gradients add up in
// the backward of column_entry(), as a column-parallel layer's do. Splitting
// the kv heads would need a fraction of a head per rank.
class ReplicatedKVLinearImpl : public torch::nn::Cloneable<ReplicatedKVLinearImpl>, public PlacedModule {
 public:
  ReplicatedKVLinearImpl(int64_t in, int64_t kv_heads, int64_t rows, bool bias, comm::CommunicatorPtr shards,
                         comm::CommunicatorPtr replicas)
      : in_(in), kv_heads_(kv_heads), rows_(rows), bias_(bias), shards_(std::move(shards)),
        replicas_(std::move(replicas)) {
    reset();
  }
  void reset() override {
    weight = register_parameter("weight", at::zeros({rows_, in_}));
    if (bias_) bias = register_parameter("bias", at::zeros({rows_}));
  }
  NamedPlacements local_placements() override {
    NamedPlacements out;
    for (auto* p : {&weight, &bias}) {
      if (!p->defined()) continue;
      ParamPlacement placed =
          replicated_placement(*p).shard("kv-heads", shards_, 0, kv_heads_ * rows_).partial("kv-replicas", replicas_);
      out.emplace_back(p == &weight ? "weight" : "bias", std::move(placed));
    }
    return out;
  }
  // input: column_entry()'s output.
  at::Tensor forward(const at::Tensor& input) { return at::linear(input, weight, bias); }

  at::Tensor weight, bias;  // [rows, in], [rows]: this rank's kv head

 private:
  int64_t in_, kv_heads_, rows_;
  bool bias_;
  comm::CommunicatorPtr shards_, replicas_;
};

TORCH_MODULE(ReplicatedKVLinear);

class Factory1D : public LayerFactory {
 public:
  Factory1D(comm::CommunicatorPtr group, bool sp, uint64_t seed_block, uint64_t seed_sharded, MoEGroups experts,
            bool row_keyed)
      : group_(std::move(group)), sp_(sp), seed_block_(seed_block), seed_sharded_(seed_sharded),
        experts_(std::move(experts)), row_keyed_(row_keyed) {
    TORCH_CHECK(group_ != nullptr, "the 1D layer factory needs a tensor-parallel communicator");
  }

  std::string mode() const override { return sp_ ? "1d-sp" : "1d"; }
  const comm::CommunicatorPtr& tensor_group() const override { return group_; }

  at::Tensor scatter_activation(const at::Tensor& full) const override {
    return sp_ ? comm::split_along_dim(full, 1, group_) : full;
  }
  at::Tensor gather_activation(const at::Tensor& local) const override {
    return sp_ ? comm::gather_along_dim(local, 1, group_) : local;
  }
  at::Tensor positions(int64_t seq_len) const override {
    at::Tensor all = at::arange(seq_len, at::kLong);
    if (!sp_) return all;
    check_divisible(seq_len, group_->size(), "sequence length", "the sequence-parallel variant shards the sequence");
    return all.chunk(group_->size())[group_->rank()].contiguous();
  }
  int64_t local_heads(int64_t heads) const override {
    check_divisible(heads, group_->size(), "number of attention heads", "heads are split across tensor ranks");
    return heads / group_->size();
  }
  int64_t head_split() const override { return group_->size(); }
  at::Tensor attention_positions(int64_t tokens) const override {
    return at::arange(tokens, at::kLong);  // c_attn's output holds the whole sequence
  }

  torch::nn::AnyModule linear(int64_t in, int64_t out, LinearRole role, bool bias) override {
    if (role != LinearRole::kRow) {
      return torch::nn::AnyModule(ColumnParallelLinear(ColumnParallelLinearOptions(in, out)
                                                           .bias(bias)
                                                           .sequence_parallel(sp_)
                                                           .input_entered(role == LinearRole::kColumnEntered)
                                                           .init_seed(draw_seed()),
                                                       group_));
    }
    return torch::nn::AnyModule(RowParallelLinear(
        RowParallelLinearOptions(in, out).bias(bias).sequence_parallel(sp_).init_seed(draw_seed()), group_));
  }
  std::function<at::Tensor(const at::Tensor&)> column_entry() const override {
    auto group = group_;
    if (sp_) return [group](const at::Tensor& x) { return comm::all_gather_along_dim(x, 1, group); };
    return [group](const at::Tensor& x) { return comm::copy_to_group(x, group); };
  }
  torch::nn::AnyModule vocab_embedding(int64_t vocab, int64_t dim) override {
    return torch::nn::AnyModule(VocabParallelEmbedding(
        VocabParallelEmbeddingOptions(vocab, dim).sequence_parallel(sp_).init_seed(draw_seed()), group_));
  }
  torch::nn::AnyModule norm(int64_t dim, NormKind kind, double eps) override {
    if (kind == NormKind::kRMSNorm) return torch::nn::AnyModule(RMSNorm(RMSNormOptions(dim).eps(eps)));
    return torch::nn::AnyModule(torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim}).eps(eps)));
  }
  torch::nn::AnyModule kv_linear(int64_t in, int64_t kv_heads, int64_t rows_per_head, bool bias) override {
    if (!context::kv_heads_replicated(kv_heads, group_->size(), /*can_replicate=*/true, "tensor mode " + mode()))
      return linear(in, kv_heads * rows_per_head, LinearRole::kColumnEntered, bias);
    const auto& [shards, replicas] = kv_groups(kv_heads);
    // Drawn like any layer (one seed per layer); the model's initialization
    // then fills every replica alike from the full tensor's blocks.
    (void)draw_seed();
    return torch::nn::AnyModule(ReplicatedKVLinear(in, kv_heads, rows_per_head, bias, shards, replicas));
  }
  torch::nn::AnyModule position_embedding(int64_t context, int64_t dim) override {
    // Drawn blockwise from one seed, as every factory's embeddings are: the
    // default generator then advances alike in every mode.
    torch::nn::Embedding e(torch::nn::EmbeddingOptions(context, dim)._weight(at::empty({context, dim})));
    init_blockwise(replicated_placement(e->weight), draw_seed(), "weight", normal_draw(0.0, 1.0));
    return torch::nn::AnyModule(e);
  }
  torch::nn::AnyModule dropout(double p, DropoutSite site) override {
    // Block-layout activations are replicated over the group in 1D but
    // sequence shards in the variant. Each dropout gets its own stream,
    // numbered in construction order (the same on every rank).
    const bool replicated = site == DropoutSite::kBlock && !sp_;
    const uint64_t seed = splitmix64((replicated ? seed_block_ : seed_sharded_) + (++dropouts_));
    return torch::nn::AnyModule(ParallelDropout(ParallelDropoutOptions(p, seed).row_keyed(row_keyed_)));
  }

  torch::nn::AnyModule moe(const MoEOptions& options, std::shared_ptr<MoELossScale> loss_scale) override {
    // Tensor ranks hold the same tokens and run the same experts (expert
    // tensor parallelism is not built); the variant's tokens differ across
    // them, which the experts' placements do not describe.
    TORCH_CHECK(!sp_, "mixture-of-experts layers do not run in the 1D sequence-parallel variant; use sequence "
                "parallelism (sequence size > 1) or the plain 1D layers");
    return torch::nn::AnyModule(MoE(MoEOptions(options).init_seed(draw_seed()), experts_, std::move(loss_scale)));
  }
  int64_t expert_size() const override { return experts_.expert ? experts_.expert->size() : 1; }

  ParamPlacement replicated_param(const at::Tensor& param) const override {
    // In the sequence-parallel variant each rank feeds these parameters its
    // sequence shard only: their gradients are partial over the group.
    ParamPlacement p = replicated_placement(param);
    return sp_ ? p.partial("tensor", group_) : p.replicate("tensor", group_);
  }
  ParamPlacement head_param(const at::Tensor& param) const override {
    return replicated_placement(param).partial("tensor", group_);  // heads are split in both variants
  }

  at::Tensor lm_logits(const at::Tensor& hidden, torch::nn::AnyModule& vocab_embedding) override {
    auto e = std::dynamic_pointer_cast<VocabParallelEmbeddingImpl>(vocab_embedding.ptr());
    TORCH_CHECK(e != nullptr, "lm_logits needs a vocabulary embedding made by this factory");
    // Every rank needs every position for its vocabulary columns.
    const at::Tensor x = sp_ ? comm::all_gather_along_dim(hidden, 1, group_) : comm::copy_to_group(hidden, group_);
    return at::matmul(x, e->weight.t());
  }

  at::Tensor loss(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab) override {
    return vocab_parallel_cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}), group_,
                                        VocabParallelCrossEntropyOptions().vocab_size(vocab));
  }

 private:
  comm::CommunicatorPtr group_;
  bool sp_;
  uint64_t seed_block_;
  uint64_t seed_sharded_;
  uint64_t dropouts_ = 0;
  MoEGroups experts_;
  bool row_keyed_;
  // Note [Replicated key/value heads]: per number of kv heads, the groups of
  // ranks holding different kv heads and those holding the same one.
  std::map<int64_t, std::pair<comm::CommunicatorPtr, comm::CommunicatorPtr>> kv_groups_;

  const std::pair<comm::CommunicatorPtr, comm::CommunicatorPtr>& kv_groups(int64_t kv_heads) {
    auto it = kv_groups_.find(kv_heads);
    if (it != kv_groups_.end()) return it->second;
    const int r = group_->rank(), copies = static_cast<int>(group_->size() / kv_heads);
    auto shards = group_->split(r % copies, r / copies, group_->name() + "-kv-heads");
    auto replicas = group_->split(r / copies, r % copies, group_->name() + "-kv-replicas");
    return kv_groups_.emplace(kv_heads, std::make_pair(std::move(shards), std::move(replicas))).first->second;
  }
};

}  // namespace

std::shared_ptr<LayerFactory> make_1d_factory(comm::CommunicatorPtr tensor_group, bool sequence_parallel,
                                              uint64_t seed_block, uint64_t seed_sharded, MoEGroups experts,
                                              bool row_keyed_dropout) {
  return std::make_shared<Factory1D>(std::move(tensor_group), sequence_parallel, seed_block, seed_sharded,
                                     std::move(experts), row_keyed_dropout);
}

}  // namespace nn
}  // namespace tessera
