#include "tessera/core/process_memory.h"

#include <fstream>
#include <string>

namespace tessera {
namespace {

int64_t status_bytes(const char* key) {
  std::ifstream in("/proc/self/status");
  const std::string prefix = std::string(key) + ":";
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(prefix, 0) == 0) return std::stoll(line.substr(prefix.size())) * 1024;  // "  1234 kB"
  return -1;
}

}  // namespace

int64_t resident_bytes() { return status_bytes("VmRSS"); }
int64_t peak_resident_bytes() { return status_bytes("VmHWM"); }

}  // namespace tessera
