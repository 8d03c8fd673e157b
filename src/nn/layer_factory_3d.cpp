// The 3D layer factory (arXiv 2105.14450): block layout A [b/q², s, h/q],
// column-role linears to layout B and row-role linears back (Note [3D
// layouts] in nn/linear_3d.h). Attention needs no communication: c_attn's
// output (layout B) holds whole heads in its feature block j. Layer norm
// and the position embedding are the 2D layers over (row = 3d_output,
// col = 3d_input, depth = 3d_weight): layout A's hidden block is 3d_output's
// index and the other two groups hold other batch rows, exactly the roles
// of 2D's row, col and depth. The rest is GridFactory's.
#include "grid_factory.h"
#include "tessera/nn/init.h"
#include "tessera/nn/linear_3d.h"
#include "tessera/nn/vocab_embedding_3d.h"

namespace tessera {
namespace nn {
namespace {

using context::ParallelMode;

GridGroups groups_3d(const context::ParallelContextPtr& ctx) {
  GridGroups g;
  g.tensor = ctx->comm(ParallelMode::kTensor);
  g.hidden = ctx->comm(ParallelMode::k3DOutput);
  g.across = ctx->comm(ParallelMode::k3DInput);
  g.depth = ctx->comm(ParallelMode::k3DWeight);
  g.batch = ctx->comm(ParallelMode::k3DInputWeight);  // layout A: sub-block k·q + j
  // The logits are in layout B: vocabulary block j over 3d_input, batch
  // sub-block k·q + i over 3d_output_weight.
  g.vocab = g.across;
  g.logit_batch = ctx->comm(ParallelMode::k3DOutputWeight);
  g.mode = "3d";
  g.blocks_rule = "q*q";
  return g;
}

class Factory3D : public GridFactory {
 public:
  explicit Factory3D(const context::ParallelContextPtr& ctx) : GridFactory(ctx, groups_3d(ctx)) {}

  torch::nn::AnyModule linear(int64_t in, int64_t out, LinearRole role, bool bias) override {
    const GridGroups& g = groups();
    const bool column = role != LinearRole::kRow;  // layout A -> B; a row-role layer swaps the groups back
    return torch::nn::AnyModule(Linear3D(Linear3DOptions(in, out).bias(bias).init_seed(draw_seed()),
                                         column ? g.across : g.hidden, g.depth, column ? g.hidden : g.across));
  }
  torch::nn::AnyModule vocab_embedding(int64_t vocab, int64_t dim) override {
    const GridGroups& g = groups();
    return torch::nn::AnyModule(
        VocabEmbedding3D(VocabEmbedding3DOptions(vocab, dim).init_seed(draw_seed()), g.across, g.depth, g.hidden));
  }
  at::Tensor lm_logits(const at::Tensor& hidden, torch::nn::AnyModule& vocab_embedding) override {
    auto e = std::dynamic_pointer_cast<VocabEmbedding3DImpl>(vocab_embedding.ptr());
    TORCH_CHECK(e != nullptr, "lm_logits needs a vocabulary embedding made by this factory");
    return e->logits(hidden);  // layout B: [b/q², s, V_p/q], vocabulary block j
  }
};

}  // namespace

std::shared_ptr<LayerFactory> make_3d_factory(const context::ParallelContextPtr& ctx) {
  TORCH_CHECK(ctx != nullptr, "make_3d_factory: the ParallelContext is null");
  TORCH_CHECK(ctx->config().tensor_mode() == context::TensorMode::k3D, "make_3d_factory: the context's tensor mode is ",
              context::tensor_mode_name(ctx->config().tensor_mode()), ", 3d expected");
  return std::make_shared<Factory3D>(ctx);
}

}  // namespace nn
}  // namespace tessera
