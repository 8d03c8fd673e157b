#pragma once
// Initialization that does not depend on the parallel layout and never
// materializes a full tensor.
//
// Note [Layout-independent initialization]
// The full tensor of a parameter is cut into blocks of whole rows along
// dimension 0 (about kInitBlockElements elements each, at least one row);
// block i is drawn from its own generator, seeded from (seed, parameter
// name, i). A rank draws only the blocks that overlap its region
// (ParamPlacement) and copies the overlap, so its peak at initialization is
// its shard plus one block, and every layout (serial included) gets the same
// full tensor from the same seed.
#include "tessera/nn/placement.h"

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>

namespace tessera {
namespace nn {

constexpr int64_t kInitBlockElements = int64_t(1) << 16;

// Fills a block in place from the generator.
using BlockDraw = std::function<void(at::Tensor& block, at::Generator& gen)>;

// Fills p.param's region (padding zeroed) as Note [Layout-independent initialization] says.
void init_blockwise(const ParamPlacement& p, uint64_t seed, const std::string& name, const BlockDraw& draw);
BlockDraw normal_draw(double mean, double std);
BlockDraw uniform_draw(double low, double high);

// A seed drawn from the default CPU generator (the same on every rank that
// seeded it alike), for layers initialized blockwise.
uint64_t draw_seed();

}  // namespace nn
}  // namespace tessera
