#include "tessera/nn/moe.h"

#include "tessera/comm/functional.h"
#include "tessera/nn/init.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace tessera {
namespace nn {

// Note [Expert dispatch]
// 1. Route: router logits in fp32, softmax, top-k per token. Assignments are
//    listed in routing order (every token's first choice, then every
//    token's second choice; tokens in order), which is the priority for
//    dropping by position. With a capacity, each expert keeps its first C
//    assignments (or its C largest gates); the rest contribute nothing and
//    the residual carries their token. Capacity counts this rank's tokens
//    (GShard's groups), so it needs no agreement across ranks.
// 2. Sort the kept assignments by expert. Expert e lives on rank e / E_l of
//    the expert group, so the rows for rank r are one contiguous run.
// 3. Agree the splits: one all-to-all of the [ep, E_l] assignment counts;
//    each rank then knows how many rows it receives for each of its experts
//    from each rank. Every rank takes part in both all-to-alls whatever
//    its counts, zero included, so no routing can leave a rank waiting.
// 4. All-to-all the token rows (variable splits), group them by local
//    expert into [E_l, M, hidden] (M: the largest group, the rest zero
//    padding), run the experts as two batched matmuls, ungroup, and
//    all-to-all the outputs back along the reverse splits.
// 5. Combine: each token's output is the sum of its kept assignments'
//    outputs times their gates (gradients flow to the router through the
//    gates), scattered back with index_add.

namespace {

struct Routing {
  at::Tensor token, expert, gate;  // kept assignments, sorted by expert
  at::Tensor routed;               // [E] assignments per expert before dropping
  int64_t dropped = 0;
};

Routing route(const at::Tensor& probs, const MoEOptions& o) {
  const int64_t tokens = probs.size(0), experts = o.experts(), k = o.top_k();
  at::Tensor top_p, top_e;
  std::tie(top_p, top_e) = probs.topk(k, -1);
  const at::Tensor gates = o.renormalize() ? top_p / top_p.sum(-1, true) : top_p;
  // Routing order: slot-major, tokens in order within a slot.
  const at::Tensor expert = top_e.t().reshape(-1);
  const at::Tensor token = at::arange(tokens, probs.options().dtype(at::kLong)).repeat({k});
  const at::Tensor gate = gates.t().reshape(-1);
  Routing r;
  r.routed = at::bincount(expert, {}, experts);
  at::Tensor kept;
  if (!o.capacity_factor()) {
    kept = std::get<1>(at::sort(expert, /*stable=*/true, 0, false));
  } else {
    const auto capacity =
        static_cast<int64_t>(std::ceil(*o.capacity_factor() * static_cast<double>(k * tokens) / experts));
    at::Tensor order;
    if (o.drop_policy() == MoEDropPolicy::kPosition) {
      order = std::get<1>(at::sort(expert, /*stable=*/true, 0, false));
    } else {  // by expert, largest gate first within an expert
      const at::Tensor by_gate = std::get<1>(at::sort(gate.detach(), /*stable=*/true, 0, /*descending=*/true));
      order = by_gate.index_select(0, std::get<1>(at::sort(expert.index_select(0, by_gate), true, 0, false)));
    }
    const at::Tensor sorted_expert = expert.index_select(0, order);
    const at::Tensor starts = r.routed.cumsum(0) - r.routed;
    const at::Tensor rank_in_expert =
        at::arange(order.numel(), order.options()) - starts.index_select(0, sorted_expert);
    kept = order.masked_select(rank_in_expert < capacity);
  }
  r.token = token.index_select(0, kept);
  r.expert = expert.index_select(0, kept);
  r.gate = gate.index_select(0, kept);
  r.dropped = expert.numel() - kept.numel();
  return r;
}

// Adds the auxiliary losses' gradient at the layer's output (Note [MoE
// auxiliary losses]); the output passes through unchanged.
struct AddAuxLoss : torch::autograd::Function<AddAuxLoss> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& out, const at::Tensor& /*aux*/,
                            double scale) {
    ctx->saved_data["scale"] = scale;
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    const double scale = ctx->saved_data["scale"].toDouble();
    return {g[0], at::full({}, scale, at::TensorOptions().dtype(at::kFloat).device(g[0].device())), at::Tensor()};
  }
};

int64_t group_size(const comm::CommunicatorPtr& g) { return g ? g->size() : 1; }

}  // namespace

MoEImpl::MoEImpl(const MoEOptions& options_, MoEGroups groups, std::shared_ptr<MoELossScale> loss_scale)
    : options(options_), groups_(std::move(groups)), loss_scale_(std::move(loss_scale)) {
  const auto& o = options;
  const int64_t ep = group_size(groups_.expert);
  TORCH_CHECK(o.hidden() > 0 && o.ffn() > 0, "MoE: hidden (", o.hidden(), ") and ffn (", o.ffn(), ") must be positive");
  TORCH_CHECK(o.experts() > 0, "MoE: experts must be positive, got ", o.experts());
  TORCH_CHECK(o.experts() % ep == 0, "MoE: ", o.experts(), " experts do not divide over an expert group of ", ep,
              " ranks; choose an expert size that divides the number of experts");
  TORCH_CHECK(o.top_k() >= 1 && o.top_k() <= o.experts(), "MoE: top-k ", o.top_k(), " must be between 1 and the ",
              o.experts(), " experts; lower top-k or add experts");
  TORCH_CHECK(!o.capacity_factor() || *o.capacity_factor() > 0, "MoE: capacity factor ",
              o.capacity_factor().value_or(0), " must be positive; leave it unset for dropless routing");
  TORCH_CHECK(o.aux_loss_coef() >= 0 && o.z_loss_coef() >= 0, "MoE: the auxiliary loss coefficients (",
              o.aux_loss_coef(), ", z ", o.z_loss_coef(), ") must be >= 0; 0 turns a loss off");
  TORCH_CHECK(o.capacity_factor() || o.drop_policy() == MoEDropPolicy::kPosition,
              "MoE: drop policy 'probability' chooses what an expert over capacity keeps, but no capacity factor is "
              "set (dropless routing drops nothing); set a capacity factor or leave the policy at 'position'");
  TORCH_CHECK(groups_.gradient_average >= 0, "MoE: gradient_average must be >= 0, got ", groups_.gradient_average);
  local_experts_ = o.experts() / ep;
  seed_ = o.init_seed() ? *o.init_seed() : draw_seed();
  reset();
}

void ExpertLinearImpl::reset() {
  weight = register_parameter("weight", at::empty({experts_, out_, in_}));
  if (has_bias_) bias = register_parameter("bias", at::zeros({experts_, out_}));
}

at::Tensor ExpertLinearImpl::forward(const at::Tensor& x) {
  if (!bias.defined()) return at::bmm(x, weight.transpose(1, 2));
  return at::baddbmm(bias.unsqueeze(1), x, weight.transpose(1, 2));
}

void MoEImpl::reset() {
  const auto& o = options;
  router = register_module("router", torch::nn::Linear(torch::nn::LinearOptions(o.hidden(), o.experts()).bias(false)));
  if (o.gated()) c_gate = register_module("c_gate", ExpertLinear(local_experts_, o.hidden(), o.ffn(), o.bias()));
  c_fc = register_module("c_fc", ExpertLinear(local_experts_, o.hidden(), o.ffn(), o.bias()));
  c_proj = register_module("c_proj", ExpertLinear(local_experts_, o.ffn(), o.hidden(), o.bias()));
  reset_parameters();
}

void MoEImpl::reset_parameters() {
  at::NoGradGuard no_grad;
  init_blockwise(replicated_placement(router->weight), seed_, "router.weight", normal_draw(0, options.init_std()));
  for (auto& [name, p] : expert_placements()) {
    if (name.find(".bias") != std::string::npos) {
      p.param.zero_();
    } else {
      const double std = name == "c_proj.weight" ? options.proj_init_std() : options.init_std();
      init_blockwise(p, seed_, name, normal_draw(0, std));
    }
  }
}

NamedPlacements MoEImpl::local_placements() {
  // One expert group: the experts are placed like any replicated parameter.
  return group_size(groups_.expert) > 1 ? expert_placements() : NamedPlacements{};
}

NamedPlacements MoEImpl::expert_placements() {
  NamedPlacements out;
  std::vector<std::pair<std::string, at::Tensor*>> params;
  const std::pair<const char*, ExpertLinear*> layers[] = {{"c_gate", &c_gate}, {"c_fc", &c_fc}, {"c_proj", &c_proj}};
  for (const auto& [prefix, layer] : layers) {
    if (layer->is_empty()) continue;
    params.emplace_back(std::string(prefix) + ".weight", &(*layer)->weight);
    if ((*layer)->bias.defined()) params.emplace_back(std::string(prefix) + ".bias", &(*layer)->bias);
  }
  for (const auto& [name, t] : params) {
    if (group_size(groups_.expert) == 1) {
      out.emplace_back(name, replicated_placement(*t));
      continue;
    }
    ParamPlacement p = sharded_placement(*t, 0, options.experts(), groups_.expert, "expert");
    p.replica_group = groups_.expert_data;
    out.emplace_back(name, std::move(p));
  }
  return out;
}

at::Tensor MoEImpl::forward(const at::Tensor& x) {
  const auto& o = options;
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == o.hidden(), "MoE: expected inputs [..., ", o.hidden(), "], got shape ",
              x.sizes());
  const int64_t hidden = o.hidden(), experts = o.experts(), el = local_experts_;
  const int64_t ep = group_size(groups_.expert);
  const at::Tensor tokens_in = x.reshape({-1, hidden});
  const int64_t tokens = tokens_in.size(0);

  const at::Tensor logits = at::linear(tokens_in.to(at::kFloat), router->weight.to(at::kFloat));
  const at::Tensor probs = at::softmax(logits, -1);
  Routing r = route(probs, o);

  // Splits: rows to each rank (runs of its experts), and rows from each.
  const at::Tensor counts = at::bincount(r.expert, {}, experts);  // kept, per global expert
  at::Tensor recv_counts = counts.view({ep, el});
  if (ep > 1) recv_counts = comm::raw::all_to_all(counts, 0, 0, *groups_.expert).view({ep, el});
  // One read to the host: the splits and the longest local expert.
  const at::Tensor per_expert = recv_counts.sum(0);
  const at::Tensor sizes =
      at::cat({counts.view({ep, el}).sum(1), recv_counts.sum(1), per_expert.max().view({1})}).cpu();
  const int64_t* size = sizes.data_ptr<int64_t>();
  const std::vector<int64_t> send_splits(size, size + ep), recv_splits(size + ep, size + 2 * ep);
  const int64_t longest = size[2 * ep];
  at::Tensor rows = tokens_in.index_select(0, r.token);
  if (ep > 1) rows = comm::all_to_all_rows(rows, send_splits, recv_splits, groups_.expert);

  // Group the received rows (by source rank, then local expert) per local expert.
  const at::Tensor local_id =
      at::repeat_interleave(at::arange(el, counts.options()).repeat({ep}), recv_counts.reshape(-1));
  const at::Tensor order = std::get<1>(at::sort(local_id, /*stable=*/true, 0, false));
  const at::Tensor sorted_id = local_id.index_select(0, order);
  const at::Tensor slot = sorted_id * longest + at::arange(order.numel(), order.options()) -
                          (per_expert.cumsum(0) - per_expert).index_select(0, sorted_id);
  at::Tensor grouped =
      at::zeros({el * longest, hidden}, rows.options()).index_copy(0, slot, rows.index_select(0, order));
  grouped = grouped.view({el, longest, hidden});
  const at::Tensor hidden_out = options.gated() ? at::silu(c_gate->forward(grouped)) * c_fc->forward(grouped)
                                                : at::gelu(c_fc->forward(grouped));
  const at::Tensor expert_out = c_proj->forward(hidden_out);
  const at::Tensor inverse = at::empty_like(order).scatter_(0, order, at::arange(order.numel(), order.options()));
  at::Tensor back = expert_out.reshape({el * longest, hidden}).index_select(0, slot).index_select(0, inverse);
  if (ep > 1) back = comm::all_to_all_rows(back, recv_splits, send_splits, groups_.expert);

  at::Tensor out = at::zeros({tokens, hidden}, back.options())
                       .index_add(0, r.token, back * r.gate.to(back.scalar_type()).unsqueeze(1));
  out = out.view(x.sizes());

  // Global statistics (Note [MoE auxiliary losses]): one all-reduce on the
  // device, one read to the host.
  const at::Tensor lse = at::logsumexp(logits, -1);
  const at::Tensor lse_squared = lse * lse;
  at::Tensor stats;
  {
    at::NoGradGuard no_grad;
    stats = at::cat(
        {r.routed.to(at::kDouble), probs.sum(0).to(at::kDouble), lse_squared.sum().to(at::kDouble).view({1}),
         at::tensor({static_cast<double>(tokens), static_cast<double>(r.dropped)}, at::kDouble).to(probs.device())});
    if (group_size(groups_.tokens) > 1) groups_.tokens->all_reduce(stats);
  }
  const at::Tensor host = stats.cpu();
  const double* v = host.data_ptr<double>();
  const double total_tokens = v[2 * experts + 1];
  double aux_value = 0;
  for (int64_t i = 0; i < experts; ++i)
    aux_value += v[i] / (static_cast<double>(o.top_k()) * total_tokens) * v[experts + i];
  stats_.aux_loss = total_tokens > 0 ? experts * aux_value / total_tokens : 0.0;
  stats_.z_loss = total_tokens > 0 ? v[2 * experts] / total_tokens : 0.0;
  stats_.dropped = static_cast<int64_t>(v[2 * experts + 2]);
  stats_.tokens_per_expert.resize(experts);
  for (int64_t i = 0; i < experts; ++i) stats_.tokens_per_expert[i] = static_cast<int64_t>(v[i]);

  if (!at::GradMode::is_enabled() || !(o.aux_loss_coef() > 0 || o.z_loss_coef() > 0) || total_tokens == 0) return out;
  const double average =
      static_cast<double>(groups_.gradient_average ? groups_.gradient_average : group_size(groups_.tokens));
  const double per_token = average / total_tokens;
  const at::Tensor f = (stats.narrow(0, 0, experts) / (static_cast<double>(o.top_k()) * total_tokens)).to(at::kFloat);
  at::Tensor aux = (probs.sum(0) * f).sum() * (experts * per_token * o.aux_loss_coef());
  if (o.z_loss_coef() > 0) aux = aux + lse_squared.sum() * (per_token * o.z_loss_coef());
  return AddAuxLoss::apply(out, aux, loss_scale_ ? loss_scale_->value : 1.0);
}

}  // namespace nn
}  // namespace tessera
