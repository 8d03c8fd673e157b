#pragma once
// Helpers shared by the multi-rank tests.
#include "tessera/comm/mpi_communicator.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>

namespace tessera {
namespace test {

// The world communicator of the test process, created on first use.
inline std::shared_ptr<comm::MpiCommunicator> world() {
  static std::shared_ptr<comm::MpiCommunicator> w = comm::MpiCommunicator::world();
  return w;
}

// Throws unless `fn` throws a c10::Error whose message contains `needle`.
template <typename Fn>
::testing::AssertionResult throws_with(Fn&& fn, const std::string& needle) {
  try {
    fn();
  } catch (const c10::Error& e) {
    const std::string what = e.what();
    if (what.find(needle) != std::string::npos) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "message lacks '" << needle << "': " << what;
  }
  return ::testing::AssertionFailure() << "no c10::Error was thrown (expected one containing '" << needle << "')";
}

}  // namespace test
}  // namespace tessera
