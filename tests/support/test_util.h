#pragma once
// Helpers shared by the multi-rank tests.
#include "tessera/comm/factory.h"
#include "tessera/core/remove_tree.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdlib>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

// EXPECT_REL_CLOSE(actual, expected, tolerance): rel_error within tolerance.
#define EXPECT_REL_CLOSE(actual, expected, tolerance) \
  EXPECT_LE(::tessera::test::rel_error((actual), (expected)), (tolerance)) << #actual " vs " #expected

namespace tessera {
namespace test {

// The world communicator of the test process (MPI backend), created on first
// use through the factory, so TESSERA_CHECK_COLLECTIVES=1 runs a test in
// checked mode; a run asked to check that is not checking fails.
inline comm::CommunicatorPtr world() {
  static comm::CommunicatorPtr w = [] {
    comm::CommunicatorPtr made = comm::make_world_communicator();
    // Read here, not through the library's own reading of it, which is what is checked.
    const char* env = std::getenv("TESSERA_CHECK_COLLECTIVES");
    const bool asked = env != nullptr && std::string(env) != "0" && std::string(env) != "";
    TORCH_CHECK(!asked || made->backend().rfind("checked(", 0) == 0,
                "TESSERA_CHECK_COLLECTIVES is set but the world communicator is '", made->backend(),
                "', not checked: the test would not check what it claims to");
    return made;
  }();
  return w;
}

// randn from a private generator: the same tensor on every rank that passes
// the same seed, and the program's global generator is left alone.
inline at::Tensor seeded_randn(at::IntArrayRef shape, uint64_t seed, at::ScalarType dtype = at::kFloat) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, at::TensorOptions().dtype(dtype));
}

// The device the tensor suites run on: TESSERA_TEST_DEVICE ("cpu" unless
// set; scripts/gpu-check.sh sets "cuda"). Ranks may share one GPU: the MPI
// backend stages CUDA buffers through host memory. TF32 is turned off on
// CUDA, since the comparisons are fp32 at 1e-5. Suites that read it say so
// in their first comment; the others run on the CPU whatever it says
// (docs/gpu-checks.md lists which).
inline c10::Device device() {
  static const c10::Device d = [] {
    const char* env = std::getenv("TESSERA_TEST_DEVICE");
    c10::Device made(env != nullptr && *env != '\0' ? env : "cpu");
    if (made.is_cuda()) {
      TORCH_CHECK(torch::cuda::is_available(), "TESSERA_TEST_DEVICE=", made.str(),
                  " but LibTorch sees no CUDA device: unset it or run where a GPU is");
      at::globalContext().setAllowTF32CuBLAS(false);
      at::globalContext().setAllowTF32CuDNN(false);
    }
    return made;
  }();
  return d;
}

// seeded_randn on the test device: the same values on every device, drawn
// on the CPU and copied.
inline at::Tensor device_randn(at::IntArrayRef shape, uint64_t seed, at::ScalarType dtype = at::kFloat) {
  return seeded_randn(shape, seed, dtype).to(device());
}

// Options for tensors made on the test device.
inline at::TensorOptions device_options(at::ScalarType dtype = at::kFloat) {
  return at::TensorOptions().dtype(dtype).device(device());
}

// ||actual - expected|| / ||expected||: the error measure of the
// serial-equivalence tests.
// On the CPU: one side may be on the test device, the other a serial reference.
inline double rel_error(const at::Tensor& actual_anywhere, const at::Tensor& expected_anywhere) {
  const at::Tensor actual = actual_anywhere.detach().cpu(), expected = expected_anywhere.detach().cpu();
  const double denom = std::max(expected.norm().item<double>(), 1e-12);
  return (actual - expected).norm().item<double>() / denom;
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

// Whether a sharding spec's sub-group sizes (P(k), mics:k) fit data size dp:
// each k divides dp. Written apart from ShardingSpec::resolve so that a spec
// resolve() wrongly rejects fails its test instead of being skipped.
inline bool spec_fits(const std::string& spec, int dp) {
  for (const char* marker : {"P(", "mics:"}) {
    const std::string m = marker;
    for (size_t at = spec.find(m); at != std::string::npos; at = spec.find(m, at + 1)) {
      const int k = std::stoi(spec.substr(at + m.size()));
      if (k > dp || dp % k != 0) return false;
    }
  }
  return true;
}

// Note [AdamW eps in equality tests]
// AdamW moves each weight by about lr · g / (|g| + eps). A gradient whose
// terms cancel to rounding size (which differs with every layout's summation
// order in fp32) then moves its weight by a visible fraction of lr with the
// default eps 1e-8, and "parallel equals serial after N AdamW steps" fails on
// rounding alone. Tests that compare weights after AdamW steps in fp32 use
// eps 1e-4: gradients well above it move as with the default, rounding-size
// ones do not move.

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
