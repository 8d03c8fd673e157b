#pragma once
// The layer factory: how a model asks for its layers without knowing the
// tensor-parallel mode. A model written against it (models::GPT) runs
// serially (tensor size 1), in 1D and, once their factories exist, in 2D,
// 2.5D and 3D.
//
// Note [Layer factory contract]
// - Activations between blocks are in the mode's "block layout": 1D keeps
//   them replicated [b, s, h]; its sequence-parallel variant shards the
//   sequence [b, s/n, h]; 2D uses [b/q, s, h/q], 2.5D [b/(d·q), s, h/q], 3D [b/q², s, h/q]
//   (docs/architecture.md). scatter_activation / gather_activation convert from / to the
//   full tensor; positions() says which sequence positions this rank holds.
// - linear(role = kColumn) takes block layout and returns features sharded
//   the way heads are split (local_heads()); linear(kRow) takes that and
//   returns block layout. A model never reshapes across the sharded
//   dimension other than through these.
// - Layers are returned as torch::nn::AnyModule. Every parameter of a layer
//   has a placement (nn/placement.h): the tensor-parallel layers describe
//   their own (PlacedModule), the others get replicated_param()'s. Full
//   weights go in and out through the placements (load_full, full_value), so
//   a model can load and give back full weights whatever the mode.
// - Slots: core_attention (q, k, v of the local heads and tokens and the
//   tokens' positions -> attention output) and mlp (block layout -> block
//   layout) are where sequence-parallel attention plugs in without a change
//   to the model; moe (block layout -> block layout, a mixture-of-experts
//   layer in place of mlp) is the expert slot.
// - Grouped-query attention: the key/value projection (kv_linear) splits
//   its kv heads like the query heads where the head split divides them;
//   where it does not, 1D gives each rank the one kv head its query heads
//   share, replicated over the ranks that share it, with its gradient
//   summed over them (Note [Replicated key/value heads] in
//   src/nn/layer_factory_1d.cpp). Rotary positions are applied by the model
//   to q and k with attention_positions(), so every mode rotates each token
//   by its place in the whole sequence.
// - lm_logits gives logits on this rank's vocabulary shard; loss takes them
//   with full targets [b, s].
// - Factory-made layers are initialized blockwise from seeds drawn from the
//   default generator (Note [Layout-independent initialization]).
#include "tessera/comm/communicator.h"
#include "tessera/context/parallel_context.h"
#include "tessera/nn/attention.h"
#include "tessera/nn/moe.h"
#include "tessera/nn/placement.h"

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/any.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>

namespace tessera {
namespace nn {

// kColumnEntered: a column layer whose input went through column_entry().
enum class LinearRole { kColumn, kRow, kColumnEntered };
enum class NormKind { kLayerNorm, kRMSNorm };
// Where a dropout sits: on block-layout activations, or on activations
// sharded over the tensor group (heads, features) — Note [Dropout seeds].
enum class DropoutSite { kBlock, kSharded };

class LayerFactory {
 public:
  virtual ~LayerFactory() = default;

  virtual std::string mode() const = 0;  // "1d", "1d-sp", ...
  virtual const comm::CommunicatorPtr& tensor_group() const = 0;

  virtual at::Tensor scatter_activation(const at::Tensor& full) const = 0;
  virtual at::Tensor gather_activation(const at::Tensor& local) const = 0;
  // The sequence positions [0, seq_len) this rank's block layout holds.
  virtual at::Tensor positions(int64_t seq_len) const = 0;
  virtual int64_t local_heads(int64_t heads) const = 0;
  // How many ways attention heads are split (local_heads(h) = h / head_split()).
  virtual int64_t head_split() const = 0;
  // Key/value heads on this rank: kv_heads / head_split(), or 1 where the
  // split does not divide them (each rank holds the kv head its query heads
  // share; only where kv_linear accepted that).
  int64_t local_kv_heads(int64_t kv_heads) const;
  // The sequence positions of the `tokens` tokens that this rank's
  // attention sees (c_attn's output), for core_attention.
  virtual at::Tensor attention_positions(int64_t tokens) const = 0;

  virtual torch::nn::AnyModule linear(int64_t in, int64_t out, LinearRole role, bool bias) = 0;
  // What a column layer does to its input before its matmul (1D: copy_to_group,
  // or the sequence all-gather of the variant; identity where the layers have
  // no such step), for several kColumnEntered layers reading one input: q and
  // kv projections, SwiGLU's gate and up. One collective, one backward
  // all-reduce, instead of one per layer. Holds no reference to the factory.
  virtual std::function<at::Tensor(const at::Tensor&)> column_entry() const;
  // Token ids [b, s] (full) -> block layout [.., dim].
  virtual torch::nn::AnyModule vocab_embedding(int64_t vocab, int64_t dim) = 0;
  // LayerNorm (weight and bias) or RMSNorm (weight) over the hidden
  // dimension of block-layout activations.
  virtual torch::nn::AnyModule norm(int64_t dim, NormKind kind, double eps) = 0;
  torch::nn::AnyModule layer_norm(int64_t dim) { return norm(dim, NormKind::kLayerNorm, 1e-5); }
  // RMSNorm over head_dim of q or k [b, local heads, tokens, head_dim]
  // (Qwen 3): one weight for every head, its gradient partial over whatever
  // splits heads and tokens (head_param).
  virtual torch::nn::AnyModule head_norm(int64_t head_dim, double eps);
  // The key/value projection of grouped-query attention: column_entry()'s
  // output -> [.., local_kv_heads(kv_heads) · rows_per_head], rows grouped
  // per kv head. The default: linear(kColumnEntered) where head_split()
  // divides kv_heads, and a refusal otherwise.
  virtual torch::nn::AnyModule kv_linear(int64_t in, int64_t kv_heads, int64_t rows_per_head, bool bias);
  // Positions [s_local] -> [s_local, dim], replicated table.
  virtual torch::nn::AnyModule position_embedding(int64_t context, int64_t dim) = 0;
  virtual torch::nn::AnyModule dropout(double p, DropoutSite site) = 0;

  // Slots. core_attention's forward(q, k, v, positions): q, k, v
  // [b, local heads, local tokens, head_dim], positions [local tokens] (the
  // tokens' places in the sequence, for the causal mask) -> [b, local heads,
  // local tokens, head_dim]. mlp's forward(x): block layout -> block layout,
  // hidden -> ffn -> hidden with GELU or SwiGLU (nn::MLPKind); its
  // parameters are named "c_fc.*", "c_proj.*" and, SwiGLU, "c_gate.*".
  // The defaults: attention over the local heads and tokens (every key a
  // query needs is on this rank; dropout(p, kSharded) on the probabilities),
  // and the MLP from linear(kColumn) and linear(kRow).
  virtual torch::nn::AnyModule core_attention(int64_t heads, int64_t head_dim, double dropout);
  virtual torch::nn::AnyModule mlp(int64_t hidden, int64_t ffn, MLPKind kind = MLPKind::kGelu, bool bias = true);
  // A mixture-of-experts layer (nn/moe.h) over this factory's expert groups,
  // its auxiliary losses' gradient scaled by `loss_scale`. The default
  // refuses: tensor modes whose layers do not carry experts say so.
  virtual torch::nn::AnyModule moe(const MoEOptions& options, std::shared_ptr<MoELossScale> loss_scale);
  // The expert group's size (1: no expert parallelism).
  virtual int64_t expert_size() const { return 1; }

  // The placement of a parameter no layer describes (LayerNorm, position
  // embeddings): replicated over the tensor group, or partial over it where
  // each rank sees only its sequence shard.
  virtual ParamPlacement replicated_param(const at::Tensor& param) const = 0;
  // The placement of a parameter applied alike to every local head and token
  // (head_norm): replicated values, gradient partial over the groups that
  // split heads or tokens.
  virtual ParamPlacement head_param(const at::Tensor& param) const = 0;
  // Every parameter of `module` (names of named_parameters()) with its placement.
  virtual NamedPlacements placements(torch::nn::Module& module) const;

  // Logits [.., vocab shard] from block-layout hidden states and the
  // vocabulary embedding (tied head) this factory made.
  virtual at::Tensor lm_logits(const at::Tensor& hidden, torch::nn::AnyModule& vocab_embedding) = 0;
  // Mean cross entropy over targets [b, s] (full), ignore_index -100.
  virtual at::Tensor loss(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab) = 0;
};

// The factory for the context's tensor, sequence and expert modes: 1D (and
// its sequence-parallel variant), 2D, 2.5D and 3D, sequence parallelism
// (sequence size > 1, on 1D) and experts (1D, with or without sequence
// parallelism). Sequence parallelism or an expert group on another tensor
// mode is refused on every rank with what to use instead.
// `row_keyed_dropout`: every dropout row-keyed, seeded equal across data
// ranks (Note [Row-keyed dropout]), for jobs that change their data size;
// tensor mode 1d without sequence parallelism only. `expert_tensor_parallel`:
// the MoE layers split each expert over the tensor group (MoEGroups::
// expert_tensor) instead of running whole experts on every tensor rank.
std::shared_ptr<LayerFactory> make_layer_factory(const context::ParallelContextPtr& ctx, bool sequence_parallel = false,
                                                 bool row_keyed_dropout = false, bool expert_tensor_parallel = false);

// The 1D (Megatron) factory over `tensor_group`; `sequence_parallel` selects
// its sequence-parallel variant. `seed_block` / `seed_sharded` seed dropout
// (ctx->seed(kData) and ctx->seed(kTensor), Note [Dropout seeds]). Its MoE
// layers work over `experts` (experts whole on every tensor rank unless
// experts.expert_tensor is set; not in the sequence-parallel variant).
std::shared_ptr<LayerFactory> make_1d_factory(comm::CommunicatorPtr tensor_group, bool sequence_parallel,
                                              uint64_t seed_block, uint64_t seed_sharded, MoEGroups experts = {},
                                              bool row_keyed_dropout = false);

// The groups sequence parallelism runs over: the whole sequence group and,
// in mode hybrid only, its Ulysses and ring sub-groups
// (ParallelMode::kSequenceUlysses, kSequenceRing).
struct SequenceGroups {
  comm::CommunicatorPtr sequence;
  comm::CommunicatorPtr ulysses;
  comm::CommunicatorPtr ring;
};

// Sequence parallelism over `groups` on top of a 1D factory (mode "1d"):
// block layout [b, S/P, h] holding the positions of SequenceLayout(split,
// ulysses size), core_attention by `mode` (nn/sequence_attention.h), the
// loss normalized over the whole sequence, and every parameter's gradient
// partial over the sequence group (Note [Sequence-parallel data path] in the
// source). Sequence lengths must divide into the split's chunks.
std::shared_ptr<LayerFactory> make_sequence_factory(std::shared_ptr<LayerFactory> inner, SequenceGroups groups,
                                                    context::SequenceMode mode, context::SequenceSplit split);

// The 2D (Optimus) / 2.5D (Tesseract) factory over the context's grid:
// block layout [b/(q·d), s, h/q], SUMMA linears, heads split over the grid's
// columns. Batches (and pipeline micro-batches) must divide by q·d.
std::shared_ptr<LayerFactory> make_2d_factory(const context::ParallelContextPtr& ctx);

// The 3D factory over the context's cube (Note [3D layouts] in
// nn/linear_3d.h): block layout [b/q², s, h/q], heads split over the
// feature blocks. Batches (and micro-batches) must divide by q², hidden sizes
// by q², heads by q.
std::shared_ptr<LayerFactory> make_3d_factory(const context::ParallelContextPtr& ctx);

}  // namespace nn
}  // namespace tessera
