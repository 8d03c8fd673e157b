#include "tessera/comm/checked_communicator.h"

#include "op_checks.h"
#include "tessera/core/dtype.h"
#include "tessera/core/error.h"

#include <ATen/ATen.h>

#include <exception>
#include <functional>
#include <map>

namespace tessera {
namespace comm {
namespace {

constexpr int kMaxDims = 8;
// op, dtype, root, reduce op, input numel, output numel, ndim, valid, dims[kMaxDims]
constexpr int kFixedFields = 8 + kMaxDims;

std::vector<int64_t> shape_of(const at::Tensor& t) { return t.defined() ? t.sizes().vec() : std::vector<int64_t>{}; }

}  // namespace

// What one rank is about to call, in a form every rank can compare.
struct CheckedCommunicator::Call {
  OpType op;
  c10::ScalarType dtype = c10::kFloat;
  int64_t root = -1;        // broadcast/reduce root, -1 otherwise
  int64_t reduce_op = -1;   // ReduceOp, -1 when the op does not reduce
  int64_t input_numel = 0;  // the numel every rank must agree on
  int64_t output_numel = 0;
  std::vector<int64_t> shape;   // for messages
  std::vector<int64_t> splits;  // all_to_all: input splits then output splits
  int64_t valid = 1;            // 0 when this rank's own arguments were rejected

  std::vector<int64_t> encode() const {
    std::vector<int64_t> v(kFixedFields, -1);
    v[0] = static_cast<int64_t>(op);
    v[1] = static_cast<int64_t>(dtype);
    v[2] = root;
    v[3] = reduce_op;
    v[4] = input_numel;
    v[5] = output_numel;
    v[6] = static_cast<int64_t>(shape.size());
    v[7] = valid;
    for (size_t i = 0; i < shape.size() && i < kMaxDims; ++i) v[8 + i] = shape[i];
    v.insert(v.end(), splits.begin(), splits.end());
    return v;
  }

  static Call decode(const int64_t* v, int64_t splits) {
    Call c;
    c.op = static_cast<OpType>(v[0]);
    c.dtype = static_cast<c10::ScalarType>(v[1]);
    c.root = v[2];
    c.reduce_op = v[3];
    c.input_numel = v[4];
    c.output_numel = v[5];
    c.valid = v[7];
    for (int64_t i = 0; i < v[6] && i < kMaxDims; ++i) c.shape.push_back(v[8 + i]);
    c.splits.assign(v + kFixedFields, v + kFixedFields + splits);
    return c;
  }

  std::string describe() const {
    std::string s = op_type_name(op) + "(" + dtype_name(dtype) + ", shape " + join_list(shape);
    if (root >= 0) s += ", root " + std::to_string(root);
    if (reduce_op >= 0) s += ", " + reduce_op_name(static_cast<ReduceOp>(reduce_op));
    if (!splits.empty()) s += ", splits " + join_list(splits);
    return s + ")";
  }

  bool same_as(const Call& o) const {
    return op == o.op && dtype == o.dtype && root == o.root && reduce_op == o.reduce_op &&
           input_numel == o.input_numel && (splits.empty() || o.splits.empty() || splits.size() == o.splits.size());
  }
};

CheckedCommunicator::CheckedCommunicator(CommunicatorPtr inner) : inner_(std::move(inner)) {
  TORCH_CHECK(inner_ != nullptr, "CheckedCommunicator needs a communicator to wrap");
  channel_ = inner_->control();
  if (channel_ != inner_) control_ = std::make_shared<CheckedCommunicator>(channel_);
}

CommunicatorPtr CheckedCommunicator::control() {
  if (control_) return control_;
  return shared_from_this();
}

// Note [Checked argument errors]
// A call whose arguments are wrong on some ranks only would leave the others
// waiting in the collective. So each rank validates its own arguments first
// (with the checks the backends use, op_checks.h), and the outcome travels in
// the descriptor: the ranks that rejected their arguments throw their own
// error, the others throw one naming those ranks.
void CheckedCommunicator::check_collective(Call call, const std::function<void()>& validate) {
  const int n = size();
  std::exception_ptr local_error;
  try {
    validate();
  } catch (const c10::Error&) {
    local_error = std::current_exception();
    call.valid = 0;
  }
  // all_to_all always carries 2n split entries so every rank's record has the same length.
  const int64_t splits = call.op == OpType::kAllToAll ? 2 * n : 0;
  std::vector<int64_t> mine = call.encode();
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(mine.size()) == kFixedFields + splits);
  auto options = at::TensorOptions().dtype(at::kLong);
  at::Tensor local = at::tensor(mine, options);
  at::Tensor all = at::empty({n * static_cast<int64_t>(mine.size())}, options);
  channel_->all_gather(all, local)->wait();
  const int64_t* data = all.data_ptr<int64_t>();
  std::vector<Call> calls;
  for (int r = 0; r < n; ++r) calls.push_back(Call::decode(data + r * mine.size(), splits));

  if (local_error) std::rethrow_exception(local_error);
  std::vector<int> rejected;
  for (int r = 0; r < n; ++r) {
    if (!calls[r].valid) rejected.push_back(r);
  }
  TORCH_CHECK(rejected.empty(), op_type_name(call.op), " on communicator '", name(), "' abandoned: rank(s) ",
              join_list(rejected), " rejected their arguments (the error on those ranks says why)");

  std::vector<int> differing;
  for (int r = 1; r < n; ++r) {
    if (!calls[r].same_as(calls[0])) differing.push_back(r);
  }
  // all_to_all: what r sends to s must be what s expects from r.
  if (differing.empty() && call.op == OpType::kAllToAll && !calls[0].splits.empty()) {
    for (int r = 0; r < n; ++r) {
      for (int s = 0; s < n; ++s) {
        if (calls[r].splits[s] != calls[s].splits[n + r]) {
          TORCH_CHECK(false, "collective mismatch on communicator '", name(), "': rank ", r, " sends ",
                      calls[r].splits[s], " rows to rank ", s, ", which expects ", calls[s].splits[n + r],
                      " rows from it; rank ", r, " calls ", calls[r].describe(), ", rank ", s, " calls ",
                      calls[s].describe());
        }
      }
    }
  }
  if (differing.empty()) return;
  std::string message = "collective mismatch on communicator '" + name() + "' (size " + std::to_string(n) +
                        "): ranks " + join_list(differing) + " differ from rank 0. Calls:";
  for (int r = 0; r < n; ++r) message += "\n  rank " + std::to_string(r) + ": " + calls[r].describe();
  TORCH_CHECK(false, message);
}

namespace {

std::vector<int64_t> all_to_all_splits(const AllToAllOptions& options, int n) {
  if (options.input_split_sizes.empty() && options.output_split_sizes.empty()) return std::vector<int64_t>(2 * n, -1);
  std::vector<int64_t> splits(2 * n, -1);
  for (int i = 0; i < n && i < static_cast<int>(options.input_split_sizes.size()); ++i)
    splits[i] = options.input_split_sizes[i];
  for (int i = 0; i < n && i < static_cast<int>(options.output_split_sizes.size()); ++i)
    splits[n + i] = options.output_split_sizes[i];
  return splits;
}

}  // namespace

WorkPtr CheckedCommunicator::all_reduce(at::Tensor& tensor, const AllReduceOptions& options) {
  check_collective({OpType::kAllReduce,
                    tensor.scalar_type(),
                    -1,
                    static_cast<int64_t>(options.op),
                    tensor.numel(),
                    tensor.numel(),
                    shape_of(tensor),
                    {}},
                   [&] { validate_all_reduce(*this, tensor, options.op); });
  return inner_->all_reduce(tensor, options);
}

WorkPtr CheckedCommunicator::broadcast(at::Tensor& tensor, const BroadcastOptions& options) {
  check_collective({OpType::kBroadcast,
                    tensor.scalar_type(),
                    options.root,
                    -1,
                    tensor.numel(),
                    tensor.numel(),
                    shape_of(tensor),
                    {}},
                   [&] { validate_broadcast(*this, tensor, options.root); });
  return inner_->broadcast(tensor, options);
}

WorkPtr CheckedCommunicator::reduce(at::Tensor& tensor, const ReduceOptions& options) {
  check_collective({OpType::kReduce,
                    tensor.scalar_type(),
                    options.root,
                    static_cast<int64_t>(options.op),
                    tensor.numel(),
                    tensor.numel(),
                    shape_of(tensor),
                    {}},
                   [&] { validate_reduce(*this, tensor, options.root, options.op); });
  return inner_->reduce(tensor, options);
}

WorkPtr CheckedCommunicator::all_gather(at::Tensor& output, const at::Tensor& input, const AllGatherOptions& options) {
  check_collective(
      {OpType::kAllGather, input.scalar_type(), -1, -1, input.numel(), output.numel(), shape_of(input), {}},
      [&] { validate_all_gather(*this, output, input); });
  return inner_->all_gather(output, input, options);
}

WorkPtr CheckedCommunicator::reduce_scatter(at::Tensor& output, const at::Tensor& input,
                                            const ReduceScatterOptions& options) {
  check_collective({OpType::kReduceScatter,
                    input.scalar_type(),
                    -1,
                    static_cast<int64_t>(options.op),
                    input.numel(),
                    output.numel(),
                    shape_of(input),
                    {}},
                   [&] { validate_reduce_scatter(*this, output, input, options.op); });
  return inner_->reduce_scatter(output, input, options);
}

WorkPtr CheckedCommunicator::all_to_all(at::Tensor& output, const at::Tensor& input, const AllToAllOptions& options) {
  // With uneven splits the sizes legitimately differ per rank; the split
  // cross-check replaces the numel comparison.
  const bool equal = options.input_split_sizes.empty() && options.output_split_sizes.empty();
  const int64_t row = input.dim() > 0 && input.size(0) > 0 ? input.numel() / input.size(0) : 0;
  check_collective({OpType::kAllToAll, input.scalar_type(), -1, -1, equal ? input.numel() : row, output.numel(),
                    shape_of(input), all_to_all_splits(options, size())},
                   [&] { validate_all_to_all(*this, output, input, options); });
  return inner_->all_to_all(output, input, options);
}

namespace {

// Note [Checked point-to-point]
// Each send's descriptor travels on the control channel while the payload
// travels on the device channel; both keep the order of messages between one
// pair of ranks, so the receiver's descriptors pair with its payloads. Both
// sides post descriptors and payloads without blocking, so an asynchronous
// recv stays asynchronous (a ring of "recv async, then send" must not
// deadlock); the receiver checks the descriptors in wait() (or in the
// is_completed() that finds them in), before it waits for the payloads.
class CheckedP2PWork : public Work {
 public:
  CheckedP2PWork(WorkPtr descriptors, WorkPtr payloads, std::function<void()> check)
      : descriptors_(std::move(descriptors)), payloads_(std::move(payloads)), check_(std::move(check)) {}

  void wait() override {
    descriptors_->wait();
    run_check();
    payloads_->wait();
  }

  // Checks the descriptors once they are in (a local comparison), so that a
  // caller that only polls sees the work complete.
  bool is_completed() override {
    if (!descriptors_->is_completed()) return false;
    run_check();
    return payloads_->is_completed();
  }

 private:
  void run_check() {
    if (!check_) return;
    auto check = std::move(check_);
    check_ = nullptr;
    check();
  }

  WorkPtr descriptors_;
  WorkPtr payloads_;
  std::function<void()> check_;
};

}  // namespace

WorkPtr CheckedCommunicator::send(const at::Tensor& tensor, int dst, const SendOptions& options) {
  check_rank(*this, OpType::kSend, "destination", dst, /*allow_self=*/false);  // only a batch may send to itself
  auto work = batch_isend_irecv({{P2POp::Kind::kSend, tensor, dst}});
  if (!options.async) work->wait();
  return work;
}

WorkPtr CheckedCommunicator::recv(at::Tensor& tensor, int src, const RecvOptions& options) {
  check_rank(*this, OpType::kRecv, "source", src, /*allow_self=*/false);
  auto work = batch_isend_irecv({{P2POp::Kind::kRecv, tensor, src}});
  if (!options.async) work->wait();
  return work;
}

WorkPtr CheckedCommunicator::batch_isend_irecv(const std::vector<P2POp>& ops) {
  std::vector<P2POp> descriptors;
  std::vector<std::function<void()>> checks;
  for (const auto& o : ops) {
    if (o.kind == P2POp::Kind::kSend) {
      const Call call{OpType::kSend, o.tensor.scalar_type(), -1, -1, o.tensor.numel(), o.tensor.numel(),
                      shape_of(o.tensor), {}};
      descriptors.push_back({P2POp::Kind::kSend, at::tensor(call.encode(), at::TensorOptions().dtype(at::kLong)),
                             o.peer});
      continue;
    }
    at::Tensor desc = at::empty({kFixedFields}, at::TensorOptions().dtype(at::kLong));
    descriptors.push_back({P2POp::Kind::kRecv, desc, o.peer});
    checks.push_back([this, desc, src = o.peer, dtype = o.tensor.scalar_type(), numel = o.tensor.numel(),
                      shape = shape_of(o.tensor)] {
      Call theirs = Call::decode(desc.data_ptr<int64_t>(), 0);
      TORCH_CHECK(theirs.op == OpType::kSend && theirs.dtype == dtype && theirs.input_numel == numel,
                  "point-to-point mismatch on communicator '", name(), "': rank ", src, " calls ", theirs.describe(),
                  " to rank ", rank(), ", which calls recv(", dtype_name(dtype), ", shape ", join_list(shape),
                  ") from it");
    });
  }
  WorkPtr described = channel_->batch_isend_irecv(descriptors);
  WorkPtr payloads = inner_->batch_isend_irecv(ops);
  return std::make_shared<CheckedP2PWork>(described, payloads, [checks] {
    for (const auto& c : checks) c();
  });
}

WorkPtr CheckedCommunicator::barrier(const BarrierOptions& options) {
  check_collective({OpType::kBarrier, c10::kFloat, -1, -1, 0, 0, {}, {}}, [] {});
  return inner_->barrier(options);
}

CommunicatorPtr CheckedCommunicator::split(int color, int key, const std::string& name) {
  auto child = inner_->split(color, key, name);
  if (!child) return nullptr;
  return std::make_shared<CheckedCommunicator>(std::move(child));
}

}  // namespace comm
}  // namespace tessera
