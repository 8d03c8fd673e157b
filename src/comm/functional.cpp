#include "tessera/comm/functional.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

namespace tessera {
namespace comm {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace raw {
namespace {

int64_t checked_dim(const at::Tensor& input, int64_t dim, const Communicator& comm, const char* op) {
  TORCH_CHECK(input.dim() > 0, op, " on communicator '", comm.name(),
              "': a 0-dimensional tensor has no dimension to split");
  const int64_t d = dim < 0 ? dim + input.dim() : dim;
  TORCH_CHECK(d >= 0 && d < input.dim(), op, " on communicator '", comm.name(), "': dimension ", dim,
              " is out of range for a tensor of shape ", input.sizes());
  return d;
}

void check_divisible(const at::Tensor& input, int64_t dim, const Communicator& comm, const char* op) {
  TORCH_CHECK(input.size(dim) % comm.size() == 0, op, " on communicator '", comm.name(), "': dimension ", dim,
              " of shape ", input.sizes(), " (", input.size(dim), ") is not divisible by the group size ", comm.size(),
              "; pad it or choose a group size that divides it");
}

// [n, chunk...] contiguous, chunk i = input.chunk(n, dim)[i].
at::Tensor stack_chunks(const at::Tensor& input, int64_t dim, int64_t n) {
  std::vector<int64_t> shape = input.sizes().vec();
  shape[dim] /= n;
  shape.insert(shape.begin() + dim, n);
  // [.., n, chunk_d, ..] -> move n to the front.
  return input.reshape(shape).movedim(dim, 0).contiguous();
}

// Inverse of stack_chunks: [n, chunk...] -> concatenation along dim.
at::Tensor unstack_chunks(const at::Tensor& stacked, int64_t dim) {
  at::Tensor moved = stacked.movedim(0, dim);
  std::vector<int64_t> shape = moved.sizes().vec();
  shape[dim] *= shape[dim + 1];
  shape.erase(shape.begin() + dim + 1);
  return moved.reshape(shape);
}

}  // namespace

at::Tensor all_reduce(const at::Tensor& input, const Communicator& comm) {
  at::Tensor out = input.contiguous().clone();
  const_cast<Communicator&>(comm).all_reduce(out);
  return out;
}

at::Tensor split(const at::Tensor& input, int64_t dim, const Communicator& comm) {
  if (comm.size() == 1) return input;
  const int64_t d = checked_dim(input, dim, comm, "split_along_dim");
  check_divisible(input, d, comm, "split_along_dim");
  return input.chunk(comm.size(), d)[comm.rank()].contiguous();
}

at::Tensor all_gather(const at::Tensor& input, int64_t dim, const Communicator& comm) {
  if (comm.size() == 1) return input;
  const int64_t d = checked_dim(input, dim, comm, "all_gather_along_dim");
  at::Tensor in = input.contiguous();
  std::vector<int64_t> stacked_shape = in.sizes().vec();
  stacked_shape.insert(stacked_shape.begin(), comm.size());
  at::Tensor stacked = at::empty(stacked_shape, in.options());
  const_cast<Communicator&>(comm).all_gather(stacked, in);
  return unstack_chunks(stacked, d);
}

at::Tensor reduce_scatter(const at::Tensor& input, int64_t dim, const Communicator& comm) {
  if (comm.size() == 1) return input;
  const int64_t d = checked_dim(input, dim, comm, "reduce_scatter_along_dim");
  check_divisible(input, d, comm, "reduce_scatter_along_dim");
  at::Tensor stacked = stack_chunks(input, d, comm.size());
  at::Tensor out = at::empty(stacked.sizes().slice(1), stacked.options());
  const_cast<Communicator&>(comm).reduce_scatter(out, stacked);
  return out;
}

at::Tensor all_to_all(const at::Tensor& input, int64_t scatter_dim, int64_t gather_dim, const Communicator& comm) {
  if (comm.size() == 1) return input;
  const int64_t s = checked_dim(input, scatter_dim, comm, "all_to_all_along_dims");
  const int64_t g = checked_dim(input, gather_dim, comm, "all_to_all_along_dims");
  check_divisible(input, s, comm, "all_to_all_along_dims");
  at::Tensor stacked = stack_chunks(input, s, comm.size());
  at::Tensor received = at::empty_like(stacked);
  const_cast<Communicator&>(comm).all_to_all(received, stacked);
  // received[r] is rank r's chunk of our scatter-dim slice: concatenate along g.
  return unstack_chunks(received, g);
}

at::Tensor all_to_all_rows(const at::Tensor& input, const std::vector<int64_t>& send_splits,
                           const std::vector<int64_t>& recv_splits, const Communicator& comm) {
  const auto n = static_cast<size_t>(comm.size());
  TORCH_CHECK(input.dim() > 0, "all_to_all_rows on communicator '", comm.name(),
              "': a 0-dimensional tensor has no rows");
  TORCH_CHECK(send_splits.size() == n && recv_splits.size() == n, "all_to_all_rows on communicator '", comm.name(),
              "': ", send_splits.size(), " send and ", recv_splits.size(), " receive splits for a group of ", n,
              " ranks; give one of each per rank");
  int64_t sent = 0, received = 0;
  for (size_t r = 0; r < n; ++r) {
    TORCH_CHECK(send_splits[r] >= 0 && recv_splits[r] >= 0, "all_to_all_rows on communicator '", comm.name(),
                "': negative split for rank ", r);
    sent += send_splits[r];
    received += recv_splits[r];
  }
  TORCH_CHECK(sent == input.size(0), "all_to_all_rows on communicator '", comm.name(), "': send splits sum to ", sent,
              " rows, but the input has ", input.size(0));
  std::vector<int64_t> shape = input.sizes().vec();
  shape[0] = received;
  at::Tensor out = at::empty(shape, input.options());
  if (n == 1) return out.copy_(input);
  AllToAllOptions options;
  options.input_split_sizes = send_splits;
  options.output_split_sizes = recv_splits;
  const_cast<Communicator&>(comm).all_to_all(out, input.contiguous(), options);
  return out;
}

}  // namespace raw

namespace {

// Note [Communicators in autograd contexts]
// AutogradContext::saved_data holds IValues; a communicator travels inside an
// IValue capsule so backward uses the same group as forward, with its lifetime
// tied to the graph and no registry of groups.
struct CommHolder : torch::CustomClassHolder {
  explicit CommHolder(CommunicatorPtr c) : comm(std::move(c)) {}
  CommunicatorPtr comm;
};

void save_comm(AutogradContext* ctx, const CommunicatorPtr& comm) {
  TORCH_CHECK(comm != nullptr, "autograd collective called with a null communicator");
  ctx->saved_data["comm"] = at::IValue::make_capsule(c10::make_intrusive<CommHolder>(comm));
}

const Communicator& load_comm(AutogradContext* ctx) {
  auto capsule = ctx->saved_data["comm"].toCapsule();
  return *static_cast<CommHolder*>(capsule.get())->comm;
}

struct CopyToGroup : torch::autograd::Function<CopyToGroup> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, CommunicatorPtr comm) {
    save_comm(ctx, comm);
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {raw::all_reduce(g[0], load_comm(ctx)), at::Tensor()};
  }
};

struct ReduceFromGroup : torch::autograd::Function<ReduceFromGroup> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, CommunicatorPtr comm) {
    save_comm(ctx, comm);
    return raw::all_reduce(x, *comm);
  }
  static variable_list backward(AutogradContext*, variable_list g) { return {g[0], at::Tensor()}; }
};

struct SplitAlongDim : torch::autograd::Function<SplitAlongDim> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t dim, CommunicatorPtr comm) {
    save_comm(ctx, comm);
    ctx->saved_data["dim"] = dim;
    return raw::split(x, dim, *comm);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {raw::all_gather(g[0], ctx->saved_data["dim"].toInt(), load_comm(ctx)), at::Tensor(), at::Tensor()};
  }
};

struct GatherAlongDim : torch::autograd::Function<GatherAlongDim> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t dim, CommunicatorPtr comm) {
    save_comm(ctx, comm);
    ctx->saved_data["dim"] = dim;
    return raw::all_gather(x, dim, *comm);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {raw::split(g[0], ctx->saved_data["dim"].toInt(), load_comm(ctx)), at::Tensor(), at::Tensor()};
  }
};

struct AllGatherAlongDim : torch::autograd::Function<AllGatherAlongDim> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t dim, CommunicatorPtr comm) {
    save_comm(ctx, comm);
    ctx->saved_data["dim"] = dim;
    return raw::all_gather(x, dim, *comm);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {raw::reduce_scatter(g[0], ctx->saved_data["dim"].toInt(), load_comm(ctx)), at::Tensor(), at::Tensor()};
  }
};

struct ReduceScatterAlongDim : torch::autograd::Function<ReduceScatterAlongDim> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t dim, CommunicatorPtr comm) {
    save_comm(ctx, comm);
    ctx->saved_data["dim"] = dim;
    return raw::reduce_scatter(x, dim, *comm);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {raw::all_gather(g[0], ctx->saved_data["dim"].toInt(), load_comm(ctx)), at::Tensor(), at::Tensor()};
  }
};

struct AllToAllAlongDims : torch::autograd::Function<AllToAllAlongDims> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t scatter_dim, int64_t gather_dim,
                            CommunicatorPtr comm) {
    save_comm(ctx, comm);
    ctx->saved_data["scatter"] = scatter_dim;
    ctx->saved_data["gather"] = gather_dim;
    return raw::all_to_all(x, scatter_dim, gather_dim, *comm);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    at::Tensor dx =
        raw::all_to_all(g[0], ctx->saved_data["gather"].toInt(), ctx->saved_data["scatter"].toInt(), load_comm(ctx));
    return {dx, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct AllToAllRows : torch::autograd::Function<AllToAllRows> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, std::vector<int64_t> send,
                            std::vector<int64_t> recv, CommunicatorPtr comm) {
    save_comm(ctx, comm);
    at::Tensor out = raw::all_to_all_rows(x, send, recv, *comm);
    ctx->saved_data["send"] = std::move(send);
    ctx->saved_data["recv"] = std::move(recv);
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const std::vector<int64_t> send = ctx->saved_data["send"].toIntVector();
    const std::vector<int64_t> recv = ctx->saved_data["recv"].toIntVector();
    // The adjoint runs the exchange in reverse: what came from rank r goes back to it.
    return {raw::all_to_all_rows(g[0], recv, send, load_comm(ctx)), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor copy_to_group(const at::Tensor& input, const CommunicatorPtr& comm) {
  if (comm && comm->size() == 1) return input;  // a size-1 group adds no autograd node
  return CopyToGroup::apply(input, comm);
}
at::Tensor reduce_from_group(const at::Tensor& input, const CommunicatorPtr& comm) {
  if (comm && comm->size() == 1) return input;
  return ReduceFromGroup::apply(input, comm);
}
at::Tensor split_along_dim(const at::Tensor& input, int64_t dim, const CommunicatorPtr& comm) {
  if (comm && comm->size() == 1) return input;
  return SplitAlongDim::apply(input, dim, comm);
}
at::Tensor gather_along_dim(const at::Tensor& input, int64_t dim, const CommunicatorPtr& comm) {
  if (comm && comm->size() == 1) return input;
  return GatherAlongDim::apply(input, dim, comm);
}
at::Tensor all_gather_along_dim(const at::Tensor& input, int64_t dim, const CommunicatorPtr& comm) {
  if (comm && comm->size() == 1) return input;
  return AllGatherAlongDim::apply(input, dim, comm);
}
at::Tensor reduce_scatter_along_dim(const at::Tensor& input, int64_t dim, const CommunicatorPtr& comm) {
  if (comm && comm->size() == 1) return input;
  return ReduceScatterAlongDim::apply(input, dim, comm);
}
at::Tensor all_to_all_along_dims(const at::Tensor& input, int64_t scatter_dim, int64_t gather_dim,
                                 const CommunicatorPtr& comm) {
  if (comm && comm->size() == 1) return input;
  return AllToAllAlongDims::apply(input, scatter_dim, gather_dim, comm);
}
at::Tensor all_to_all_rows(const at::Tensor& input, std::vector<int64_t> send_splits,
                           std::vector<int64_t> recv_splits, const CommunicatorPtr& comm) {
  TORCH_CHECK(comm != nullptr, "all_to_all_rows: the communicator is null");
  return AllToAllRows::apply(input, std::move(send_splits), std::move(recv_splits), comm);
}

}  // namespace comm
}  // namespace tessera
