#pragma once
// Distributed checkpoints: every rank writes the pieces of tensors it holds
// to its own safetensors file, and one index.json says, for every tensor,
// its full shape and where each piece of it lies, so that a checkpoint
// loads into any other parallel configuration (docs/checkpoints.md).
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
#include "tessera/infer/checkpoint_reader.h"

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

// Writes the tensors named `prefix`... of a checkpoint, full and with the
// prefix removed, into one safetensors file (readable by PyTorch and
// Hugging Face's safetensors). The checkpoint's metadata JSON goes into the
// file's metadata as "tessera.checkpoint_metadata".
void consolidate_checkpoint(const std::string& dir, const std::string& out_file, const std::string& prefix = "model/");

}  // namespace train
}  // namespace tessera
