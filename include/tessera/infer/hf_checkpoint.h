#pragma once
// Hugging Face model directories in and out (docs/huggingface.md):
//
//   infer::HFCheckpoint hf("Llama-3.2-1B");           // config.json + safetensors
//   trainer.load_weights(hf);                         // each rank reads its boxes only
//   infer::export_hf("ckpt/final", "out", world);     // any layout -> transformers
//
// Import reads config.json (models::hf_config_from_json: every key carried
// out, kept or refused) and model.safetensors or the shards of
// model.safetensors.index.json, and serves the model under tessera's names
// ("model/<full-state name>") as a PieceSource: a rank asking for its shard
// reads, through models::hf_table, only the boxes of the Hugging Face tensors
// that hold it, one read buffer at a time, and converts them to fp32.
#include "tessera/comm/communicator.h"
#include "tessera/infer/piece_source.h"
#include "tessera/infer/stored_weights.h"
#include "tessera/models/huggingface.h"

#include <c10/core/ScalarType.h>
#include <c10/util/Optional.h>
#include <torch/arg.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace tessera {
namespace infer {

// DIR/config.json read (models::hf_config_from_json); throws naming DIR
// when it is not a model directory.
models::HFConfig read_hf_config(const std::string& dir);

class HFCheckpoint : public PieceSource {
 public:
  // Opens DIR: parses config.json, the index (when sharded) and every file's
  // header; checks that the files hold exactly the weights of the
  // configured model with their shapes. Throws naming what is wrong.
  explicit HFCheckpoint(std::string dir, int io_threads = 2);
  ~HFCheckpoint() override;

  const std::string& dir() const { return dir_; }
  const models::HFConfig& hf() const { return hf_; }
  const models::GPTConfig& config() const { return hf_.model; }
  // The stored weights' dtype (of the first tensor; Hugging Face files hold one).
  at::ScalarType stored_dtype() const { return stored_dtype_; }

  std::string describe() const override { return "Hugging Face model " + dir_; }
  std::vector<std::string> names(const std::string& prefix = "") const override;
  bool contains(const std::string& name) const override;
  std::vector<int64_t> full_shape(const std::string& name) const override;
  at::Tensor full(const std::string& name) const override;
  at::Tensor flat(const std::string& name, const std::vector<int64_t>& offset, const std::vector<int64_t>& length,
                  int64_t begin, int64_t end) const override;
  // The box [offset, offset + length) of a tessera tensor ("model/<name>"), fp32.
  at::Tensor region(const std::string& name, const std::vector<int64_t>& offset,
                    const std::vector<int64_t>& length) const;
  // The name/layout table (Note [Hugging Face tables]) and the file that
  // holds each Hugging Face tensor.
  const std::map<std::string, models::HFEntry>& table() const { return table_; }
  const std::string& file_of(const std::string& hf_name) const;
  // The largest read buffer so far, in bytes (the import's memory beyond
  // the boxes asked for; fp32 row parts are read straight into the box).
  int64_t largest_read() const { return largest_read_; }

 private:
  const models::HFEntry& entry(const std::string& name) const;
  // The box of a Hugging Face tensor, in its stored dtype: into `into` when
  // it is contiguous and of that dtype (then returned), else a new buffer.
  at::Tensor read_box(const std::string& hf_name, const std::vector<int64_t>& offset,
                      const std::vector<int64_t>& length, const at::Tensor& into) const;

  std::string dir_;
  models::HFConfig hf_;
  std::map<std::string, models::HFEntry> table_;
  std::map<std::string, int> file_of_;  // Hugging Face tensor -> files_
  std::vector<std::unique_ptr<StoredWeights>> files_;
  at::ScalarType stored_dtype_ = at::kFloat;
  mutable int64_t largest_read_ = 0;
};

struct HFExportOptions {
  // Largest shard file, in bytes (a tensor larger than it gets a shard of its own).
  TORCH_ARG(int64_t, shard_bytes) = int64_t{5} * 1000 * 1000 * 1000;
  // The files' dtype; empty: the checkpoint's stored dtype.
  TORCH_ARG(c10::optional<at::ScalarType>, dtype) = c10::nullopt;

 public:
  HFExportOptions() = default;
};

struct HFExportStats {
  std::string architecture;
  int64_t tensors = 0, bytes = 0;
  int shards = 0;
  int64_t bytes_written_here = 0;  // by this rank
};

// Writes the tessera checkpoint `checkpoint_dir` (any layout; its metadata
// names the model, Note [Checkpoint layout]) as a Hugging Face directory
// `out_dir`: config.json (the imported one written back, or made from the
// model), generation_config.json, safetensors shards with their index.
// Collective over `world`: shard k is assembled and written by rank
// k mod world size from the checkpoint's pieces that overlap it, so no rank
// holds more than one shard. The files go to out_dir + ".partial", which
// rank 0 renames to out_dir once every rank finished (an existing out_dir
// is replaced then).
HFExportStats export_hf(const std::string& checkpoint_dir, const std::string& out_dir,
                        const comm::CommunicatorPtr& world, const HFExportOptions& options = {});

// "float32" / "bfloat16" / "float16" and back; throws naming the others.
std::string hf_dtype_name(at::ScalarType dtype);
at::ScalarType hf_dtype(const std::string& name);

}  // namespace infer
}  // namespace tessera
