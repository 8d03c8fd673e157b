#pragma once
// Small arithmetic the planner's traffic and memory models share.
#include "tessera/context/parallel_config.h"
#include "tessera/context/rank_grid.h"

#include <cstdint>
#include <string>

namespace tessera {
namespace planner {
namespace detail {

inline std::string mode_group(context::ParallelMode m) { return context::mode_name(m); }

inline int64_t pad_to(int64_t n, int64_t k) { return (n + k - 1) / k * k; }

// The grid of a plan's (resolved) config: q, the batch and hidden blocks,
// the vocabulary unit and the token group come from it (Note [Layout
// arithmetic] in tessera/context/rank_grid.h).
inline context::RankGrid rank_grid(const context::ParallelConfig& c) {
  return context::RankGrid(c, c.data() * c.pipeline() * c.tensor() * c.sequence());
}

}  // namespace detail
}  // namespace planner
}  // namespace tessera
