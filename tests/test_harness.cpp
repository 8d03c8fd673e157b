// Self-test of the multi-rank harness (tests/support/mpi_test_main.cpp): a
// test that fails on one rank only must fail on every rank and name that
// rank. Registered as a failure test: the run must exit non-zero with
// "this test failed on rank(s) 1" in rank 0's output.
#include <gtest/gtest.h>
#include <mpi.h>

TEST(Harness, FailsOnRankOneOnly) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank == 1) ADD_FAILURE() << "deliberate failure on rank 1";
}

TEST(Harness, PassesEverywhere) { SUCCEED(); }
