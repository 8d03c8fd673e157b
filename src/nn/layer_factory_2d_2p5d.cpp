// The 2D (Optimus) and 2.5D (Tesseract) layer factory: every activation
// between blocks is [b/(q·d), s, h/q] (Note [2D and 2.5D layouts] in
// nn/linear_2d.h), every linear is a SUMMA product, and attention needs no
// communication at all: c_attn's output block j holds whole heads (c_attn's
// rows are grouped per head, Note [GPT full weights]), so each rank attends
// over its batch rows and its heads alone. The rest is GridFactory's.
#include "grid_factory.h"
#include "tessera/nn/init.h"
#include "tessera/nn/linear_2d.h"
#include "tessera/nn/summa.h"
#include "tessera/nn/vocab_embedding_2d.h"

namespace tessera {
namespace nn {
namespace {

using context::ParallelMode;

GridGroups groups_2d(const context::ParallelContextPtr& ctx) {
  const bool deep = ctx->config().tensor_mode() == context::TensorMode::k2p5D;
  GridGroups g;
  g.tensor = ctx->comm(ParallelMode::kTensor);
  g.hidden = ctx->comm(deep ? ParallelMode::k2p5DRow : ParallelMode::k2DRow);
  g.across = ctx->comm(deep ? ParallelMode::k2p5DCol : ParallelMode::k2DCol);
  if (deep) g.depth = ctx->comm(ParallelMode::k2p5DDep);
  // The batch is cut into q·d blocks: block i + q·k on rank (i, j, k),
  // which is that rank's local rank in 2.5D's xz group. The logits keep the
  // block layout's batch blocks, with vocabulary block j over the row group.
  g.batch = deep ? ctx->comm(ParallelMode::k2p5DXZ) : g.across;
  g.vocab = g.hidden;
  g.logit_batch = g.batch;
  g.mode = deep ? "2.5d" : "2d";
  g.blocks_rule = "q*depth";
  return g;
}

class Factory2D : public GridFactory {
 public:
  explicit Factory2D(const context::ParallelContextPtr& ctx) : GridFactory(ctx, groups_2d(ctx)) {}

  // Both roles are the same layer: a SUMMA product takes and gives the block layout.
  torch::nn::AnyModule linear(int64_t in, int64_t out, LinearRole /*role*/, bool bias) override {
    const GridGroups& g = groups();
    return torch::nn::AnyModule(
        Linear2D(Linear2DOptions(in, out).bias(bias).init_seed(draw_seed()), g.hidden, g.across, g.depth));
  }
  torch::nn::AnyModule vocab_embedding(int64_t vocab, int64_t dim) override {
    const GridGroups& g = groups();
    return torch::nn::AnyModule(VocabEmbedding2D(
        VocabEmbedding2DOptions(vocab, dim).full_batch(true).init_seed(draw_seed()), g.hidden, g.across, g.depth));
  }
  at::Tensor lm_logits(const at::Tensor& hidden, torch::nn::AnyModule& vocab_embedding) override {
    auto e = std::dynamic_pointer_cast<VocabEmbedding2DImpl>(vocab_embedding.ptr());
    TORCH_CHECK(e != nullptr, "lm_logits needs a vocabulary embedding made by this factory");
    return summa_matmul_nt(hidden, e->weight, groups().hidden, groups().across);  // [b/(q·d), s, V_p/q]
  }
};

}  // namespace

std::shared_ptr<LayerFactory> make_2d_factory(const context::ParallelContextPtr& ctx) {
  TORCH_CHECK(ctx != nullptr, "make_2d_factory: the ParallelContext is null");
  const auto mode = ctx->config().tensor_mode();
  TORCH_CHECK(mode == context::TensorMode::k2D || mode == context::TensorMode::k2p5D,
              "make_2d_factory: the context's tensor mode is ", context::tensor_mode_name(mode),
              ", 2d or 2.5d expected");
  return std::make_shared<Factory2D>(ctx);
}

}  // namespace nn
}  // namespace tessera
