// What every layer factory shares, and the choice of factory by the context.
#include "tessera/nn/layer_factory.h"

#include <torch/nn/module.h>

namespace tessera {
namespace nn {

NamedPlacements LayerFactory::placements(torch::nn::Module& module) const {
  return placements_of(module, [this](const at::Tensor& p) { return replicated_param(p); });
}

std::shared_ptr<LayerFactory> make_layer_factory(const context::ParallelContextPtr& ctx, bool sequence_parallel) {
  TORCH_CHECK(ctx != nullptr, "make_layer_factory: the ParallelContext is null");
  const auto& c = ctx->config();
  TORCH_CHECK(c.tensor_mode() == context::TensorMode::k1D || c.tensor() == 1, "tensor mode ",
              context::tensor_mode_name(c.tensor_mode()), " (tensor size ", c.tensor(),
              ") is configured, but tessera's layers implement tensor mode 1d only so far; set tensor mode 1d");
  TORCH_CHECK(c.sequence() == 1, "sequence size ", c.sequence(), " (mode ",
              context::sequence_mode_name(c.sequence_mode()),
              ") is configured, but no layer carries out sequence parallelism over a sequence group yet; set sequence "
              "size 1 (the 1D tensor-parallel layers' sequence-parallel variant needs no sequence group)");
  TORCH_CHECK(c.expert() == 1, "expert size ", c.expert(),
              " is configured, but no layer carries out expert parallelism yet; set expert size 1");
  return make_1d_factory(ctx->comm(context::ParallelMode::kTensor), sequence_parallel,
                         ctx->seed(context::ParallelMode::kData), ctx->seed(context::ParallelMode::kTensor));
}

}  // namespace nn
}  // namespace tessera
