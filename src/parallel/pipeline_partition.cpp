#include "tessera/parallel/pipeline_partition.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>
#include <numeric>

namespace tessera {
namespace parallel {

namespace {

void check_fits(int64_t layers, int stages) {
  TORCH_CHECK(stages >= 1, "a pipeline needs at least one stage, got ", stages);
  TORCH_CHECK(layers >= stages, "a pipeline of ", stages, " stages needs at least ", stages, " layers, the model has ",
              layers, "; use fewer stages (pipeline size x chunks) or more layers");
}

}  // namespace

std::vector<int64_t> partition_by_count(int64_t layers, int stages) {
  check_fits(layers, stages);
  std::vector<int64_t> bounds(stages + 1, 0);
  for (int s = 0; s < stages; ++s) bounds[s + 1] = bounds[s] + layers / stages + (s < layers % stages ? 1 : 0);
  return bounds;
}

std::vector<int64_t> partition_by_weight(const std::vector<double>& weights, int stages) {
  const int64_t n = static_cast<int64_t>(weights.size());
  check_fits(n, stages);
  for (double w : weights) TORCH_CHECK(w >= 0, "pipeline partition: layer weights must be >= 0, got ", w);
  std::vector<double> prefix(n + 1, 0.0);
  for (int64_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + weights[i];
  // best[s][i]: the smallest largest-stage weight for the first i layers in s stages.
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(stages + 1, std::vector<double>(n + 1, inf));
  std::vector<std::vector<int64_t>> cut(stages + 1, std::vector<int64_t>(n + 1, 0));
  best[0][0] = 0;
  for (int s = 1; s <= stages; ++s) {
    for (int64_t i = s; i <= n - (stages - s); ++i) {
      for (int64_t j = s - 1; j < i; ++j) {
        const double cost = std::max(best[s - 1][j], prefix[i] - prefix[j]);
        if (cost < best[s][i]) {
          best[s][i] = cost;
          cut[s][i] = j;
        }
      }
    }
  }
  std::vector<int64_t> bounds(stages + 1, n);
  for (int s = stages; s >= 1; --s) bounds[s - 1] = cut[s][bounds[s]];
  return bounds;
}

std::vector<int64_t> partition_by_sizes(const std::vector<int64_t>& sizes, int64_t layers, int stages) {
  check_fits(layers, stages);
  TORCH_CHECK(static_cast<int>(sizes.size()) == stages, "pipeline partition: ", sizes.size(), " stage sizes given for ",
              stages, " stages (pipeline size x chunks)");
  std::vector<int64_t> bounds(stages + 1, 0);
  for (int s = 0; s < stages; ++s) {
    TORCH_CHECK(sizes[s] >= 1, "pipeline partition: stage ", s, " is given ", sizes[s], " layers; each needs >= 1");
    bounds[s + 1] = bounds[s] + sizes[s];
  }
  TORCH_CHECK(bounds[stages] == layers, "pipeline partition: the stage sizes sum to ", bounds[stages],
              " but the model has ", layers, " layers");
  return bounds;
}

}  // namespace parallel
}  // namespace tessera
