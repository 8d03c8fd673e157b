#pragma once
// Stable mixing of 64-bit seeds (SplitMix64's finalizer): the same on every
// platform and run, unlike std::hash, so that streams derived from a seed
// agree across ranks.
#include <cstddef>
#include <cstdint>

namespace tessera {

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// A 64-bit checksum of n bytes: the same on every run and little-endian
// machine, several GB/s, not cryptographic. Safetensors files written by tessera carry one
// per tensor, so a damaged file is refused rather than loaded.
uint64_t hash_bytes(const void* data, size_t n);

}  // namespace tessera
