#pragma once
// Which tokens of a sequence each rank of a sequence group holds.
//
// Contiguous: P equal chunks, rank r holds chunk r. Zigzag: 2P equal
// chunks, rank r holds chunks r and 2P-1-r, so that under a causal mask
// every rank has the same number of (query, key) pairs to compute (the
// first chunk's few and the last chunk's many). Attention masks by the
// positions, never by index, so any split is exact.
//
// Hybrid (ulysses U > 1, Note [Hybrid sequence layout]): the split is taken
// over the R = P/U ring ranks, and ring rank r's tokens are cut into U equal
// consecutive pieces held by sequence ranks r·U .. r·U+U-1, so that a
// Ulysses all-to-all over those U ranks lays out ring rank r's tokens in
// order (ring_layout()).
#include "tessera/context/parallel_config.h"

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace tessera {
namespace nn {

class SequenceLayout {
 public:
  SequenceLayout(int size, int rank, context::SequenceSplit split, int ulysses = 1);

  int size() const { return size_; }
  int rank() const { return rank_; }
  context::SequenceSplit split() const { return split_; }
  int ulysses() const { return ulysses_; }
  // The ring's layout in hybrid: size P/U, rank r = rank / U, no Ulysses.
  SequenceLayout ring_layout() const;

  // Throws on every rank unless seq_len divides into the split's chunks
  // (P for contiguous, 2P for zigzag).
  void check(int64_t seq_len) const;
  // The positions (int64, ascending) that rank `rank` holds of a sequence of seq_len.
  at::Tensor positions(int64_t seq_len, int rank) const;
  at::Tensor positions(int64_t seq_len) const { return positions(seq_len, rank_); }
  // Every rank's positions, concatenated in rank order [seq_len]: the order
  // in which a gather over the group lays the tokens out.
  at::Tensor gathered_positions(int64_t seq_len) const;
  // The first and last position rank `rank` holds (for skipping blocks whose
  // keys all come after every query); layouts without Ulysses pieces only.
  int64_t first_position(int64_t seq_len, int rank) const;
  int64_t last_position(int64_t seq_len, int rank) const;

 private:
  int size_;
  int rank_;
  context::SequenceSplit split_;
  int ulysses_;
};

}  // namespace nn
}  // namespace tessera
