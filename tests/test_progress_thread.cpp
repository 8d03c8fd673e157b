// Note [A progress thread] (src/comm/progress_thread.h): with the thread, a
// nonblocking all-reduce that the caller posts and then leaves alone (no
// MPI call on its thread, as during a long stretch of backward) completes
// by itself; without it, it waits for the caller's next call.
#include "test_util.h"

#include "tessera/comm/mpi_communicator.h"

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
