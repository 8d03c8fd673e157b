// Every collective of the MPI backend, for every supported dtype, synchronous
// and asynchronous, against values computed locally. Runs at 1, 2, 3, 4 and
// 8 ranks; values are small integers so that every dtype represents the
// expected results exactly.
#include "test_util.h"

#include "tessera/core/dtype.h"

#include <gtest/gtest.h>

namespace tessera {
namespace {

using comm::ReduceOp;

struct Case {
  c10::ScalarType dtype;
  bool async;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return dtype_name(info.param.dtype) + (info.param.async ? "_async" : "_sync");
}

class Collectives : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    comm_ = test::world();
    rank_ = comm_->rank();
    n_ = comm_->size();
  }
  at::TensorOptions options() const { return at::TensorOptions().dtype(GetParam().dtype); }
  bool is_bool() const { return GetParam().dtype == c10::kBool; }
  // Values from double, converted like the tensor's dtype would store them.
  at::Tensor make(const at::Tensor& values) const { return values.to(GetParam().dtype); }
  void finish(const comm::WorkPtr& work) const {
    ASSERT_TRUE(work != nullptr);
    work->wait();
    EXPECT_TRUE(work->is_completed());
    work->wait();  // a second wait is allowed and does nothing
  }
  void expect_equal(const at::Tensor& actual, const at::Tensor& expected) const {
    ASSERT_EQ(actual.scalar_type(), GetParam().dtype);
    EXPECT_TRUE(at::equal(actual.to(at::kDouble), expected.to(GetParam().dtype).to(at::kDouble)))
        << "rank " << rank_ << "\nactual:\n"
        << actual << "\nexpected:\n"
        << expected;
  }
  // rank r's contribution: (r + 1) * (i % 3 + 1), or for bool (r + i) % 2 == 0.
  at::Tensor contribution(int r, int64_t numel) const {
    at::Tensor i = at::arange(numel, at::kDouble);
    if (is_bool()) return at::remainder(i + r, 2).eq(0).to(at::kDouble);
    return (r + 1) * (at::remainder(i, 3) + 1);
  }

  comm::CommunicatorPtr comm_;
  int rank_ = 0;
  int n_ = 1;
};

TEST_P(Collectives, AllReduceSumMaxMin) {
  const int64_t numel = 7;
  at::Tensor sum = at::zeros({numel}, at::kDouble);
  at::Tensor mx = contribution(0, numel), mn = contribution(0, numel);
  for (int r = 0; r < n_; ++r) {
    sum += contribution(r, numel);
    mx = at::maximum(mx, contribution(r, numel));
    mn = at::minimum(mn, contribution(r, numel));
  }
  if (is_bool()) sum = sum.gt(0).to(at::kDouble);  // sum of booleans is "any"
  at::Tensor a = make(contribution(rank_, numel)), b = a.clone(), c = a.clone();
  auto w1 = comm_->all_reduce(a, {ReduceOp::kSum, GetParam().async});
  auto w2 = comm_->all_reduce(b, {ReduceOp::kMax, GetParam().async});
  auto w3 = comm_->all_reduce(c, {ReduceOp::kMin, GetParam().async});
  finish(w1);
  finish(w2);
  finish(w3);
  expect_equal(a, sum);
  expect_equal(b, mx);
  expect_equal(c, mn);
}

TEST_P(Collectives, AllReduceProductAndAvg) {
  if (is_bool()) GTEST_SKIP() << "avg is rejected for bool (tested in CommErrors)";
  // Product of ones and twos stays exact: 2^(ranks with odd index) fits in uint8 at 8 ranks.
  at::Tensor p = make(at::full({3}, rank_ % 2 == 0 ? 1.0 : 2.0, at::kDouble));
  comm_->all_reduce(p, {ReduceOp::kProduct, GetParam().async})->wait();
  expect_equal(p, at::full({3}, std::pow(2.0, n_ / 2), at::kDouble));
  if (!c10::isFloatingType(GetParam().dtype)) return;
  // Avg of 2r over ranks is n - 1, exact in every floating dtype.
  at::Tensor a = make(at::full({5}, 2.0 * rank_, at::kDouble));
  comm_->all_reduce(a, {ReduceOp::kAvg, GetParam().async})->wait();
  expect_equal(a, at::full({5}, n_ - 1.0, at::kDouble));
}

TEST_P(Collectives, Broadcast) {
  const int root = n_ - 1;
  at::Tensor t = make(contribution(rank_, 9));
  finish(comm_->broadcast(t, {root, GetParam().async}));
  expect_equal(t, contribution(root, 9));
}

TEST_P(Collectives, ReduceToRoot) {
  const int root = n_ / 2;
  at::Tensor sum = at::zeros({6}, at::kDouble);
  for (int r = 0; r < n_; ++r) sum += contribution(r, 6);
  if (is_bool()) sum = sum.gt(0).to(at::kDouble);
  at::Tensor t = make(contribution(rank_, 6));
  finish(comm_->reduce(t, {ReduceOp::kSum, root, GetParam().async}));
  // Non-root tensors are left as they were.
  expect_equal(t, rank_ == root ? sum : contribution(rank_, 6));
}

TEST_P(Collectives, AllGather) {
  const int64_t numel = 5;
  at::Tensor in = make(contribution(rank_, numel));
  at::Tensor out = at::empty({n_ * numel}, options());
  finish(comm_->all_gather(out, in, {GetParam().async}));
  std::vector<at::Tensor> parts;
  for (int r = 0; r < n_; ++r) parts.push_back(contribution(r, numel));
  expect_equal(out, at::cat(parts));
}

TEST_P(Collectives, AllGatherInPlace) {
  // The input is this rank's slot of the output, as flat sharded buffers use it.
  const int64_t numel = 4;
  at::Tensor out = at::zeros({n_ * numel}, options());
  at::Tensor slot = out.narrow(0, rank_ * numel, numel);
  slot.copy_(make(contribution(rank_, numel)));
  finish(comm_->all_gather(out, slot, {GetParam().async}));
  std::vector<at::Tensor> parts;
  for (int r = 0; r < n_; ++r) parts.push_back(contribution(r, numel));
  expect_equal(out, at::cat(parts));
}

TEST_P(Collectives, ReduceScatter) {
  const int64_t chunk = 3;
  at::Tensor in = make(contribution(rank_, n_ * chunk));
  at::Tensor out = at::empty({chunk}, options());
  finish(comm_->reduce_scatter(out, in, {ReduceOp::kSum, GetParam().async}));
  at::Tensor sum = at::zeros({n_ * chunk}, at::kDouble);
  for (int r = 0; r < n_; ++r) sum += contribution(r, n_ * chunk);
  if (is_bool()) sum = sum.gt(0).to(at::kDouble);
  expect_equal(out, sum.narrow(0, rank_ * chunk, chunk));
}

// Row (src, dst, k) carries src * 16 + dst * 2 + k % 2 (all < 128, exact in
// uint8); for bool its parity.
double cell(int src, int dst, int k) { return src * 16 + dst * 2 + (k % 2); }

TEST_P(Collectives, AllToAllEqual) {
  const int64_t rows = 2, cols = 3;
  at::Tensor in = at::empty({n_ * rows, cols}, at::kDouble);
  for (int dst = 0; dst < n_; ++dst)
    for (int k = 0; k < rows; ++k) in[dst * rows + k].fill_(cell(rank_, dst, k));
  at::Tensor expected = at::empty({n_ * rows, cols}, at::kDouble);
  for (int src = 0; src < n_; ++src)
    for (int k = 0; k < rows; ++k) expected[src * rows + k].fill_(cell(src, rank_, k));
  if (is_bool()) {
    in = at::remainder(in, 2);
    expected = at::remainder(expected, 2);
  }
  at::Tensor out = at::empty({n_ * rows, cols}, options());
  comm::AllToAllOptions opts;
  opts.async = GetParam().async;
  finish(comm_->all_to_all(out, make(in), opts));
  expect_equal(out, expected);
}

TEST_P(Collectives, AllToAllUneven) {
  // Rank r sends dst + 1 rows to rank dst, so it receives r + 1 rows from each.
  const int64_t cols = 2;
  comm::AllToAllOptions opts;
  opts.async = GetParam().async;
  std::vector<at::Tensor> send_rows, recv_rows;
  for (int dst = 0; dst < n_; ++dst) {
    opts.input_split_sizes.push_back(dst + 1);
    for (int k = 0; k <= dst; ++k) send_rows.push_back(at::full({1, cols}, cell(rank_, dst, k), at::kDouble));
  }
  for (int src = 0; src < n_; ++src) {
    opts.output_split_sizes.push_back(rank_ + 1);
    for (int k = 0; k <= rank_; ++k) recv_rows.push_back(at::full({1, cols}, cell(src, rank_, k), at::kDouble));
  }
  at::Tensor in = at::cat(send_rows), expected = at::cat(recv_rows);
  if (is_bool()) {
    in = at::remainder(in, 2);
    expected = at::remainder(expected, 2);
  }
  at::Tensor out = at::empty({n_ * (rank_ + 1), cols}, options());
  finish(comm_->all_to_all(out, make(in), opts));
  expect_equal(out, expected);
}

TEST_P(Collectives, SendRecvRing) {
  if (n_ == 1) GTEST_SKIP() << "point-to-point needs two ranks";
  const int next = (rank_ + 1) % n_, prev = (rank_ + n_ - 1) % n_;
  at::Tensor out = make(contribution(rank_, 8));
  at::Tensor in = at::empty({8}, options());
  // Receive posted asynchronously first so the blocking variant cannot deadlock.
  auto r = comm_->recv(in, prev, {true});
  auto s = comm_->send(out, next, {GetParam().async});
  finish(s);
  finish(r);
  expect_equal(in, contribution(prev, 8));
}

TEST_P(Collectives, Barrier) { finish(comm_->barrier({GetParam().async})); }

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (auto t : {c10::kFloat, c10::kDouble, c10::kBFloat16, c10::kHalf, c10::kInt, c10::kLong, c10::kByte, c10::kBool})
    for (bool async : {false, true}) cases.push_back({t, async});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(AllDtypes, Collectives, ::testing::ValuesIn(all_cases()), case_name);

TEST(Split, EvenOddGroups) {
  auto world = test::world();
  const int r = world->rank(), n = world->size();
  auto child = world->split(r % 2, -r, "parity");  // reversed order by key
  ASSERT_TRUE(child != nullptr);
  const int expected_size = (n + 1 - r % 2) / 2;
  EXPECT_EQ(child->size(), expected_size);
  EXPECT_EQ(child->name(), "parity");
  // Key -r orders the members by descending world rank.
  std::vector<int> members;
  for (int m = n - 1; m >= 0; --m)
    if (m % 2 == r % 2) members.push_back(m);
  EXPECT_EQ(members[child->rank()], r);
  at::Tensor t = at::full({1}, static_cast<double>(r), at::kDouble);
  child->all_reduce(t);
  double expected = 0;
  for (int m : members) expected += m;
  EXPECT_EQ(t.item<double>(), expected);
}

TEST(Split, NegativeColorGivesNoCommunicator) {
  auto world = test::world();
  auto child = world->split(world->rank() == 0 ? 0 : -1, 0, "only0");
  EXPECT_EQ(child == nullptr, world->rank() != 0);
  if (child) EXPECT_EQ(child->size(), 1);
}

TEST(Work, DroppedHandleCompletesTheOperation) {
  auto world = test::world();
  at::Tensor t = at::ones({16});
  { auto work = world->all_reduce(t, {ReduceOp::kSum, true}); }  // destroyed without wait()
  EXPECT_TRUE(at::equal(t, at::full({16}, static_cast<float>(world->size()))));
}

// On the test device (TESSERA_TEST_DEVICE): a CUDA tensor goes through host
// staging, and the root's own tensor must come back untouched, version
// included, since autograd refuses a saved tensor changed in place (SUMMA
// broadcasts attention outputs that the fused attention saved).
TEST(CollectivesOnDevice, BroadcastLeavesTheRootsTensorAndVersionAlone) {
  auto world = test::world();
  for (int root = 0; root < world->size(); ++root) {
    at::Tensor t = at::full({5}, world->rank() == root ? 7.0 : 0.0, test::device_options());
    const auto version = t._version();
    comm::BroadcastOptions opts;
    opts.root = root;
    world->broadcast(t, opts)->wait();
    EXPECT_TRUE(at::equal(t.cpu(), at::full({5}, 7.0))) << "root " << root;
    if (world->rank() == root) EXPECT_EQ(t._version(), version) << "the root's tensor was written";
  }
}

}  // namespace
}  // namespace tessera
