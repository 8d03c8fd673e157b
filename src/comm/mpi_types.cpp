#include "mpi_types.h"

#include "tessera/comm/mpi_check.h"
#include "tessera/core/dtype.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>

namespace tessera {
namespace comm {
namespace {

// Note [Half-precision reductions]
// Each pairwise combine converts both operands to float, combines, and rounds
// back once. That is what a bf16/fp16 tensor op on the CPU does too, so a sum
// of k ranks rounds k-1 times, in MPI's reduction order.
template <typename T, typename F>
void combine(void* in, void* inout, int* len, F f) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = T(f(static_cast<float>(a[i]), static_cast<float>(b[i])));
}

struct Sum {
  float operator()(float a, float b) const { return a + b; }
};
struct Prod {
  float operator()(float a, float b) const { return a * b; }
};
struct Min {
  float operator()(float a, float b) const { return std::min(a, b); }
};
struct Max {
  float operator()(float a, float b) const { return std::max(a, b); }
};

template <typename T, typename F>
void reduce_fn(void* in, void* inout, int* len, MPI_Datatype*) {
  combine<T>(in, inout, len, F{});
}

template <typename T>
void create_ops(MPI_Op* ops) {
  TESSERA_MPI_CHECK(MPI_Op_create(&reduce_fn<T, Sum>, 1, &ops[0]));
  TESSERA_MPI_CHECK(MPI_Op_create(&reduce_fn<T, Prod>, 1, &ops[1]));
  TESSERA_MPI_CHECK(MPI_Op_create(&reduce_fn<T, Min>, 1, &ops[2]));
  TESSERA_MPI_CHECK(MPI_Op_create(&reduce_fn<T, Max>, 1, &ops[3]));
}

int op_index(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return 0;
    case ReduceOp::kProduct:
      return 1;
    case ReduceOp::kMin:
      return 2;
    case ReduceOp::kMax:
      return 3;
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled ReduceOp");
}

}  // namespace

bool mpi_finalized() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  return finalized != 0;
}

MpiTypes::MpiTypes() {
  TESSERA_MPI_CHECK(MPI_Type_contiguous(2, MPI_BYTE, &half_type_));
  TESSERA_MPI_CHECK(MPI_Type_commit(&half_type_));
  TESSERA_MPI_CHECK(MPI_Type_contiguous(2, MPI_BYTE, &bfloat16_type_));
  TESSERA_MPI_CHECK(MPI_Type_commit(&bfloat16_type_));
  create_ops<c10::Half>(half_ops_);
  create_ops<c10::BFloat16>(bfloat16_ops_);
}

MpiTypes::~MpiTypes() {
  if (mpi_finalized()) return;
  for (int i = 0; i < 4; ++i) {
    MPI_Op_free(&half_ops_[i]);
    MPI_Op_free(&bfloat16_ops_[i]);
  }
  MPI_Type_free(&half_type_);
  MPI_Type_free(&bfloat16_type_);
}

MPI_Datatype MpiTypes::datatype(c10::ScalarType type) const {
  switch (type) {
    case c10::kFloat:
      return MPI_FLOAT;
    case c10::kDouble:
      return MPI_DOUBLE;
    case c10::kHalf:
      return half_type_;
    case c10::kBFloat16:
      return bfloat16_type_;
    case c10::kInt:
      return MPI_INT32_T;
    case c10::kLong:
      return MPI_INT64_T;
    case c10::kByte:
      return MPI_UINT8_T;
    case c10::kBool:
      return MPI_C_BOOL;
    default:
      TORCH_CHECK(false, "dtype ", dtype_name(type),
                  " is not supported by tessera communicators; use float32, float64, "
                  "bfloat16, float16, int32, int64, uint8 or bool");
  }
}

MPI_Op MpiTypes::op(ReduceOp op, c10::ScalarType type) const {
  if (type == c10::kHalf) return half_ops_[op_index(op)];
  if (type == c10::kBFloat16) return bfloat16_ops_[op_index(op)];
  if (type == c10::kBool) {
    // As in c10d: sum and max of booleans are "any", product and min "all".
    TORCH_CHECK(op != ReduceOp::kAvg, "reduce op avg is not defined for bool tensors");
    return (op == ReduceOp::kSum || op == ReduceOp::kMax) ? MPI_LOR : MPI_LAND;
  }
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return MPI_SUM;
    case ReduceOp::kProduct:
      return MPI_PROD;
    case ReduceOp::kMin:
      return MPI_MIN;
    case ReduceOp::kMax:
      return MPI_MAX;
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled ReduceOp");
}

}  // namespace comm
}  // namespace tessera
