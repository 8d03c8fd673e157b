#pragma once
// The one authority on which layouts tessera runs: the combinations of
// parallel modes its layers carry out (check_supported) and the shapes a
// model needs in a layout (check_shape). The layer factories, ShardedModule,
// the trainer and the planner all ask here, so that nothing ranks, builds or
// documents a layout another part refuses (docs/parallel-context.md,
// "Layouts").
#include "tessera/context/parallel_config.h"

#include <torch/arg.h>

#include <cstdint>

namespace tessera {
namespace context {

struct Layout {
  TORCH_ARG(ParallelConfig, grid) = {};
  // Megatron's sequence-parallel variant of the 1D layers (activations
  // between blocks split over the sequence on the tensor group).
  TORCH_ARG(bool, sequence_parallel) = false;
  // Every dropout keyed by the row of the global batch (Note [Row-keyed
  // dropout]), for jobs that change their data size.
  TORCH_ARG(bool, row_keyed_dropout) = false;
  // The experts' matrices split over the 1D tensor group (Megatron's expert
  // tensor parallelism) instead of whole experts on every tensor rank.
  TORCH_ARG(bool, expert_tensor_parallel) = false;

 public:
  Layout() = default;
  explicit Layout(ParallelConfig grid) : grid_(std::move(grid)) {}
};

// Throws c10::Error, the same on every rank, naming the modes that do not
// combine and what to use instead: sequence parallelism, an expert group
// and the sequence-parallel variant run on tensor mode 1d; the variant and
// sequence parallelism split the sequence twice; experts do not combine with
// the variant; row-keyed dropout needs 1d without sequence splits; expert
// tensor parallelism needs tensor mode 1d without the variant. Sizes are
// resolve()'s business, not checked here.
void check_supported(const Layout& layout);

// What a model looks like to the layout rules; 0 leaves a quantity unchecked.
struct ModelShape {
  TORCH_ARG(int64_t, hidden) = 0;
  TORCH_ARG(int64_t, heads) = 0;
  // Key/value heads (grouped-query attention); 0: as many as heads.
  TORCH_ARG(int64_t, kv_heads) = 0;
  TORCH_ARG(int64_t, ffn) = 0;
  TORCH_ARG(int64_t, seq) = 0;
  // Mixture-of-experts experts per MoE block (0: a dense model).
  TORCH_ARG(int64_t, experts) = 0;
  // Rows of one micro-batch on one data replica.
  TORCH_ARG(int64_t, rows) = 0;

 public:
  ModelShape() = default;
};

// check_supported, then the shapes the layers of the (resolved) layout need:
// heads and hidden sizes split over q (q² for the 3D hidden size), rows over
// the batch blocks, the sequence into its chunks, heads per tensor rank over
// Ulysses' sequence ranks (hybrid: its Ulysses group), experts over the
// expert group, and an expert group, expert tensor parallelism or experts
// only where the layers carry them. Throws naming the quantity, the rule and
// the layout.
void check_shape(const Layout& layout, const ModelShape& shape);

// Note [Replicated key/value heads]: `kv_heads` over `split` head blocks of
// `mode` (text for messages). Splits where split divides them; otherwise,
// where `can_replicate` (1D) and split is a multiple of them, each block
// holds one replicated kv head. Anything else is refused. Returns whether
// they are replicated. check_shape and the layer factories both ask it.
bool kv_heads_replicated(int64_t kv_heads, int64_t split, bool can_replicate, const std::string& mode);

}  // namespace context
}  // namespace tessera
