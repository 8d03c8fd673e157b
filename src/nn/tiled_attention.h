#pragma once
// The causal attention kernel ring attention and LocalAttention share: an
// online softmax over key blocks, in tiles (Note [Ring attention] and Note
// [Ring attention tiles] in tiled_attention.cpp). Internal to nn/.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace tessera {
namespace nn {
namespace detail {

// Tokens at consecutive positions: local indices [begin, begin + length)
// hold positions [first, first + length).
struct TokenRun {
  int64_t begin;
  int64_t length;
  int64_t first;
};

// The maximal runs of consecutive positions of `positions` [n].
std::vector<TokenRun> runs_of_positions(const at::Tensor& positions);
// Each run cut into tiles of at most `tile` tokens.
std::vector<TokenRun> tiles_of(const std::vector<TokenRun>& runs, int64_t tile);

// Dropout of one key block's probabilities (Note [Ring attention dropout]);
// p = 0: none. `owner` is the block's rank, part of the masks' seed.
struct BlockDropout {
  double p = 0;
  uint64_t seed = 0;
  int owner = 0;
};

// Called after each pair of tiles: ring attention moves its shifts in
// flight there (Note [Ring progress] in comm/p2p.h); what it returns is
// not used. Empty: nothing.
using BetweenTiles = std::function<bool()>;

// The online softmax of a rank's queries q [b, h, n, d] (float or double).
struct OnlineSoftmax {
  explicit OnlineSoftmax(const at::Tensor& q);
  // Extends it by the keys and values kv [2, b, h, n_k, d]; `queries` and
  // `keys` are the tiles of q and of kv.
  void extend(const at::Tensor& q, const at::Tensor& kv, const std::vector<TokenRun>& queries,
              const std::vector<TokenRun>& keys, const BlockDropout& drop, const BetweenTiles& between = {});
  // The output acc / l and the log-sum-exp m + log l of each query's row.
  std::pair<at::Tensor, at::Tensor> finish() const;

  at::Tensor m, l, acc;
};

// Backward of one key block: adds its part of dq, returns dk and dv as
// [2, b, h, n_k, d] (undefined when no query sees a key of the block).
// delta = rowsum(dout ∘ out).
at::Tensor attention_block_backward(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& dout,
                                    const at::Tensor& delta, const at::Tensor& lse,
                                    const std::vector<TokenRun>& queries, const std::vector<TokenRun>& keys,
                                    const BlockDropout& drop, at::Tensor& dq, const BetweenTiles& between = {});

// softmax(q·kᵀ/√d)·v [b, h, n, d], each query seeing the keys at positions
// up to its own, in tiles: no n x n matrix, forward or backward. No dropout.
at::Tensor tiled_causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& positions);

}  // namespace detail
}  // namespace nn
}  // namespace tessera
