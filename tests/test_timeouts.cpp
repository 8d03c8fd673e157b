// Timeouts and abort (Note [Timeouts] in communicator.h), and sends that
// block until received (MPI synchronous sends, as NCCL's do): a stalled
// rank ends the others with a message naming the operation; unbatched
// sends that would deadlock on NCCL time out here; batched ones complete.
#include "tessera/comm/checked_communicator.h"
#include "tessera/comm/mpi_communicator.h"
#include "tessera/comm/tracing_communicator.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <cstdlib>
#include <thread>

namespace tessera {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

comm::MpiOptions options(double seconds, bool synchronous_sends) {
  comm::MpiOptions o;
  o.timeout = std::chrono::milliseconds(static_cast<int64_t>(seconds * 1e3));
  o.synchronous_sends = synchronous_sends;
  return o;
}

// The last rank joins the all-reduce 3 s late; the others give up after 1 s
// with a TimeoutError that names the operation, the communicator and the
// late rank, and their communicators (the split one too) refuse further
// calls. The late rank's all-reduce then completes the abandoned ones, so
// the job can still finalize.
TEST(Timeouts, StalledRankEndsTheOthersWithinTheTimeout) {
  const int n = test::world()->size();
  if (n < 2) GTEST_SKIP() << "needs 2 ranks";
  auto comm = comm::MpiCommunicator::create(MPI_COMM_WORLD, "stall", options(1.0, false));
  auto child = comm->split(0, comm->rank(), "stall.child");
  const int late = n - 1;
  at::Tensor t = at::ones({4});
  if (comm->rank() == late) {
    std::this_thread::sleep_for(std::chrono::seconds(3));
    comm->all_reduce(t);
  } else {
    const auto t0 = Clock::now();
    std::string message;
    try {
      comm->all_reduce(t);
    } catch (const comm::TimeoutError& e) {
      message = e.what();
    }
    const double waited = seconds_since(t0);
    EXPECT_GE(waited, 1.0);
    EXPECT_LT(waited, 2.5) << "the timeout must end the wait before the late rank arrives";
    EXPECT_NE(message.find("all_reduce #1 on communicator 'stall'"), std::string::npos) << message;
    EXPECT_NE(message.find("(world " + std::to_string(late) + ")"), std::string::npos) << message;
    EXPECT_NE(message.find("TESSERA_COMM_TIMEOUT"), std::string::npos) << message;
    EXPECT_TRUE(test::throws_with([&] { comm->barrier(); }, "were aborted after an earlier timeout"));
    EXPECT_TRUE(test::throws_with([&] { child->all_reduce(t); }, "all_reduce #1 on communicator 'stall'"));
    EXPECT_TRUE(test::throws_with([&] { comm->control()->barrier(); }, "aborted"));
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// Ranks 0 and 1 each send to the other, unbatched: with sends that block
// until received, both wait forever (as NCCL's stream would), so both time
// out naming the send and the peer. The same exchange as one batch
// completes with the right data.
TEST(Timeouts, UnbatchedSendsDeadlockUnderBlockingSendsAndBatchesDoNot) {
  auto world = test::world();
  if (world->size() < 2) GTEST_SKIP() << "needs 2 ranks";
  const bool pair = world->rank() < 2;
  MPI_Comm raw = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, pair ? 0 : MPI_UNDEFINED, world->rank(), &raw);
  if (pair) {
    const int me = world->rank(), peer = 1 - me;
    at::Tensor mine = at::full({1 << 12}, static_cast<float>(me));
    {
      auto comm = comm::MpiCommunicator::create(raw, "pair", options(1.0, true));
      std::string message;
      try {
        comm::SendOptions async;
        async.async = true;
        comm->send(mine, peer, async);
        at::Tensor in = at::empty_like(mine);
        comm->recv(in, peer);
      } catch (const comm::TimeoutError& e) {
        message = e.what();
      }
      EXPECT_NE(message.find("send #1 on communicator 'pair'"), std::string::npos) << message;
      EXPECT_NE(message.find("Peers (rank in the communicator, world rank): " + std::to_string(peer)),
                std::string::npos)
          << message;
      // Drain the abandoned send so that MPI can finalize, once both ranks
      // have given up: a drain posted earlier would complete the peer's send.
      MPI_Barrier(raw);
      at::Tensor drain = at::empty_like(mine);
      MPI_Recv(drain.data_ptr(), static_cast<int>(drain.numel()), MPI_FLOAT, peer, 0, comm->handle(),
               MPI_STATUS_IGNORE);
      EXPECT_TRUE(drain.equal(at::full_like(mine, static_cast<float>(peer))));
    }
    auto comm = comm::MpiCommunicator::create(raw, "pair", options(10.0, true));
    at::Tensor in = at::empty_like(mine), again = at::empty_like(mine), self = at::empty_like(mine);
    comm->batch_isend_irecv({{comm::P2POp::Kind::kSend, mine, peer},
                             {comm::P2POp::Kind::kSend, mine * 2, peer},
                             {comm::P2POp::Kind::kSend, mine * 3, me},
                             {comm::P2POp::Kind::kRecv, in, peer},
                             {comm::P2POp::Kind::kRecv, again, peer},
                             {comm::P2POp::Kind::kRecv, self, me}})
        ->wait();
    EXPECT_TRUE(in.equal(at::full_like(mine, static_cast<float>(peer))));
    EXPECT_TRUE(again.equal(at::full_like(mine, 2.0f * static_cast<float>(peer)))) << "posted order, no tags";
    EXPECT_TRUE(self.equal(mine * 3));
    MPI_Comm_free(&raw);
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// What the pipeline executor asks to choose between paired batches and sends
// posted ahead (Note [Pipeline message batches]): decorators and the control
// channel report their device channel's transport.
TEST(Timeouts, SendsWaitForTheReceiverOnlyInSynchronousMode) {
  auto plain = comm::MpiCommunicator::create(MPI_COMM_WORLD, "plain", options(0, false));
  auto sync = comm::MpiCommunicator::create(MPI_COMM_WORLD, "sync", options(0, true));
  EXPECT_FALSE(plain->sends_wait_for_receiver());
  EXPECT_TRUE(sync->sends_wait_for_receiver());
  EXPECT_FALSE(sync->control()->sends_wait_for_receiver()) << "control sends stay eager";
  auto trace = std::make_shared<comm::CommTrace>();
  EXPECT_TRUE(std::make_shared<comm::TracingCommunicator>(sync, trace)->sends_wait_for_receiver());
  EXPECT_TRUE(std::make_shared<comm::CheckedCommunicator>(sync)->sends_wait_for_receiver());
  EXPECT_FALSE(std::make_shared<comm::CheckedCommunicator>(plain)->sends_wait_for_receiver());
}

TEST(Timeouts, FromTheEnvironment) {
  const char* saved = std::getenv("TESSERA_COMM_TIMEOUT");
  const std::string restore = saved ? saved : "";
  unsetenv("TESSERA_COMM_TIMEOUT");
  EXPECT_EQ(comm::timeout_from_env().count(), 600000);
  setenv("TESSERA_COMM_TIMEOUT", "2.5", 1);
  EXPECT_EQ(comm::timeout_from_env().count(), 2500);
  setenv("TESSERA_COMM_TIMEOUT", "0", 1);
  EXPECT_EQ(comm::timeout_from_env().count(), 0);
  setenv("TESSERA_COMM_TIMEOUT", "ten", 1);
  EXPECT_TRUE(test::throws_with([] { comm::timeout_from_env(); }, "TESSERA_COMM_TIMEOUT='ten' is not a number"));
  if (saved) {
    setenv("TESSERA_COMM_TIMEOUT", restore.c_str(), 1);
  } else {
    unsetenv("TESSERA_COMM_TIMEOUT");
  }
}

}  // namespace
}  // namespace tessera
