#include "tessera/core/async_file.h"

#include "tessera/core/error.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace tessera {
namespace detail {

struct IoState {
  std::mutex mutex;
  std::condition_variable done;
  int remaining = 0;
  std::string error;  // the first part's failure
  std::chrono::steady_clock::time_point submitted = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point finished = submitted;
};

struct FilePool {
  int fd = -1;
  std::string path;
  bool direct = false;
  std::mutex mutex;
  std::condition_variable wake;
  std::condition_variable idle;
  std::deque<std::function<void()>> jobs;
  int running = 0;
  bool stopping = false;
  std::vector<std::thread> threads;

  FilePool(int fd_, std::string path_, AsyncFileOptions options) : fd(fd_), path(std::move(path_)), direct(options.direct) {
    for (int i = 0; i < options.threads; ++i) threads.emplace_back([this] { work(); });
  }
  ~FilePool() {
    {
      std::unique_lock<std::mutex> lock(mutex);
      idle.wait(lock, [&] { return jobs.empty() && running == 0; });
      stopping = true;
    }
    wake.notify_all();
    for (auto& t : threads) t.join();
    if (fd >= 0) ::close(fd);
  }
  void work() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lock(mutex);
        wake.wait(lock, [&] { return stopping || !jobs.empty(); });
        if (jobs.empty()) return;
        job = std::move(jobs.front());
        jobs.pop_front();
        ++running;
      }
      job();
      {
        std::lock_guard<std::mutex> lock(mutex);
        --running;
      }
      idle.notify_all();
    }
  }
  void post(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      jobs.push_back(std::move(job));
    }
    wake.notify_one();
  }
};

}  // namespace detail

namespace {

std::string errno_text(int err) { return std::string(std::strerror(err)); }

void check_directory(const std::string& dir) {
  struct stat st {};
  TORCH_CHECK(!dir.empty(), "AsyncFile: the directory is empty; pass a directory on a local disk");
  TORCH_CHECK(::stat(dir.c_str(), &st) == 0, "AsyncFile: directory '", dir, "' cannot be used: ", errno_text(errno),
              "; create it first or pass another directory");
  TORCH_CHECK(S_ISDIR(st.st_mode), "AsyncFile: '", dir, "' is not a directory");
}

int open_flags(bool direct) { return direct ? O_DIRECT : 0; }

void check_aligned(const detail::FilePool& pool, const void* buffer, int64_t bytes, int64_t offset) {
  if (!pool.direct) return;
  const auto address = reinterpret_cast<uintptr_t>(buffer);
  TORCH_CHECK(address % kDirectAlignment == 0 && bytes % kDirectAlignment == 0 && offset % kDirectAlignment == 0,
              "AsyncFile: direct I/O on '", pool.path, "' needs buffer address, size and offset aligned to ",
              kDirectAlignment, " bytes; got address ", address, ", size ", bytes, ", offset ", offset);
}

// One part of a request: loops over short transfers, which the kernel may
// return for large sizes; a read past the end is a truncated file.
std::string transfer(int fd, char* buffer, int64_t bytes, int64_t offset, bool write, const std::string& path) {
  int64_t done = 0;
  while (done < bytes) {
    const ssize_t n = write ? ::pwrite(fd, buffer + done, static_cast<size_t>(bytes - done), offset + done)
                            : ::pread(fd, buffer + done, static_cast<size_t>(bytes - done), offset + done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0)
      return (write ? "writing " : "reading ") + std::to_string(bytes - done) + " bytes at offset " +
             std::to_string(offset + done) + " of '" + path + "' failed: " + errno_text(errno);
    if (n == 0)
      return "'" + path + "' is truncated: reading " + std::to_string(bytes) + " bytes at offset " +
             std::to_string(offset) + " found the end of the file after " + std::to_string(done);
    done += n;
  }
  return {};
}

}  // namespace

void IoWork::wait() const {
  if (!state_) return;
  std::unique_lock<std::mutex> lock(state_->mutex);
  state_->done.wait(lock, [&] { return state_->remaining == 0; });
  TORCH_CHECK(state_->error.empty(), "AsyncFile: ", state_->error);
}

bool IoWork::completed() const {
  if (!state_) return true;
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->remaining == 0;
}

std::chrono::steady_clock::time_point IoWork::submitted_at() const {
  if (!state_) return {};
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->submitted;
}

std::chrono::steady_clock::time_point IoWork::finished_at() const {
  if (!state_) return {};
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->finished;
}

AsyncFile::AsyncFile(std::unique_ptr<detail::FilePool> pool) : pool_(std::move(pool)) {}
AsyncFile::AsyncFile(AsyncFile&&) noexcept = default;
AsyncFile& AsyncFile::operator=(AsyncFile&&) noexcept = default;
AsyncFile::~AsyncFile() = default;

AsyncFile AsyncFile::create_temporary(const std::string& dir, const std::string& prefix, AsyncFileOptions options) {
  TORCH_CHECK(options.threads >= 1, "AsyncFile: threads must be >= 1, got ", options.threads);
  check_directory(dir);
  std::string name = dir + "/tessera-" + prefix + "-XXXXXX";
  std::vector<char> buffer(name.begin(), name.end());
  buffer.push_back('\0');
  const int fd = ::mkostemp(buffer.data(), O_CLOEXEC);
  TORCH_CHECK(fd >= 0, "AsyncFile: cannot create a file in '", dir, "': ", errno_text(errno));
  name.assign(buffer.data());
  ::unlink(name.c_str());
  if (options.direct) {
    const int flags = ::fcntl(fd, F_GETFL);
    if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_DIRECT) != 0) {
      const int err = errno;
      ::close(fd);
      TORCH_CHECK(false, "AsyncFile: the file system of '", dir, "' refuses direct I/O (O_DIRECT): ", errno_text(err),
                  "; turn direct I/O off or use a directory on a disk file system");
    }
  }
  return AsyncFile(std::make_unique<detail::FilePool>(fd, name, options));
}

AsyncFile AsyncFile::open_read(const std::string& path, AsyncFileOptions options) {
  TORCH_CHECK(options.threads >= 1, "AsyncFile: threads must be >= 1, got ", options.threads);
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | open_flags(options.direct));
  if (fd < 0 && options.direct && errno == EINVAL)
    TORCH_CHECK(false, "AsyncFile: the file system of '", path, "' refuses direct I/O (O_DIRECT); turn direct I/O off");
  TORCH_CHECK(fd >= 0, "AsyncFile: cannot open '", path, "': ", errno_text(errno));
  return AsyncFile(std::make_unique<detail::FilePool>(fd, path, options));
}

namespace {

std::shared_ptr<detail::IoState> submit(detail::FilePool& pool, char* buffer, int64_t bytes, int64_t offset,
                                        bool write) {
  TORCH_CHECK(bytes >= 0 && offset >= 0, "AsyncFile: negative size ", bytes, " or offset ", offset);
  auto state = std::make_shared<detail::IoState>();
  if (bytes == 0) return state;
  // Split between the threads in aligned parts of at least 1 MiB.
  const int64_t min_part = int64_t(1) << 20;
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(static_cast<int64_t>(pool.threads.size()), bytes / min_part));
  int64_t part = (bytes + parts - 1) / parts;
  part = (part + kDirectAlignment - 1) / kDirectAlignment * kDirectAlignment;
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (int64_t begin = 0; begin < bytes; begin += part) ranges.emplace_back(begin, std::min(part, bytes - begin));
  state->remaining = static_cast<int>(ranges.size());
  for (const auto& [begin, size] : ranges) {
    pool.post([&pool, state, buffer, begin = begin, size = size, offset, write] {
      std::string error = transfer(pool.fd, buffer + begin, size, offset + begin, write, pool.path);
      {
        std::lock_guard<std::mutex> lock(state->mutex);
        if (!error.empty() && state->error.empty()) state->error = std::move(error);
        if (--state->remaining == 0) state->finished = std::chrono::steady_clock::now();
      }
      state->done.notify_all();
    });
  }
  return state;
}

}  // namespace

IoWork AsyncFile::read(void* dst, int64_t bytes, int64_t offset) {
  check_aligned(*pool_, dst, bytes, offset);
  return IoWork(submit(*pool_, static_cast<char*>(dst), bytes, offset, /*write=*/false));
}

IoWork AsyncFile::read_batch(const std::vector<IoRequest>& requests) {
  auto state = std::make_shared<detail::IoState>();
  int64_t total = 0;
  for (const auto& r : requests) {
    TORCH_CHECK(r.bytes >= 0 && r.offset >= 0, "AsyncFile: negative size ", r.bytes, " or offset ", r.offset);
    check_aligned(*pool_, r.buffer, r.bytes, r.offset);
    total += r.bytes;
  }
  if (total == 0) return IoWork(state);
  // Consecutive requests, cut into parts of about total / threads bytes.
  const auto threads = static_cast<int64_t>(pool_->threads.size());
  const int64_t share = (total + threads - 1) / threads;
  std::vector<std::vector<IoRequest>> parts(1);
  int64_t in_part = 0;
  for (const auto& r : requests) {
    if (in_part >= share) parts.emplace_back(), in_part = 0;
    parts.back().push_back(r);
    in_part += r.bytes;
  }
  state->remaining = static_cast<int>(parts.size());
  detail::FilePool& pool = *pool_;
  for (auto& part : parts) {
    pool.post([&pool, state, part = std::move(part)] {
      std::string error;
      for (const auto& r : part) {
        error = transfer(pool.fd, static_cast<char*>(r.buffer), r.bytes, r.offset, /*write=*/false, pool.path);
        if (!error.empty()) break;
      }
      {
        std::lock_guard<std::mutex> lock(state->mutex);
        if (!error.empty() && state->error.empty()) state->error = std::move(error);
        if (--state->remaining == 0) state->finished = std::chrono::steady_clock::now();
      }
      state->done.notify_all();
    });
  }
  return IoWork(state);
}

IoWork AsyncFile::write(const void* src, int64_t bytes, int64_t offset) {
  check_aligned(*pool_, src, bytes, offset);
  return IoWork(submit(*pool_, const_cast<char*>(static_cast<const char*>(src)), bytes, offset, /*write=*/true));
}

void AsyncFile::reserve(int64_t offset, int64_t bytes) {
  if (bytes <= 0) return;
  const int err = ::posix_fallocate(pool_->fd, offset, bytes);
  TORCH_CHECK(err == 0, "AsyncFile: cannot reserve ", bytes, " bytes at offset ", offset, " of '", pool_->path,
              "': ", errno_text(err), "; free disk space or choose another directory");
}

void AsyncFile::drop_cache(int64_t offset, int64_t bytes) {
  const int err = ::posix_fadvise(pool_->fd, offset, bytes, POSIX_FADV_DONTNEED);
  TORCH_CHECK(err == 0, "AsyncFile: cannot drop the cached pages of '", pool_->path, "': ", errno_text(err));
}

int64_t AsyncFile::size() const {
  struct stat st {};
  TORCH_CHECK(::fstat(pool_->fd, &st) == 0, "AsyncFile: cannot stat '", pool_->path, "': ", errno_text(errno));
  return static_cast<int64_t>(st.st_size);
}

const std::string& AsyncFile::path() const { return pool_->path; }
bool AsyncFile::direct() const { return pool_->direct; }

}  // namespace tessera
