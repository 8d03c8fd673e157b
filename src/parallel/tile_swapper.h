#pragma once
// TileSwapper: tensors kept in a file between uses and brought into a few
// bounded host buffers one tile at a time (disk offload of optimizer states
// and master copies; Note [Disk offload] in sharded_optimizer.h).
//
// Note [Tiles in slots]
// A tile is a set of tensors that are used together (the optimizer states
// and master copy of a range of a bucket's optimizer chunk). Between uses
// every tile tensor is released: its storage object stays (so the
// optimizer's state map, views and pieces keep pointing at it) but holds no
// memory. run() walks the tiles through `slots` buffers: tile t's record is
// read into slot t % slots while tile t - 1 computes and tile t - 2 is
// written back, and its tensors are bound to the slot's memory (storage
// data pointers into the buffer, not owning it) for the work. A tensor that
// holds memory of its own when its tile comes up (created by the
// optimizer's first step, or put there by a checkpoint load) is newer than
// the file, so it is copied into the slot rather than read over. After the
// work the tile's tensors are laid out again (a step may have created
// states) and the slot is written to the tile's record. Tensors are matched
// to their place in a record by storage object, so a state replaced by a
// new tensor is never mistaken for the old one.
#include "tessera/core/async_file.h"

#include <ATen/core/Tensor.h>

#include <functional>
#include <string>
#include <vector>

namespace c10 {
struct StorageImpl;
}

namespace tessera {
namespace parallel {
namespace detail {

class TileSwapper {
 public:
  // The tensors of tile t, in a stable order; each contiguous, owning its
  // storage, on the CPU.
  using TensorsOf = std::function<std::vector<at::Tensor>(size_t tile)>;

  TileSwapper(AsyncFile file, size_t tiles, int slots, bool pinned, TensorsOf tensors_of);
  ~TileSwapper();

  // Calls work(t) for every tile in order, with the tile's tensors in
  // memory; afterwards every tile tensor is in the file and released.
  void run(const std::function<void(size_t)>& work);
  // Every tile tensor in memory of its own (checkpoints); park() or the
  // next run() sends them back.
  void fetch();
  void park() { run([](size_t) {}); }
  bool parked() const { return parked_; }

  int64_t buffer_bytes() const;  // the slots' host memory
  int64_t file_bytes() const { return file_end_; }
  const std::string& path() const { return file_.path(); }

 private:
  struct Entry {
    const c10::StorageImpl* storage;
    int64_t offset;
    int64_t nbytes;
  };
  struct Record {
    int64_t file_offset = -1;
    int64_t capacity = 0;  // bytes reserved in the file
    int64_t bytes = 0;     // bytes used, a multiple of the I/O alignment
    std::vector<Entry> entries;
  };
  struct Slot {
    at::Tensor memory;
    char* base = nullptr;
    int64_t capacity = 0;
    IoWork read;
    IoWork write;
    std::vector<at::Tensor> bound;  // tensors whose storage points into this slot
  };

  void acquire(Slot& slot, size_t tile);
  void bind(Slot& slot, size_t tile);
  void store(Slot& slot, size_t tile);
  void unbind_all(Slot& slot);
  void grow(Slot& slot, int64_t bytes);
  bool in_slot(const Slot& slot, const at::Tensor& t) const;
  void drain();
  std::vector<at::Tensor> tensors(size_t tile) const;

  AsyncFile file_;
  TensorsOf tensors_of_;
  std::vector<Record> records_;
  std::vector<Slot> slots_;
  bool pinned_;
  int64_t file_end_ = 0;
  bool parked_ = false;
  std::string broken_;  // why an earlier run failed; the file no longer matches
};

}  // namespace detail
}  // namespace parallel
}  // namespace tessera
