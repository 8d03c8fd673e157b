// HierarchicalCommunicator (Note [Reductions inside a host first]): which
// groups it takes over, and its all_reduce, reduce_scatter and all_gather
// against results computed locally from every rank's input. Hosts are given to it by hand here, so
// the ranks of this machine stand for 2 hosts of 2 or 4, 4 hosts of 2, with
// a host's ranks contiguous or interleaved; tests/cluster_run.sh runs it
// across real network namespaces.
#include "test_util.h"

#include "tessera/comm/checked_communicator.h"
#include "tessera/comm/hierarchical_communicator.h"
#include "tessera/comm/tracing_communicator.h"
#include "tessera/core/dtype.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <thread>
#include <vector>

namespace tessera {
namespace {

using comm::HierarchicalCommunicator;
using comm::ReduceOp;

TEST(Hierarchical, TakesOverOnlyGroupsSpreadEvenlyOverSeveralHosts) {
  auto world = test::world();
  const int n = world->size();
  const int r = world->rank();
  EXPECT_EQ(HierarchicalCommunicator::wrap(world, 0), world) << "one host";
  EXPECT_EQ(HierarchicalCommunicator::wrap(world, r), world) << "one rank per host";
  EXPECT_EQ(HierarchicalCommunicator::wrap(world, r == 0 ? 0 : 1), world) << "hosts of 1 and n-1 ranks";
  if (n < 4 || n % 2 != 0) GTEST_SKIP() << "two hosts of equal size need an even world of 4 or more";
  auto wrapped = HierarchicalCommunicator::wrap(world, r / (n / 2));
  ASSERT_NE(wrapped, world);
  auto* h = dynamic_cast<HierarchicalCommunicator*>(wrapped.get());
  ASSERT_NE(h, nullptr);
  EXPECT_EQ(h->host_group()->size(), n / 2);
  EXPECT_EQ(h->cross_group()->size(), 2);
  EXPECT_EQ(h->host_group()->rank(), r % (n / 2));
  EXPECT_EQ(h->cross_group()->rank(), r / (n / 2));
  EXPECT_EQ(h->rank(), r);
  EXPECT_EQ(h->size(), n);
}

struct Layout {
  std::string name;
  std::function<int(int rank, int n)> host;
};

// Each rank's input, the same wherever it is made.
at::Tensor input_of(int rank, int64_t numel, c10::ScalarType dtype, ReduceOp op) {
  at::Tensor x = test::seeded_randn({numel}, 100 + rank, at::kDouble);
  if (op == ReduceOp::kProduct) x = 1 + 0.05 * x;  // a product of values near 1 stays in range
  return x.to(dtype);
}

// The reduction over every rank's input, in double, computed here.
at::Tensor expected(int n, int64_t numel, c10::ScalarType dtype, ReduceOp op) {
  at::Tensor acc = input_of(0, numel, dtype, op).to(at::kDouble);
  for (int q = 1; q < n; ++q) {
    const at::Tensor x = input_of(q, numel, dtype, op).to(at::kDouble);
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg:
        acc = acc + x;
        break;
      case ReduceOp::kProduct:
        acc = acc * x;
        break;
      case ReduceOp::kMin:
        acc = at::minimum(acc, x);
        break;
      case ReduceOp::kMax:
        acc = at::maximum(acc, x);
        break;
    }
  }
  if (op == ReduceOp::kAvg) acc = acc / n;
  return acc;
}

TEST(Hierarchical, AllReduceEqualsTheReductionComputedLocallyOnEveryRankAlike) {
  auto world = test::world();
  const int n = world->size();
  if (n < 4 || n % 2 != 0) GTEST_SKIP() << "hosts of 2 or more ranks need an even world of 4 or more";
  std::vector<Layout> layouts = {
      {"2 hosts, ranks contiguous", [](int r, int m) { return r / (m / 2); }},
      {"2 hosts, ranks interleaved", [](int r, int) { return r % 2; }},
  };
  if (n >= 8) layouts.push_back({"4 hosts of 2", [](int r, int) { return r / 2; }});
  const int64_t big = HierarchicalCommunicator::kMinElements;
  for (const Layout& layout : layouts) {
    auto group = HierarchicalCommunicator::wrap(world, layout.host(world->rank(), n));
    ASSERT_NE(group, world) << layout.name;
    for (c10::ScalarType dtype : {at::kFloat, at::kDouble}) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin, ReduceOp::kProduct}) {
        // Flat (under kMinElements), padded to the group's size, and dividing.
        for (int64_t numel : {int64_t{1000}, big + 5, 2 * big}) {
          const at::Tensor want = expected(n, numel, dtype, op);
          for (bool async : {false, true}) {
            SCOPED_TRACE(fmt::format("{}, {}, {}, {} elements, {}", layout.name, dtype_name(dtype),
                                     comm::reduce_op_name(op), numel, async ? "async" : "sync"));
            at::Tensor x = input_of(world->rank(), numel, dtype, op).to(test::device());
            comm::AllReduceOptions o;
            o.op = op;
            o.async = async;
            auto work = group->all_reduce(x, o);
            if (async)
              while (!work->is_completed()) {
              }
            work->wait();
            const double tol = dtype == at::kFloat ? 2e-6 : 1e-13;
            const at::Tensor got = x.cpu().to(at::kDouble);
            if (op == ReduceOp::kMax || op == ReduceOp::kMin) {
              EXPECT_TRUE(got.equal(want));
            } else {
              // Relative to the largest value: sums of signed terms come near zero.
              const double err = ((got - want).abs().max() / want.abs().max()).item<double>();
              EXPECT_LE(err, tol);
            }
            // Every rank alike, bit for bit.
            at::Tensor first = x.clone();
            world->broadcast(first);
            EXPECT_TRUE(first.equal(x)) << "rank " << world->rank() << " differs from rank 0";
          }
        }
      }
    }
  }
}

// Note [Scatters and gathers by host]: each rank's chunk of the reduction,
// and every rank's input in group-rank order, whatever the hosts' layout.
TEST(Hierarchical, ReduceScatterAndAllGatherEqualTheResultsComputedLocally) {
  auto world = test::world();
  const int n = world->size();
  const int r = world->rank();
  if (n < 4 || n % 2 != 0) GTEST_SKIP() << "hosts of 2 or more ranks need an even world of 4 or more";
  std::vector<Layout> layouts = {
      {"2 hosts, ranks contiguous", [](int q, int m) { return q / (m / 2); }},
      {"2 hosts, ranks interleaved", [](int q, int) { return q % 2; }},
  };
  if (n >= 8) layouts.push_back({"4 hosts of 2, interleaved", [](int q, int m) { return q % (m / 2); }});
  const int64_t big = HierarchicalCommunicator::kMinElements;
  for (const Layout& layout : layouts) {
    auto group = HierarchicalCommunicator::wrap(world, layout.host(r, n));
    ASSERT_NE(group, world) << layout.name;
    for (c10::ScalarType dtype : {at::kFloat, at::kDouble}) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kProduct}) {
        for (int64_t chunk : {int64_t{10}, big / n + 3}) {  // flat, and staged
          for (bool async : {false, true}) {
            SCOPED_TRACE(fmt::format("{}, {}, {}, {} elements a rank, {}", layout.name, dtype_name(dtype),
                                     comm::reduce_op_name(op), chunk, async ? "async" : "sync"));
            const at::Tensor want = expected(n, n * chunk, dtype, op).narrow(0, r * chunk, chunk);
            const at::Tensor x = input_of(r, n * chunk, dtype, op).to(test::device());
            at::Tensor got = at::empty({chunk}, x.options());
            comm::ReduceScatterOptions o;
            o.op = op;
            o.async = async;
            auto work = group->reduce_scatter(got, x, o);
            if (async)
              while (!work->is_completed()) {
              }
            work->wait();
            const at::Tensor g = got.cpu().to(at::kDouble);
            if (op == ReduceOp::kMax) {
              EXPECT_TRUE(g.equal(want));
            } else {
              const double tol = dtype == at::kFloat ? 2e-6 : 1e-13;
              EXPECT_LE(((g - want).abs().max() / want.abs().max()).item<double>(), tol);
            }
          }
        }
      }
      for (int64_t chunk : {int64_t{10}, big / n + 3}) {
        for (bool async : {false, true}) {
          SCOPED_TRACE(fmt::format("{}, all_gather of {} {} a rank, {}", layout.name, chunk, dtype_name(dtype),
                                   async ? "async" : "sync"));
          at::Tensor out = at::empty({n * chunk}, dtype).to(test::device());
          comm::AllGatherOptions o;
          o.async = async;
          auto work = group->all_gather(out, input_of(r, chunk, dtype, ReduceOp::kSum).to(test::device()), o);
          if (async)
            while (!work->is_completed()) {
            }
          work->wait();
          for (int q = 0; q < n; ++q)
            EXPECT_TRUE(out.cpu().narrow(0, q * chunk, chunk).equal(input_of(q, chunk, dtype, ReduceOp::kSum)))
                << "rank " << q << "'s chunk";
        }
      }
    }
  }
}

// Six reductions posted back to back, polled until all complete in an
// order that differs between ranks (later ones first on even ranks); each
// must end with its sum.
void post_and_poll_in_any_order(comm::Communicator& world, comm::Communicator& group) {
  const int n = world.size();
  std::vector<at::Tensor> xs;
  std::vector<comm::WorkPtr> works;
  for (int i = 0; i < 6; ++i) {
    const int64_t numel = HierarchicalCommunicator::kMinElements + 1000 * i + 3;
    xs.push_back(at::full({numel}, static_cast<double>(world.rank() + i), at::kDouble).to(test::device()));
    comm::AllReduceOptions o;
    o.async = true;
    works.push_back(group.all_reduce(xs.back(), o));
  }
  const bool backwards = world.rank() % 2 == 0;
  for (bool all = false; !all;) {
    all = true;
    for (size_t k = 0; k < works.size(); ++k) all = works[backwards ? works.size() - 1 - k : k]->is_completed() && all;
  }
  for (int i = 0; i < 6; ++i) {
    works[static_cast<size_t>(i)]->wait();
    const double want = n * (n - 1) / 2.0 + static_cast<double>(n) * i;
    EXPECT_TRUE(xs[static_cast<size_t>(i)].cpu().eq(want).all().item<bool>()) << "reduction " << i;
  }
}

// Note [Reductions in bucket order per link]: reductions posted back to
// back (as the buckets of a backward pass) and polled in an order that
// differs between ranks, each polled step driving whichever stage it
// reaches, all end with the sums.
// With a stage driver (Note [Stages advanced beside the caller]) the driver
// advances them too, beside the polls.
class HierarchicalInFlight : public ::testing::TestWithParam<int> {};

TEST_P(HierarchicalInFlight, ReductionsInFlightTogetherPolledInAnyOrder) {
  auto world = test::world();
  const int n = world->size();
  if (n < 4 || n % 2 != 0) GTEST_SKIP() << "hosts of 2 or more ranks need an even world of 4 or more";
  auto group = HierarchicalCommunicator::wrap(world, world->rank() / (n / 2), std::chrono::microseconds(GetParam()));
  ASSERT_NE(group, world);
  post_and_poll_in_any_order(*world, *group);
}

INSTANTIATE_TEST_SUITE_P(Hierarchical, HierarchicalInFlight, ::testing::Values(0, 20),
                         [](const auto& info) { return info.param ? "driven" : "polled"; });

// The same over CheckedCommunicator, whose collectives wait at issue until
// the group has issued them: there the stages keep one lane (Note
// [Reductions in bucket order per link]), or two ranks could each wait in
// a different lane for the other.
TEST(Hierarchical, OverCheckedCommunicatorsReductionsInFlightKeepOneOrder) {
  auto world = test::world();
  const int n = world->size();
  if (n < 4 || n % 2 != 0) GTEST_SKIP() << "hosts of 2 or more ranks need an even world of 4 or more";
  auto checked = std::make_shared<comm::CheckedCommunicator>(world);
  auto traced = std::make_shared<comm::TracingCommunicator>(checked, std::make_shared<comm::CommTrace>());
  EXPECT_FALSE(world->issue_waits_for_group());
  EXPECT_TRUE(traced->issue_waits_for_group());
  auto group = HierarchicalCommunicator::wrap(traced, world->rank() / (n / 2), std::chrono::microseconds(0));
  ASSERT_NE(group, traced);
  EXPECT_TRUE(group->issue_waits_for_group());
  post_and_poll_in_any_order(*world, *group);
}

// Note [Reductions in bucket order per link]: while bucket 0 waits on the
// link (the other host has not posted yet), buckets 1 and 2 still reduce
// inside this host, and nothing of theirs crosses before bucket 0's ring
// has been issued.
TEST(Hierarchical, LaterReductionsReduceInsideTheHostWhileTheFirstWaitsOnTheLink) {
  auto world = test::world();
  const int n = world->size();
  if (n < 4 || n % 2 != 0) GTEST_SKIP() << "hosts of 2 or more ranks need an even world of 4 or more";
  auto trace = std::make_shared<comm::CommTrace>();
  auto traced = std::make_shared<comm::TracingCommunicator>(world, trace);
  const int host = world->rank() / (n / 2);
  auto group = HierarchicalCommunicator::wrap(traced, host, std::chrono::microseconds(0));
  ASSERT_NE(group, traced);
  const int64_t numel = HierarchicalCommunicator::kMinElements * n;
  std::vector<at::Tensor> xs;
  std::vector<comm::WorkPtr> works;
  auto post = [&] {
    for (int i = 0; i < 3; ++i) {
      xs.push_back(at::full({numel}, static_cast<double>(world->rank() + i), at::kDouble).to(test::device()));
      comm::AllReduceOptions o;
      o.async = true;
      works.push_back(group->all_reduce(xs.back(), o));
    }
  };
  world->control()->barrier()->wait();
  trace->reset();
  if (host == 0) {
    post();
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(200);
    while (std::chrono::steady_clock::now() < until) {
      for (auto& w : works) w->is_completed();
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    EXPECT_FALSE(works[0]->is_completed()) << "bucket 0 cannot finish before the other host posts";
    EXPECT_EQ(trace->get("world.host", comm::OpType::kReduceScatter).calls, 3)
        << "every bucket reduced inside the host while bucket 0 waited on the link";
    EXPECT_EQ(trace->get("world.cross", comm::OpType::kSend).calls, 1)
        << "only bucket 0's first step of the ring is on the link";
  }
  world->control()->barrier()->wait();  // host 1 posts after host 0 has looked
  if (host == 1) post();
  for (int i = 0; i < 3; ++i) {
    works[static_cast<size_t>(i)]->wait();
    const double want = n * (n - 1) / 2.0 + static_cast<double>(n) * i;
    EXPECT_TRUE(xs[static_cast<size_t>(i)].cpu().eq(want).all().item<bool>()) << "reduction " << i;
  }
}

// Note [Stages advanced beside the caller]: reductions posted and then left
// alone (no call on the caller's thread, as during a stretch of backward)
// run every stage with a driver; without one, only their first.
TEST(Hierarchical, ADriverAdvancesTheStagesWhileTheCallerLeavesThemAlone) {
  auto world = test::world();
  const int n = world->size();
  if (n < 4 || n % 2 != 0) GTEST_SKIP() << "hosts of 2 or more ranks need an even world of 4 or more";
  if (test::device().is_cuda()) GTEST_SKIP() << "the MPI backend's host tensors";
  // Sizes that divide over the group: the last stage writes the tensor itself.
  const int64_t numel = (int64_t{1} << 15) * n;
  for (int drive : {0, 50}) {
    SCOPED_TRACE(drive ? "with a driver" : "without");
    auto group = HierarchicalCommunicator::wrap(world, world->rank() / (n / 2), std::chrono::microseconds(drive));
    auto* h = dynamic_cast<HierarchicalCommunicator*>(group.get());
    ASSERT_NE(h, nullptr);
    std::vector<at::Tensor> xs;
    std::vector<comm::WorkPtr> works;
    world->control()->barrier()->wait();
    for (int i = 0; i < 3; ++i) {
      xs.push_back(at::full({numel}, static_cast<double>(world->rank() + i), at::kDouble));
      comm::AllReduceOptions o;
      o.async = true;
      works.push_back(group->all_reduce(xs.back(), o));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    // Before anyone here looks again: with a driver every reduction is done.
    int finished = 0;
    for (int i = 0; i < 3; ++i) {
      const double want = n * (n - 1) / 2.0 + static_cast<double>(n) * i;
      finished += xs[static_cast<size_t>(i)].eq(want).all().item<bool>() ? 1 : 0;
    }
    if (drive) {
      EXPECT_EQ(finished, 3) << "reductions done while the caller slept";
      EXPECT_GT(h->driver_polls(), 0) << "the driver polled";
    } else {
      EXPECT_EQ(finished, 0) << "without a driver, nothing past a stage's end moves";
      EXPECT_EQ(h->driver_polls(), -1);
    }
    for (int i = 0; i < 3; ++i) {
      works[static_cast<size_t>(i)]->wait();
      const double want = n * (n - 1) / 2.0 + static_cast<double>(n) * i;
      EXPECT_TRUE(xs[static_cast<size_t>(i)].eq(want).all().item<bool>()) << "reduction " << i;
    }
  }
}

// The bytes on each class of link equal the formulas of Note [Reductions
// inside a host first]: for n floats padded to a multiple of L·H (L ranks
// per host, H hosts), each rank puts (L-1)/L of the padded tensor on the
// host's links in the reduce-scatter and again in the all-gather, and sends
// 2(H-1) pieces of n/(L·H) across hosts; a flat all-reduce crosses nothing
// of its own.
TEST(Hierarchical, BytesPerLinkClassEqualTheFormula) {
  auto world = test::world();
  const int n = world->size();
  if (n < 4 || n % 2 != 0) GTEST_SKIP() << "hosts of 2 or more ranks need an even world of 4 or more";
  auto trace = std::make_shared<comm::CommTrace>();
  auto traced = std::make_shared<comm::TracingCommunicator>(world, trace);
  for (int per_host : {2, n / 2}) {
    if (per_host < 2 || n % per_host != 0 || n / per_host < 2) continue;
    const int hosts = n / per_host;
    SCOPED_TRACE(fmt::format("{} hosts of {}", hosts, per_host));
    auto group = HierarchicalCommunicator::wrap(traced, world->rank() / per_host);
    for (int64_t numel : {HierarchicalCommunicator::kMinElements + 5, int64_t{1} << 16}) {
      trace->reset();
      at::Tensor x = at::ones({numel}, at::kFloat).to(test::device());
      group->all_reduce(x);
      EXPECT_TRUE(x.cpu().equal(at::full({numel}, static_cast<float>(n)))) << numel;
      const int64_t piece = (numel + n - 1) / n;  // of the padded tensor, per rank across hosts
      const int64_t padded = piece * n;
      const auto rs = trace->get("world.host", comm::OpType::kReduceScatter);
      const auto ag = trace->get("world.host", comm::OpType::kAllGather);
      EXPECT_EQ(rs.bytes, padded * 4) << "reduce-scatter input inside the host";
      EXPECT_EQ(ag.bytes, padded * 4) << "all-gather output inside the host";
      EXPECT_DOUBLE_EQ(rs.bus_bytes + ag.bus_bytes, 2.0 * (per_host - 1) / per_host * padded * 4);
      const auto sent = trace->get("world.cross", comm::OpType::kSend);
      EXPECT_EQ(sent.calls, 2 * (hosts - 1));
      EXPECT_EQ(sent.bytes, 2 * (hosts - 1) * piece * 4) << "bytes sent across hosts";
      EXPECT_EQ(trace->get("world", comm::OpType::kAllReduce).calls, 0) << "nothing flat";
    }
    // Note [Scatters and gathers by host]: a reduce-scatter or all-gather of
    // c floats a rank traces n·c floats inside the host and sends H-1
    // pieces of c across hosts.
    const int64_t c = HierarchicalCommunicator::kMinElements / n + 7;
    at::Tensor full = at::ones({n * c}, at::kFloat).to(test::device());
    at::Tensor mine = at::empty({c}, at::kFloat).to(test::device());
    auto check = [&](comm::OpType op) {
      EXPECT_EQ(trace->get("world.host", op).bytes, n * c * 4) << "the whole tensor inside the host";
      EXPECT_EQ(trace->get("world.cross", comm::OpType::kSend).calls, hosts - 1);
      EXPECT_EQ(trace->get("world.cross", comm::OpType::kSend).bytes, (hosts - 1) * c * 4) << "sent across hosts";
      EXPECT_EQ(trace->get("world", op).calls, 0) << "nothing flat";
      trace->reset();
    };
    trace->reset();
    group->reduce_scatter(mine, full);
    EXPECT_TRUE(mine.cpu().equal(at::full({c}, static_cast<float>(n))));
    check(comm::OpType::kReduceScatter);
    group->all_gather(full, mine);
    EXPECT_TRUE(full.cpu().equal(at::full({n * c}, static_cast<float>(n))));
    check(comm::OpType::kAllGather);
  }
}

}  // namespace
}  // namespace tessera
