#pragma once
// Cutting a sequence of layers into pipeline stages: contiguous ranges, by
// layer count, by a weight per layer (parameter count, measured time) or by
// an explicit list of sizes. A partition is the list of stage boundaries:
// stage s holds layers [bounds[s], bounds[s + 1]).
#include <cstdint>
#include <vector>

namespace tessera {
namespace parallel {

// As even as possible; earlier stages take the remainder.
std::vector<int64_t> partition_by_count(int64_t layers, int stages);
// Minimizes the largest stage's total weight (exact, by dynamic programming).
std::vector<int64_t> partition_by_weight(const std::vector<double>& weights, int stages);
// Stage sizes given by the user: each >= 1, summing to `layers`.
std::vector<int64_t> partition_by_sizes(const std::vector<int64_t>& sizes, int64_t layers, int stages);

}  // namespace parallel
}  // namespace tessera
