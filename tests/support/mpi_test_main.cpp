// GoogleTest main for tests that run on several MPI ranks.
//
// - MPI is initialized before and finalized after all tests.
// - Rank 0 prints the usual gtest output; other ranks print only their
//   failures, prefixed with their rank.
// - After each test the ranks agree on its outcome: a test that failed on any
//   rank is failed on every rank, naming the ranks where it failed, and every
//   rank exits non-zero.
// - Every skipped test is printed on one line, "[tessera-skip] npN Suite.Name:
//   reason", which scripts/test-skips.sh collects into the suite's summary;
//   a run in which no test ran at all exits with kSkipReturnCode, which
//   CTest shows as a skip (SKIP_RETURN_CODE) instead of a pass.
#include "tessera/comm/mpi_runtime.h"
#include "tessera/core/threads.h"

#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>
#include <string>

// Note [Leaks before MPI_Finalize]
// Under AddressSanitizer (make test-sanitize) the leak check runs here,
// after the tests and before MPI_Finalize, instead of at exit
// (leak_check_at_exit=0): MPI_Finalize unloads Open MPI's components, and
// what they keep to the end of the process is then reported from modules
// with no name, which no suppression can match. A leak makes the rank fail.
#if defined(__SANITIZE_ADDRESS__)
#define TESSERA_TEST_LEAK_CHECK 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TESSERA_TEST_LEAK_CHECK 1
#endif
#endif
#ifdef TESSERA_TEST_LEAK_CHECK
#include <sanitizer/lsan_interface.h>
#endif

namespace {

class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_, result.file_name() ? result.file_name() : "?",
                 result.line_number(), result.summary());
    std::fflush(stderr);
  }

 private:
  int rank_;
};

class CrossRankOutcome : public ::testing::EmptyTestEventListener {
 public:
  CrossRankOutcome(int rank, int size) : rank_(rank), size_(size) {}
  void OnTestEnd(const ::testing::TestInfo& info) override {
    int failed = info.result()->Failed() ? 1 : 0;
    std::string ranks;
    std::vector<int> all(size_);
    MPI_Allgather(&failed, 1, MPI_INT, all.data(), 1, MPI_INT, MPI_COMM_WORLD);
    bool others = false;
    for (int r = 0; r < size_; ++r) {
      if (!all[r]) continue;
      ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
      others = others || r != rank_;
    }
    // Runs before the result printer (end events go to listeners in reverse
    // order), so the added failure is printed as part of this test.
    if (others && !failed) ADD_FAILURE() << "this test failed on rank(s) " << ranks;
  }

 private:
  int rank_;
  int size_;
};

// The reason a skipped test gave: the message of its GTEST_SKIP().
std::string skip_reason(const ::testing::TestResult& result) {
  for (int i = 0; i < result.total_part_count(); ++i) {
    const auto& part = result.GetTestPartResult(i);
    if (part.skipped()) return part.message();
  }
  return "";
}

class SkipPrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit SkipPrinter(int size) : size_(size) {}
  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (!info.result()->Skipped()) return;
    std::printf("[tessera-skip] np%d %s.%s: %s\n", size_, info.test_suite_name(), info.name(),
                skip_reason(*info.result()).c_str());
    std::fflush(stdout);
  }

 private:
  int size_;
};

// CTest's SKIP_RETURN_CODE (cmake/TesseraTesting.cmake).
constexpr int kSkipReturnCode = 77;

}  // namespace

int main(int argc, char** argv) {
  tessera::comm::MpiRuntime mpi(&argc, &argv);
  tessera::limit_threads(1);
  ::testing::InitGoogleTest(&argc, argv);
  int rank = 0;
  int size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
  if (rank != 0) {
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(rank));
  }
  listeners.Append(new CrossRankOutcome(rank, size));
  if (rank == 0) listeners.Append(new SkipPrinter(size));
  int failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
#ifdef TESSERA_TEST_LEAK_CHECK
  if (__lsan_do_recoverable_leak_check() != 0) failed = 1;
#endif
  int any = 0;
  MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (any) return 1;
  // A run that ran nothing is not a pass: no test matched, or every one skipped.
  const auto& unit = *::testing::UnitTest::GetInstance();
  int ran = unit.test_to_run_count() - unit.skipped_test_count();
  int most = 0;
  MPI_Allreduce(&ran, &most, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (most == 0) {
    if (rank == 0) std::printf("[tessera-skip] np%d: no test ran at %d rank(s)\n", size, size);
    return kSkipReturnCode;
  }
  return 0;
}
