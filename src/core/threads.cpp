#include "tessera/core/threads.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <dlfcn.h>

namespace tessera {

bool limit_threads(int threads) {
  TORCH_CHECK(threads >= 1, "limit_threads: thread count must be at least 1, got ", threads);
  at::set_num_threads(threads);
  // Looked up at run time: which BLAS libblas.so.3 resolves to is a property
  // of the machine (Debian's alternatives), not of the build.
  using SetThreads = void (*)(int);
  auto set_blas = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  if (set_blas == nullptr) return false;
  set_blas(threads);
  return true;
}

}  // namespace tessera
