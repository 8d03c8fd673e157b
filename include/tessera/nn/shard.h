#pragma once
// Even sharding of one tensor dimension over the ranks of a tensor-parallel
// group, shared by every 1D layer: which slice a rank holds, padding of sizes
// that may be padded (vocabularies), the clear rejection of sizes that may
// not (hidden sizes), and full <-> shard conversion of weights.
#include "tessera/comm/communicator.h"
#include "tessera/nn/placement.h"

#include <cstdint>
#include <string>
#include <vector>

namespace tessera {
namespace nn {

// Throws "<what> (<size>) is not divisible by the tensor-parallel size <n>; <hint>"
// unless size % n == 0.
void check_divisible(int64_t size, int64_t n, const std::string& what, const std::string& hint);

// The smallest multiple of n that is >= size.
int64_t pad_to_multiple(int64_t size, int64_t n);

// This rank's slice of a full tensor along dim (size divisible by the group
// size), contiguous and detached: how a layer loads its shard from full weights.
at::Tensor shard_of(const at::Tensor& full, int64_t dim, const comm::Communicator& group);

// The full tensor from every rank's shard along dim (collective over group):
// how a layer gives back its full weights.
at::Tensor unshard(const at::Tensor& shard, int64_t dim, const comm::Communicator& group);

}  // namespace nn
}  // namespace tessera
