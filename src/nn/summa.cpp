#include "tessera/nn/summa.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <array>
#include <vector>

namespace tessera {
namespace nn {
namespace raw {
namespace {

void check_grid(const comm::Communicator& row, const comm::Communicator& col, const char* op) {
  TORCH_CHECK(row.size() == col.size(), op, ": the row group '", row.name(), "' has ", row.size(),
              " ranks and the column group '", col.name(), "' has ", col.size(), "; SUMMA needs a square grid");
}

// Posts the broadcast of this rank's `mine` (if it is the root) into a buffer.
struct Posted {
  at::Tensor buffer;
  comm::WorkPtr work;
};
Posted post_broadcast(const at::Tensor& mine, int root, comm::Communicator& group) {
  Posted p;
  p.buffer = group.rank() == root ? mine : at::empty_like(mine);
  comm::BroadcastOptions opts;
  opts.root = root;
  opts.async = true;
  p.work = group.broadcast(p.buffer, opts);
  return p;
}

// Σ_t f(step t's broadcast of `sent` over `over`), one term per step, with
// step t+1's broadcast in flight while step t computes. `reduce` (may be
// null) then receives each term and sums it over its group to root t, the
// result left on the rank whose local rank in `reduce` is t.
template <typename F>
at::Tensor steps(const at::Tensor& sent, comm::Communicator& over, comm::Communicator* reduce_over, F term) {
  const int q = over.size();
  const at::Tensor mine = sent.contiguous();
  std::array<Posted, 2> slot;
  slot[0] = post_broadcast(mine, 0, over);
  at::Tensor acc, result;
  std::vector<std::pair<at::Tensor, comm::WorkPtr>> reduces;
  for (int t = 0; t < q; ++t) {
    if (t + 1 < q) slot[(t + 1) % 2] = post_broadcast(mine, t + 1, over);
    Posted& now = slot[t % 2];
    now.work->wait();
    at::Tensor product = term(now.buffer, t);
    if (reduce_over == nullptr) {
      acc = acc.defined() ? acc.add_(product) : product;
      continue;
    }
    product = product.contiguous();
    comm::ReduceOptions opts;
    opts.root = t;
    opts.async = true;
    reduces.emplace_back(product, reduce_over->reduce(product, opts));
    if (reduce_over->rank() == t) result = product;
  }
  for (auto& r : reduces) r.second->wait();
  return reduce_over == nullptr ? acc : result;
}

}  // namespace

at::Tensor summa_ab(const at::Tensor& a, const at::Tensor& b, comm::Communicator& row, comm::Communicator& col) {
  check_grid(row, col, "summa_ab");
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0), "summa_ab: blocks of shape ", a.sizes(), " and ",
              b.sizes(), " do not multiply");
  // B_tj's broadcast along the column rides beside A_it's along the row.
  const at::Tensor bm = b.contiguous();
  std::array<Posted, 2> bslot;
  bslot[0] = post_broadcast(bm, 0, col);
  return steps(a, row, nullptr, [&](const at::Tensor& a_t, int t) {
    if (t + 1 < col.size()) bslot[(t + 1) % 2] = post_broadcast(bm, t + 1, col);
    bslot[t % 2].work->wait();
    return at::mm(a_t, bslot[t % 2].buffer);
  });
}

at::Tensor summa_abt(const at::Tensor& a, const at::Tensor& b, comm::Communicator& row, comm::Communicator& col) {
  check_grid(row, col, "summa_abt");
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(1), "summa_abt: blocks of shape ", a.sizes(),
              " and ", b.sizes(), " do not multiply as A·Bᵀ");
  return steps(b, col, &row, [&](const at::Tensor& b_s, int) { return at::mm(a, b_s.t()); });
}

at::Tensor summa_atb(const at::Tensor& a, const at::Tensor& b, comm::Communicator& row, comm::Communicator& col) {
  check_grid(row, col, "summa_atb");
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(0) == b.size(0), "summa_atb: blocks of shape ", a.sizes(),
              " and ", b.sizes(), " do not multiply as Aᵀ·B");
  return steps(a, row, &col, [&](const at::Tensor& a_s, int) { return at::mm(a_s.t(), b); });
}

}  // namespace raw

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct Groups : torch::CustomClassHolder {
  Groups(comm::CommunicatorPtr r, comm::CommunicatorPtr c) : row(std::move(r)), col(std::move(c)) {}
  comm::CommunicatorPtr row, col;
};

struct SummaMatmul : torch::autograd::Function<SummaMatmul> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b, comm::CommunicatorPtr row,
                            comm::CommunicatorPtr col) {
    ctx->save_for_backward({a, b});
    ctx->saved_data["groups"] = at::IValue::make_capsule(c10::make_intrusive<Groups>(row, col));
    const at::Tensor a2 = a.reshape({-1, a.size(-1)});
    std::vector<int64_t> shape = a.sizes().vec();
    shape.back() = b.size(1);
    return raw::summa_ab(a2, b, *row, *col).view(shape);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& a = saved[0];
    const at::Tensor& b = saved[1];
    auto capsule = ctx->saved_data["groups"].toCapsule();
    auto* g = static_cast<Groups*>(capsule.get());
    const at::Tensor dc = grads[0].reshape({-1, grads[0].size(-1)});
    // Both products on every rank, whatever needs a gradient: they are collective.
    at::Tensor da = raw::summa_abt(dc, b, *g->row, *g->col).view(a.sizes());
    at::Tensor db = raw::summa_atb(a.reshape({-1, a.size(-1)}), dc, *g->row, *g->col);
    return {da, db, at::Tensor(), at::Tensor()};
  }
};

struct SummaMatmulNT : torch::autograd::Function<SummaMatmulNT> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b, comm::CommunicatorPtr row,
                            comm::CommunicatorPtr col) {
    ctx->save_for_backward({a, b});
    ctx->saved_data["groups"] = at::IValue::make_capsule(c10::make_intrusive<Groups>(row, col));
    std::vector<int64_t> shape = a.sizes().vec();
    shape.back() = b.size(0);
    return raw::summa_abt(a.reshape({-1, a.size(-1)}), b, *row, *col).view(shape);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& a = saved[0];
    const at::Tensor& b = saved[1];
    auto capsule = ctx->saved_data["groups"].toCapsule();
    auto* g = static_cast<Groups*>(capsule.get());
    const at::Tensor dc = grads[0].reshape({-1, grads[0].size(-1)});
    at::Tensor da = raw::summa_ab(dc, b, *g->row, *g->col).view(a.sizes());
    at::Tensor db = raw::summa_atb(dc, a.reshape({-1, a.size(-1)}), *g->row, *g->col);
    return {da, db, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor summa_matmul_nt(const at::Tensor& a, const at::Tensor& b, const comm::CommunicatorPtr& row,
                           const comm::CommunicatorPtr& col) {
  TORCH_CHECK(row && col, "summa_matmul_nt: the row and column groups must not be null");
  TORCH_CHECK(a.dim() >= 1 && b.dim() == 2 && a.size(-1) == b.size(1), "summa_matmul_nt: local blocks of shape ",
              a.sizes(), " and ", b.sizes(), " do not multiply as A·Bᵀ; A's last dimension must equal B's second");
  if (row->size() == 1 && col->size() == 1) return at::matmul(a, b.t());
  return SummaMatmulNT::apply(a, b, row, col);
}

at::Tensor summa_matmul(const at::Tensor& a, const at::Tensor& b, const comm::CommunicatorPtr& row,
                        const comm::CommunicatorPtr& col) {
  TORCH_CHECK(row && col, "summa_matmul: the row and column groups must not be null");
  TORCH_CHECK(a.dim() >= 1 && b.dim() == 2 && a.size(-1) == b.size(0), "summa_matmul: local blocks of shape ",
              a.sizes(), " and ", b.sizes(), " do not multiply; A's last dimension must equal B's first");
  if (row->size() == 1 && col->size() == 1) return at::matmul(a, b);
  return SummaMatmul::apply(a, b, row, col);
}

}  // namespace nn
}  // namespace tessera
