#include "tile_swapper.h"

#include "storage.h"

#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>

#include <cstring>

namespace tessera {
namespace parallel {
namespace detail {
namespace {

constexpr int64_t kEntryAlignment = 64;

int64_t align_up(int64_t value, int64_t alignment) { return (value + alignment - 1) / alignment * alignment; }

c10::StorageImpl* storage_of(const at::Tensor& t) { return t.storage().unsafeGetStorageImpl(); }

const char* data_of(const at::Tensor& t) {
  return static_cast<const char*>(static_cast<const c10::StorageImpl*>(storage_of(t))->data_ptr().get());
}

int64_t bytes_of(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

// Points t's storage at memory it does not own.
void bind_to(const at::Tensor& t, char* memory, int64_t nbytes) {
  c10::StorageImpl* impl = storage_of(t);
  impl->set_data_ptr_noswap(at::DataPtr(memory, t.device()));
  impl->set_nbytes(nbytes);
}

// Gives t memory of its own holding `from`'s bytes.
void own_copy(const at::Tensor& t, const char* from, int64_t nbytes) {
  c10::StorageImpl* impl = storage_of(t);
  at::DataPtr mine = impl->allocator()->allocate(nbytes);
  std::memcpy(mine.get(), from, static_cast<size_t>(nbytes));
  impl->set_data_ptr_noswap(std::move(mine));
  impl->set_nbytes(nbytes);
}

}  // namespace

TileSwapper::TileSwapper(AsyncFile file, size_t tiles, int slots, bool pinned, TensorsOf tensors_of)
    : file_(std::move(file)), tensors_of_(std::move(tensors_of)), records_(tiles), pinned_(pinned) {
  TORCH_CHECK(slots >= 1, "disk offload: buffers must be >= 1, got ", slots);
  slots_.resize(static_cast<size_t>(slots));
}

TileSwapper::~TileSwapper() {
  try {
    drain();
  } catch (...) {  // destructors do not throw; the error was or will be seen by wait() elsewhere
  }
}

std::vector<at::Tensor> TileSwapper::tensors(size_t tile) const {
  std::vector<at::Tensor> out;
  for (auto& t : tensors_of_(tile)) {
    if (!t.defined() || t.numel() == 0) continue;
    TORCH_INTERNAL_ASSERT(t.device().is_cpu() && t.is_contiguous() && t.storage_offset() == 0,
                          "disk offload: tile tensors must be contiguous CPU tensors owning their storage");
    out.push_back(t);
  }
  return out;
}

bool TileSwapper::in_slot(const Slot& slot, const at::Tensor& t) const {
  const char* p = data_of(t);
  return slot.base != nullptr && p >= slot.base && p < slot.base + slot.capacity;
}

void TileSwapper::grow(Slot& slot, int64_t bytes) {
  if (bytes <= slot.capacity) return;
  for (const auto& t : slot.bound) TORCH_INTERNAL_ASSERT(!in_slot(slot, t), "disk offload: growing a slot in use");
  slot.memory = at::empty({bytes + kDirectAlignment}, at::TensorOptions().dtype(at::kByte).pinned_memory(pinned_));
  const auto address = reinterpret_cast<uintptr_t>(slot.memory.data_ptr());
  slot.base = reinterpret_cast<char*>(align_up(static_cast<int64_t>(address), kDirectAlignment));
  slot.capacity = bytes;
}

void TileSwapper::unbind_all(Slot& slot) {
  for (const auto& t : slot.bound)
    if (in_slot(slot, t)) own_copy(t, data_of(t), bytes_of(t));
  slot.bound.clear();
}

void TileSwapper::acquire(Slot& slot, size_t tile) {
  slot.write.wait();
  slot.read.wait();
  for (const auto& t : slot.bound)
    if (in_slot(slot, t)) release_storage(t);
  slot.bound.clear();
  const Record& record = records_[tile];
  slot.read = IoWork();
  if (record.bytes == 0) return;
  grow(slot, record.bytes);
  slot.read = file_.read(slot.base, record.bytes, record.file_offset);
}

void TileSwapper::bind(Slot& slot, size_t tile) {
  slot.read.wait();
  const Record& record = records_[tile];
  for (const auto& t : tensors(tile)) {
    if (storage_of(t)->nbytes() != 0) continue;  // memory of its own: newer than the file
    const Entry* entry = nullptr;
    for (const auto& e : record.entries)
      if (e.storage == storage_of(t)) entry = &e;
    TORCH_INTERNAL_ASSERT(entry != nullptr && entry->nbytes == bytes_of(t),
                          "disk offload: a released tensor of tile ", tile, " has no place in its record");
    bind_to(t, slot.base + entry->offset, entry->nbytes);
    slot.bound.push_back(t);
  }
}

void TileSwapper::store(Slot& slot, size_t tile) {
  const std::vector<at::Tensor> ts = tensors(tile);
  std::vector<Entry> entries;
  int64_t end = 0;
  for (const auto& t : ts) {
    entries.push_back(Entry{storage_of(t), end, bytes_of(t)});
    end = align_up(end + bytes_of(t), kEntryAlignment);
  }
  const int64_t total = align_up(end, kDirectAlignment);
  if (total > slot.capacity) {
    unbind_all(slot);
    grow(slot, total);
  }
  // Tensors already in the slot at another place get memory of their own
  // first, so that copying the others in overwrites nothing still needed.
  for (size_t i = 0; i < ts.size(); ++i)
    if (in_slot(slot, ts[i]) && data_of(ts[i]) != slot.base + entries[i].offset)
      own_copy(ts[i], data_of(ts[i]), entries[i].nbytes);
  for (size_t i = 0; i < ts.size(); ++i) {
    if (in_slot(slot, ts[i])) continue;
    char* place = slot.base + entries[i].offset;
    std::memcpy(place, data_of(ts[i]), static_cast<size_t>(entries[i].nbytes));
    bind_to(ts[i], place, entries[i].nbytes);  // frees the tensor's own memory
  }
  slot.bound = ts;
  Record& record = records_[tile];
  record.entries = std::move(entries);
  record.bytes = total;
  if (total > record.capacity) {  // a new place at the end of the file (first steps only)
    file_.reserve(file_end_, total);
    record.file_offset = file_end_;
    record.capacity = total;
    file_end_ += total;
  }
  if (total > 0) slot.write = file_.write(slot.base, total, record.file_offset);
}

void TileSwapper::drain() {
  std::string error;
  for (auto& slot : slots_) {
    for (const IoWork* w : {&slot.read, &slot.write}) {
      try {
        w->wait();
      } catch (const std::exception& e) {
        if (error.empty()) error = e.what();
      }
    }
    slot.read = IoWork();
    slot.write = IoWork();
    for (const auto& t : slot.bound)
      if (in_slot(slot, t)) release_storage(t);
    slot.bound.clear();
  }
  TORCH_CHECK(error.empty(), error);
}

void TileSwapper::run(const std::function<void(size_t)>& work) {
  TORCH_CHECK(broken_.empty(), "disk offload: an earlier step failed (", broken_,
              "), so the states in '", file_.path(),
              "' no longer match the model; load a checkpoint into a new optimizer to go on");
  const size_t n = records_.size(), k = slots_.size();
  const size_t ahead = k >= 3 ? k - 2 : 0;  // tiles read ahead of the one working
  try {
    size_t acquired = 0;
    for (size_t t = 0; t < n; ++t) {
      for (; acquired < n && acquired <= t + ahead; ++acquired) acquire(slots_[acquired % k], acquired);
      Slot& slot = slots_[t % k];
      bind(slot, t);
      work(t);
      store(slot, t);
    }
    drain();
  } catch (const std::exception& e) {
    const auto* error = dynamic_cast<const c10::Error*>(&e);
    broken_ = error != nullptr ? error->msg() : e.what();
    try {
      drain();
    } catch (...) {  // the first error is the one reported
    }
    throw;
  }
  parked_ = true;
}

void TileSwapper::fetch() {
  TORCH_CHECK(broken_.empty(), "disk offload: an earlier step failed (", broken_, "); the states on disk are lost");
  Slot& slot = slots_[0];
  for (size_t tile = 0; tile < records_.size(); ++tile) {
    acquire(slot, tile);
    slot.read.wait();
    for (const auto& t : tensors(tile)) {
      if (storage_of(t)->nbytes() != 0) continue;
      for (const auto& e : records_[tile].entries)
        if (e.storage == storage_of(t)) own_copy(t, slot.base + e.offset, e.nbytes);
      TORCH_INTERNAL_ASSERT(storage_of(t)->nbytes() != 0, "disk offload: a released tensor of tile ", tile,
                            " has no place in its record");
    }
  }
  parked_ = false;
}

int64_t TileSwapper::buffer_bytes() const {
  int64_t bytes = 0;
  for (const auto& s : slots_) bytes += s.capacity;
  return bytes;
}

}  // namespace detail
}  // namespace parallel
}  // namespace tessera
