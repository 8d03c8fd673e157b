// What every layer factory shares, and the choice of factory by the context.
#include "tessera/nn/layer_factory.h"

#include "tessera/context/layout.h"
#include "tessera/core/hash.h"
#include "tessera/nn/attention.h"
#include "tessera/nn/rms_norm.h"

#include <torch/nn/module.h>

namespace tessera {
namespace nn {

torch::nn::AnyModule LayerFactory::core_attention(int64_t /*heads*/, int64_t head_dim, double p) {
  return torch::nn::AnyModule(LocalAttention(head_dim, dropout(p, DropoutSite::kSharded)));
}

torch::nn::AnyModule LayerFactory::mlp(int64_t hidden, int64_t ffn, MLPKind kind, bool bias) {
  // Construction order fixes the seeds each linear draws: gate, up, down.
  if (kind == MLPKind::kSwiGLU) {
    auto gate = linear(hidden, ffn, LinearRole::kColumnEntered, bias);
    auto fc = linear(hidden, ffn, LinearRole::kColumnEntered, bias);
    return torch::nn::AnyModule(
        MLP(std::move(gate), std::move(fc), linear(ffn, hidden, LinearRole::kRow, bias), column_entry()));
  }
  auto fc = linear(hidden, ffn, LinearRole::kColumn, bias);
  return torch::nn::AnyModule(
      MLP(std::move(fc), linear(ffn, hidden, LinearRole::kRow, bias), kind == MLPKind::kGeluTanh));
}

int64_t LayerFactory::local_kv_heads(int64_t kv_heads) const {
  const int64_t split = head_split();
  return kv_heads % split == 0 ? kv_heads / split : 1;
}

torch::nn::AnyModule LayerFactory::head_norm(int64_t head_dim, double eps) {
  // The placement's groups, copied: the layer may outlive this factory.
  ParamPlacement shape = head_param(at::empty({head_dim}));
  return torch::nn::AnyModule(RMSNorm(RMSNormOptions(head_dim).eps(eps), [shape](const at::Tensor& p) {
    ParamPlacement placed = shape;
    placed.param = p;
    return placed;
  }));
}

torch::nn::AnyModule LayerFactory::kv_linear(int64_t in, int64_t kv_heads, int64_t rows_per_head, bool bias) {
  context::kv_heads_replicated(kv_heads, head_split(), /*can_replicate=*/false, "tensor mode " + mode());
  return linear(in, kv_heads * rows_per_head, LinearRole::kColumnEntered, bias);
}

std::function<at::Tensor(const at::Tensor&)> LayerFactory::column_entry() const {
  return [](const at::Tensor& x) { return x; };
}

torch::nn::AnyModule LayerFactory::moe(const MoEOptions& /*options*/, std::shared_ptr<MoELossScale> /*loss_scale*/) {
  TORCH_CHECK(false, "mixture-of-experts layers run on tensor mode 1d (with or without sequence parallelism), "
              "not on layers of mode '", mode(), "'; use tensor mode 1d, or a dense model (experts 0)");
}

NamedPlacements LayerFactory::placements(torch::nn::Module& module) const {
  return placements_of(module, [this](const at::Tensor& p) { return replicated_param(p); });
}

std::shared_ptr<LayerFactory> make_layer_factory(const context::ParallelContextPtr& ctx, bool sequence_parallel,
                                                 bool row_keyed_dropout, bool expert_tensor_parallel) {
  TORCH_CHECK(ctx != nullptr, "make_layer_factory: the ParallelContext is null");
  const auto& c = ctx->config();
  // The context is the authority on which layouts the layers carry out.
  context::check_supported(context::Layout(c)
                               .sequence_parallel(sequence_parallel)
                               .row_keyed_dropout(row_keyed_dropout)
                               .expert_tensor_parallel(expert_tensor_parallel));
  const bool grid = ctx->grid().grid_tensor_mode();
  if (grid) return c.tensor_mode() == context::TensorMode::k3D ? make_3d_factory(ctx) : make_2d_factory(ctx);
  // Experts split over the expert group, replicated over expert-data; the
  // auxiliary losses' statistics span every rank holding other tokens.
  MoEGroups experts;
  experts.expert = ctx->comm(context::ParallelMode::kExpert);
  experts.expert_data = ctx->comm(context::ParallelMode::kExpertData);
  experts.tokens = ctx->comm(ctx->grid().token_mode());
  experts.gradient_average = ctx->size(context::ParallelMode::kData);
  if (expert_tensor_parallel && c.tensor() > 1) experts.expert_tensor = ctx->comm(context::ParallelMode::kTensor);
  if (c.sequence() > 1) {
    // Block activations differ across data and sequence ranks; sharded ones
    // across tensor and sequence ranks (Note [Dropout seeds]).
    auto inner = make_1d_factory(ctx->comm(context::ParallelMode::kTensor), false,
                                 ctx->seed(context::ParallelMode::kDataSequence),
                                 splitmix64(ctx->seed(context::ParallelMode::kTensor) ^
                                            ctx->seed(context::ParallelMode::kSequence)),
                                 std::move(experts));
    SequenceGroups groups;
    groups.sequence = ctx->comm(context::ParallelMode::kSequence);
    if (c.sequence_mode() == context::SequenceMode::kHybrid) {
      groups.ulysses = ctx->comm(context::ParallelMode::kSequenceUlysses);
      groups.ring = ctx->comm(context::ParallelMode::kSequenceRing);
    }
    return make_sequence_factory(std::move(inner), std::move(groups), c.sequence_mode(), c.sequence_split());
  }
  if (row_keyed_dropout) {
    // Equal across data ranks (rows key the masks instead); block seeds
    // equal across tensor ranks too, sharded ones differ between them.
    const uint64_t stage = ctx->has(context::ParallelMode::kPipeline) ? ctx->rank(context::ParallelMode::kPipeline) : 0;
    const uint64_t block = splitmix64(c.seed() ^ splitmix64(stage + 1));
    return make_1d_factory(ctx->comm(context::ParallelMode::kTensor), false, block,
                           ctx->seed(context::ParallelMode::kTensor), std::move(experts), true);
  }
  return make_1d_factory(ctx->comm(context::ParallelMode::kTensor), sequence_parallel,
                         ctx->seed(context::ParallelMode::kData), ctx->seed(context::ParallelMode::kTensor),
                         std::move(experts));
}

}  // namespace nn
}  // namespace tessera
