#pragma once
// The names of flight record files (Note [Flight recorder]), shared by the
// recorder and its reader. Internal to comm/.
#include <cstdio>
#include <cstring>

namespace tessera {
namespace comm {
namespace detail {

// True, with the world rank, for "flight-rank-R.json" exactly (a writer's
// "flight-rank-R.json.tmp" is not a record yet).
inline bool parse_record_name(const char* name, int* rank) {
  char tail[8] = {0};
  return std::sscanf(name, "flight-rank-%d.%5s", rank, tail) == 2 && std::strcmp(tail, "json") == 0;
}

}  // namespace detail
}  // namespace comm
}  // namespace tessera
