// The 1D (Megatron) layer factory and its sequence-parallel variant.
#include "tessera/comm/functional.h"
#include "tessera/nn/column_parallel_linear.h"
#include "tessera/nn/layer_factory.h"
#include "tessera/nn/parallel_dropout.h"
#include "tessera/nn/row_parallel_linear.h"
#include "tessera/nn/shard.h"
#include "tessera/nn/vocab_parallel_cross_entropy.h"
#include "tessera/nn/vocab_parallel_embedding.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/normalization.h>

namespace tessera {
namespace nn {
namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

class Factory1D : public LayerFactory {
 public:
  Factory1D(comm::CommunicatorPtr group, bool sp, uint64_t seed_block, uint64_t seed_sharded)
      : group_(std::move(group)), sp_(sp), seed_block_(seed_block), seed_sharded_(seed_sharded) {
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

  torch::nn::AnyModule linear(int64_t in, int64_t out, LinearRole role, bool bias) override {
    if (role == LinearRole::kColumn) {
      return torch::nn::AnyModule(
          ColumnParallelLinear(ColumnParallelLinearOptions(in, out).bias(bias).sequence_parallel(sp_), group_));
    }
    return torch::nn::AnyModule(
        RowParallelLinear(RowParallelLinearOptions(in, out).bias(bias).sequence_parallel(sp_), group_));
  }
  torch::nn::AnyModule vocab_embedding(int64_t vocab, int64_t dim) override {
    return torch::nn::AnyModule(
        VocabParallelEmbedding(VocabParallelEmbeddingOptions(vocab, dim).sequence_parallel(sp_), group_));
  }
  torch::nn::AnyModule layer_norm(int64_t dim) override {
    return torch::nn::AnyModule(torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
  }
  torch::nn::AnyModule position_embedding(int64_t context, int64_t dim) override {
    return torch::nn::AnyModule(torch::nn::Embedding(context, dim));
  }
  torch::nn::AnyModule dropout(double p, DropoutSite site) override {
    // Block-layout activations are replicated over the group in 1D but
    // sequence shards in the variant. Each dropout gets its own stream,
    // numbered in construction order (the same on every rank).
    const bool replicated = site == DropoutSite::kBlock && !sp_;
    const uint64_t seed = splitmix64((replicated ? seed_block_ : seed_sharded_) + (++dropouts_));
    return torch::nn::AnyModule(ParallelDropout(ParallelDropoutOptions(p, seed)));
  }

  void load_full(torch::nn::AnyModule& layer, const at::Tensor& weight, const at::Tensor& bias) override {
    auto module = layer.ptr();
    if (auto c = std::dynamic_pointer_cast<ColumnParallelLinearImpl>(module)) return c->load_full(weight, bias);
    if (auto r = std::dynamic_pointer_cast<RowParallelLinearImpl>(module)) return r->load_full(weight, bias);
    if (auto e = std::dynamic_pointer_cast<VocabParallelEmbeddingImpl>(module)) return e->load_full(weight);
    if (auto n = std::dynamic_pointer_cast<torch::nn::LayerNormImpl>(module)) {
      at::NoGradGuard no_grad;
      n->weight.copy_(weight);
      n->bias.copy_(bias);
      return;
    }
    if (auto p = std::dynamic_pointer_cast<torch::nn::EmbeddingImpl>(module)) {
      at::NoGradGuard no_grad;
      p->weight.copy_(weight);
      return;
    }
    TORCH_CHECK(false, "the 1D layer factory cannot load full weights into ", module->name());
  }

  std::pair<at::Tensor, at::Tensor> full_weights(torch::nn::AnyModule& layer, bool gradients) override {
    auto module = layer.ptr();
    auto pick = [gradients](const at::Tensor& p) {
      if (!p.defined()) return at::Tensor();
      return gradients ? (p.grad().defined() ? p.grad() : at::zeros_like(p)) : p.detach();
    };
    if (auto c = std::dynamic_pointer_cast<ColumnParallelLinearImpl>(module)) {
      return {unshard(pick(c->weight), 0, *group_),
              c->bias.defined() ? unshard(pick(c->bias), 0, *group_) : at::Tensor()};
    }
    if (auto r = std::dynamic_pointer_cast<RowParallelLinearImpl>(module)) {
      return {unshard(pick(r->weight), 1, *group_), r->bias.defined() ? pick(r->bias).clone() : at::Tensor()};
    }
    if (auto e = std::dynamic_pointer_cast<VocabParallelEmbeddingImpl>(module)) {
      return {unshard(pick(e->weight), 0, *group_).narrow(0, 0, e->options.num_embeddings()), at::Tensor()};
    }
    if (auto n = std::dynamic_pointer_cast<torch::nn::LayerNormImpl>(module)) {
      return {pick(n->weight).clone(), pick(n->bias).clone()};
    }
    if (auto p = std::dynamic_pointer_cast<torch::nn::EmbeddingImpl>(module))
      return {pick(p->weight).clone(), at::Tensor()};
    TORCH_CHECK(false, "the 1D layer factory cannot give full weights of ", module->name());
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

  PartialGradients partial_gradients(torch::nn::Module& model) override {
    PartialGradients out{{}, group_};
    if (!sp_) return out;
    // Parameters replicated over the group but fed by this rank's sequence
    // shard only: LayerNorm, position embeddings, row-parallel biases.
    for (const auto& module : model.modules()) {
      if (auto r = std::dynamic_pointer_cast<RowParallelLinearImpl>(module)) {
        if (r->options.bias()) out.params.push_back(r->bias);
        continue;
      }
      const bool replicated = std::dynamic_pointer_cast<torch::nn::LayerNormImpl>(module) != nullptr ||
                              std::dynamic_pointer_cast<torch::nn::EmbeddingImpl>(module) != nullptr;
      if (!replicated) continue;
      for (auto& p : module->parameters(/*recurse=*/false)) out.params.push_back(p);
    }
    return out;
  }

  std::pair<ParamPlacement, ParamPlacement> placements(torch::nn::AnyModule& layer) override {
    auto module = layer.ptr();
    auto maybe = [](const at::Tensor& p) { return p.defined() ? replicated_placement(p) : ParamPlacement(); };
    if (auto c = std::dynamic_pointer_cast<ColumnParallelLinearImpl>(module)) {
      ParamPlacement bias;
      if (c->bias.defined()) bias = sharded_placement(c->bias, 0, c->options.out_features(), *group_);
      return {sharded_placement(c->weight, 0, c->options.out_features(), *group_), bias};
    }
    if (auto r = std::dynamic_pointer_cast<RowParallelLinearImpl>(module))
      return {sharded_placement(r->weight, 1, r->options.in_features(), *group_), maybe(r->bias)};
    if (auto e = std::dynamic_pointer_cast<VocabParallelEmbeddingImpl>(module))
      return {sharded_placement(e->weight, 0, e->options.num_embeddings(), *group_), ParamPlacement()};
    if (auto n = std::dynamic_pointer_cast<torch::nn::LayerNormImpl>(module)) return {maybe(n->weight), maybe(n->bias)};
    if (auto p = std::dynamic_pointer_cast<torch::nn::EmbeddingImpl>(module))
      return {maybe(p->weight), ParamPlacement()};
    TORCH_CHECK(false, "the 1D layer factory cannot place the weights of ", module->name());
  }

  std::vector<at::Tensor> sharded_parameters(torch::nn::Module& model) override {
    std::vector<at::Tensor> out;
    for (const auto& module : model.modules()) {
      if (auto c = std::dynamic_pointer_cast<ColumnParallelLinearImpl>(module)) {
        out.push_back(c->weight);
        if (c->options.bias()) out.push_back(c->bias);
      } else if (auto r = std::dynamic_pointer_cast<RowParallelLinearImpl>(module)) {
        out.push_back(r->weight);  // its bias is replicated
      } else if (auto e = std::dynamic_pointer_cast<VocabParallelEmbeddingImpl>(module)) {
        out.push_back(e->weight);
      }
    }
    return out;
  }

 private:
  comm::CommunicatorPtr group_;
  bool sp_;
  uint64_t seed_block_;
  uint64_t seed_sharded_;
  uint64_t dropouts_ = 0;
};

}  // namespace

std::shared_ptr<LayerFactory> make_1d_factory(comm::CommunicatorPtr tensor_group, bool sequence_parallel,
                                              uint64_t seed_block, uint64_t seed_sharded) {
  return std::make_shared<Factory1D>(std::move(tensor_group), sequence_parallel, seed_block, seed_sharded);
}

}  // namespace nn
}  // namespace tessera
