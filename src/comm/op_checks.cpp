#include "op_checks.h"

#include "tessera/core/dtype.h"
#include "tessera/core/error.h"

#include <numeric>

namespace tessera {
namespace comm {
namespace {

std::vector<int64_t> row_counts(const std::vector<int64_t>& splits, int64_t row_numel) {
  std::vector<int64_t> counts(splits.size());
  for (size_t i = 0; i < splits.size(); ++i) counts[i] = splits[i] * row_numel;
  return counts;
}

std::vector<int64_t> displacements(const std::vector<int64_t>& counts) {
  std::vector<int64_t> displs(counts.size(), 0);
  for (size_t i = 1; i < counts.size(); ++i) displs[i] = displs[i - 1] + counts[i - 1];
  return displs;
}

}  // namespace

std::string where(const Communicator& comm, OpType op) {
  return op_type_name(op) + " on communicator '" + comm.name() + "' (size " + std::to_string(comm.size()) + ")";
}

void check_tensor(const Communicator& comm, OpType op, const at::Tensor& tensor, const char* what) {
  TORCH_CHECK(tensor.defined(), where(comm, op), ": the ", what, " tensor is undefined");
  TORCH_CHECK(tensor.is_contiguous(), where(comm, op), ": the ", what,
              " tensor must be contiguous (call .contiguous() first); sizes ", tensor.sizes(), ", strides ",
              tensor.strides());
  TORCH_CHECK(is_supported_comm_dtype(tensor.scalar_type()), where(comm, op), ": dtype ",
              dtype_name(tensor.scalar_type()),
              " is not supported; use float32, float64, bfloat16, float16, int32, int64, uint8 or bool");
}

void check_same_dtype(const Communicator& comm, OpType op, const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), where(comm, op), ": input dtype ", dtype_name(b.scalar_type()),
              " differs from output dtype ", dtype_name(a.scalar_type()));
  TORCH_CHECK(a.device() == b.device(), where(comm, op), ": input on ", b.device(), " but output on ", a.device());
}

void check_numel(const Communicator& comm, OpType op, const char* what, int64_t actual, int64_t expected,
                 const char* rule) {
  TORCH_CHECK(actual == expected, where(comm, op), ": ", what, " has ", actual, " elements but ", expected,
              " are required (", rule, ")");
}

void check_rank(const Communicator& comm, OpType op, const char* what, int rank, bool allow_self) {
  TORCH_CHECK(rank >= 0 && rank < comm.size(), where(comm, op), ": ", what, " ", rank, " is outside [0, ", comm.size(),
              ")");
  TORCH_CHECK(allow_self || rank != comm.rank(), where(comm, op), ": ", what, " ", rank, " is the calling rank itself");
}

void check_reduce_op(const Communicator& comm, OpType op, ReduceOp reduce, c10::ScalarType type) {
  if (reduce != ReduceOp::kAvg) return;
  TORCH_CHECK(c10::isFloatingType(type), where(comm, op), ": reduce op avg needs a floating-point dtype, got ",
              dtype_name(type), "; use sum and divide yourself");
}

AllToAllLayout all_to_all_layout(const Communicator& comm, const at::Tensor& output, const at::Tensor& input,
                                 const AllToAllOptions& options) {
  const OpType op = OpType::kAllToAll;
  const int n = comm.size();
  AllToAllLayout layout;
  TORCH_CHECK(input.dim() >= 1 && output.dim() >= 1, where(comm, op),
              ": input and output need at least one dimension (rows are split along dimension 0)");
  const int64_t in_row = input.size(0) == 0 ? 0 : input.numel() / input.size(0);
  const int64_t out_row = output.size(0) == 0 ? 0 : output.numel() / output.size(0);
  const bool has_in = !options.input_split_sizes.empty();
  const bool has_out = !options.output_split_sizes.empty();
  if (!has_in && !has_out) {
    TORCH_CHECK(input.size(0) % n == 0, where(comm, op), ": input dimension 0 (", input.size(0),
                ") must be divisible by the group size ", n, " for equal splits; pass split sizes otherwise");
    check_numel(comm, op, "output", output.numel(), input.numel(),
                "equal splits need output and input of the same size");
    const int64_t chunk = input.numel() / n;
    layout.send_counts.assign(n, chunk);
    layout.recv_counts.assign(n, chunk);
  } else {
    layout.equal = false;
    TORCH_CHECK(options.input_split_sizes.size() == static_cast<size_t>(n) &&
                    options.output_split_sizes.size() == static_cast<size_t>(n),
                where(comm, op), ": input_split_sizes (", options.input_split_sizes.size(),
                " entries) and output_split_sizes (", options.output_split_sizes.size(),
                " entries) must both have one entry per rank (", n, ")");
    const auto in_rows =
        std::accumulate(options.input_split_sizes.begin(), options.input_split_sizes.end(), int64_t{0});
    const auto out_rows =
        std::accumulate(options.output_split_sizes.begin(), options.output_split_sizes.end(), int64_t{0});
    TORCH_CHECK(in_rows == input.size(0), where(comm, op), ": input_split_sizes ", join_list(options.input_split_sizes),
                " sum to ", in_rows, " but input has ", input.size(0), " rows");
    TORCH_CHECK(out_rows == output.size(0), where(comm, op), ": output_split_sizes ",
                join_list(options.output_split_sizes), " sum to ", out_rows, " but output has ", output.size(0),
                " rows");
    TORCH_CHECK(in_row == out_row || input.numel() == 0 || output.numel() == 0, where(comm, op), ": input rows have ",
                in_row, " elements but output rows have ", out_row);
    layout.send_counts = row_counts(options.input_split_sizes, in_row);
    layout.recv_counts = row_counts(options.output_split_sizes, out_row);
  }
  layout.send_displs = displacements(layout.send_counts);
  layout.recv_displs = displacements(layout.recv_counts);
  return layout;
}

void validate_all_reduce(const Communicator& comm, const at::Tensor& tensor, ReduceOp op) {
  check_tensor(comm, OpType::kAllReduce, tensor, "input");
  check_reduce_op(comm, OpType::kAllReduce, op, tensor.scalar_type());
}

void validate_broadcast(const Communicator& comm, const at::Tensor& tensor, int root) {
  check_tensor(comm, OpType::kBroadcast, tensor, "input");
  check_rank(comm, OpType::kBroadcast, "root", root, true);
}

void validate_reduce(const Communicator& comm, const at::Tensor& tensor, int root, ReduceOp op) {
  check_tensor(comm, OpType::kReduce, tensor, "input");
  check_rank(comm, OpType::kReduce, "root", root, true);
  check_reduce_op(comm, OpType::kReduce, op, tensor.scalar_type());
}

void validate_all_gather(const Communicator& comm, const at::Tensor& output, const at::Tensor& input) {
  const OpType op = OpType::kAllGather;
  check_tensor(comm, op, input, "input");
  check_tensor(comm, op, output, "output");
  check_same_dtype(comm, op, output, input);
  check_numel(comm, op, "output", output.numel(), input.numel() * comm.size(),
              "all_gather output must hold size() x input elements");
}

void validate_reduce_scatter(const Communicator& comm, const at::Tensor& output, const at::Tensor& input,
                             ReduceOp reduce) {
  const OpType op = OpType::kReduceScatter;
  check_tensor(comm, op, input, "input");
  check_tensor(comm, op, output, "output");
  check_same_dtype(comm, op, output, input);
  check_reduce_op(comm, op, reduce, input.scalar_type());
  check_numel(comm, op, "input", input.numel(), output.numel() * comm.size(),
              "reduce_scatter input must hold size() x output elements");
}

AllToAllLayout validate_all_to_all(const Communicator& comm, const at::Tensor& output, const at::Tensor& input,
                                   const AllToAllOptions& options) {
  const OpType op = OpType::kAllToAll;
  check_tensor(comm, op, input, "input");
  check_tensor(comm, op, output, "output");
  check_same_dtype(comm, op, output, input);
  return all_to_all_layout(comm, output, input, options);
}

void validate_batch(const Communicator& comm, const std::vector<P2POp>& ops) {
  for (const auto& o : ops) {
    const bool send = o.kind == P2POp::Kind::kSend;
    const OpType op = send ? OpType::kSend : OpType::kRecv;
    check_tensor(comm, op, o.tensor, send ? "input" : "output");
    check_rank(comm, op, send ? "destination" : "source", o.peer, /*allow_self=*/true);
  }
}

}  // namespace comm
}  // namespace tessera
