// Checked mode: mismatched collectives throw on every rank with the
// operation, the ranks and the shapes, instead of hanging.
#include "test_util.h"

#include "tessera/comm/checked_communicator.h"
#include "tessera/comm/factory.h"

#include <gtest/gtest.h>

namespace tessera {
namespace {

std::shared_ptr<comm::CheckedCommunicator> checked() {
  return std::make_shared<comm::CheckedCommunicator>(test::world());
}

TEST(Checked, MatchingCallsPass) {
  auto c = checked();
  at::Tensor t = at::ones({3, 2});
  c->all_reduce(t);
  EXPECT_TRUE(at::equal(t, at::full({3, 2}, static_cast<float>(c->size()))));
  at::Tensor out = at::empty({6 * c->size()});
  c->all_gather(out, t);
  c->barrier();
  comm::AllToAllOptions opts;
  for (int r = 0; r < c->size(); ++r) {
    opts.input_split_sizes.push_back(r + 1);
    opts.output_split_sizes.push_back(c->rank() + 1);
  }
  at::Tensor in = at::ones({c->size() * (c->size() + 1) / 2, 2});
  at::Tensor recv = at::empty({c->size() * (c->rank() + 1), 2});
  c->all_to_all(recv, in, opts);
  EXPECT_TRUE(at::equal(recv, at::ones_like(recv)));
}

TEST(Checked, ShapeMismatchThrowsOnEveryRank) {
  auto c = checked();
  if (c->size() == 1) GTEST_SKIP() << "needs two ranks";
  at::Tensor t = at::ones({c->rank() == 1 ? 5 : 4});
  EXPECT_TRUE(test::throws_with([&] { c->all_reduce(t); }, "collective mismatch on communicator 'world'"));
  EXPECT_TRUE(test::throws_with([&] { c->all_reduce(t); }, "rank 1: all_reduce(float32, shape [5]"));
}

TEST(Checked, OpMismatchThrows) {
  auto c = checked();
  if (c->size() == 1) GTEST_SKIP() << "needs two ranks";
  at::Tensor t = at::ones({4});
  auto call = [&] {
    if (c->rank() % 2 == 0) {
      c->all_reduce(t);
    } else {
      c->broadcast(t);
    }
  };
  EXPECT_TRUE(test::throws_with(call, "rank 1: broadcast(float32, shape [4], root 0)"));
}

TEST(Checked, DtypeAndRootMismatchThrow) {
  auto c = checked();
  if (c->size() == 1) GTEST_SKIP() << "needs two ranks";
  at::Tensor t = at::ones({4}, c->rank() == 0 ? at::kFloat : at::kDouble);
  EXPECT_TRUE(test::throws_with([&] { c->all_reduce(t); }, "float64"));
  at::Tensor u = at::ones({4});
  EXPECT_TRUE(test::throws_with([&] { c->broadcast(u, {c->rank() == 0 ? 0 : 1}); }, "root 1"));
}

TEST(Checked, AllToAllSplitMismatchThrows) {
  auto c = checked();
  if (c->size() == 1) GTEST_SKIP() << "needs two ranks";
  comm::AllToAllOptions opts;
  opts.input_split_sizes.assign(c->size(), 1);
  opts.output_split_sizes.assign(c->size(), 1);
  if (c->rank() == 0) opts.output_split_sizes[1] = 2;  // expects 2 rows from rank 1, which sends 1
  at::Tensor in = at::ones({c->size(), 2});
  at::Tensor out = at::empty({c->size() + (c->rank() == 0 ? 1 : 0), 2});
  EXPECT_TRUE(
      test::throws_with([&] { c->all_to_all(out, in, opts); }, "rank 1 sends 1 rows to rank 0, which expects 2"));
}

TEST(Checked, PointToPointMismatchThrowsOnReceiver) {
  auto c = checked();
  if (c->size() == 1) GTEST_SKIP() << "needs two ranks";
  if (c->rank() == 0) {
    c->send(at::ones({3}), 1);
  } else if (c->rank() == 1) {
    at::Tensor t = at::empty({4});
    // The payload receive was posted with the descriptor's; the failed Work
    // completes it when destroyed, so nothing is left pending.
    EXPECT_TRUE(test::throws_with([&] { c->recv(t, 0); }, "point-to-point mismatch"));
  }
}

TEST(Checked, ArgumentErrorOnOneRankFailsEveryRankWithoutHanging) {
  auto c = checked();
  if (c->size() == 1) GTEST_SKIP() << "needs two ranks";
  // Rank 1's tensor is not contiguous: it throws its own error, the others
  // are told which rank abandoned the call instead of waiting for it.
  at::Tensor t = c->rank() == 1 ? at::zeros({4, 4}).t() : at::zeros({4, 4});
  const std::string expected =
      c->rank() == 1 ? "must be contiguous" : "abandoned: rank(s) [1] rejected their arguments";
  EXPECT_TRUE(test::throws_with([&] { c->all_reduce(t); }, expected));
}

TEST(Checked, AsyncReceiveStaysAsynchronous) {
  // Every rank posts its receive before its send: only works if the checked
  // recv does not block on the descriptor (Note [Checked point-to-point]).
  auto c = checked();
  if (c->size() == 1) GTEST_SKIP() << "needs two ranks";
  const int n = c->size(), next = (c->rank() + 1) % n, prev = (c->rank() + n - 1) % n;
  at::Tensor in = at::empty({5}, at::kDouble);
  auto r = c->recv(in, prev, {true});
  c->send(at::full({5}, double(c->rank()), at::kDouble), next, {false});
  r->wait();
  EXPECT_TRUE(at::equal(in, at::full({5}, double(prev), at::kDouble)));
}

TEST(Checked, EnvironmentTurnsItOn) {
  setenv("TESSERA_CHECK_COLLECTIVES", "1", 1);
  EXPECT_TRUE(comm::WorldOptions::checked_mode_from_env());
  auto world = comm::make_world_communicator();
  EXPECT_EQ(world->backend(), "checked(mpi)");
  setenv("TESSERA_CHECK_COLLECTIVES", "0", 1);
  EXPECT_FALSE(comm::WorldOptions::checked_mode_from_env());
  unsetenv("TESSERA_CHECK_COLLECTIVES");
}

}  // namespace
}  // namespace tessera
