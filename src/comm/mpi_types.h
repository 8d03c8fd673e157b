#pragma once
// Maps tessera dtypes and reduce ops to MPI. MPI has no bfloat16 or float16:
// they travel as a 2-byte derived datatype and are reduced by user-defined
// operations that compute in float (Note [Half-precision reductions]).
#include "tessera/comm/communicator.h"

#include <c10/core/ScalarType.h>
#include <mpi.h>

namespace tessera {
namespace comm {

// MPI_Finalized, for code that may run after it: no MPI call is allowed then.
bool mpi_finalized();

// Owns the derived datatypes and user-defined ops. One instance is shared by a
// communicator and every communicator split from it; it frees its handles when
// the last one goes, unless MPI has already been finalized.
class MpiTypes {
 public:
  MpiTypes();
  ~MpiTypes();
  MpiTypes(const MpiTypes&) = delete;
  MpiTypes& operator=(const MpiTypes&) = delete;

  MPI_Datatype datatype(c10::ScalarType type) const;
  // For kAvg this is the sum op; the caller divides afterwards.
  MPI_Op op(ReduceOp op, c10::ScalarType type) const;

 private:
  MPI_Datatype half_type_ = MPI_DATATYPE_NULL;      // float16
  MPI_Datatype bfloat16_type_ = MPI_DATATYPE_NULL;  // bfloat16
  // [0]=sum [1]=product [2]=min [3]=max
  MPI_Op half_ops_[4] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};
  MPI_Op bfloat16_ops_[4] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};
};

}  // namespace comm
}  // namespace tessera
