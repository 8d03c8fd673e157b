#pragma once
// Autograd-aware collectives: the building blocks of every tensor- and
// sequence-parallel layer. Each is a torch::autograd::Function whose backward
// is the collective's adjoint, written once here.
//
//   op                        forward                       backward
//   copy_to_group             identity                      all-reduce (sum)
//   reduce_from_group         all-reduce (sum)              identity
//   split_along_dim           keep this rank's chunk        all-gather along dim
//   gather_along_dim          all-gather along dim          keep this rank's chunk
//   all_gather_along_dim      all-gather along dim          reduce-scatter along dim
//   reduce_scatter_along_dim  reduce-scatter along dim      all-gather along dim
//   all_to_all_along_dims     scatter dim a, gather dim b   scatter b, gather a
//   all_to_all_rows           rows by send/recv splits      rows by recv/send splits
//
// gather_along_dim assumes the gathered tensor's gradient is the same on every
// rank (replicated compute after the gather); all_gather_along_dim assumes each
// rank holds a partial gradient that must be summed (Megatron's sequence
// parallelism). Dimensions must divide by the group size.
#include "tessera/comm/communicator.h"

#include <vector>

namespace tessera {
namespace comm {

at::Tensor copy_to_group(const at::Tensor& input, const CommunicatorPtr& comm);
at::Tensor reduce_from_group(const at::Tensor& input, const CommunicatorPtr& comm);
at::Tensor split_along_dim(const at::Tensor& input, int64_t dim, const CommunicatorPtr& comm);
at::Tensor gather_along_dim(const at::Tensor& input, int64_t dim, const CommunicatorPtr& comm);
at::Tensor all_gather_along_dim(const at::Tensor& input, int64_t dim, const CommunicatorPtr& comm);
at::Tensor reduce_scatter_along_dim(const at::Tensor& input, int64_t dim, const CommunicatorPtr& comm);
at::Tensor all_to_all_along_dims(const at::Tensor& input, int64_t scatter_dim, int64_t gather_dim,
                                 const CommunicatorPtr& comm);
// Rows of dimension 0: send_splits[r] rows go to rank r, recv_splits[r] come
// from it (every rank's send_splits[r] is rank r's recv_splits of it; agree
// them first). Splits may be zero; a rank that sends and receives nothing
// still takes part.
at::Tensor all_to_all_rows(const at::Tensor& input, std::vector<int64_t> send_splits,
                           std::vector<int64_t> recv_splits, const CommunicatorPtr& comm);

// The same data movements without autograd, for code that manages gradients
// itself (they are what the Functions above call).
namespace raw {
at::Tensor all_reduce(const at::Tensor& input, const Communicator& comm);
at::Tensor split(const at::Tensor& input, int64_t dim, const Communicator& comm);
at::Tensor all_gather(const at::Tensor& input, int64_t dim, const Communicator& comm);
at::Tensor reduce_scatter(const at::Tensor& input, int64_t dim, const Communicator& comm);
at::Tensor all_to_all(const at::Tensor& input, int64_t scatter_dim, int64_t gather_dim, const Communicator& comm);
at::Tensor all_to_all_rows(const at::Tensor& input, const std::vector<int64_t>& send_splits,
                           const std::vector<int64_t>& recv_splits, const Communicator& comm);
}  // namespace raw

}  // namespace comm
}  // namespace tessera
