#pragma once
// Stable mixing of 64-bit seeds (SplitMix64's finalizer): the same on every
// platform and run, unlike std::hash, so that streams derived from a seed
// agree across ranks.
#include <cstdint>

namespace tessera {

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace tessera
