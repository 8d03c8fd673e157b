// The tracing decorator counts calls and bytes per (group, op) as
// Note [Trace byte counts] defines them, including for split communicators.
#include "test_util.h"

#include "tessera/comm/tracing_communicator.h"

#include <gtest/gtest.h>

namespace tessera {
namespace {

using comm::OpType;

TEST(Tracing, CountsBytesPerOp) {
  auto trace = std::make_shared<comm::CommTrace>();
  comm::TracingCommunicator traced(test::world(), trace);
  const int n = traced.size();
  const double nd = n;
  at::Tensor t = at::ones({10});  // 40 bytes
  traced.all_reduce(t);
  traced.all_reduce(t);
  at::Tensor gathered = at::empty({10 * n});
  traced.all_gather(gathered, t);
  at::Tensor piece = at::empty({10});
  traced.reduce_scatter(piece, gathered);
  at::Tensor rows = at::ones({2 * n, 3}, at::kDouble);
  at::Tensor rows_out = at::empty_like(rows);
  traced.all_to_all(rows_out, rows);
  traced.broadcast(t);
  traced.barrier();

  auto ar = trace->get("world", OpType::kAllReduce);
  EXPECT_EQ(ar.calls, 2);
  EXPECT_EQ(ar.bytes, 80);
  EXPECT_DOUBLE_EQ(ar.bus_bytes, 80 * 2 * (nd - 1) / nd);
  auto ag = trace->get("world", OpType::kAllGather);
  EXPECT_EQ(ag.bytes, 40 * n);
  EXPECT_DOUBLE_EQ(ag.bus_bytes, 40 * n * (nd - 1) / nd);
  auto rs = trace->get("world", OpType::kReduceScatter);
  EXPECT_EQ(rs.bytes, 40 * n);
  auto a2a = trace->get("world", OpType::kAllToAll);
  EXPECT_EQ(a2a.bytes, 2 * n * 3 * 8);
  EXPECT_DOUBLE_EQ(a2a.bus_bytes, 2 * (n - 1) * 3 * 8);  // rows to other ranks only
  EXPECT_EQ(trace->get("world", OpType::kBroadcast).bytes, 40);
  EXPECT_EQ(trace->get("world", OpType::kBarrier).calls, 1);
  EXPECT_EQ(trace->total("world").calls, 7);
  EXPECT_EQ(trace->total("nonexistent").calls, 0);
  trace->reset();
  EXPECT_EQ(trace->total().calls, 0);
}

TEST(Tracing, SplitCommunicatorsShareTheTrace) {
  auto trace = std::make_shared<comm::CommTrace>();
  auto traced = std::make_shared<comm::TracingCommunicator>(test::world(), trace);
  auto half = traced->split(traced->rank() % 2, traced->rank(), "half");
  ASSERT_TRUE(half != nullptr);
  EXPECT_EQ(half->backend(), "tracing(mpi)");
  at::Tensor t = at::ones({4}, at::kDouble);
  half->all_reduce(t);
  EXPECT_EQ(trace->get("half", OpType::kAllReduce).calls, 1);
  EXPECT_EQ(trace->get("half", OpType::kAllReduce).bytes, 32);
  EXPECT_EQ(trace->get("world", OpType::kAllReduce).calls, 0);
  EXPECT_NE(trace->to_string().find("half all_reduce calls=1 bytes=32"), std::string::npos) << trace->to_string();
}

TEST(Tracing, RejectedCallsAreNotCounted) {
  auto trace = std::make_shared<comm::CommTrace>();
  comm::TracingCommunicator traced(test::world(), trace);
  at::Tensor bad = at::zeros({4, 4}).t();
  EXPECT_THROW(traced.all_reduce(bad), c10::Error);
  EXPECT_EQ(trace->total().calls, 0);
}

}  // namespace
}  // namespace tessera
