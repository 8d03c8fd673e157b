#pragma once
// The links between a run's hosts, measured for the planner.
//
// Note [Measuring the links]
// --plan on several hosts describes them as nodes: the ranks of one host
// are a node's GPUs, the hosts its nodes. Each class of link is timed the
// way the step uses it, every group at once: all-reduce, all-gather and
// reduce-scatter of 4 KiB and 1 MiB of floats inside each host (all hosts
// together) and across hosts among the ranks of one local index (all local
// indices together), and the ring exchange of the cross-host reduction
// (Note [A ring across hosts]): each rank sends to the next host and
// receives from the previous one. The small size's time over the call's
// algorithm steps is the latency per step; the extra bus bytes of the large
// size over its extra time the bandwidth. Across hosts the L ranks of a
// host shared its link while timed, so the node's bandwidth is L times one
// rank's (Note [Links across nodes]).
#include "tessera/comm/communicator.h"
#include "tessera/context/hosts.h"
#include "tessera/planner/cluster.h"

#include <map>
#include <vector>

namespace tessera {
namespace train {

struct MeasuredLinks {
  int nodes = 1;
  int per_node = 0;                                    // ranks per host
  std::map<comm::OpType, planner::Link> intra, inter;  // empty: not measured
};

// Collective over `world`: the mean over its ranks of a value each measured
// (a time taken while all ran at once).
double mean_over_ranks(double value, comm::Communicator& world);
// Collective over `world`: each value's largest over its ranks.
std::vector<double> max_over_ranks(const std::vector<double>& values, comm::Communicator& world);

// Collective over `world`. One host: nothing measured. Several hosts: they
// must hold equal numbers of ranks, filled host by host (rank r on host
// r / per_node), or it throws on every rank saying so.
MeasuredLinks measure_links(comm::Communicator& world, const context::HostMap& hosts);

}  // namespace train
}  // namespace tessera
