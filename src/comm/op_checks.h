#pragma once
// Argument checks shared by every backend, so that a wrong call gets the same
// message whichever backend runs it: the operation, the communicator's name,
// the offending value and the rule.
#include "tessera/comm/communicator.h"

#include <cstdint>
#include <string>
#include <vector>

namespace tessera {
namespace comm {

// "all_reduce on communicator 'data' (size 4)": how every message starts.
std::string where(const Communicator& comm, OpType op);

// Defined, contiguous, of a supported dtype.
void check_tensor(const Communicator& comm, OpType op, const at::Tensor& tensor, const char* what);
void check_same_dtype(const Communicator& comm, OpType op, const at::Tensor& a, const at::Tensor& b);
void check_numel(const Communicator& comm, OpType op, const char* what, int64_t actual, int64_t expected,
                 const char* rule);
void check_rank(const Communicator& comm, OpType op, const char* what, int rank, bool allow_self);
void check_reduce_op(const Communicator& comm, OpType op, ReduceOp reduce, c10::ScalarType type);

// Element counts and displacements of an all_to_all, per rank, from the
// options' row splits (equal splits when both are empty).
struct AllToAllLayout {
  bool equal = true;
  std::vector<int64_t> send_counts, send_displs, recv_counts, recv_displs;
};
AllToAllLayout all_to_all_layout(const Communicator& comm, const at::Tensor& output, const at::Tensor& input,
                                 const AllToAllOptions& options);

// Every local check of one collective's arguments, in one place for the
// backends and the checked decorator.
void validate_all_reduce(const Communicator& comm, const at::Tensor& tensor, ReduceOp op);
void validate_broadcast(const Communicator& comm, const at::Tensor& tensor, int root);
void validate_reduce(const Communicator& comm, const at::Tensor& tensor, int root, ReduceOp op);
void validate_all_gather(const Communicator& comm, const at::Tensor& output, const at::Tensor& input);
void validate_reduce_scatter(const Communicator& comm, const at::Tensor& output, const at::Tensor& input,
                             ReduceOp op);
AllToAllLayout validate_all_to_all(const Communicator& comm, const at::Tensor& output, const at::Tensor& input,
                                   const AllToAllOptions& options);
// Each op of a batch_isend_irecv: its tensor, and a peer in range (itself allowed).
void validate_batch(const Communicator& comm, const std::vector<P2POp>& ops);

}  // namespace comm
}  // namespace tessera
