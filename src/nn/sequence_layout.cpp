#include "tessera/nn/sequence_layout.h"

#include <ATen/ATen.h>

namespace tessera {
namespace nn {

// Note [Hybrid sequence layout]
// With U Ulysses ranks per ring rank, sequence rank s = r·U + u holds piece u
// of ring rank r's tokens (the contiguous or zigzag split over R = P/U). The
// all-to-all over the Ulysses group gathers the U pieces in rank order, which
// is ring rank r's token order, so the ring attention that follows sees
// exactly the layout it expects. Contiguous hybrid equals contiguous over P;
// zigzag hybrid gives each rank an equal share of tokens, and the attention
// work (done after the gather, per ring rank) stays balanced as in zigzag.
// The sequence must divide into the same P (contiguous) or 2P (zigzag)
// chunks as without Ulysses.

SequenceLayout::SequenceLayout(int size, int rank, context::SequenceSplit split, int ulysses)
    : size_(size), rank_(rank), split_(split), ulysses_(ulysses) {
  TORCH_CHECK(size_ >= 1 && rank_ >= 0 && rank_ < size_, "SequenceLayout: rank ", rank_, " of ", size_,
              " is not a rank of the group");
  TORCH_CHECK(ulysses_ >= 1 && size_ % ulysses_ == 0, "SequenceLayout: Ulysses size ", ulysses_,
              " does not divide the sequence size ", size_);
}

SequenceLayout SequenceLayout::ring_layout() const {
  return SequenceLayout(size_ / ulysses_, rank_ / ulysses_, split_);
}

void SequenceLayout::check(int64_t seq_len) const {
  const bool zigzag = split_ == context::SequenceSplit::kZigzag;
  const int64_t chunks = zigzag ? 2 * int64_t{size_} : int64_t{size_};
  TORCH_CHECK(seq_len > 0 && seq_len % chunks == 0, "sequence length ", seq_len, " does not divide into ", chunks,
              " equal chunks, which the ", context::sequence_split_name(split_), " split over ", size_,
              " sequence ranks needs", zigzag ? " (2 chunks per rank)" : "", "; pad or cut the sequence to a multiple of ",
              chunks);
}

at::Tensor SequenceLayout::positions(int64_t seq_len, int rank) const {
  check(seq_len);
  TORCH_INTERNAL_ASSERT(rank >= 0 && rank < size_);
  if (ulysses_ > 1) {
    const at::Tensor ring = ring_layout().positions(seq_len, rank / ulysses_);
    const int64_t piece = ring.size(0) / ulysses_;
    return ring.narrow(0, (rank % ulysses_) * piece, piece);
  }
  if (split_ == context::SequenceSplit::kContiguous) {
    const int64_t n = seq_len / size_;
    return at::arange(rank * n, (rank + 1) * n, at::kLong);
  }
  const int64_t c = seq_len / (2 * size_);
  const int64_t last = 2 * size_ - 1 - rank;
  return at::cat({at::arange(rank * c, (rank + 1) * c, at::kLong), at::arange(last * c, (last + 1) * c, at::kLong)});
}

at::Tensor SequenceLayout::gathered_positions(int64_t seq_len) const {
  std::vector<at::Tensor> parts;
  for (int r = 0; r < size_; ++r) parts.push_back(positions(seq_len, r));
  return at::cat(parts);
}

int64_t SequenceLayout::first_position(int64_t seq_len, int rank) const {
  check(seq_len);
  TORCH_INTERNAL_ASSERT(ulysses_ == 1, "first_position of a hybrid layout; ask its ring_layout()");
  const int64_t chunks = split_ == context::SequenceSplit::kZigzag ? 2 * int64_t{size_} : int64_t{size_};
  return rank * (seq_len / chunks);
}

int64_t SequenceLayout::last_position(int64_t seq_len, int rank) const {
  check(seq_len);
  TORCH_INTERNAL_ASSERT(ulysses_ == 1, "last_position of a hybrid layout; ask its ring_layout()");
  if (split_ == context::SequenceSplit::kContiguous) return (rank + 1) * (seq_len / size_) - 1;
  const int64_t c = seq_len / (2 * size_);
  return (2 * int64_t{size_} - rank) * c - 1;
}

}  // namespace nn
}  // namespace tessera
