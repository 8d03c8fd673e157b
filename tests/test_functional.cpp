// Autograd-aware collectives: forward values, and backward checked against
// central finite differences of the global loss, in float64.
// Runs on TESSERA_TEST_DEVICE (test::device()).
//
// Note [Global loss for gradient checks]
// A collective's adjoint is only right for the layout it assumes, so each
// check states (a) whether the input is replicated (the same tensor on every
// rank, perturbed on every rank at once) or sharded (perturbed on one rank at a
// time), and (b) whether the loss is replicated (identical on every rank,
// counted once) or per rank (summed over ranks).
#include "test_util.h"

#include "tessera/comm/functional.h"

#include <gtest/gtest.h>

#include <functional>

namespace tessera {
namespace {

using Fn = std::function<at::Tensor(const at::Tensor&)>;
constexpr double kEps = 1e-6;
constexpr double kTolerance = 1e-7;  // absolute, on gradients of order 1

struct Layout {
  bool input_replicated;
  bool loss_replicated;
};

at::Tensor seeded(at::IntArrayRef shape, uint64_t seed) { return test::device_randn(shape, seed, at::kDouble); }

void check_gradient(const Fn& fn, at::IntArrayRef input_shape, at::IntArrayRef output_shape, Layout layout) {
  auto world = test::world();
  const int rank = world->rank(), n = world->size();
  at::Tensor x = seeded(input_shape, layout.input_replicated ? 7 : 7 + rank);
  at::Tensor w = seeded(output_shape, layout.loss_replicated ? 11 : 11 + rank);

  at::Tensor xg = x.clone().requires_grad_(true);
  at::Tensor y = fn(xg);
  ASSERT_EQ(y.sizes(), output_shape);
  (w * y).sum().backward();
  at::Tensor analytic = xg.grad();
  ASSERT_TRUE(analytic.defined());

  auto global_loss = [&](const at::Tensor& input) {
    at::NoGradGuard no_grad;
    at::Tensor l = (w * fn(input)).sum().reshape({1});
    if (!layout.loss_replicated) world->all_reduce(l);
    return l.item<double>();
  };
  const int owners = layout.input_replicated ? 1 : n;
  for (int p = 0; p < owners; ++p) {
    const bool mine = layout.input_replicated || p == rank;
    for (int64_t j = 0; j < x.numel(); ++j) {
      at::Tensor plus = x.clone(), minus = x.clone();
      if (mine) {
        plus.view(-1)[j] += kEps;
        minus.view(-1)[j] -= kEps;
      }
      const double numeric = (global_loss(plus) - global_loss(minus)) / (2 * kEps);
      if (mine) {
        EXPECT_NEAR(analytic.view(-1)[j].item<double>(), numeric, kTolerance)
            << "rank " << rank << " owner " << p << " element " << j;
      }
    }
  }
}

TEST(Functional, CopyToGroup) {
  auto c = test::world();
  check_gradient([&](const at::Tensor& x) { return comm::copy_to_group(x, c); }, {3, 2}, {3, 2}, {true, false});
}

TEST(Functional, ReduceFromGroup) {
  auto c = test::world();
  at::Tensor x = at::full({2}, static_cast<double>(c->rank()), test::device_options(at::kDouble));
  EXPECT_TRUE(at::allclose(comm::reduce_from_group(x, c),
                           at::full({2}, c->size() * (c->size() - 1) / 2.0, test::device_options(at::kDouble))));
  check_gradient([&](const at::Tensor& x) { return comm::reduce_from_group(x, c); }, {3, 2}, {3, 2}, {false, true});
}

TEST(Functional, SplitAlongDim) {
  auto c = test::world();
  const int n = c->size();
  at::Tensor x = at::arange(2 * 3 * n, test::device_options(at::kDouble)).reshape({2, 3 * n});
  EXPECT_TRUE(at::equal(comm::split_along_dim(x, 1, c), x.chunk(n, 1)[c->rank()]));
  check_gradient([&](const at::Tensor& x) { return comm::split_along_dim(x, 1, c); }, {2, 2 * n}, {2, 2},
                 {true, false});
}

TEST(Functional, GatherAlongDim) {
  auto c = test::world();
  const int n = c->size();
  at::Tensor x = at::full({2, 2}, static_cast<double>(c->rank()), test::device_options(at::kDouble));
  at::Tensor g = comm::gather_along_dim(x, 1, c);
  ASSERT_EQ(g.sizes(), (std::vector<int64_t>{2, 2 * n}));
  for (int r = 0; r < n; ++r)
    EXPECT_TRUE(at::equal(g.narrow(1, 2 * r, 2), at::full({2, 2}, double(r), test::device_options(at::kDouble))));
  check_gradient([&](const at::Tensor& x) { return comm::gather_along_dim(x, 1, c); }, {2, 2}, {2, 2 * n},
                 {false, true});
}

TEST(Functional, AllGatherAlongDim) {
  auto c = test::world();
  const int n = c->size();
  check_gradient([&](const at::Tensor& x) { return comm::all_gather_along_dim(x, 0, c); }, {2, 3}, {2 * n, 3},
                 {false, false});
}

TEST(Functional, ReduceScatterAlongDim) {
  auto c = test::world();
  const int n = c->size();
  check_gradient([&](const at::Tensor& x) { return comm::reduce_scatter_along_dim(x, 1, c); }, {2, 2 * n}, {2, 2},
                 {false, false});
}

TEST(Functional, AllToAllAlongDims) {
  auto c = test::world();
  const int n = c->size();
  // [b, s/n, h] -> [b, s, h/n], the sequence <-> head exchange of Ulysses.
  at::Tensor x = at::arange(2 * 1 * 2 * n, test::device_options(at::kDouble)).reshape({2, 1, 2 * n}) + 100 * c->rank();
  at::Tensor y = comm::all_to_all_along_dims(x, 2, 1, c);
  ASSERT_EQ(y.sizes(), (std::vector<int64_t>{2, n, 2}));
  for (int r = 0; r < n; ++r) {
    at::Tensor from_r = at::arange(2 * 1 * 2 * n, test::device_options(at::kDouble)).reshape({2, 1, 2 * n}) + 100 * r;
    EXPECT_TRUE(at::equal(y.narrow(1, r, 1), from_r.narrow(2, 2 * c->rank(), 2)));
  }
  check_gradient([&](const at::Tensor& x) { return comm::all_to_all_along_dims(x, 2, 1, c); }, {2, 1, 2 * n}, {2, n, 2},
                 {false, false});
}

TEST(Functional, IndivisibleDimensionIsRejected) {
  auto c = test::world();
  if (c->size() == 1) GTEST_SKIP() << "every size divides by 1";
  at::Tensor x = at::zeros({2, c->size() + 1}, test::device_options());
  EXPECT_TRUE(test::throws_with([&] { comm::split_along_dim(x, 1, c); }, "not divisible by the group size"));
}

}  // namespace
}  // namespace tessera
