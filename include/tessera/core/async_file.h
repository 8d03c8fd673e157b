#pragma once
// AsyncFile: positional reads and writes of one file on a small pool of I/O
// threads, so that disk traffic overlaps compute (disk offload of optimizer
// states, weights streamed for inference; docs/offload.md).
//
//   auto file = AsyncFile::create_temporary("/scratch", "optim-r0", {});
//   file.reserve(0, bytes);                 // disk space now, or a clear error
//   IoWork w = file.write(buffer, bytes, 0);
//   ...                                     // compute while the threads write
//   w.wait();                               // rethrows an I/O error
//
// Note [Direct I/O]
// With AsyncFileOptions::direct, the file is opened with O_DIRECT: reads and
// writes bypass the page cache, so streaming gigabytes through a bounded
// buffer neither grows the cache nor evicts the job's other pages. The
// kernel then requires buffers, offsets and sizes aligned to the device's
// block; callers align to kDirectAlignment (4096), and a request that is
// not aligned is refused with the values. A file system without O_DIRECT
// (tmpfs) refuses the open, and the error says so.
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace tessera {

constexpr int64_t kDirectAlignment = 4096;

struct AsyncFileOptions {
  int threads = 2;      // I/O threads; a request is split between them
  bool direct = false;  // O_DIRECT (Note [Direct I/O])
};

namespace detail {
struct IoState;
struct FilePool;
}  // namespace detail

// One read or write in flight. wait() blocks until every part of it is
// done and rethrows the first error (short read, ENOSPC, EIO) as c10::Error
// naming the file, offset and size; it may be called again. A default
// IoWork is complete.
class IoWork {
 public:
  IoWork() = default;
  void wait() const;
  bool completed() const;
  // When the request was submitted, and when its last part finished (valid
  // once completed): what a caller that overlaps I/O with compute measures
  // its reads by.
  std::chrono::steady_clock::time_point submitted_at() const;
  std::chrono::steady_clock::time_point finished_at() const;

 private:
  friend class AsyncFile;
  explicit IoWork(std::shared_ptr<detail::IoState> state) : state_(std::move(state)) {}
  std::shared_ptr<detail::IoState> state_;
};

// One read of a batch (AsyncFile::read_batch).
struct IoRequest {
  void* buffer = nullptr;
  int64_t bytes = 0;
  int64_t offset = 0;
};

class AsyncFile {
 public:
  // A new file in `dir` that nobody else sees: it is unlinked at once, so
  // it disappears with the process, however the process ends.
  static AsyncFile create_temporary(const std::string& dir, const std::string& prefix, AsyncFileOptions options);
  // An existing file, read only.
  static AsyncFile open_read(const std::string& path, AsyncFileOptions options);

  AsyncFile(AsyncFile&&) noexcept;
  AsyncFile& operator=(AsyncFile&&) noexcept;
  // Waits for the requests in flight, then closes the file.
  ~AsyncFile();

  // The buffer must stay alive and untouched until the work completes.
  IoWork read(void* dst, int64_t bytes, int64_t offset);
  IoWork write(const void* src, int64_t bytes, int64_t offset);
  // Many small reads as one work: the requests are dealt to at most
  // `threads` jobs of about equal bytes, each reading its own in turn, so
  // scattered reads (a shard's rows) do not cost a job each.
  IoWork read_batch(const std::vector<IoRequest>& requests);
  // Allocates [offset, offset + bytes) on the disk now (posix_fallocate), so
  // a full disk is reported here rather than by a later write.
  void reserve(int64_t offset, int64_t bytes);

  int64_t size() const;
  // Asks the kernel to drop [offset, offset + bytes) from the page cache
  // (posix_fadvise DONTNEED), so that the next read of it goes to the disk.
  void drop_cache(int64_t offset, int64_t bytes);
  const std::string& path() const;
  bool direct() const;

 private:
  explicit AsyncFile(std::unique_ptr<detail::FilePool> pool);
  std::unique_ptr<detail::FilePool> pool_;
};

}  // namespace tessera
