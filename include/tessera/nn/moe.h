#pragma once
// A mixture-of-experts layer for the mlp slot: a router picks top-k experts
// per token, each expert is a GELU MLP, and with expert parallelism the
// experts are split over the expert group and tokens travel to them and back
// by all-to-all (Note [Expert dispatch] in src/nn/moe.cpp).
//
// Note [MoE auxiliary losses]
// The load-balancing loss (Switch/GShard: E · Σ_i f_i · P_i, f_i the share of
// token-to-expert assignments routed to expert i before dropping, P_i the
// mean router probability of expert i) and the router z-loss (mean over
// tokens of logsumexp(logits)²) are defined over the global batch: the
// tokens of every rank of the token group (data × sequence). f is global and
// constant; each rank's differentiable term holds only its own tokens' P,
// scaled so that the data-parallel mean of the ranks' gradients is the
// gradient of the global loss. Their gradient is added in backward at the
// layer's output (the way Megatron's aux-loss scaler does), not through the
// model's loss, so it reaches the router under pipelining and activation
// checkpointing. It is multiplied by MoELossScale::value as read at forward:
// whoever scales the main loss before backward (1/accumulation, a loss
// scaler, 1/micro-batches) sets the same factor there.
#include "tessera/comm/communicator.h"
#include "tessera/nn/attention.h"
#include "tessera/nn/placement.h"

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace tessera {
namespace nn {

// Which assignments an expert over capacity keeps: the first in routing
// order (every token's first choice before any second choice, then token
// order), or those with the largest gate.
enum class MoEDropPolicy { kPosition, kProbability };

// How the local experts run over their rows (Note [Expert compute] in
// src/nn/moe.cpp): each expert's matrices over exactly the rows routed to
// it, or one batched matmul over every expert padded to the busiest.
enum class MoEExpertCompute { kGrouped, kPadded };

// The gradient factor of the auxiliary losses, shared by a model's MoE layers.
struct MoELossScale {
  double value = 1.0;
};

struct MoEOptions {
  MoEOptions(int64_t hidden, int64_t ffn, int64_t experts) : hidden_(hidden), ffn_(ffn), experts_(experts) {}
  TORCH_ARG(int64_t, hidden);
  TORCH_ARG(int64_t, ffn);
  TORCH_ARG(int64_t, experts);
  TORCH_ARG(int64_t, top_k) = 1;
  // Renormalize the top-k gates to sum to 1 (otherwise they are the router's
  // probabilities).
  TORCH_ARG(bool, renormalize) = false;
  // Capacity per expert = ceil(capacity_factor · k · tokens / experts) of
  // this rank's tokens; nullopt: dropless (every assignment is computed).
  TORCH_ARG(c10::optional<double>, capacity_factor) = c10::nullopt;
  TORCH_ARG(MoEDropPolicy, drop_policy) = MoEDropPolicy::kPosition;
  TORCH_ARG(double, aux_loss_coef) = 1e-2;
  TORCH_ARG(double, z_loss_coef) = 1e-3;
  // Each expert a SwiGLU MLP c_proj(silu(c_gate x) · c_fc x) (Mixtral's w2,
  // w1, w3) instead of GELU; experts with biases or without (Mixtral).
  TORCH_ARG(bool, gated) = false;
  TORCH_ARG(bool, bias) = true;
  TORCH_ARG(MoEExpertCompute, expert_compute) = MoEExpertCompute::kGrouped;
  // Shared experts (DeepSeekMoE, Qwen-MoE): an MLP of the experts' kind and
  // this width that every token passes through beside its routed experts
  // (n shared experts of width f are one MLP of width n·f); 0: none. With
  // shared_gate, its output is scaled by sigmoid(w · x) per token (Qwen-MoE's
  // shared_expert_gate).
  TORCH_ARG(int64_t, shared_ffn) = 0;
  TORCH_ARG(bool, shared_gate) = false;
  // Initialization: the router, c_fc and c_gate weights N(0, init_std), c_proj
  // weights N(0, proj_init_std), biases 0, drawn blockwise from init_seed
  // (Note [Layout-independent initialization]); nullopt: draw_seed().
  TORCH_ARG(double, init_std) = 0.02;
  TORCH_ARG(double, proj_init_std) = 0.02;
  TORCH_ARG(c10::optional<uint64_t>, init_seed) = c10::nullopt;
};

// The groups a MoE layer works over. Null groups mean one rank.
struct MoEGroups {
  // Experts are split over it; tokens are exchanged within it.
  comm::CommunicatorPtr expert;
  // Where the experts' parameters are replicated (the expert-data group).
  comm::CommunicatorPtr expert_data;
  // Every rank holding other tokens of the batch (data × sequence): the
  // auxiliary losses' statistics are summed over it.
  comm::CommunicatorPtr tokens;
  // The number of ranks the data-parallel wrapper averages gradients over
  // (the data size; tokens' size / sequence size). 0: tokens' size.
  int64_t gradient_average = 0;
  // Expert tensor parallelism (Megatron's ETP): each expert's matrices split
  // over this group, whose ranks hold the same tokens (the 1D tensor group):
  // c_fc and c_gate along ffn, c_proj along its input, the experts' outputs
  // summed over it (Note [Expert tensor parallelism] in src/nn/moe.cpp).
  // Null: every rank of it runs whole experts.
  comm::CommunicatorPtr expert_tensor;
};

// What the last forward measured over the global batch.
struct MoEStats {
  double aux_loss = 0;  // E · Σ f_i · P_i, before its coefficient
  double z_loss = 0;
  std::vector<int64_t> tokens_per_expert;  // assignments routed to each expert
  int64_t dropped = 0;                     // assignments over capacity
  // This rank's local experts, not the global batch: the rows they were
  // routed and the rows they ran (more when padded to the busiest expert).
  int64_t rows_routed = 0;
  int64_t rows_computed = 0;
};

// The local experts' linear layers, stacked: weight [E_l, out, in], bias
// [E_l, out] (undefined without bias); x [E_l, M, in] -> [E_l, M, out], one
// batched matmul for all.
class ExpertLinearImpl : public torch::nn::Cloneable<ExpertLinearImpl> {
 public:
  ExpertLinearImpl(int64_t experts, int64_t in, int64_t out, bool bias = true)
      : experts_(experts), in_(in), out_(out), has_bias_(bias) {
    reset();
  }
  void reset() override;
  at::Tensor forward(const at::Tensor& x);

  at::Tensor weight, bias;

 private:
  int64_t experts_, in_, out_;
  bool has_bias_;
};

TORCH_MODULE(ExpertLinear);

class MoEImpl : public torch::nn::Cloneable<MoEImpl>, public PlacedModule {
 public:
  MoEImpl(const MoEOptions& options, MoEGroups groups = {}, std::shared_ptr<MoELossScale> loss_scale = nullptr);

  void reset() override;
  void reset_parameters();
  // x [..., hidden] -> [..., hidden]; collective over the expert and token
  // groups (every rank calls it, with or without tokens for its experts).
  at::Tensor forward(const at::Tensor& x);

  // With an expert group, the experts' parameters: Shard(0) over it,
  // replicated over the expert-data group. The router (and, at expert size
  // 1, the experts) are left to the caller's default placement.
  NamedPlacements local_placements() override;
  const MoEStats& last_stats() const { return stats_; }
  int64_t local_experts() const { return local_experts_; }

  MoEOptions options;
  torch::nn::Linear router{nullptr};  // [experts, hidden], no bias
  // Local experts [rank · E_l, (rank + 1) · E_l) of the expert group:
  // c_fc [E_l, ffn, hidden], c_proj [E_l, hidden, ffn] and, gated, c_gate
  // [E_l, ffn, hidden] (the mlp slot's names).
  ExpertLinear c_fc{nullptr}, c_proj{nullptr}, c_gate{nullptr};
  // With shared_ffn > 0: shared_expert, the block's MLP of the experts' kind
  // over plain linears (c_fc, c_gate when gated, c_proj), and, with
  // shared_gate, shared_expert_gate [1, hidden] (Qwen-MoE's names).
  MLP shared_expert{nullptr};
  torch::nn::Linear shared_expert_gate{nullptr};

 private:
  NamedPlacements expert_placements();
  // The local experts over rows sorted by local expert: `per_expert` the
  // rows of each (host values), `id` each row's local expert. Without
  // c_proj's bias, which is added after the sum over the expert-tensor group.
  at::Tensor run_experts(const at::Tensor& rows, const std::vector<int64_t>& per_expert, const at::Tensor& id);

  MoEGroups groups_;
  std::shared_ptr<MoELossScale> loss_scale_;
  int64_t local_experts_ = 0;
  int64_t local_ffn_ = 0;  // ffn over the expert-tensor group
  uint64_t seed_ = 0;
  MoEStats stats_;
};

TORCH_MODULE(MoE);

}  // namespace nn
}  // namespace tessera
