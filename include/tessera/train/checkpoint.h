#pragma once
// Distributed checkpoints: every rank writes the pieces of tensors it holds
// to its own safetensors file, and one index.json says, for every tensor,
// its full shape and where each piece of it lies, so that a checkpoint
// loads into any other parallel configuration (docs/checkpoints.md).
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
//
// Note [Atomic checkpoints]
// save_checkpoint writes into DIR.partial; each file goes to a temporary
// name first and is renamed when complete; after every rank's file is in
// place rank 0 writes index.json (also through a rename), then replaces DIR
// in two renames: an existing DIR to DIR.old, DIR.partial to DIR, and
// removes DIR.old. A save killed at any point leaves DIR complete (the old
// or the new one), or absent with the previous checkpoint in DIR.old when
// killed between the two renames. The reader refuses a directory without
// an index, a ".partial" one, files whose sizes differ from the index, and
// a DIR missing beside a DIR.old (naming both, and what to do), with a
// message that says so; it never loads another directory than the one it
// was given. The next save into DIR renames DIR.old back first, so the
// previous checkpoint is not lost if that save is killed too.
#include "tessera/comm/communicator.h"
#include "tessera/train/piece_source.h"
#include "tessera/train/safetensors.h"

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace tessera {
namespace train {

struct TensorPiece {
  std::string name;
  std::vector<int64_t> full_shape;
  std::vector<int64_t> offset;  // the region; empty: the whole tensor
  std::vector<int64_t> length;
  int64_t flat_begin = 0;
  int64_t flat_end = -1;  // -1: the whole region
  at::Tensor data;        // the piece's elements (any shape, numel as described)
};

struct CheckpointOptions {
  // Called on each rank once its file is in place, before the index is
  // written (tests stop a rank there to check atomicity).
  TORCH_ARG(std::function<void(const std::string& file)>, after_file) = nullptr;
  // Called on rank 0 between moving the previous DIR to DIR.old and moving
  // DIR.partial to DIR (tests stop rank 0 there).
  TORCH_ARG(std::function<void()>, before_move_in) = nullptr;

 public:
  CheckpointOptions() = default;
};

// Collective over `world`: writes dir/rank-NNNNN.safetensors (ranks that
// write something) and dir/index.json, with `metadata_json` (a JSON object
// as text) stored in the index. An existing dir is replaced.
void save_checkpoint(const std::string& dir, const std::vector<TensorPiece>& pieces, const std::string& metadata_json,
                     const comm::CommunicatorPtr& world, const CheckpointOptions& options = {});

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

// Writes the tensors named `prefix`... of a checkpoint, full and with the
// prefix removed, into one safetensors file (readable by PyTorch and
// Hugging Face's safetensors). The checkpoint's metadata JSON goes into the
// file's metadata as "tessera.checkpoint_metadata".
void consolidate_checkpoint(const std::string& dir, const std::string& out_file, const std::string& prefix = "model/");

}  // namespace train
}  // namespace tessera
