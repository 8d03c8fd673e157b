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

}  // namespace comm
}  // namespace tessera
