#pragma once
// Which ranks share a host. Ranks on one host share its memory and cores,
// and the link between hosts is slower than anything inside one: commands
// ask here before they describe "this machine" to the planner.
#include "tessera/comm/communicator.h"

#include <string>
#include <vector>

namespace tessera {
namespace context {

struct HostMap {
  // Host index of every rank of the communicator; hosts are numbered in the
  // order of their lowest rank.
  std::vector<int> host_of_rank;
  // Each host's name, by host index.
  std::vector<std::string> names;
  int hosts() const;
  int ranks_on(int host) const;
  // The fewest ranks any host has.
  int fewest_ranks_per_host() const;
  // "1 host (NAME)" or "2 hosts: a ranks 0-1, b ranks 2-3" (rank lists
  // as ranges), for run headers.
  std::string describe() const;
};

// Collective over `world` (its control channel): each rank's host name, as
// gethostname() gives it (a network namespace with its own UTS namespace is
// a host of its own), all-gathered.
HostMap map_hosts(comm::Communicator& world);

// TESSERA_HOST_REDUCTIONS: whether a data group that spans hosts reduces
// inside each host first (comm::HierarchicalCommunicator; "hierarchical",
// the default) or not ("flat"). Any other value throws.
bool host_reductions_from_env();

}  // namespace context
}  // namespace tessera
