// Wrong calls are rejected locally, before any communication, with the
// operation, the communicator and the offending value in the message.
#include "test_util.h"

#include <gtest/gtest.h>

namespace tessera {
namespace {

TEST(CommErrors, NonContiguous) {
  auto w = test::world();
  at::Tensor t = at::zeros({4, 4}).t();
  EXPECT_TRUE(test::throws_with([&] { w->all_reduce(t); }, "must be contiguous"));
}

TEST(CommErrors, UnsupportedDtype) {
  auto w = test::world();
  at::Tensor t = at::zeros({4}, at::kShort);
  EXPECT_TRUE(test::throws_with([&] { w->all_reduce(t); }, "is not supported"));
}

TEST(CommErrors, AvgOfIntegers) {
  auto w = test::world();
  at::Tensor t = at::zeros({4}, at::kInt);
  EXPECT_TRUE(test::throws_with([&] { w->all_reduce(t, {comm::ReduceOp::kAvg}); }, "floating-point"));
}

TEST(CommErrors, AllGatherWrongOutputSize) {
  auto w = test::world();
  at::Tensor in = at::zeros({4}), out = at::zeros({4 * w->size() + 1});
  EXPECT_TRUE(test::throws_with([&] { w->all_gather(out, in); }, "all_gather output must hold size() x input"));
}

TEST(CommErrors, ReduceScatterWrongInputSize) {
  auto w = test::world();
  at::Tensor in = at::zeros({4 * w->size() + 1}), out = at::zeros({4});
  EXPECT_TRUE(test::throws_with([&] { w->reduce_scatter(out, in); }, "reduce_scatter input must hold"));
}

TEST(CommErrors, DtypeMismatch) {
  auto w = test::world();
  at::Tensor in = at::zeros({4}), out = at::zeros({4 * w->size()}, at::kDouble);
  EXPECT_TRUE(test::throws_with([&] { w->all_gather(out, in); }, "differs from output dtype"));
}

TEST(CommErrors, BadRootAndPeer) {
  auto w = test::world();
  at::Tensor t = at::zeros({2});
  EXPECT_TRUE(test::throws_with([&] { w->broadcast(t, {w->size()}); }, "root"));
  EXPECT_TRUE(test::throws_with([&] { w->send(t, w->rank()); }, "calling rank itself"));
  EXPECT_TRUE(test::throws_with([&] { w->recv(t, -1); }, "outside"));
}

TEST(CommErrors, AllToAllSplits) {
  auto w = test::world();
  if (w->size() > 1) {
    at::Tensor t = at::zeros({w->size() * 2 + 1, 3});
    EXPECT_TRUE(test::throws_with([&] { w->all_to_all(t, t); }, "divisible by the group size"));
  }
  comm::AllToAllOptions opts;
  opts.input_split_sizes = {1};
  opts.output_split_sizes = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  at::Tensor a = at::zeros({1, 3});
  EXPECT_TRUE(test::throws_with([&] { w->all_to_all(a, a, opts); }, "one entry per rank"));
}

}  // namespace
}  // namespace tessera
