#pragma once
// Small arithmetic the planner's traffic and memory models share.
#include "tessera/context/parallel_config.h"
#include "tessera/context/rank_grid.h"

#include <cmath>
#include <cstdint>
#include <string>

namespace tessera {
namespace planner {
namespace detail {

inline std::string mode_group(context::ParallelMode m) { return context::mode_name(m); }

inline int64_t pad_to(int64_t n, int64_t k) { return (n + k - 1) / k * k; }

// q of the 2d (tp = q²), 2.5d (tp = q²·d) and 3d (tp = q³) arrangements; tp for 1d.
inline int grid_q(const context::ParallelConfig& c) {
  const int tp = c.tensor();
  switch (c.tensor_mode()) {
    case context::TensorMode::k2D:
      return static_cast<int>(std::lround(std::sqrt(tp)));
    case context::TensorMode::k2p5D:
      return static_cast<int>(std::lround(std::sqrt(tp / c.tensor_depth())));
    case context::TensorMode::k3D:
      return static_cast<int>(std::lround(std::cbrt(tp)));
    default:
      return tp;
  }
}

// What one rank's share of a [rows, hidden] matrix is divided by: tp, but
// 2.5d replicates matrices over its depth.
inline int matrix_split(const context::ParallelConfig& c) {
  return c.tensor_mode() == context::TensorMode::k2p5D ? c.tensor() / c.tensor_depth() : c.tensor();
}

// The unit the vocabulary is padded to: tp in 1d, q otherwise.
inline int vocab_unit(const context::ParallelConfig& c) { return grid_q(c); }

}  // namespace detail
}  // namespace planner
}  // namespace tessera
