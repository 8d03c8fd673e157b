#pragma once
// Where a rank's state pieces are loaded from: a checkpoint on disk
// (CheckpointReader) or pieces received over the network from a running
// job in another layout (train/piece_exchange.h). Loading code asks for the
// part of a full tensor it holds (Note [Checkpoint layout]) and does not
// care which.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace tessera {
namespace infer {

// The part of a full tensor a rank will load, described as a TensorPiece
// is (Note [Checkpoint layout]); offset empty: the whole tensor.
struct PieceRequest {
  std::string name;
  std::vector<int64_t> offset;
  std::vector<int64_t> length;
  int64_t flat_begin = 0;
  int64_t flat_end = -1;  // -1: the whole region
};

class PieceSource {
 public:
  virtual ~PieceSource() = default;

  // What the pieces come from, for error messages: "checkpoint DIR", ...
  virtual std::string describe() const = 0;
  // Names of the tensors that start with prefix, sorted.
  virtual std::vector<std::string> names(const std::string& prefix = "") const = 0;
  virtual bool contains(const std::string& name) const = 0;
  virtual std::vector<int64_t> full_shape(const std::string& name) const = 0;
  // The full tensor (CPU or the job's device).
  virtual at::Tensor full(const std::string& name) const = 0;
  // Elements [begin, end) of the box [offset, offset + length) read
  // row-major: a ZeRO shard of a tensor-parallel shard. 1-D.
  virtual at::Tensor flat(const std::string& name, const std::vector<int64_t>& offset,
                          const std::vector<int64_t>& length, int64_t begin, int64_t end) const = 0;
};

}  // namespace infer
}  // namespace tessera
