#include "tessera/parallel/spec_on_hosts.h"

#include <c10/util/Exception.h>

namespace tessera {
namespace parallel {

ShardingSpec spec_on_hosts(const ShardingSpec& spec, comm::Communicator& group) {
  if (!spec.per_host()) return spec;
  return spec_on_hosts(spec, context::map_hosts(group), group.name());
}

ShardingSpec spec_on_hosts(const ShardingSpec& spec, const context::HostMap& hosts, const std::string& group_name) {
  if (!spec.per_host()) return spec;
  const int n = static_cast<int>(hosts.host_of_rank.size());
  const int k = hosts.ranks_on(0);
  TORCH_CHECK(hosts.fewest_ranks_per_host() == k && n % k == 0 && n / k == hosts.hosts(), "sharding spec ",
              spec.to_string(), " shards inside each host, but the ", n, " ranks of group '", group_name,
              "' are spread unevenly (", hosts.describe(), "); give every host the same number of ranks, or name k");
  for (int r = 0; r < n; ++r) {
    TORCH_CHECK(hosts.host_of_rank[static_cast<size_t>(r)] == r / k, "sharding spec ", spec.to_string(),
                " shards inside each host over blocks of ", k, " consecutive ranks of group '", group_name,
                "', but its rank ", r, " is not on the host of its block (", hosts.describe(),
                "); launch ranks host by host (mpirun --map-by slot, srun --distribution=block) or name k");
  }
  return spec.on_hosts(k);
}

}  // namespace parallel
}  // namespace tessera
