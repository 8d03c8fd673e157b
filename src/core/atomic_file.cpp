#include "tessera/core/atomic_file.h"

#include <c10/util/Exception.h>

#include <cstdio>
#include <fstream>

namespace tessera {

void write_file_atomically(const std::string& path, const std::string& text, const WriteHook& hook) {
  const std::string tmp = path + ".tmp";
  bool ok = false;
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    TORCH_CHECK(f.good(), "cannot write ", tmp, "; is the directory there and writable?");
    const auto total = static_cast<int64_t>(text.size());
    const int64_t half = hook ? total / 2 : total;
    f.write(text.data(), static_cast<std::streamsize>(half));
    if (hook) {
      f.flush();
      hook(f, half, total);
      f.write(text.data() + half, static_cast<std::streamsize>(total - half));
    }
    f.flush();
    ok = f.good();
  }
  if (!ok) {
    std::remove(tmp.c_str());
    TORCH_CHECK(false, "writing ", text.size(), " bytes to ", tmp, " failed (is the disk full?); ", path,
                " was left as it was");
  }
  TORCH_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, "cannot rename ", tmp, " to ", path);
}

}  // namespace tessera
