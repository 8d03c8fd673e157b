#pragma once
// Which host's link is slow: timed exchanges between hosts during a run.
//
// Note [Slow links]
// A host whose link to the switch is slow makes every step slow, but not
// one rank's compute: every rank waits in the collectives that cross hosts,
// so Note [Stragglers] (the most compute) cannot name it. The probe times
// the links directly: the lowest rank of each host exchanges `bytes` with
// the lowest rank of every other host, both ways at once, host pairs in
// rounds where each host is in one pair (the circle method), so a round's
// pairs share no link; each pair three times, the fastest kept (with two,
// a clean host on cores the ranks share lost all four of its exchanges to
// scheduling once: named at 2.1x, in a suite where the test ran alone).
// Of an exchange's two ends the shorter time counts: a message of `bytes`
// (past any eager size) moves only once both ends have posted, so the end
// that posted later timed the transfer, and the earlier one also its wait
// for the other to leave the barrier, which on shared cores can be a
// scheduling slice (with the longer end, a clean host was named at 2.2x
// once more, in a suite on this 2-core machine).
// A host's time is its fastest exchange: a slow link slows all of a
// host's exchanges, while a host with a good link has at least one fast
// partner when two or more hosts have good links. The slow host is the one whose time exceeds
// `factor` × the median host's (the lower median). With two hosts both
// share the one path and neither can be told from the other: the probe
// reports their times and names no host. Run between steps: it moves
// 3 · 2 · bytes per host pair and round over the world's control channel.
#include "tessera/comm/communicator.h"
#include "tessera/context/hosts.h"

#include <cstdint>
#include <vector>

namespace tessera {
namespace train {

struct LinkProbe {
  std::vector<double> host_seconds;  // per host: its fastest exchange
  int slow_host = -1;                // -1: none named
  double slowdown = 0;               // the slow host's seconds over the median host's
};

// From the seconds of each host pair's exchange (symmetric; the diagonal is
// not read), Note [Slow links]'s rule. Throws on fewer than two hosts, a
// non-square matrix or a time that is not positive and finite.
LinkProbe name_slow_host(const std::vector<std::vector<double>>& pair_seconds, double factor);

// Collective over `world`: the exchanges of Note [Slow links] and the rule
// above, the same result on every rank. Throws on one host.
LinkProbe probe_links(comm::Communicator& world, const context::HostMap& hosts, int64_t bytes = int64_t(1) << 20,
                      double factor = 2.0);

}  // namespace train
}  // namespace tessera
