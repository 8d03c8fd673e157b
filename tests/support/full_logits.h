#pragma once
// The full logits [b, s, vocab] from every rank's block of them, in any
// tensor or sequence mode: vocabulary shards over the tensor group (1D),
// sequence shards over the sequence group, batch and vocabulary blocks of
// the 2D, 2.5D and 3D grids. Collective over the tensor (and sequence) group.
#include "tessera/context/parallel_context.h"
#include "tessera/nn/layer_factory.h"
#include "tessera/nn/shard.h"

#include <ATen/ATen.h>

namespace tessera {
namespace test {

inline at::Tensor full_logits(const at::Tensor& local, const context::ParallelContextPtr& ctx,
                              const nn::LayerFactory& factory, int64_t vocab) {
  using context::ParallelMode;
  using context::TensorMode;
  if (ctx->grid().grid_tensor_mode()) {
    // The logits' vocabulary blocks and batch blocks, per mode (Note [2D and
    // 2.5D layouts], Note [3D layouts]).
    comm::CommunicatorPtr vocab_blocks, batch_blocks;
    switch (ctx->config().tensor_mode()) {
      case TensorMode::k2D:
        vocab_blocks = ctx->comm(ParallelMode::k2DRow), batch_blocks = ctx->comm(ParallelMode::k2DCol);
        break;
      case TensorMode::k2p5D:
        vocab_blocks = ctx->comm(ParallelMode::k2p5DRow), batch_blocks = ctx->comm(ParallelMode::k2p5DXZ);
        break;
      default:
        vocab_blocks = ctx->comm(ParallelMode::k3DInput), batch_blocks = ctx->comm(ParallelMode::k3DOutputWeight);
    }
    return nn::unshard(nn::unshard(local, -1, *vocab_blocks), 0, *batch_blocks).narrow(-1, 0, vocab);
  }
  const at::Tensor vocab_full = nn::unshard(local, -1, *ctx->comm(ParallelMode::kTensor));
  // The 1D sequence-parallel variant's LM head gathers the sequence itself.
  if (factory.mode() == "1d-sp") return vocab_full.narrow(-1, 0, vocab);
  return factory.gather_activation(vocab_full).narrow(-1, 0, vocab);
}

}  // namespace test
}  // namespace tessera
