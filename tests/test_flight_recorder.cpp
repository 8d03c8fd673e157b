// The flight recorder (Note [Flight recorder]) and its reader: what each
// entry says, the ring, and a stalled rank named from every rank's record.
#include "tessera/comm/flight_recorder.h"
#include "tessera/comm/flight_trace.h"
#include "tessera/comm/mpi_communicator.h"
#include "tessera/core/remove_tree.h"
#include "test_util.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <mpi.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <thread>

namespace tessera {
namespace {

using nlohmann::json;

json record_of(const comm::FlightRecorder& recorder) { return json::parse(recorder.to_json("test")); }

// A directory of this rank's own, empty.
std::string fresh_dir(const std::string& name) {
  const std::string dir = fmt::format("{}_rank{}", name, test::world()->rank());
  remove_tree(dir);
  ::mkdir(dir.c_str(), 0755);
  return dir;
}

comm::FlightRecorderOptions recorder_options(int64_t entries, const std::string& dir = "") {
  comm::FlightRecorderOptions o;
  o.entries = entries;
  o.dir = dir;
  o.poll = std::chrono::milliseconds(50);
  return o;
}

TEST(FlightRecorder, KeepsTheLastEntriesOldestFirst) {
  comm::FlightRecorder recorder(recorder_options(4), 0, 2);
  const int c = recorder.add_communicator("g", "mpi", {0, 1});
  std::vector<int64_t> ids;
  for (int i = 0; i < 10; ++i) {
    const bool p2p = i % 3 == 2;
    ids.push_back(recorder.issued(c, p2p ? "send" : "all_reduce", i + 1, p2p ? std::vector<int>{1} : std::vector<int>{},
                                  4 * (i + 1), "Float"));
  }
  for (int i = 0; i < 9; ++i) recorder.ended(ids[static_cast<size_t>(i)], comm::OpState::kCompleted);
  recorder.ended(ids[1], comm::OpState::kTimedOut);  // passed by the ring: ignored
  const json r = record_of(recorder);
  ASSERT_EQ(r["entries"].size(), 4u);
  for (int k = 0; k < 4; ++k) {
    const json& e = r["entries"][static_cast<size_t>(k)];
    const int i = 6 + k;
    EXPECT_EQ(e["id"], i);
    EXPECT_EQ(e["seq"], i + 1);
    EXPECT_EQ(e["bytes"], 4 * (i + 1));
    EXPECT_EQ(e["op"], i % 3 == 2 ? "send" : "all_reduce");
    EXPECT_EQ(e["state"], i < 9 ? "completed" : "issued");
    EXPECT_GE(e["start_us"].get<int64_t>(), 0);
    if (i < 9) EXPECT_GE(e["end_us"].get<int64_t>(), e["start_us"].get<int64_t>());
  }
  // Sends are not collectives: i = 2, 5, 8 are skipped in the count.
  EXPECT_EQ(r["entries"][0]["collective"], 5);  // i = 6
  EXPECT_EQ(r["entries"][2]["collective"], 0);  // i = 8, a send
  EXPECT_EQ(r["entries"][3]["collective"], 7);  // i = 9
  EXPECT_EQ(r["communicators"][0]["last_issued"], 10);
  EXPECT_EQ(r["communicators"][0]["last_completed"], 9);
  EXPECT_EQ(r["communicators"][0]["collectives"], 7);
}

TEST(FlightRecorder, ZeroEntriesRecordsNothing) {
  comm::FlightRecorder recorder(recorder_options(0), 0, 1);
  const int c = recorder.add_communicator("g", "mpi", {0});
  EXPECT_EQ(recorder.issued(c, "barrier", 1, {}, 0, ""), -1);
  EXPECT_TRUE(record_of(recorder)["entries"].empty());
}

TEST(FlightRecorder, TheEnvironmentIsCheckedByName) {
  const char* old = std::getenv("TESSERA_TRACE_BUFFER");
  const std::string saved = old ? old : "";
  setenv("TESSERA_TRACE_BUFFER", "lots", 1);
  EXPECT_TRUE(test::throws_with([] { comm::FlightRecorderOptions::entries_from_env(); },
                                "TESSERA_TRACE_BUFFER='lots' is not a number"));
  setenv("TESSERA_TRACE_BUFFER", "16", 1);
  EXPECT_EQ(comm::FlightRecorderOptions::entries_from_env(), 16);
  if (old)
    setenv("TESSERA_TRACE_BUFFER", saved.c_str(), 1);
  else
    unsetenv("TESSERA_TRACE_BUFFER");
  EXPECT_TRUE(test::throws_with([] { comm::FlightRecorder(recorder_options(8, "no/such/parent/dir"), 0, 1); },
                                "cannot create the record directory 'no/such/parent/dir'"));
}

// Every operation of a communicator, with its sequence number, size, dtype
// and peers, completed; point-to-point ones outside the collective count.
TEST(FlightRecorder, RecordsEachOperationOfACommunicator) {
  const int n = test::world()->size();
  comm::MpiOptions o;
  o.flight_recorder = recorder_options(64);
  auto c = comm::MpiCommunicator::create(MPI_COMM_WORLD, "recorded", o);
  const int me = c->rank();
  at::Tensor t = at::ones({5});
  c->all_reduce(t);
  at::Tensor gathered = at::empty({3 * n}, at::kDouble);
  c->all_gather(gathered, at::ones({3}, at::kDouble));
  auto work = c->broadcast(t, {0, /*async=*/true});
  work->wait();
  if (n >= 2) {
    at::Tensor in = at::empty({2}, at::kLong);
    c->batch_isend_irecv({{comm::P2POp::Kind::kSend, at::ones({2}, at::kLong), (me + 1) % n},
                          {comm::P2POp::Kind::kRecv, in, (me + n - 1) % n}});
  }
  c->barrier();
  const json r = record_of(*c->flight_recorder());
  // The world and its control channel are the family's communicators.
  ASSERT_EQ(r["communicators"].size(), 2u);
  EXPECT_EQ(r["communicators"][0]["name"], "recorded");
  EXPECT_EQ(r["communicators"][0]["world_ranks"].size(), static_cast<size_t>(n));
  const json& e = r["entries"];
  const size_t count = n >= 2 ? 5 : 4;
  ASSERT_EQ(e.size(), count);
  const std::vector<std::string> ops =
      n >= 2 ? std::vector<std::string>{"all_reduce", "all_gather", "broadcast", "batch_isend_irecv", "barrier"}
             : std::vector<std::string>{"all_reduce", "all_gather", "broadcast", "barrier"};
  for (size_t i = 0; i < count; ++i) {
    EXPECT_EQ(e[i]["op"], ops[i]);
    EXPECT_EQ(e[i]["seq"], static_cast<int64_t>(i + 1));
    EXPECT_EQ(e[i]["state"], "completed") << ops[i];
    EXPECT_EQ(e[i]["comm"], 0);
  }
  EXPECT_EQ(e[0]["bytes"], 20);
  EXPECT_EQ(e[0]["dtype"], "Float");
  EXPECT_EQ(e[1]["bytes"], 24 * n);  // the gathered output
  EXPECT_EQ(e[1]["dtype"], "Double");
  EXPECT_EQ(e[count - 1]["collective"], 4);
  if (n >= 2) {
    EXPECT_EQ(e[3]["collective"], 0);
    EXPECT_EQ(e[3]["bytes"], 32);
    EXPECT_EQ(e[3]["peers"], json::array({(me + 1) % n, (me + n - 1) % n}));
  }
}

// Note [Stuck inside an operation]: ranks 0 and 1 give up on all_reduce #1;
// rank 2 entered it with them and is still inside; rank 3 entered it later
// and is merely waiting.
TEST(FlightRecorder, TheReaderNamesARankStuckInsideAnOperation) {
  const std::string dir = fresh_dir("flight_stuck");
  std::vector<std::unique_ptr<comm::FlightRecorder>> r;
  std::vector<int64_t> ids;
  for (int k = 0; k < 4; ++k) {
    r.push_back(std::make_unique<comm::FlightRecorder>(recorder_options(8), k, 4));
    r.back()->add_communicator("data", "mpi", {0, 1, 2, 3});
  }
  for (int k = 0; k < 3; ++k) ids.push_back(r[k]->issued(0, "all_reduce", 1, {}, 64, "Float"));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ids.push_back(r[3]->issued(0, "all_reduce", 1, {}, 64, "Float"));
  std::this_thread::sleep_for(std::chrono::milliseconds(10));
  r[0]->ended(ids[0], comm::OpState::kTimedOut);
  r[1]->ended(ids[1], comm::OpState::kTimedOut);
  for (int k = 0; k < 4; ++k) r[k]->dump_to(comm::FlightRecorder::record_path(dir, k), "test");
  const comm::FlightVerdict v = comm::analyze_flight_records(dir);
  const std::string text = v.text();
  EXPECT_EQ(v.behind, std::vector<int>{2}) << text;
  EXPECT_NE(text.find("world rank(s) 2 entered it with the ranks that gave up and were still inside it"),
            std::string::npos)
      << text;
  // Records dumped before `since_us` are an earlier run's.
  EXPECT_THROW(comm::analyze_flight_records(dir, r[3]->started_us() + 3600LL * 1000 * 1000), c10::Error);
}

// A rank stopped before collective 2, continued at the end (Note [Arriving
// after the others gave up]): it enters 2 after the others gave up on it,
// completes it with the ranks still inside it and waits in 3, which they
// never issue. It is behind; they are not.
TEST(FlightRecorder, TheReaderNamesARankThatWentOnAfterTheOthersGaveUp) {
  const std::string dir = fresh_dir("flight_went_on");
  std::vector<std::unique_ptr<comm::FlightRecorder>> r;
  for (int k = 0; k < 4; ++k) {
    r.push_back(std::make_unique<comm::FlightRecorder>(recorder_options(8), k, 4));
    r.back()->add_communicator("world", "mpi", {0, 1, 2, 3});
    r.back()->ended(r.back()->issued(0, "all_reduce", 1, {}, 8, "Long"), comm::OpState::kCompleted);
  }
  std::vector<int64_t> ids(4);
  for (int k : {0, 1, 3}) ids[k] = r[k]->issued(0, "all_reduce", 2, {}, 8, "Long");
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  for (int k : {0, 1, 3}) r[k]->ended(ids[k], comm::OpState::kTimedOut);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  r[2]->ended(r[2]->issued(0, "all_reduce", 2, {}, 8, "Long"), comm::OpState::kCompleted);
  r[2]->issued(0, "all_gather", 3, {}, 32, "Long");
  for (int k = 0; k < 4; ++k) r[k]->dump_to(comm::FlightRecorder::record_path(dir, k), "test");
  const comm::FlightVerdict v = comm::analyze_flight_records(dir);
  const std::string text = v.text();
  EXPECT_EQ(v.behind, std::vector<int>{2}) << text;
  EXPECT_NE(text.find("world rank(s) 2 entered it only after a rank had given up on it or an earlier operation"),
            std::string::npos)
      << text;
  EXPECT_EQ(text.find("world rank(s) 0, 1, 3 had not issued it"), std::string::npos) << text;
}

#if defined(__SANITIZE_THREAD__)
#define TESSERA_TEST_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define TESSERA_TEST_TSAN 1
#endif
#endif

// Note [Records on a fatal signal]: a process ended by SIGTERM (as a
// launcher ends the survivors of a job whose rank died) writes its record
// first, then dies of the signal. Run in a forked child.
TEST(FlightRecorder, WritesItsRecordOnAFatalSignal) {
#ifdef TESSERA_TEST_TSAN
  GTEST_SKIP() << "ThreadSanitizer does not run the forked child's signal handler (every other build runs this)";
#endif
  const std::string dir = fresh_dir("flight_signal");
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    comm::FlightRecorder recorder(recorder_options(8, dir), 3, 4);
    const int c = recorder.add_communicator("data", "mpi", {0, 1, 2, 3});
    recorder.issued(c, "all_reduce", 1, {}, 64, "Float");  // never completes
    ::raise(SIGTERM);
    ::_exit(0);  // not reached: the signal ends the process
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM) << "status " << status;
  const std::string path = comm::FlightRecorder::record_path(dir, 3);
  std::ifstream in(path);
  ASSERT_TRUE(in.good()) << "no record at " << path;
  const json record = json::parse(in);
  EXPECT_EQ(record["reason"], "signal 15 (Terminated)");
  ASSERT_EQ(record["entries"].size(), 1u);
  EXPECT_EQ(record["entries"][0]["state"], "issued");
}

// The reader from records it is handed: ranks that called different
// collectives, and a rank whose record is missing.
TEST(FlightRecorder, TheReaderNamesMismatchesAndMissingRecords) {
  const std::string dir = fresh_dir("flight_reader");
  {
    comm::FlightRecorder r0(recorder_options(8), 0, 3), r1(recorder_options(8), 1, 3);
    const int c0 = r0.add_communicator("data", "mpi", {0, 1, 2});
    const int c1 = r1.add_communicator("data", "mpi", {0, 1, 2});
    r0.ended(r0.issued(c0, "all_reduce", 1, {}, 64, "Float"), comm::OpState::kCompleted);
    r1.ended(r1.issued(c1, "all_reduce", 1, {}, 64, "Float"), comm::OpState::kCompleted);
    // Both entered before either gave up, as in a run: a rank that entered
    // after another gave up would be named as behind by the timeout.
    const int64_t e0 = r0.issued(c0, "all_reduce", 2, {}, 64, "Float");
    const int64_t e1 = r1.issued(c1, "broadcast", 2, {}, 64, "Float");
    r0.ended(e0, comm::OpState::kTimedOut);
    r1.ended(e1, comm::OpState::kTimedOut);
    r0.dump_to(comm::FlightRecorder::record_path(dir, 0), "test");
    r1.dump_to(comm::FlightRecorder::record_path(dir, 1), "test");
  }
  const comm::FlightVerdict v = comm::analyze_flight_records(dir);
  EXPECT_EQ(v.world_size, 3);
  EXPECT_EQ(v.missing, std::vector<int>{2});
  EXPECT_EQ(v.behind, std::vector<int>{2});
  const std::string text = v.text();
  EXPECT_NE(text.find("collective number 2 differs between ranks (world rank(s) 0: all_reduce of 64 bytes; world "
                      "rank(s) 1: broadcast of 64 bytes)"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("world rank(s) 2 wrote no record"), std::string::npos) << text;
  EXPECT_NE(text.find("none from world rank(s) 2"), std::string::npos) << text;
  remove_tree(dir);
  EXPECT_TRUE(test::throws_with([&] { comm::analyze_flight_records(dir); }, "no flight record"));
}

// The last rank of a split joins late: the others time out and write their
// records; the late rank, in compute, writes its own when it sees theirs.
// The reader, given the directory, names the late rank, the communicator and
// the operation the others waited in. The directory stays for the
// tessera_trace test that reads it again (tests/CMakeLists.txt).
TEST(FlightRecorder, AStalledRankIsNamedFromEveryRanksRecord) {
  auto world = test::world();
  const int n = world->size();
  if (n < 2) GTEST_SKIP() << "needs 2 ranks";
  const std::string dir = fmt::format("flight_stall_np{}", n);
  if (world->rank() == 0) remove_tree(dir);
  MPI_Barrier(MPI_COMM_WORLD);
  comm::MpiOptions o;
  o.timeout = std::chrono::milliseconds(1000);
  o.flight_recorder = recorder_options(64, dir);
  o.flight_recorder.peer_wait = std::chrono::milliseconds(5000);
  auto c = comm::MpiCommunicator::create(MPI_COMM_WORLD, "stall", o);
  const int late = n / 2;
  at::Tensor t = at::ones({4});
  for (int i = 0; i < 3; ++i) c->all_reduce(t);
  if (c->rank() == late) {
    std::this_thread::sleep_for(std::chrono::seconds(4));  // "compute": the others give up after 1 s
    c->all_reduce(t);                                      // completes the abandoned ones, so the job can finalize
  } else {
    std::string message;
    try {
      c->all_reduce(t);
    } catch (const comm::TimeoutError& e) {
      message = e.what();
    }
    EXPECT_NE(message.find("all_reduce #4 on communicator 'stall'"), std::string::npos) << message;
    // Every waiter's message names the late rank, from the records it waited for.
    EXPECT_NE(message.find(fmt::format("Flight records of {} of {} ranks in {}", n, n, dir)), std::string::npos)
        << message;
    EXPECT_NE(message.find(fmt::format("put world rank(s) {} behind", late)), std::string::npos) << message;
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (world->rank() != 0) return;
  const comm::FlightVerdict v = comm::analyze_flight_records(dir);
  const std::string text = v.text();
  EXPECT_EQ(v.ranks_read.size(), static_cast<size_t>(n)) << text;
  EXPECT_EQ(v.behind, std::vector<int>{late}) << text;
  std::string waiters;
  for (int r = 0; r < n; ++r)
    if (r != late) waiters += (waiters.empty() ? "" : ", ") + std::to_string(r);
  EXPECT_NE(text.find(fmt::format("waited in all_reduce #4 (16 bytes of Float) and gave up after 1.")),
            std::string::npos)
      << text;
  EXPECT_NE(text.find(fmt::format("world rank(s) {} waited in all_reduce #4", waiters)), std::string::npos) << text;
  EXPECT_NE(text.find(fmt::format("world rank(s) {} had not issued it, so they are behind; world rank {}: its last "
                                  "there was all_reduce #3 (16 bytes of Float), completed",
                                  late, late)),
            std::string::npos)
      << text;
  const json mine = json::parse(std::ifstream(comm::FlightRecorder::record_path(dir, late)));
  EXPECT_NE(mine["reason"].get<std::string>().find("wrote its record"), std::string::npos) << mine["reason"];
  const json first = json::parse(std::ifstream(comm::FlightRecorder::record_path(dir, 0)));
  EXPECT_NE(first["reason"].get<std::string>().find("did not complete within 1 s"), std::string::npos)
      << first["reason"];
}

}  // namespace
}  // namespace tessera
