// Tests of the NCCL backend against values computed on the CPU.
//
// Every rank builds every rank's input deterministically, so each can compute
// the expected result itself. Inputs are small integers, exact in every dtype
// (bfloat16 included), so that results compare exactly; only kAvg compares
// with a tolerance. Tests skip when no GPU is visible, and those that create
// CUDA tensors also skip when LibTorch was built without CUDA. The test main
// (MPI_Init / MPI_Finalize) lives elsewhere.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "test_util.h"

#include "tessera/comm/nccl_check.h"
#include "tessera/config.h"  // TESSERA_HAVE_C10_CUDA
#include "tessera/comm/nccl_communicator.h"

#include <mpi.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace tessera {
namespace comm {
namespace {

int visible_devices(std::string* why) {
  int count = 0;
  const cudaError_t result = cudaGetDeviceCount(&count);
  if (result != cudaSuccess) {
    (void)cudaGetLastError();
    *why = std::string("cudaGetDeviceCount failed: ") + cudaGetErrorString(result);
    return 0;
  }
  if (count == 0) *why = "cudaGetDeviceCount reports 0 devices";
  return count;
}

// Ranks of this node: (rank, size). Collective over MPI_COMM_WORLD the first
// time; every rank reaches it in the same test.
std::pair<int, int> node_rank_and_size() {
  static const std::pair<int, int> node = [] {
    MPI_Comm comm = MPI_COMM_NULL;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &comm);
    int rank = 0;
    int size = 1;
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
    MPI_Comm_free(&comm);
    return std::make_pair(rank, size);
  }();
  return node;
}

// "" if every rank of this node can have a GPU of its own (NCCL refuses two
// ranks of one communicator on the same device), else why not.
std::string gpu_problem() {
  const int ranks_here = node_rank_and_size().second;  // collective: call on every rank
  std::string why;
  const int devices = visible_devices(&why);
  if (devices == 0) return why;
  if (ranks_here > devices) {
    return std::to_string(ranks_here) + " ranks on this node but only " + std::to_string(devices) +
           " CUDA device(s); NCCL needs a device per rank";
  }
  return "";
}

#define TESSERA_REQUIRE_GPU()                                         \
  do {                                                                \
    const std::string tessera_why_ = gpu_problem();                   \
    if (!tessera_why_.empty()) {                                      \
      GTEST_SKIP() << "NCCL backend not exercised: " << tessera_why_; \
    }                                                                 \
  } while (0)

#ifdef TESSERA_HAVE_C10_CUDA
#define TESSERA_REQUIRE_CUDA_TENSORS() TESSERA_REQUIRE_GPU()
#else
#define TESSERA_REQUIRE_CUDA_TENSORS() GTEST_SKIP() << "this LibTorch has no CUDA, so no CUDA tensors can be created"
#endif

int world_rank() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

int device_for_this_rank() {
  std::string why;
  const int count = visible_devices(&why);
  return count == 0 ? 0 : node_rank_and_size().first % count;
}

// One world communicator for all tests, destroyed before MPI_Finalize by the
// environment's TearDown.
class NcclWorldEnvironment : public ::testing::Environment {
 public:
  void TearDown() override { world_ptr().reset(); }

  static std::shared_ptr<NcclCommunicator>& world_ptr() {
    static std::shared_ptr<NcclCommunicator> world;
    return world;
  }
};

::testing::Environment* const kNcclEnvironment = ::testing::AddGlobalTestEnvironment(new NcclWorldEnvironment);

NcclCommunicator& nccl_world() {
  auto& world = NcclWorldEnvironment::world_ptr();
  if (!world) world = NcclCommunicator::create(MPI_COMM_WORLD, device_for_this_rank(), "world");
  return *world;
}

at::Device device_of(const NcclCommunicator& comm) {
  return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(comm.device()));
}

const std::vector<c10::ScalarType> kDtypes = {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf,
                                              at::kInt,   at::kLong,   at::kByte,     at::kBool};

const std::vector<ReduceOp> kOps = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kProduct, ReduceOp::kMin, ReduceOp::kMax};

bool supports(ReduceOp op, c10::ScalarType dtype) { return op != ReduceOp::kAvg || c10::isFloatingType(dtype); }

// Rank `rank`'s input: small non-negative integers (1 or 2 for products, so
// that products over 8 ranks stay exact), as int64 on the CPU.
at::Tensor rank_values_long(int rank, int64_t numel, int salt, bool for_product) {
  const at::Tensor i = at::arange(numel, at::kLong);
  if (for_product) return (i + rank + salt).remainder(2) + 1;
  return (i * 3 + rank * 5 + salt).remainder(11);
}

at::Tensor rank_values(int rank, int64_t numel, c10::ScalarType dtype, int salt = 0, bool for_product = false) {
  if (dtype == at::kBool) {
    return (at::arange(numel, at::kLong) + rank + salt).remainder(3).eq(0);
  }
  return rank_values_long(rank, numel, salt, for_product).to(dtype);
}

// op over the inputs of ranks 0..size-1, computed in int64 or float64 and
// cast: exact for these values, and wrapping for uint8 as NCCL does.
at::Tensor reduce_reference(ReduceOp op, c10::ScalarType dtype, int size,
                            const std::function<at::Tensor(int)>& input_of) {
  const bool floating = c10::isFloatingType(dtype);
  const c10::ScalarType wide = floating ? at::kDouble : at::kLong;
  if (dtype == at::kBool) {  // sum/max = logical or, product/min = logical and
    op = (op == ReduceOp::kSum || op == ReduceOp::kMax) ? ReduceOp::kMax : ReduceOp::kMin;
  }
  at::Tensor result = input_of(0).to(wide);
  for (int r = 1; r < size; ++r) {
    const at::Tensor next = input_of(r).to(wide);
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg:
        result = result + next;
        break;
      case ReduceOp::kProduct:
        result = result * next;
        break;
      case ReduceOp::kMin:
        result = at::minimum(result, next);
        break;
      case ReduceOp::kMax:
        result = at::maximum(result, next);
        break;
    }
  }
  if (op == ReduceOp::kAvg) return result / size;  // float64; compared with a tolerance
  return result.to(dtype);
}

void expect_result(const at::Tensor& actual_on_gpu, const at::Tensor& expected, ReduceOp op) {
  const at::Tensor actual = actual_on_gpu.cpu();
  if (op == ReduceOp::kAvg) {
    const c10::ScalarType dtype = actual.scalar_type();
    // NCCL pre-multiplies by 1/size in the dtype, then sums: one rounding per
    // term and per partial sum (unit roundoff 2^-8 bfloat16, 2^-11 float16).
    const double rtol = dtype == at::kBFloat16 ? 5e-2 : dtype == at::kHalf ? 1e-2 : 1e-5;
    EXPECT_TRUE(at::allclose(actual.to(at::kDouble), expected.to(at::kDouble), rtol, 1e-6)) << "actual\n"
                                                                                            << actual << "\nexpected\n"
                                                                                            << expected;
  } else {
    EXPECT_TRUE(at::equal(actual, expected)) << "actual\n" << actual << "\nexpected\n" << expected;
  }
}

// Synchronous calls have already made the current stream wait.
void finish(const WorkPtr& work, bool async) {
  ASSERT_NE(work, nullptr);
  if (async) work->wait();
}

std::string trace(c10::ScalarType dtype, bool async) {
  return std::string(c10::toString(dtype)) + (async ? " async" : " sync");
}

TEST(NcclCommunicator, CreateFailsOnEveryRankForABadDevice) {
  // Runs without a GPU too: the device check is agreed on over MPI first.
  EXPECT_TRUE(test::throws_with([&] { NcclCommunicator::create(MPI_COMM_WORLD, -1, "bad"); }, "failed on rank"));
}

// The backend's sources see the build's configuration: with a LibTorch
// that has CUDA, NCCL work is ordered against LibTorch's current stream and
// the allocator learns which stream uses a tensor. (Without config.h in the
// backend's translation unit this compiled out silently.) Runs without a GPU.
TEST(NcclCommunicator, OrdersWithLibTorchStreamsWhereLibTorchHasCuda) {
#ifdef TESSERA_HAVE_C10_CUDA
  EXPECT_TRUE(NcclCommunicator::orders_with_torch_streams());
#else
  EXPECT_FALSE(NcclCommunicator::orders_with_torch_streams());
#endif
}

TEST(NcclCommunicator, CreateFailsEverywhereWhenOneRankFails) {
  TESSERA_REQUIRE_GPU();
  const int device = world_rank() == 0 ? -1 : device_for_this_rank();
  EXPECT_TRUE(test::throws_with([&] { NcclCommunicator::create(MPI_COMM_WORLD, device, "bad"); }, "failed on rank 0"));
}

TEST(NcclCommunicator, DescribesItself) {
  TESSERA_REQUIRE_GPU();
  int rank = 0;
  int size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  EXPECT_EQ(nccl_world().rank(), rank);
  EXPECT_EQ(nccl_world().size(), size);
  EXPECT_EQ(nccl_world().name(), "world");
  EXPECT_EQ(nccl_world().backend(), "nccl");
}

TEST(NcclCommunicator, AllReduce) {
  TESSERA_REQUIRE_CUDA_TENSORS();
  NcclCommunicator& comm = nccl_world();
  const int64_t n = 37;
  for (c10::ScalarType dtype : kDtypes) {
    for (ReduceOp op : kOps) {
      if (!supports(op, dtype)) continue;
      for (bool async : {false, true}) {
        SCOPED_TRACE(trace(dtype, async) + " " + reduce_op_name(op));
        const bool product = op == ReduceOp::kProduct;
        auto input_of = [&](int r) { return rank_values(r, n, dtype, 0, product); };
        at::Tensor tensor = input_of(comm.rank()).to(device_of(comm));
        WorkPtr work = comm.all_reduce(tensor, {op, async});
        finish(work, async);
        expect_result(tensor, reduce_reference(op, dtype, comm.size(), input_of), op);
        EXPECT_TRUE(work->is_completed());
      }
    }
  }
}

TEST(NcclCommunicator, AvgNeedsAFloatingDtype) {
  TESSERA_REQUIRE_CUDA_TENSORS();
  for (c10::ScalarType dtype : {at::kInt, at::kLong, at::kByte, at::kBool}) {
    at::Tensor tensor = at::zeros({4}, at::TensorOptions(dtype).device(device_of(nccl_world())));
    EXPECT_TRUE(test::throws_with([&] { nccl_world().all_reduce(tensor, {ReduceOp::kAvg}); }, "floating-point"));
  }
}

TEST(NcclCommunicator, Broadcast) {
  TESSERA_REQUIRE_CUDA_TENSORS();
  NcclCommunicator& comm = nccl_world();
  for (c10::ScalarType dtype : kDtypes) {
    for (bool async : {false, true}) {
      for (int root : {0, comm.size() - 1}) {
        SCOPED_TRACE(trace(dtype, async) + " root " + std::to_string(root));
        at::Tensor tensor = rank_values(comm.rank(), 29, dtype).to(device_of(comm));
        BroadcastOptions options;
        options.root = root;
        options.async = async;
        finish(comm.broadcast(tensor, options), async);
        expect_result(tensor, rank_values(root, 29, dtype), ReduceOp::kSum);
      }
    }
  }
}

TEST(NcclCommunicator, Reduce) {
  TESSERA_REQUIRE_CUDA_TENSORS();
  NcclCommunicator& comm = nccl_world();
  const int root = comm.size() - 1;
  for (c10::ScalarType dtype : kDtypes) {
    for (ReduceOp op : kOps) {
      if (!supports(op, dtype)) continue;
      for (bool async : {false, true}) {
        SCOPED_TRACE(trace(dtype, async) + " " + reduce_op_name(op));
        const bool product = op == ReduceOp::kProduct;
        auto input_of = [&](int r) { return rank_values(r, 23, dtype, 1, product); };
        at::Tensor tensor = input_of(comm.rank()).to(device_of(comm));
        ReduceOptions options;
        options.op = op;
        options.root = root;
        options.async = async;
        finish(comm.reduce(tensor, options), async);
        if (comm.rank() == root) {
          expect_result(tensor, reduce_reference(op, dtype, comm.size(), input_of), op);
        } else {  // left unchanged
          expect_result(tensor, input_of(comm.rank()), ReduceOp::kSum);
        }
      }
    }
  }
}

TEST(NcclCommunicator, AllGather) {
  TESSERA_REQUIRE_CUDA_TENSORS();
  NcclCommunicator& comm = nccl_world();
  const int64_t n = 13;
  for (c10::ScalarType dtype : kDtypes) {
    for (bool async : {false, true}) {
      SCOPED_TRACE(trace(dtype, async));
      const at::Tensor input = rank_values(comm.rank(), n, dtype, 2).to(device_of(comm));
      at::Tensor output = at::empty({comm.size(), n}, at::TensorOptions(dtype).device(device_of(comm)));
      finish(comm.all_gather(output, input, {async}), async);
      std::vector<at::Tensor> pieces;
      for (int r = 0; r < comm.size(); ++r) pieces.push_back(rank_values(r, n, dtype, 2));
      expect_result(output, at::stack(pieces), ReduceOp::kSum);
    }
  }
}

TEST(NcclCommunicator, ReduceScatter) {
  TESSERA_REQUIRE_CUDA_TENSORS();
  NcclCommunicator& comm = nccl_world();
  const int64_t n = 11;  // per rank
  for (c10::ScalarType dtype : kDtypes) {
    for (ReduceOp op : kOps) {
      if (!supports(op, dtype)) continue;
      for (bool async : {false, true}) {
        SCOPED_TRACE(trace(dtype, async) + " " + reduce_op_name(op));
        const bool product = op == ReduceOp::kProduct;
        auto input_of = [&](int r) { return rank_values(r, comm.size() * n, dtype, 3, product); };
        const at::Tensor input = input_of(comm.rank()).to(device_of(comm));
        at::Tensor output = at::empty({n}, at::TensorOptions(dtype).device(device_of(comm)));
        ReduceScatterOptions options;
        options.op = op;
        options.async = async;
        finish(comm.reduce_scatter(output, input, options), async);
        const at::Tensor full = reduce_reference(op, dtype, comm.size(), input_of);
        expect_result(output, full.narrow(0, comm.rank() * n, n), op);
      }
    }
  }
}

TEST(NcclCommunicator, AllToAllEqualSplits) {
  TESSERA_REQUIRE_CUDA_TENSORS();
  NcclCommunicator& comm = nccl_world();
  const int64_t rows = 2;  // per peer
  const int64_t width = 3;
  for (c10::ScalarType dtype : kDtypes) {
    for (bool async : {false, true}) {
      SCOPED_TRACE(trace(dtype, async));
      auto input_of = [&](int r) { return rank_values(r, comm.size() * rows * width, dtype, 4).view({-1, width}); };
      const at::Tensor input = input_of(comm.rank()).to(device_of(comm));
      at::Tensor output = at::empty_like(input);
      AllToAllOptions options;
      options.async = async;
      finish(comm.all_to_all(output, input, options), async);
      std::vector<at::Tensor> pieces;
      for (int r = 0; r < comm.size(); ++r) {
        pieces.push_back(input_of(r).narrow(0, comm.rank() * rows, rows));
      }
      expect_result(output, at::cat(pieces), ReduceOp::kSum);
    }
  }
}

TEST(NcclCommunicator, AllToAllUnevenSplits) {
  TESSERA_REQUIRE_CUDA_TENSORS();
  NcclCommunicator& comm = nccl_world();
  const int size = comm.size();
  const int me = comm.rank();
  const int64_t width = 2;
  // Rows rank src sends to rank dst; some are zero.
  auto split = [](int src, int dst) { return static_cast<int64_t>((src + 2 * dst) % 3); };
  auto rows_of = [&](int src) {
    int64_t rows = 0;
    for (int dst = 0; dst < size; ++dst) rows += split(src, dst);
    return rows;
  };
  auto offset = [&](int src, int dst) {
    int64_t begin = 0;
    for (int d = 0; d < dst; ++d) begin += split(src, d);
    return begin;
  };
  AllToAllOptions options;
  int64_t out_rows = 0;
  for (int r = 0; r < size; ++r) {
    options.input_split_sizes.push_back(split(me, r));
    options.output_split_sizes.push_back(split(r, me));
    out_rows += split(r, me);
  }
  for (c10::ScalarType dtype : kDtypes) {
    for (bool async : {false, true}) {
      SCOPED_TRACE(trace(dtype, async));
      auto input_of = [&](int r) { return rank_values(r, rows_of(r) * width, dtype, 5).view({-1, width}); };
      const at::Tensor input = input_of(me).to(device_of(comm));
      at::Tensor output = at::empty({out_rows, width}, at::TensorOptions(dtype).device(device_of(comm)));
      options.async = async;
      finish(comm.all_to_all(output, input, options), async);
      std::vector<at::Tensor> pieces;
      for (int r = 0; r < size; ++r) {
        pieces.push_back(input_of(r).narrow(0, offset(r, me), split(r, me)));
      }
      expect_result(output, at::cat(pieces), ReduceOp::kSum);
    }
  }
}

TEST(NcclCommunicator, SendRecv) {
  TESSERA_REQUIRE_CUDA_TENSORS();
  NcclCommunicator& comm = nccl_world();
  if (comm.size() < 2) GTEST_SKIP() << "send/recv needs at least 2 ranks";
  const int me = comm.rank();
  // Pairs (0,1), (2,3), ...: the even rank sends first, the odd one receives
  // first, so each pair's calls match in order. An odd last rank sits out.
  const int peer = me % 2 == 0 ? me + 1 : me - 1;
  if (peer >= comm.size()) return;
  for (c10::ScalarType dtype : kDtypes) {
    for (bool async : {false, true}) {
      SCOPED_TRACE(trace(dtype, async));
      const at::Tensor mine = rank_values(me, 17, dtype, 6).to(device_of(comm));
      at::Tensor theirs = at::empty({17}, at::TensorOptions(dtype).device(device_of(comm)));
      SendOptions send_options;
      send_options.async = async;
      RecvOptions recv_options;
      recv_options.async = async;
      WorkPtr first;
      WorkPtr second;
      if (me % 2 == 0) {
        first = comm.send(mine, peer, send_options);
        second = comm.recv(theirs, peer, recv_options);
      } else {
        first = comm.recv(theirs, peer, recv_options);
        second = comm.send(mine, peer, send_options);
      }
      finish(first, async);
      finish(second, async);
      expect_result(theirs, rank_values(peer, 17, dtype, 6), ReduceOp::kSum);
    }
  }
}

TEST(NcclCommunicator, Barrier) {
  TESSERA_REQUIRE_GPU();
  nccl_world().barrier();
  WorkPtr work = nccl_world().barrier({true});
  work->wait();  // blocks the host until every rank has reached the barrier
  EXPECT_TRUE(work->is_completed());
  work->wait();  // a second wait does nothing
}

TEST(NcclCommunicator, DroppedWorkStillOrdersTheCurrentStream) {
  TESSERA_REQUIRE_CUDA_TENSORS();
  NcclCommunicator& comm = nccl_world();
  at::Tensor tensor = at::ones({1 << 20}, at::TensorOptions(at::kFloat).device(device_of(comm)));
  comm.all_reduce(tensor, {ReduceOp::kSum, /*async=*/true});  // handle dropped at once
  EXPECT_TRUE(at::equal(tensor.cpu(), at::full({1 << 20}, float(comm.size()))));
}

// Note [Flight recorder] on NCCL: each operation is recorded when issued;
// it is completed once the host sees its event (a host-blocking wait, or
// is_completed() returning true), and a stream-only wait leaves it issued.
TEST(NcclCommunicator, RecordsEachOperationInTheFlightRecorder) {
  TESSERA_REQUIRE_CUDA_TENSORS();
  FlightRecorderOptions o;
  o.entries = 16;
  o.dir = "";
  auto comm = NcclCommunicator::create(MPI_COMM_WORLD, device_for_this_rank(), "recorded",
                                       timeout_from_env(), nullptr, o);
  at::Tensor t = at::ones({5}, at::TensorOptions(at::kFloat).device(device_of(*comm)));
  at::Tensor gathered = at::empty({3 * comm->size()}, at::TensorOptions(at::kDouble).device(device_of(*comm)));
  WorkPtr reduced = comm->all_reduce(t, {ReduceOp::kSum, /*async=*/true});
  comm->all_gather(gathered, at::ones({3}, gathered.options()));
  reduced->wait();
  (void)t.cpu();  // the current stream, which waited for the all_reduce, has finished
  EXPECT_TRUE(reduced->is_completed());
  comm->barrier();
  const nlohmann::json r = nlohmann::json::parse(comm->flight_recorder()->to_json("test"));
  const nlohmann::json& e = r["entries"];
  ASSERT_EQ(e.size(), 3u);
  EXPECT_EQ(e[0]["op"], "all_reduce");
  EXPECT_EQ(e[0]["state"], "completed");  // is_completed() saw its event
  EXPECT_EQ(e[0]["bytes"], 20);
  EXPECT_EQ(e[0]["dtype"], "Float");
  EXPECT_EQ(e[1]["op"], "all_gather");
  EXPECT_EQ(e[1]["state"], "issued");  // only the stream waited for it
  EXPECT_EQ(e[1]["bytes"], 24 * comm->size());
  EXPECT_EQ(e[1]["dtype"], "Double");
  EXPECT_EQ(e[2]["op"], "barrier");
  EXPECT_EQ(e[2]["state"], "completed");  // the barrier blocks the host
  EXPECT_EQ(e[2]["collective"], 3);
  // The family also holds the MPI control channel; the NCCL row is the one.
  const nlohmann::json& row = r["communicators"][e[0]["comm"].get<size_t>()];
  EXPECT_EQ(row["name"], "recorded");
  EXPECT_EQ(row["backend"], "nccl");
  EXPECT_EQ(row["last_completed"], 3);
}

TEST(NcclCommunicator, Split) {
  TESSERA_REQUIRE_GPU();
  NcclCommunicator& comm = nccl_world();
  const int me = comm.rank();
  const int size = comm.size();
  // Same parity together, ordered by descending world rank (key).
  CommunicatorPtr half = comm.split(me % 2, size - me, "parity");
  ASSERT_NE(half, nullptr);
  int members = 0;
  int above = 0;
  for (int r = me % 2; r < size; r += 2) {
    ++members;
    if (r > me) ++above;
  }
  EXPECT_EQ(half->size(), members);
  EXPECT_EQ(half->rank(), above);
  EXPECT_EQ(half->name(), "parity");
  EXPECT_EQ(half->backend(), "nccl");
  half->barrier();
#ifdef TESSERA_HAVE_C10_CUDA
  at::Tensor tensor = at::full({5}, double(me + 1), at::TensorOptions(at::kDouble).device(device_of(comm)));
  half->all_reduce(tensor);
  double expected = 0;
  for (int r = me % 2; r < size; r += 2) expected += r + 1;
  EXPECT_TRUE(at::equal(tensor.cpu(), at::full({5}, expected, at::kDouble)));
#endif

  CommunicatorPtr without_zero = comm.split(me == 0 ? -1 : 0, me, "without-zero");
  if (me == 0) {
    EXPECT_EQ(without_zero, nullptr);
  } else {
    ASSERT_NE(without_zero, nullptr);
    EXPECT_EQ(without_zero->size(), size - 1);
    EXPECT_EQ(without_zero->rank(), me - 1);
  }
}

TEST(NcclCommunicator, RejectsBadArguments) {
  TESSERA_REQUIRE_CUDA_TENSORS();
  NcclCommunicator& comm = nccl_world();
  const auto on_gpu = at::TensorOptions(at::kFloat).device(device_of(comm));
  at::Tensor cpu = at::zeros({4});
  EXPECT_TRUE(test::throws_with([&] { comm.all_reduce(cpu); }, "must be a CUDA tensor"));
  EXPECT_TRUE(test::throws_with([&] { comm.all_reduce(cpu); }, "communicator 'world'"));
  at::Tensor strided = at::zeros({4, 4}, on_gpu).t();
  EXPECT_TRUE(test::throws_with([&] { comm.all_reduce(strided); }, "contiguous"));
  at::Tensor complex = at::zeros({4}, on_gpu.dtype(at::kComplexFloat));
  EXPECT_TRUE(test::throws_with([&] { comm.all_reduce(complex); }, "is not supported"));
  at::Tensor tensor = at::zeros({4}, on_gpu);
  BroadcastOptions bad_root;
  bad_root.root = comm.size();
  EXPECT_TRUE(test::throws_with([&] { comm.broadcast(tensor, bad_root); }, "root"));
  at::Tensor small = at::zeros({comm.size() * 4 - 1}, on_gpu);
  EXPECT_TRUE(test::throws_with([&] { comm.all_gather(small, tensor); }, "size() x input"));
  EXPECT_TRUE(test::throws_with([&] { comm.reduce_scatter(tensor, small); }, "size() x output"));
  at::Tensor doubles = at::zeros({comm.size() * 4}, on_gpu.dtype(at::kDouble));
  EXPECT_TRUE(test::throws_with([&] { comm.all_gather(doubles, tensor); }, "dtype"));
  EXPECT_TRUE(test::throws_with([&] { comm.send(tensor, comm.rank()); }, "itself"));
  EXPECT_TRUE(test::throws_with([&] { comm.recv(tensor, -1); }, "source"));
  AllToAllOptions only_input;
  only_input.input_split_sizes.assign(comm.size(), 0);
  at::Tensor rows = at::zeros({comm.size(), 2}, on_gpu);
  at::Tensor rows_out = at::zeros({comm.size(), 2}, on_gpu);
  EXPECT_TRUE(test::throws_with([&] { comm.all_to_all(rows_out, rows, only_input); }, "one entry per rank"));
  std::string why;
  if (visible_devices(&why) > 1) {
    const int other = (comm.device() + 1) % visible_devices(&why);
    const at::Device other_device(at::kCUDA, static_cast<c10::DeviceIndex>(other));
    at::Tensor elsewhere = at::zeros({4}, at::TensorOptions(at::kFloat).device(other_device));
    EXPECT_TRUE(test::throws_with([&] { comm.all_reduce(elsewhere); }, "this communicator uses cuda:"));
  }
}

}  // namespace
}  // namespace comm
}  // namespace tessera
