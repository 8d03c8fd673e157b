#pragma once
// StoredWeights: a model's weights on disk, read a box at a time without
// loading the file whole: a safetensors file (tessera_consolidate's, or any
// with these names), a distributed checkpoint directory whose pieces lie
// in several rank files, or "hf:DIR", a Hugging Face model directory of the
// Llama family (its tensors are row blocks of tessera's, Note [Hugging Face
// tables]; GPT-2's transposed Conv1D weights are refused). Streamed inference (infer/streamed_gpt.h) reads
// one layer's weights, or this rank's shard of them, through it.
//
// Note [Reads in extents]
// A read of the box [offset, offset + length) of a tensor is planned once
// into extents: runs of bytes that are contiguous both in a file and in the
// destination buffer. For each stored piece (the whole tensor in a
// safetensors file; a region and flat range of it in a checkpoint, Note
// [Checkpoint layout]) the trailing dimensions that box and region both
// span whole are merged into one, so a layer's weight is one extent and a
// tensor-parallel column shard is one extent per row. Extents of a piece
// that touch each other are merged; a box some of whose bytes no piece
// holds is refused. Reads go to a pool of I/O threads per file
// (core/async_file.h) and land in the caller's buffer, so the caller
// decides where weights live and for how long. A stored tensor that a read
// covers whole is checked against its checksum (Note [Tensor checksums])
// the first time it is read; one read in part (a shard of a tensor stored
// whole) is not.
#include "tessera/core/async_file.h"

#include <c10/core/ScalarType.h>
#include <torch/arg.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace tessera {
namespace infer {

struct StoredWeightsOptions {
  TORCH_ARG(int, io_threads) = 2;               // per file
  TORCH_ARG(std::string, prefix) = "model/";    // of the tensors' names in a checkpoint
  // Drop the pages read from the page cache once they are in the caller's
  // buffer, so that every read goes to the disk: what streaming costs when
  // the weights do not fit in the machine's memory either, and a page cache
  // left to the job's other files.
  TORCH_ARG(bool, drop_cache) = false;

 public:
  StoredWeightsOptions() = default;
};

class StoredWeights {
 public:
  struct Extent {
    int file = 0;
    int64_t file_offset = 0, bytes = 0, dst_offset = 0;
  };
  struct Check {
    int piece = 0;  // stored tensors are checked once
    int64_t dst_offset = 0, bytes = 0;
  };
  struct ReadPlan {
    at::ScalarType dtype = at::kFloat;
    std::vector<int64_t> length;
    int64_t bytes = 0;
    std::vector<Extent> extents;
    std::vector<Check> checks;
  };

  // `path`: a safetensors file, or a checkpoint directory (its tensors
  // named options.prefix + name). Throws naming the path and what is wrong.
  explicit StoredWeights(const std::string& path, StoredWeightsOptions options = {});
  ~StoredWeights();
  StoredWeights(const StoredWeights&) = delete;
  StoredWeights& operator=(const StoredWeights&) = delete;

  const std::string& path() const;
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const;
  std::vector<int64_t> shape(const std::string& name) const;
  at::ScalarType dtype(const std::string& name) const;
  // The checkpoint's metadata (JSON text; in a consolidated file, its
  // "tessera.checkpoint_metadata"), "{}" when there is none.
  std::string metadata_json() const;

  // Plans the read of the box [offset, offset + length) of `name` into a
  // contiguous row-major buffer of length's shape in dtype(name).
  ReadPlan plan(const std::string& name, const std::vector<int64_t>& offset,
                const std::vector<int64_t>& length) const;
  ReadPlan plan_whole(const std::string& name) const;
  // Issues the plan's reads into dst (plan.bytes bytes, alive and untouched
  // until the works complete) and appends their works.
  void issue(const ReadPlan& plan, void* dst, std::vector<IoWork>& works);
  // After the works completed: checks the stored tensors the plan read whole
  // and that were not checked before (throws naming the file and tensor),
  // and with drop_cache drops the pages read.
  void complete(const ReadPlan& plan, const void* dst);

 private:
  void open_hf(const std::string& dir);

  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace infer
}  // namespace tessera
