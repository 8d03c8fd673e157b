// Note [A progress thread] (src/comm/progress_thread.h): with the thread, a
// nonblocking all-reduce that the caller posts and then leaves alone (no
// MPI call on its thread, as during a long stretch of backward) completes
// by itself; without it, it waits for the caller's next call. Note [Ring
// progress] (comm/p2p.h): a ring step that calls `progress` while it
// computes sees its shifts complete within the step, without a thread.
#include "test_util.h"

#include "tessera/comm/mpi_communicator.h"
#include "tessera/comm/p2p.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <thread>

namespace tessera {
namespace {

using Clock = std::chrono::steady_clock;

// Seconds the caller still waits for a 16 MiB all-reduce that it posted
// and then left alone for `idle`.
double wait_after_idle(comm::MpiCommunicator& c, std::chrono::milliseconds idle) {
  at::Tensor x = at::ones({int64_t{1} << 22}, at::kFloat);
  c.control()->barrier()->wait();
  comm::AllReduceOptions o;
  o.async = true;
  auto work = c.all_reduce(x, o);
  std::this_thread::sleep_for(idle);
  const auto t0 = Clock::now();
  work->wait();
  const double waited = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_TRUE(x.equal(at::full_like(x, static_cast<float>(c.size()))));
  return waited;
}

TEST(ProgressThread, APostedAllReduceCompletesWhileTheCallerComputes) {
  if (test::world()->size() < 2) GTEST_SKIP() << "one rank has nothing to move";
  if (test::device().is_cuda()) GTEST_SKIP() << "the MPI backend's host tensors";
  comm::MpiOptions with;
  with.progress = std::chrono::microseconds(200);
  comm::MpiOptions without;
  without.progress = std::chrono::microseconds(0);
  // Progress is the process's: the family without a thread is timed before
  // the one with it exists.
  const auto idle = std::chrono::milliseconds(400);
  auto plain = comm::MpiCommunicator::create(MPI_COMM_WORLD, "plain", without);
  EXPECT_EQ(plain->progress_probes(), -1);
  const double alone = wait_after_idle(*plain, idle);
  auto threaded = comm::MpiCommunicator::create(MPI_COMM_WORLD, "progress", with);
  const double helped = wait_after_idle(*threaded, idle);
  EXPECT_GT(threaded->progress_probes(), 100) << "the thread probed";
  // The whole reduction ran during the idle time: what is left is the
  // last completion check, far under the reduction's own time.
  EXPECT_LT(helped, 0.005) << "left alone for 0.4 s without a thread, the caller waited " << alone << " s";
  if (test::world()->rank() == 0)
    fmt::print("waited after 0.4 s idle for a 16 MiB all-reduce: {:.4f} s without a progress thread, {:.4f} s with\n",
               alone, helped);
}

// Calls progress until it says every shift in flight completed, for at
// most 5 s; whether it did.
bool progress_until_done(const comm::RingProgress& progress) {
  const auto until = Clock::now() + std::chrono::seconds(5);
  while (!progress()) {
    if (Clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return true;
}

// 16 MiB blocks, far past any eager size: a shift needs the receiver's
// answer, which only an MPI call on this thread gives (no progress thread).
TEST(RingProgress, ShiftsCompleteWhileTheStepCallsProgress) {
  if (test::world()->size() < 2) GTEST_SKIP() << "one rank has nothing to move";
  if (test::device().is_cuda()) GTEST_SKIP() << "the MPI backend's host tensors";
  comm::MpiOptions without;
  without.progress = std::chrono::microseconds(0);
  auto c = comm::MpiCommunicator::create(MPI_COMM_WORLD, "ring", without);
  const int n = c->size(), r = c->rank();
  const at::Tensor local = at::full({int64_t{1} << 22}, static_cast<float>(r));
  std::vector<int> owners;
  comm::ring_pass(*c, local, [&](int src, const at::Tensor& block, const comm::RingProgress& progress) {
    owners.push_back(src);
    EXPECT_TRUE(block.equal(at::full_like(block, static_cast<float>(src)))) << "block of rank " << src;
    EXPECT_TRUE(progress_until_done(progress)) << "ring_pass: the shift after step " << owners.size() - 1
                                               << " did not complete while the step called progress";
  });
  ASSERT_EQ(static_cast<int>(owners.size()), n);
  for (int t = 0; t < n; ++t) EXPECT_EQ(owners[static_cast<size_t>(t)], (r - t + n) % n);
  // The contributions travel one step behind the blocks; both move.
  int steps = 0;
  const at::Tensor sum =
      comm::ring_pass_reduce(*c, local, [&](int src, const at::Tensor& block, const comm::RingProgress& progress) {
        EXPECT_TRUE(progress_until_done(progress)) << "ring_pass_reduce: the shifts in flight during step " << steps
                                                   << " did not complete while the step called progress";
        ++steps;
        return at::full_like(block, static_cast<float>(r + 1));
      });
  // Every rank added r + 1 to this rank's block: n (n + 1) / 2.
  EXPECT_TRUE(sum.equal(at::full_like(local, static_cast<float>(n * (n + 1) / 2))));
}

TEST(ProgressThread, ABadIntervalIsRefused) {
  setenv("TESSERA_PROGRESS_US", "fast", 1);
  EXPECT_ERROR_CONTAINS(comm::MpiOptions::progress_from_env(), "TESSERA_PROGRESS_US='fast'",
                        "whole number of microseconds");
  setenv("TESSERA_PROGRESS_US", "250", 1);
  EXPECT_EQ(comm::MpiOptions::progress_from_env().count(), 250);
  unsetenv("TESSERA_PROGRESS_US");
  EXPECT_EQ(comm::MpiOptions::progress_from_env().count(), 0);
}

}  // namespace
}  // namespace tessera
