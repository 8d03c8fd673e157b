#pragma once
// P(host) made concrete: the data group's ranks on one host.
#include "tessera/comm/communicator.h"
#include "tessera/context/hosts.h"
#include "tessera/parallel/sharding_spec.h"

#include <string>

namespace tessera {
namespace parallel {

// Collective over `group` (its control channel). Returns `spec` unchanged
// unless it has a P(host) placement; then P(k) with k the group's ranks on
// each host. Throws, on every rank alike, if hosts hold different numbers
// of the group's ranks or a host's ranks are not a contiguous block of the
// group (the shard groups of P(k) are blocks of k consecutive ranks: launch
// with ranks filled host by host, mpirun's default and srun's block
// distribution).
ShardingSpec spec_on_hosts(const ShardingSpec& spec, comm::Communicator& group);

// The same for a group whose hosts are known: `hosts` maps the group's
// ranks, `group_name` is for the message.
ShardingSpec spec_on_hosts(const ShardingSpec& spec, const context::HostMap& hosts, const std::string& group_name);

}  // namespace parallel
}  // namespace tessera
