#pragma once
// Reading a distributed checkpoint (train/checkpoint.h writes them): the
// index, every rank's safetensors file, and any box of any tensor from the
// pieces that overlap it, in any other parallel layout. Training loads
// from it (through PieceSource) and streamed inference reads its bytes
// (StoredWeights); docs/checkpoints.md.
//
// Note [Checkpoint layout]
// A piece is the part of a full tensor one rank holds: a region (an
// N-dimensional box, [offset[d], offset[d] + length[d]) along each
// dimension d, as nn::ParamPlacement says for tensor-parallel shards; the
// whole tensor when offset is empty), and of that region, read row-major,
// the flat range [flat_begin, flat_end) (a ZeRO shard of a tensor-parallel
// shard). Index version 2 stores the boxes; version 1 indexes (one sharded
// dimension: dim, offset, length) are read by converting them. Pieces that several ranks hold alike
// (data-parallel replicas, tensors replicated over the tensor group, tied
// weights on two stages) are written once, by one of them, chosen
// round-robin so that the writing is spread. A reader assembles a full
// tensor from its pieces and refuses one that has holes.
#include "tessera/core/safetensors.h"
#include "tessera/infer/piece_source.h"

#include <ATen/core/Tensor.h>

#include <map>
#include <string>
#include <vector>

namespace tessera {
namespace infer {

// The reader of a checkpoint directory, on any rank, in any layout. It
// refuses what Note [Atomic checkpoints] in train/checkpoint.h says a
// reader refuses.
class CheckpointReader : public PieceSource {
 public:
  // Checks the index and the files' sizes; throws naming what is missing.
  explicit CheckpointReader(std::string dir);

  const std::string& dir() const { return dir_; }
  const std::string& metadata() const { return metadata_; }  // JSON text
  int world_size() const { return world_size_; }
  std::string describe() const override { return "checkpoint " + dir_; }
  std::vector<std::string> names(const std::string& prefix = "") const override;
  bool contains(const std::string& name) const override { return tensors_.count(name) > 0; }
  std::vector<int64_t> full_shape(const std::string& name) const override;
  // The full tensor, assembled from its pieces (CPU).
  at::Tensor full(const std::string& name) const override;
  // region(name, offset, length), flattened and narrowed to [begin, end).
  at::Tensor flat(const std::string& name, const std::vector<int64_t>& offset, const std::vector<int64_t>& length,
                  int64_t begin, int64_t end) const override;
  // The box [offset, offset + length) of the full tensor, read from the
  // pieces that overlap it only: memory of the box plus one piece's rows.
  at::Tensor region(const std::string& name, const std::vector<int64_t>& offset,
                    const std::vector<int64_t>& length) const;

  // Where each piece of a tensor lies on disk (Note [Checkpoint layout]),
  // for readers that read the bytes themselves (streamed inference).
  struct StoredPiece {
    std::string path;                   // the rank file
    std::string key;                    // the tensor's name in that file
    SafetensorsFile::Location location; // its bytes in that file
    std::vector<int64_t> offset, length;  // the region of the full tensor
    int64_t flat_begin = 0, flat_end = 0;  // of the region, read row-major
  };
  std::vector<StoredPiece> stored_pieces(const std::string& name) const;
  // The opened rank file `path` (as in StoredPiece::path), to check a
  // piece's checksum.
  const SafetensorsFile& file(const std::string& path) const;

 private:
  struct Piece {
    std::string file, key;
    std::vector<int64_t> offset, length;
    int64_t flat_begin, flat_end;
  };
  struct Entry {
    std::vector<int64_t> shape;
    std::vector<Piece> pieces;
  };
  std::string dir_;
  std::string metadata_;
  int world_size_ = 0;
  std::map<std::string, Entry> tensors_;
  // Files opened (headers parsed) once, on first use.
  mutable std::map<std::string, std::unique_ptr<SafetensorsFile>> files_;
};

}  // namespace infer
}  // namespace tessera
