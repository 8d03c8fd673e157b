#include "tessera/context/parallel_context.h"

#include "tessera/comm/hierarchical_communicator.h"
#include "tessera/context/hosts.h"
#include "tessera/core/error.h"

#include <sstream>
#include <utility>

namespace tessera {
namespace context {
namespace {

// FNV-1a: the same on every rank and build, unlike std::hash.
uint64_t fnv1a(const std::string& text) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : text) {
    h ^= c;
    h *= 0x100000001b3ULL;
  }
  return h;
}

}  // namespace

ParallelContext::ParallelContext(comm::CommunicatorPtr world, RankGrid grid)
    : world_(std::move(world)), grid_(std::move(grid)), global_rank_(world_->rank()), comms_(all_modes().size()) {}

std::shared_ptr<ParallelContext> ParallelContext::create(comm::CommunicatorPtr world, const ParallelConfig& config) {
  TORCH_CHECK(world != nullptr, "ParallelContext::create needs a world communicator");
  // Throws before any communication; see Note [Context creation].
  RankGrid grid(config, world->size());
  std::shared_ptr<ParallelContext> context(new ParallelContext(world, std::move(grid)));
  const RankGrid& g = context->grid_;
  const int me = context->global_rank_;

  const std::string summary = to_string(g.config());
  const int color = static_cast<int>(fnv1a(summary) & 0x3fffffffULL);
  const comm::CommunicatorPtr same = world->split(color, me, "config_check");
  TORCH_CHECK(same != nullptr && same->size() == world->size(), "ranks disagree on the parallel ", "config: only ",
              same ? same->size() : 0, " of ", world->size(), " ranks have the config of rank ", me, " (", summary,
              ")");

  for (ParallelMode mode : all_modes()) {
    if (!g.has_mode(mode)) continue;
    if (mode == ParallelMode::kGlobal) {
      context->comms_[static_cast<size_t>(mode)] = world;
      continue;
    }
    const int key = g.local_rank(mode, me);
    comm::CommunicatorPtr group = world->split(g.group_index(mode, me), key, mode_name(mode));
    TORCH_INTERNAL_ASSERT(group != nullptr && group->size() == g.group_size(mode) && group->rank() == key,
                          "split for mode ", mode_name(mode), " gave rank ", group ? group->rank() : -1, " of ",
                          group ? group->size() : 0, ", expected ", key, " of ", g.group_size(mode));
    context->comms_[static_cast<size_t>(mode)] = std::move(group);
  }
  // Data-parallel reductions inside each host first, when the data groups
  // span hosts (Note [Reductions inside a host first]).
  const bool hierarchical = host_reductions_from_env();
  if (hierarchical && g.has_mode(ParallelMode::kData) && g.group_size(ParallelMode::kData) >= 4) {
    const HostMap hosts = map_hosts(*world);
    if (hosts.hosts() > 1) {
      auto& data = context->comms_[static_cast<size_t>(ParallelMode::kData)];
      data = comm::HierarchicalCommunicator::wrap(data, hosts.host_of_rank[static_cast<size_t>(me)]);
    }
  }
  return context;
}

comm::CommunicatorPtr ParallelContext::comm(ParallelMode mode) const {
  // group_size throws the descriptive error for a mode the grid lacks.
  grid_.group_size(mode);
  const comm::CommunicatorPtr& result = comms_[static_cast<size_t>(mode)];
  TORCH_INTERNAL_ASSERT(result != nullptr, "no communicator for mode ", mode_name(mode));
  return result;
}

int ParallelContext::rank(ParallelMode mode) const { return grid_.local_rank(mode, global_rank_); }

int ParallelContext::size(ParallelMode mode) const { return grid_.group_size(mode); }

uint64_t ParallelContext::seed(ParallelMode mode) const {
  return grid_.seed_for(mode, global_rank_, grid_.config().seed());
}

ParallelContext::Rows ParallelContext::batch_rows(int64_t global_batch) const {
  const int data = size(ParallelMode::kData);
  TORCH_CHECK(global_batch > 0 && global_batch % data == 0, "the global batch of ", global_batch,
              " rows must be divisible by the data-parallel size ", data, " (every replica trains equal rows)");
  const int64_t count = global_batch / data;
  return {rank(ParallelMode::kData) * count, count};
}

std::string ParallelContext::describe() const {
  std::ostringstream out;
  out << "backend " << world_->backend() << ", " << grid_.describe(global_rank_);
  return out.str();
}

}  // namespace context
}  // namespace tessera
