#pragma once
// Input checks shared by the sequence-parallel attentions (internal).
#include "tessera/nn/sequence_layout.h"

#include <ATen/ATen.h>

#include <cstdint>

namespace tessera {
namespace nn {

// q, k, v [b, heads, n, head_dim] alike and positions equal to this rank's
// positions of a sequence of n·P tokens; returns that sequence length.
inline int64_t check_sequence_attention(const char* name, const at::Tensor& q, const at::Tensor& k,
                                        const at::Tensor& v, const at::Tensor& positions, int64_t head_dim,
                                        const SequenceLayout& layout) {
  TORCH_CHECK(q.dim() == 4 && q.sizes() == k.sizes() && q.sizes() == v.sizes() && q.size(-1) == head_dim, name,
              ": q, k, v must be [batch, heads, tokens, ", head_dim, "] alike, got ", q.sizes(), ", ", k.sizes(), ", ",
              v.sizes());
  const int64_t seq_len = q.size(2) * layout.size();
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == q.size(2) &&
                  at::equal(positions.to(at::kCPU, at::kLong), layout.positions(seq_len)),
              name, ": the positions must be this sequence rank's (rank ", layout.rank(), " of ", layout.size(), ", ",
              context::sequence_split_name(layout.split()), " split of ", seq_len,
              " tokens); feed the block layout of the layer factory that made this module");
  return seq_len;
}

}  // namespace nn
}  // namespace tessera
