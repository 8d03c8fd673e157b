// ShardedOptimizer's optimizer states and masters on disk (Note [Disk
// offload] in tessera/parallel/sharded_optimizer.h): the tiles, the file,
// and moving the tiles between it and memory (the I/O itself is
// TileSwapper's, src/parallel/tile_swapper.h).
#include "tessera/parallel/sharded_optimizer.h"

#include "tessera/comm/agree.h"
#include "tessera/core/async_file.h"
#include "tessera/core/optimizer_state.h"
#include "tessera/parallel/flat_bucket.h"

#include "tile_swapper.h"

#include <algorithm>

namespace tessera {
namespace parallel {

// Tiles of pieces, a master per tile where one is needed (not for fp32
// chunks on the CPU, which the tile's pieces are views of).
std::vector<int64_t> ShardedOptimizer::place_tiles(const std::vector<Range>& ranges, int64_t tile_elems) {
  for (size_t b = 0; b < module_->num_buckets(); ++b) {
    std::vector<size_t> order;
    for (size_t i = 0; i < ranges.size(); ++i)
      if (ranges[i].bucket == b) order.push_back(i);
    std::sort(order.begin(), order.end(), [&](size_t x, size_t y) { return ranges[x].begin < ranges[y].begin; });
    for (size_t i : order) {
      if (tiles_.empty() || tiles_.back().bucket != b || ranges[i].end - tiles_.back().begin > tile_elems)
        tiles_.push_back(Tile{b, ranges[i].begin, ranges[i].end, -1, {}});
      tiles_.back().end = ranges[i].end;
      tiles_.back().pieces.push_back(i);
    }
  }
  std::vector<int64_t> master_of(ranges.size(), -1);
  for (auto& tile : tiles_) {
    const at::Tensor chunk = module_->bucket(tile.bucket).param_chunk(optim_degree(tile.bucket));
    if (chunk.scalar_type() == options_.master_dtype() && chunk.device().is_cpu()) continue;
    tile.master = add_master(tile.bucket, tile.begin, tile.end - tile.begin);
    for (size_t i : tile.pieces) master_of[i] = tile.master;
  }
  return master_of;
}

void ShardedOptimizer::open_disk() {
  const DiskOffloadOptions& disk = options_.disk();
  bool pinned = false;
  for (size_t b = 0; b < module_->num_buckets(); ++b) pinned |= module_->bucket(b).device().is_cuda();
  AsyncFileOptions io;
  io.threads = disk.io_threads();
  io.direct = disk.direct_io();
  on_every_rank([&] {
    auto file = AsyncFile::create_temporary(disk.dir(), "optim-rank" + std::to_string(module_->group()->rank()), io);
    swapper_ = std::make_unique<detail::TileSwapper>(std::move(file), tiles_.size(), disk.buffers(), pinned,
                                                     [this](size_t t) { return tile_tensors(t); });
    swapper_->park();  // the master copies go to the file now; states follow at the first step
  });
}

void ShardedOptimizer::on_every_rank(const std::function<void()>& fn) {
  comm::on_every_rank(module_->group(), "ShardedOptimizer: disk offload", fn);
}

std::vector<at::Tensor> ShardedOptimizer::tile_tensors(size_t tile) {
  const Tile& t = tiles_[tile];
  std::vector<at::Tensor> out;
  if (t.master >= 0) out.push_back(masters_[static_cast<size_t>(t.master)].master);
  for (size_t i : t.pieces) {
    const torch::optim::OptimizerParamState* state = find_state(*optimizer_, pieces_[i].param);
    if (state == nullptr) continue;  // before its first step
    bool known = false;
    for (auto& s : libtorch_state_tensors(*state, known)) out.push_back(s);
    TORCH_CHECK(known, "ShardedOptimizer: disk offload knows the states of Adam, AdamW, SGD, RMSprop and Adagrad; "
                       "this optimizer's are of another type; use offload(Offload::kHost) (CPU memory)");
  }
  return out;
}

void ShardedOptimizer::fetch_offloaded() {
  if (swapper_) on_every_rank([&] { swapper_->fetch(); });
}

void ShardedOptimizer::park_offloaded() {
  if (swapper_) on_every_rank([&] { swapper_->park(); });
}

int64_t ShardedOptimizer::disk_bytes() const { return swapper_ ? swapper_->file_bytes() : 0; }

}  // namespace parallel
}  // namespace tessera
