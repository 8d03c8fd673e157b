#include "tessera/core/remove_tree.h"

#include <ftw.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

namespace tessera {

// Note [remove_all under LibTorch 2.11]
// PyTorch 2.11's wheel exports its own copy of libstdc++'s std::filesystem
// from libtorch.so, unversioned. A program links libtorch before libstdc++,
// so both the linker and the loader bind std::filesystem calls to that
// copy, and its remove_all(path, error_code&) jumps to a null address: every
// checkpoint save crashed (seen on 2.11.0 built with GCC 12; 2.15 exports
// none). The other std::filesystem calls tessera makes work there; this one
// is done with POSIX nftw instead, depth first, links not followed.

namespace {

int remove_entry(const char* path, const struct stat*, int, struct FTW*) {
  return std::remove(path) == 0 ? 0 : errno;
}

}  // namespace

bool remove_tree(const std::string& path, std::string* error) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return true;
    if (error != nullptr) *error = std::strerror(errno);
    return false;
  }
  const int rc = ::nftw(path.c_str(), remove_entry, 16, FTW_DEPTH | FTW_PHYS);
  if (rc == 0) return true;
  if (error != nullptr) *error = std::strerror(rc > 0 ? rc : errno);
  return false;
}

}  // namespace tessera
