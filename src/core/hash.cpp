#include "tessera/core/hash.h"

#include <cstring>

namespace tessera {

uint64_t hash_bytes(const void* data, size_t n) {
  // Four independent lanes of multiply-xor over 8-byte words, so the
  // multiplies pipeline; the tail and the length go through splitmix64.
  constexpr uint64_t kPrime = 0x9fb21c651e98df25ULL;
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t lane[4] = {0x243f6a8885a308d3ULL, 0x13198a2e03707344ULL, 0xa4093822299f31d0ULL, 0x082efa98ec4e6c89ULL};
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    for (int k = 0; k < 4; ++k) {
      uint64_t w;
      std::memcpy(&w, p + i + 8 * k, 8);
      lane[k] = (lane[k] ^ w) * kPrime;
      lane[k] ^= lane[k] >> 29;
    }
  }
  uint64_t h = splitmix64(n);
  for (uint64_t l : lane) h = splitmix64(h ^ l);
  uint64_t tail = 0;
  int shift = 0;
  for (; i < n; ++i) {
    tail |= static_cast<uint64_t>(p[i]) << shift;
    shift += 8;
    if (shift == 64) {
      h = splitmix64(h ^ tail);
      tail = 0;
      shift = 0;
    }
  }
  return splitmix64(h ^ tail ^ static_cast<uint64_t>(shift));
}

}  // namespace tessera
