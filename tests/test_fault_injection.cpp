// Fault injection (Note [Fault injection]): the syntax and its errors, each
// kind firing at its rank, step and place only, and a save on a full disk
// naming the rank. The kinds that end a process run in a forked child.
#include "tessera/comm/factory.h"
#include "tessera/comm/mpi_communicator.h"
#include "tessera/core/atomic_file.h"
#include "tessera/core/fault_injection.h"
#include "tessera/core/remove_tree.h"
#include "tessera/core/safetensors.h"
#include "tessera/infer/checkpoint_reader.h"
#include "tessera/train/checkpoint.h"
#include "test_util.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <mpi.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <thread>

namespace tessera {
namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

std::string own_path(const std::string& name) { return fmt::format("{}_rank{}", name, test::world()->rank()); }

TEST(FaultInjection, ParsesEveryKindAndGivesItBack) {
  const std::string spec =
      "2:3:kill,1:4:stop@save,0:1:hang:all_reduce,3:2:slow:2.5,1:1:throw,2:4:crash_file,0:4:crash_index,1:4:disk_full";
  const auto faults = parse_faults(spec);
  ASSERT_EQ(faults.size(), 8u);
  EXPECT_EQ(faults[0].rank, 2);
  EXPECT_EQ(faults[0].step, 3);
  EXPECT_EQ(faults[0].kind, FaultKind::kKill);
  EXPECT_FALSE(faults[0].at_save);
  EXPECT_TRUE(faults[1].at_save);
  EXPECT_EQ(faults[2].op, "all_reduce");
  EXPECT_DOUBLE_EQ(faults[3].factor, 2.5);
  // The writers' kinds happen in a save without saying so.
  EXPECT_TRUE(faults[5].at_save && faults[6].at_save && faults[7].at_save);
  std::string back;
  for (const auto& f : faults) back += (back.empty() ? "" : ",") + describe(f);
  EXPECT_EQ(back, spec);
  EXPECT_TRUE(parse_faults("").empty());
}

TEST(FaultInjection, RefusesABadItemNamingItAndTheRule) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"x:3:kill", "rank 'x' is not a world rank"},
      {"1:0:kill", "step '0' is not a training step"},
      {"1:2:explode", "'explode' is not a fault kind"},
      {"1:2:hang", "hang needs an argument"},
      {"1:2:kill:9", "kill takes no argument"},
      {"1:2:slow:0.5", "slow factor '0.5' must be a number from 1 to 1000"},
      {"1:2:hang:AllReduce", "'AllReduce' is not an operation name"},
      {"1:2:kill@later", "'@later' is not a place"},
      {"1:2:disk_full@save", "disk_full always happens in a save"},
      {"1:2:kill,,2:3:stop", "has an empty item"},
      {"1:2", "has 2 fields where 3 or 4 are needed"},
  };
  for (const auto& [spec, expected] : cases) {
    const std::string message = error_of([&spec = spec] { parse_faults(spec); });
    EXPECT_NE(message.find(expected), std::string::npos) << spec << ": " << message;
    EXPECT_NE(message.find("RANK:STEP:KIND"), std::string::npos) << spec << ": " << message;
  }
  const std::string message = error_of([] { FaultInjector(parse_faults("0:1:kill,5:1:kill"), 0, 4); });
  EXPECT_NE(message.find("rank 5 is not a world rank of this job (world size 4)"), std::string::npos) << message;
}

TEST(FaultInjection, FiresOnlyAtItsRankStepAndPlace) {
  const auto faults = parse_faults("1:3:throw,0:2:throw,1:2:throw@save");
  FaultInjector one(faults, 1, 2);
  EXPECT_EQ(one.faults().size(), 2u);
  EXPECT_NO_THROW(one.begin_step(1));
  EXPECT_NO_THROW(one.begin_save());  // a save after step 1
  one.end_save();
  EXPECT_NO_THROW(one.begin_step(2));
  const std::string in_save = error_of([&] { one.begin_save(); });
  EXPECT_NE(in_save.find("injected fault 1:2:throw@save (TESSERA_FAULT) at the start of the checkpoint save after "
                         "step 2"),
            std::string::npos)
      << in_save;
  one.end_save();
  EXPECT_THROW(one.begin_step(3), InjectedFault);
  FaultInjector zero(faults, 0, 2);
  EXPECT_NO_THROW(zero.begin_step(1));
  EXPECT_THROW(zero.begin_step(2), InjectedFault);
}

TEST(FaultInjection, SlowsEveryStepFromItsOwnByItsFactor) {
  FaultInjector f(parse_faults("0:2:slow:3"), 0, 1);
  auto slowed = [&](double seconds) {
    const auto start = std::chrono::steady_clock::now();
    f.slow_down(seconds);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  f.begin_step(1);
  EXPECT_LT(slowed(0.05), 0.02);
  f.begin_step(2);
  EXPECT_GE(slowed(0.05), 0.1);  // (3 - 1) x 0.05 s
  f.begin_step(3);
  EXPECT_GE(slowed(0.05), 0.1);
}

TEST(FaultInjection, DiskFullFailsTheFileWriteInASaveOnly) {
  const std::string path = own_path("fault_disk_full") + ".safetensors";
  std::remove(path.c_str());
  FaultInjector f(parse_faults("0:1:disk_full"), 0, 1);
  f.begin_step(1);
  EXPECT_EQ(f.file_hook(), nullptr);  // not in a save
  f.begin_save();
  ASSERT_NE(f.file_hook(), nullptr);
  EXPECT_EQ(f.index_hook(), nullptr);
  const std::vector<std::pair<std::string, at::Tensor>> tensors = {{"a", at::ones({64})}, {"b", at::ones({64})}};
  const std::string message = error_of([&] { write_safetensors(path, tensors, {}, f.file_hook()); });
  EXPECT_NE(message.find("failed (disk full?)"), std::string::npos) << message;
  EXPECT_FALSE(std::filesystem::exists(path));
  f.end_save();
  EXPECT_EQ(f.file_hook(), nullptr);
  EXPECT_NO_THROW(write_safetensors(path, tensors, {}, f.file_hook()));
  std::remove(path.c_str());
}

// Runs `child` in a forked process; returns its wait status, or -1 if it
// was still running after `wait` (it is then killed).
int in_child(const std::function<void()>& child, std::chrono::milliseconds wait) {
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    child();
    ::_exit(0);
  }
  const auto deadline = std::chrono::steady_clock::now() + wait;
  int status = 0;
  while (std::chrono::steady_clock::now() < deadline) {
    if (::waitpid(pid, &status, WNOHANG) == pid) return status;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, &status, 0);
  return -1;
}

TEST(FaultInjection, CrashIndexKillsTheProcessHalfwayThroughTheIndex) {
  const std::string path = own_path("fault_crash_index") + ".json";
  std::remove(path.c_str());
  std::remove((path + ".tmp").c_str());
  const int status = in_child(
      [&] {
        FaultInjector f(parse_faults("0:1:crash_index"), 0, 1);
        f.begin_step(1);
        f.begin_save();
        write_file_atomically(path, std::string(1000, 'x'), f.index_hook());
      },
      std::chrono::seconds(20));
  ASSERT_NE(status, -1) << "the child neither died nor finished";
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status;
  EXPECT_FALSE(std::filesystem::exists(path));
  ASSERT_TRUE(std::filesystem::exists(path + ".tmp"));
  EXPECT_EQ(std::filesystem::file_size(path + ".tmp"), 500u);  // half of it was on disk
  std::remove((path + ".tmp").c_str());
}

TEST(FaultInjection, AHangStopsInItsOperationOnly) {
  const int status = in_child(
      [] {
        FaultInjector f(parse_faults("0:2:hang:all_reduce"), 0, 1);
        f.begin_step(1);
        f.before_op("all_reduce");  // not armed yet
        f.begin_step(2);
        f.before_op("broadcast");
        f.before_op("all_reduce");  // never returns
        ::_exit(3);
      },
      std::chrono::milliseconds(1500));
  EXPECT_EQ(status, -1) << "the child returned from the hanging operation (status " << status << ")";
}

// A save on rank 1's full disk fails on every rank, naming rank 1, and
// leaves the checkpoint that was there.
TEST(FaultInjection, ASaveOnAFullDiskNamesTheRankAndKeepsTheLastCheckpoint) {
  const int n = test::world()->size();
  if (n < 2) GTEST_SKIP() << "needs 2 ranks";
  const std::string dir = fmt::format("fault_save_np{}", n);
  ::setenv("TESSERA_FAULT", "1:1:disk_full", 1);
  auto c = comm::MpiCommunicator::create(MPI_COMM_WORLD, "faulty");
  ::unsetenv("TESSERA_FAULT");
  const auto faults = comm::fault_injector_of(c);
  ASSERT_NE(faults, nullptr);
  auto pieces = [&](float value) {
    train::TensorPiece p;
    p.name = "w";
    p.full_shape = {4 * n};
    p.flat_begin = 4 * c->rank();
    p.flat_end = p.flat_begin + 4;
    p.data = at::full({4}, value);
    return std::vector<train::TensorPiece>{p};
  };
  train::save_checkpoint(dir, pieces(1), "{}", c);  // step 0: no fault
  faults->begin_step(1);
  const std::string message = error_of([&] { train::save_checkpoint(dir, pieces(2), "{}", c); });
  EXPECT_NE(message.find("save_checkpoint: rank(s) 1 of the world could not write their file"), std::string::npos)
      << message;
  EXPECT_NE(message.find("disk full"), std::string::npos) << message;
  EXPECT_NE(message.find(dir + " was left as it was"), std::string::npos) << message;
  const infer::CheckpointReader reader(dir);
  EXPECT_TRUE(at::equal(reader.full("w"), at::full({4 * n}, 1.0f)));
  MPI_Barrier(MPI_COMM_WORLD);
}

}  // namespace
}  // namespace tessera
