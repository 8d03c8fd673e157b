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
// 4. All-to-all the token rows (variable splits), sort them by local
//    expert, run the experts (Note [Expert compute]), unsort, and
//    all-to-all the outputs back along the reverse splits.
// 5. Combine: each token's output is the sum of its kept assignments'
//    outputs times their gates (gradients flow to the router through the
//    gates), scattered back with index_add; the shared experts' output
//    (gated per token by option) is added to every token.
//
// Note [Expert compute]
// Routing is uneven: the busiest local expert gets max/mean ≈ 2 times its
// share early in training, and all of a rank's tokens when skewed. Padded,
// every local expert runs as many rows as the busiest in one batched
// matmul, so E_l · max rows are computed for Σ rows routed, the rest zeros.
// Grouped (the default), the sorted rows are split at the experts'
// boundaries and each expert's matrices multiply exactly its rows: E_l
// matmuls instead of one, no wasted FLOPs, no padded buffer. The weights are
// unbound once, so backward stacks the experts' gradients in one tensor,
// and every expert takes part with its rows, zero rows included, so each
// weight gets a gradient (zero if unused) whatever the routing: the data-
// parallel hooks then fire on every rank alike. MoEStats' rows_routed and
// rows_computed count the difference.
//
// Note [Expert tensor parallelism]
// With an expert-tensor group of t ranks (the 1D tensor group, whose ranks
// hold the same tokens), every expert's c_fc and c_gate keep ffn/t of their
// rows and c_proj the matching ffn/t columns, as a Megatron MLP. The router
// is replicated, so the t ranks route alike and exchange the same rows with
// their own expert groups; each runs its slice of every local expert and
// the rows' outputs are summed over the group (reduce_from_group: all-reduce
// forward, identity backward) before c_proj's bias, which is replicated, is
// added. The gates then multiply whole outputs, so the router's gradient is
// whole on every rank. The rows enter through copy_to_group (identity
// forward, all-reduce backward), which sums the slices' input gradients; the
// router's path does not pass it, its gradient being whole already. Shared
// experts stay whole on every rank of the group. Cost per MoE layer: one
// all-reduce of the rows a rank's experts ran forward, one of its tokens
// backward; memory: the experts' parameters over t.

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
  TORCH_CHECK(o.shared_ffn() >= 0, "MoE: shared_ffn ", o.shared_ffn(),
              " must be >= 0 (the width of the shared experts' MLP; 0: none)");
  TORCH_CHECK(!o.shared_gate() || o.shared_ffn() > 0,
              "MoE: shared_gate scales the shared experts' output, but shared_ffn is 0 (no shared experts); set "
              "shared_ffn or drop shared_gate");
  TORCH_CHECK(groups_.gradient_average >= 0, "MoE: gradient_average must be >= 0, got ", groups_.gradient_average);
  const int64_t etp = group_size(groups_.expert_tensor);
  TORCH_CHECK(o.ffn() % etp == 0, "MoE: the experts' ffn width ", o.ffn(), " does not divide over the ", etp,
              " ranks of the expert-tensor group; choose an ffn width that divides or run the experts whole");
  local_experts_ = o.experts() / ep;
  local_ffn_ = o.ffn() / etp;
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
  if (o.gated()) c_gate = register_module("c_gate", ExpertLinear(local_experts_, o.hidden(), local_ffn_, o.bias()));
  c_fc = register_module("c_fc", ExpertLinear(local_experts_, o.hidden(), local_ffn_, o.bias()));
  c_proj = register_module("c_proj", ExpertLinear(local_experts_, local_ffn_, o.hidden(), o.bias()));
  if (o.shared_ffn() > 0) {
    auto linear = [&](int64_t in, int64_t out) {
      return torch::nn::AnyModule(torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(o.bias())));
    };
    const int64_t h = o.hidden(), f = o.shared_ffn();
    shared_expert = register_module("shared_expert", o.gated() ? MLP(linear(h, f), linear(h, f), linear(f, h),
                                                                     [](const at::Tensor& x) { return x; })
                                                               : MLP(linear(h, f), linear(f, h)));
  }
  if (o.shared_gate())
    shared_expert_gate =
        register_module("shared_expert_gate", torch::nn::Linear(torch::nn::LinearOptions(o.hidden(), 1).bias(false)));
  reset_parameters();
}

void MoEImpl::reset_parameters() {
  at::NoGradGuard no_grad;
  init_blockwise(replicated_placement(router->weight), seed_, "router.weight", normal_draw(0, options.init_std()));
  // The shared experts as a dense MLP: matrices drawn, biases 0.
  if (!shared_expert.is_empty()) {
    for (const auto& p : shared_expert->named_parameters()) {
      at::Tensor t = p.value();
      if (p.key().find("bias") != std::string::npos) {
        t.zero_();
      } else {
        const double std = p.key() == "c_proj.weight" ? options.proj_init_std() : options.init_std();
        init_blockwise(replicated_placement(t), seed_, "shared_expert." + p.key(), normal_draw(0, std));
      }
    }
  }
  if (!shared_expert_gate.is_empty())
    init_blockwise(replicated_placement(shared_expert_gate->weight), seed_, "shared_expert_gate.weight",
                   normal_draw(0, options.init_std()));
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
  // Whole experts on every rank: placed like any replicated parameter.
  return group_size(groups_.expert) > 1 || group_size(groups_.expert_tensor) > 1 ? expert_placements()
                                                                                 : NamedPlacements{};
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
    ParamPlacement p = replicated_placement(*t);
    if (group_size(groups_.expert) > 1) {
      p = sharded_placement(*t, 0, options.experts(), groups_.expert, "expert");
      p.replica_group = groups_.expert_data;
    }
    // Note [Expert tensor parallelism]: ffn is dim 1 of c_fc / c_gate, 2 of c_proj.weight.
    if (group_size(groups_.expert_tensor) > 1) {
      if (name == "c_proj.bias")
        p.replicate("tensor", groups_.expert_tensor);
      else
        p.shard("tensor", groups_.expert_tensor, name == "c_proj.weight" ? 2 : 1, options.ffn());
    }
    out.emplace_back(name, std::move(p));
  }
  return out;
}

at::Tensor MoEImpl::run_experts(const at::Tensor& rows, const std::vector<int64_t>& per_expert, const at::Tensor& id) {
  const int64_t el = local_experts_, hidden = options.hidden();
  const bool gated = options.gated();
  stats_.rows_routed = rows.size(0);
  if (options.expert_compute() == MoEExpertCompute::kPadded) {
    // Slot of each row in [E_l, longest, hidden].
    const int64_t longest = *std::max_element(per_expert.begin(), per_expert.end());
    stats_.rows_computed = el * longest;
    const at::Tensor counts = at::bincount(id, {}, el);
    const at::Tensor slot =
        id * longest + at::arange(id.numel(), id.options()) - (counts.cumsum(0) - counts).index_select(0, id);
    const at::Tensor grouped =
        at::zeros({el * longest, hidden}, rows.options()).index_copy(0, slot, rows).view({el, longest, hidden});
    const at::Tensor h =
        gated ? at::silu(c_gate->forward(grouped)) * c_fc->forward(grouped) : at::gelu(c_fc->forward(grouped));
    return at::bmm(h, c_proj->weight.transpose(1, 2)).reshape({el * longest, hidden}).index_select(0, slot);
  }
  // Note [Expert compute]
  stats_.rows_computed = rows.size(0);
  auto unbind = [](const ExpertLinear& l) {
    return std::make_pair(l->weight.unbind(0), l->bias.defined() ? l->bias.unbind(0) : std::vector<at::Tensor>());
  };
  const auto fc = unbind(c_fc);
  const auto gate = gated ? unbind(c_gate) : decltype(fc)();
  const std::vector<at::Tensor> proj = c_proj->weight.unbind(0);
  auto linear = [](const at::Tensor& in, const auto& l, int64_t e) {
    return l.second.empty() ? at::linear(in, l.first[e]) : at::linear(in, l.first[e], l.second[e]);
  };
  std::vector<at::Tensor> outs;
  const auto chunks = rows.split_with_sizes(per_expert);
  for (int64_t e = 0; e < el; ++e) {
    const at::Tensor& in = chunks[e];
    const at::Tensor h = gated ? at::silu(linear(in, gate, e)) * linear(in, fc, e) : at::gelu(linear(in, fc, e));
    outs.push_back(at::linear(h, proj[e]));
  }
  return at::cat(outs);
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
  // One read to the host: the splits and each local expert's rows.
  const at::Tensor sizes = at::cat({counts.view({ep, el}).sum(1), recv_counts.sum(1), recv_counts.sum(0)}).cpu();
  const int64_t* size = sizes.data_ptr<int64_t>();
  const std::vector<int64_t> send_splits(size, size + ep), recv_splits(size + ep, size + 2 * ep);
  const std::vector<int64_t> per_expert(size + 2 * ep, size + 2 * ep + el);
  // Note [Expert tensor parallelism]: the slices' input gradients add up here.
  const bool split = group_size(groups_.expert_tensor) > 1;
  at::Tensor rows =
      (split ? comm::copy_to_group(tokens_in, groups_.expert_tensor) : tokens_in).index_select(0, r.token);
  if (ep > 1) rows = comm::all_to_all_rows(rows, send_splits, recv_splits, groups_.expert);

  // The received rows come by source rank, then local expert: sort them by local expert.
  const at::Tensor local_id =
      at::repeat_interleave(at::arange(el, counts.options()).repeat({ep}), recv_counts.reshape(-1));
  const at::Tensor order = std::get<1>(at::sort(local_id, /*stable=*/true, 0, false));
  const at::Tensor sorted_id = local_id.index_select(0, order);
  at::Tensor expert_out = run_experts(rows.index_select(0, order), per_expert, sorted_id);
  if (split) expert_out = comm::reduce_from_group(expert_out, groups_.expert_tensor);
  if (c_proj->bias.defined()) expert_out = expert_out + c_proj->bias.index_select(0, sorted_id);
  const at::Tensor inverse = at::empty_like(order).scatter_(0, order, at::arange(order.numel(), order.options()));
  at::Tensor back = expert_out.index_select(0, inverse);
  if (ep > 1) back = comm::all_to_all_rows(back, recv_splits, send_splits, groups_.expert);

  at::Tensor out = at::zeros({tokens, hidden}, back.options())
                       .index_add(0, r.token, back * r.gate.to(back.scalar_type()).unsqueeze(1));
  out = out.view(x.sizes());
  if (!shared_expert.is_empty()) {
    at::Tensor shared = shared_expert->forward(x);
    if (!shared_expert_gate.is_empty()) shared = shared * at::sigmoid(shared_expert_gate->forward(x));
    out = out + shared;
  }

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
