#pragma once
// The matrix product of 2D and 2.5D tensor parallelism (SUMMA, van de Geijn
// and Watts 1997, as Optimus arXiv 2104.05343 and Tesseract arXiv
// 2105.14500 use it), written once as an autograd function.
//
// Note [SUMMA]
// On a q x q grid, rank (i, j) holds block (i, j) of A [m, k] and of
// B [k, n]; C = A·B is left in the same layout: C_ij = Σ_t A_it·B_tj. At
// step t, A_it is broadcast along row i (the `row` group, local rank j) from
// column t and B_tj along column j (the `col` group, local rank i) from row
// t; every rank multiplies what it received and accumulates. The backward
// products reuse the pattern with a reduce in place of one broadcast:
//   dA_is = Σ_t dC_it·B_stᵀ  broadcast B_st along column t from row s,
//                            reduce the products along row i to column s;
//   dB_sj = Σ_t A_tsᵀ·dC_tj  broadcast A_ts along row t from column s,
//                            reduce the products along column j to row s.
// Step t+1's broadcasts are posted before step t multiplies (two buffers),
// and the reduces run asynchronously until the end of the product. 2.5D
// runs the same product inside each depth layer (its row and col groups).
// Per rank and product, the bytes broadcast are (q-1)/q of the A and B
// blocks' q steps: forward (q-1)(|A_ij| + |B_ij|) received over the two
// groups' trees, and each backward product as much again.
#include "tessera/comm/communicator.h"

#include <ATen/core/Tensor.h>

namespace tessera {
namespace nn {

// C = A·B with A [..., k/q] (rows of the leading dimensions are this grid
// row's block) and B [k/q, n/q]; returns [..., n/q]. Collective over `row`
// and `col` (both of size q); differentiable in A and B.
at::Tensor summa_matmul(const at::Tensor& a, const at::Tensor& b, const comm::CommunicatorPtr& row,
                        const comm::CommunicatorPtr& col);

// C = A·Bᵀ with A [..., k/q] and B [n/q, k/q] (B's block (s, t) on rank
// (s, t)); returns [..., n/q]: the product of a tied LM head, logits =
// h·Eᵀ with the embedding table E. Backward: dA = dC·B and dB = dCᵀ·A.
at::Tensor summa_matmul_nt(const at::Tensor& a, const at::Tensor& b, const comm::CommunicatorPtr& row,
                           const comm::CommunicatorPtr& col);

namespace raw {
// The three products on 2-D blocks, without autograd (Note [SUMMA]).
at::Tensor summa_ab(const at::Tensor& a, const at::Tensor& b, comm::Communicator& row, comm::Communicator& col);
at::Tensor summa_abt(const at::Tensor& a, const at::Tensor& b, comm::Communicator& row, comm::Communicator& col);
at::Tensor summa_atb(const at::Tensor& a, const at::Tensor& b, comm::Communicator& row, comm::Communicator& col);
}  // namespace raw

}  // namespace nn
}  // namespace tessera
