#include "tessera/nn/matmul_3d.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <vector>

namespace tessera {
namespace nn {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// An operation in flight and the tensor it fills.
struct Pending {
  at::Tensor out;
  comm::WorkPtr work;
  at::Tensor wait() {
    if (work) work->wait();
    return out;
  }
};

// Rows of every rank of `group`, stacked in rank order: [size·rows, cols].
Pending gather_rows(const at::Tensor& t, comm::Communicator& group) {
  Pending p;
  const at::Tensor in = t.contiguous();
  p.out = at::empty({group.size() * in.size(0), in.size(1)}, in.options());
  comm::AllGatherOptions opts;
  opts.async = true;
  p.work = group.all_gather(p.out, in, opts);
  return p;
}

// The sum over `group` of t [size·rows, cols], this rank's rows kept.
Pending scatter_rows(const at::Tensor& t, comm::Communicator& group) {
  Pending p;
  const at::Tensor in = t.contiguous();
  p.out = at::empty({in.size(0) / group.size(), in.size(1)}, in.options());
  comm::ReduceScatterOptions opts;
  opts.async = true;
  p.work = group.reduce_scatter(p.out, in, opts);
  return p;
}

struct Groups3D : torch::CustomClassHolder {
  Groups3D(comm::CommunicatorPtr i, comm::CommunicatorPtr w, comm::CommunicatorPtr o)
      : input(std::move(i)), weight(std::move(w)), output(std::move(o)) {}
  comm::CommunicatorPtr input, weight, output;
};

struct Matmul3D : torch::autograd::Function<Matmul3D> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            comm::CommunicatorPtr input, comm::CommunicatorPtr weight, comm::CommunicatorPtr output) {
    Pending xg = gather_rows(x.reshape({-1, x.size(-1)}), *input);
    Pending wg = gather_rows(w.t(), *weight);  // Wᵀ's rows: [in/q, out/q]
    const at::Tensor xs = xg.wait(), ws = wg.wait();
    at::Tensor y = scatter_rows(at::mm(xs, ws), *output).wait();
    ctx->save_for_backward({xs, ws});
    ctx->saved_data["groups"] = at::IValue::make_capsule(c10::make_intrusive<Groups3D>(input, weight, output));
    ctx->saved_data["x_shape"] = x.sizes().vec();
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = w.size(0);
    return y.view(shape);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& xs = saved[0];
    const at::Tensor& ws = saved[1];
    auto capsule = ctx->saved_data["groups"].toCapsule();
    auto* g = static_cast<Groups3D*>(capsule.get());
    const at::Tensor dyg = gather_rows(grads[0].reshape({-1, grads[0].size(-1)}), *g->output).wait();
    Pending dw = scatter_rows(at::mm(xs.t(), dyg), *g->weight);  // runs while dx is computed
    const at::Tensor dx = scatter_rows(at::mm(dyg, ws.t()), *g->input).wait();
    const at::Tensor dwt = dw.wait();
    return {dx.view(ctx->saved_data["x_shape"].toIntVector()), dwt.t(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor matmul_3d(const at::Tensor& x, const at::Tensor& w, const comm::CommunicatorPtr& input,
                     const comm::CommunicatorPtr& weight, const comm::CommunicatorPtr& output) {
  TORCH_CHECK(input && weight && output, "matmul_3d: the input, weight and output groups must not be null");
  TORCH_CHECK(input->size() == weight->size() && input->size() == output->size(), "matmul_3d: the input group has ",
              input->size(), " ranks, the weight group ", weight->size(), " and the output group ", output->size(),
              "; the 3D cube needs q ranks in each");
  const int64_t q = input->size();
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 2 && x.size(-1) == q * w.size(1), "matmul_3d: local blocks of shape ",
              x.sizes(), " and ", w.sizes(), " do not multiply; x's last dimension (in/q) must be q = ", q,
              " times the weight's second (in/q²)");
  if (q == 1) return at::matmul(x, w.t());
  return Matmul3D::apply(x, w, input, weight, output);
}

}  // namespace nn
}  // namespace tessera
