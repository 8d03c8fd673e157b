#pragma once
// The safetensors format (Hugging Face): an 8-byte little-endian header
// length N, N bytes of JSON {name: {"dtype", "shape", "data_offsets"},
// "__metadata__": {string: string}}, then the tensors' bytes back to back,
// little-endian, row-major. Written here so that checkpoints are readable by
// PyTorch, Hugging Face and any JSON + struct reader.
#include "tessera/core/atomic_file.h"  // WriteHook

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace tessera {

// Note [Tensor checksums]
// write_safetensors stores a 64-bit checksum of every tensor's bytes
// (core/hash.h) in the metadata, under "tessera.hash64.<name>" as 16 hex
// digits; readers that read a tensor whole check it and refuse a damaged
// file naming the tensor. Files without checksums (written by other tools)
// are read unchecked; their header and sizes are still checked.

// Writes `tensors` (any device; copied to the CPU, made contiguous) to
// `path` atomically: into path + ".tmp", flushed, then renamed. `hook`
// runs after the header and after each tensor.
void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {}, const WriteHook& hook = nullptr);

// A safetensors file opened for reading; tensors are read on demand.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(std::string path);  // throws naming the file and what is wrong

  std::vector<std::string> names() const;
  bool contains(const std::string& name) const { return entries_.count(name) > 0; }
  std::vector<int64_t> shape(const std::string& name) const;
  at::Tensor read(const std::string& name) const;  // a new CPU tensor, its checksum checked

  // Where a tensor's bytes lie in the file, for readers that read them
  // themselves (streamed inference).
  struct Location {
    at::ScalarType dtype;
    std::vector<int64_t> shape;
    int64_t offset = 0;  // from the start of the file
    int64_t bytes = 0;
    bool has_checksum = false;
    uint64_t checksum = 0;  // Note [Tensor checksums]
  };
  Location location(const std::string& name) const;
  // Throws naming the file and tensor if `data` (the tensor's bytes) does
  // not match the stored checksum; no-op without one.
  void check(const std::string& name, const void* data, int64_t bytes) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& path() const { return path_; }

 private:
  struct Entry {
    at::ScalarType dtype;
    std::vector<int64_t> shape;
    int64_t begin = 0, end = 0;  // byte offsets after the header
  };
  const Entry& entry(const std::string& name) const;

  std::string path_;
  int64_t data_start_ = 0;
  std::map<std::string, Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace tessera
