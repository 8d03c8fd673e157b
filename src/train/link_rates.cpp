#include "tessera/train/link_rates.h"

#include "tessera/planner/traffic.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <vector>

namespace tessera {
namespace train {
namespace {

using comm::OpType;

// Seconds of one call of `op` moving `numel` floats on `group` (the whole
// tensor: the all-gather's output, the reduce-scatter's input), the median
// of 3 after a warm-up, each started with every rank of `world`.
double time_call(comm::Communicator& world, comm::Communicator& group, OpType op, int64_t numel) {
  const int n = group.size();
  at::Tensor whole = at::ones({numel / n * n}, at::kFloat);
  at::Tensor part = at::ones({numel / n}, at::kFloat);
  at::Tensor got = at::empty({numel}, at::kFloat);
  std::vector<double> t;
  for (int i = 0; i < 4; ++i) {
    world.control()->barrier()->wait();
    const auto t0 = std::chrono::steady_clock::now();
    switch (op) {
      case OpType::kAllReduce:
        group.all_reduce(whole)->wait();
        break;
      case OpType::kAllGather:
        group.all_gather(whole, part)->wait();
        break;
      case OpType::kReduceScatter:
        group.reduce_scatter(part, whole)->wait();
        break;
      default: {  // the ring's exchange: to the next rank, from the previous one
        std::vector<comm::P2POp> ops(2);
        ops[0] = {comm::P2POp::Kind::kSend, whole, (group.rank() + 1) % n};
        ops[1] = {comm::P2POp::Kind::kRecv, got.narrow(0, 0, whole.numel()), (group.rank() + n - 1) % n};
        group.batch_isend_irecv(ops)->wait();
      }
    }
    if (i > 0) t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Every op's link over `group` (Note [Measuring the links]); `share`: the
// ranks that used the same links at once.
std::map<OpType, planner::Link> measure(comm::Communicator& world, comm::Communicator& group, double share) {
  constexpr int64_t kSmall = 1 << 10, kBig = 1 << 18;
  const int n = group.size();
  std::map<OpType, planner::Link> out;
  for (OpType op : {OpType::kAllReduce, OpType::kAllGather, OpType::kReduceScatter, OpType::kSend}) {
    const double small = mean_over_ranks(time_call(world, group, op, kSmall), world);
    const double big = mean_over_ranks(time_call(world, group, op, kBig), world);
    const double extra =
        planner::bus_bytes_of(op, n, 4.0 * (kBig / n * n)) - planner::bus_bytes_of(op, n, 4.0 * (kSmall / n * n));
    planner::Link l;
    l.bandwidth = share * extra / std::max(big - small, 1e-9);
    l.latency = small / std::max(1.0, planner::latency_steps(op, n));
    out[op] = l;
  }
  return out;
}

}  // namespace

double mean_over_ranks(double value, comm::Communicator& world) {
  at::Tensor v = at::tensor({value}, at::kDouble);
  world.control()->all_reduce(v)->wait();
  return v.item<double>() / world.size();
}

std::vector<double> max_over_ranks(const std::vector<double>& values, comm::Communicator& world) {
  at::Tensor v = at::tensor(values, at::kDouble);
  comm::AllReduceOptions o;
  o.op = comm::ReduceOp::kMax;
  world.control()->all_reduce(v, o)->wait();
  return std::vector<double>(v.data_ptr<double>(), v.data_ptr<double>() + v.numel());
}

MeasuredLinks measure_links(comm::Communicator& world, const context::HostMap& hosts) {
  MeasuredLinks links;
  links.nodes = hosts.hosts();
  links.per_node = world.size() / std::max(1, links.nodes);
  if (links.nodes <= 1) return links;
  const int per = links.per_node;
  bool even = world.size() % links.nodes == 0;
  for (int r = 0; even && r < world.size(); ++r) even = hosts.host_of_rank[static_cast<size_t>(r)] == r / per;
  TORCH_CHECK(even, "--plan on several hosts plans them as nodes of equal size filled host by host, but the ",
              world.size(), " ranks are placed ", hosts.describe(),
              "; launch the same number of ranks on each host, host by host (mpirun --map-by slot, srun "
              "--distribution=block), or give train_gpt the layout flags without --plan");
  const int me = world.rank();
  auto host = world.split(me / per, me, "links.host");
  auto cross = world.split(me % per, me, "links.cross");
  if (per > 1) links.intra = measure(world, *host, 1.0);
  links.inter = measure(world, *cross, static_cast<double>(per));
  return links;
}

}  // namespace train
}  // namespace tessera
