#pragma once
// Helpers shared by the multi-rank tests.
#include "tessera/comm/factory.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>

namespace tessera {
namespace test {

// The world communicator of the test process (MPI backend), created on first
// use through the factory, so TESSERA_CHECK_COLLECTIVES=1 runs a test in
// checked mode.
inline comm::CommunicatorPtr world() {
  static comm::CommunicatorPtr w = comm::make_world_communicator();
  return w;
}

// The message of the c10::Error that `statement` throws, or a marker that
// none was thrown.
inline std::string error_of(const std::function<void()>& statement) {
  try {
    statement();
  } catch (const c10::Error& e) {
    return e.msg();
  }
  return "<no c10::Error thrown>";
}

// Fails unless `fn` throws a c10::Error whose message contains `needle`.
template <typename Fn>
::testing::AssertionResult throws_with(Fn&& fn, const std::string& needle) {
  const std::string message = error_of(fn);
  if (message.find(needle) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "expected a c10::Error containing '" << needle << "', got: " << message;
}

}  // namespace test
}  // namespace tessera

// EXPECT_ERROR_CONTAINS(statement, "part", ...): statement throws a
// c10::Error whose message contains every part.
#define EXPECT_ERROR_CONTAINS(statement, ...)                                     \
  do {                                                                            \
    const std::string message_ = ::tessera::test::error_of([&] { statement; });   \
    for (const char* part_ : {__VA_ARGS__}) {                                     \
      EXPECT_NE(message_.find(part_), std::string::npos)                          \
          << #statement << "\n  message: " << message_ << "\n  lacks: " << part_; \
    }                                                                             \
  } while (0)

namespace tessera {
namespace test {}  // namespace test
}  // namespace tessera
