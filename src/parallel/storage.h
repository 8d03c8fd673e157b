#pragma once
// Freeing and re-allocating a tensor's memory while its storage object, and
// so every view of it (parameters, gradients, tensors autograd saved), stays.
#include <ATen/core/Tensor.h>
#include <c10/core/StorageImpl.h>

namespace tessera {
namespace parallel {
namespace detail {

inline void release_storage(const at::Tensor& t) {
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  if (impl->nbytes() == 0) return;
  impl->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  impl->set_nbytes(0);
}

inline void restore_storage(const at::Tensor& t, int64_t nbytes) {
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  if (static_cast<int64_t>(impl->nbytes()) == nbytes) return;
  impl->set_data_ptr_noswap(impl->allocator()->allocate(nbytes));
  impl->set_nbytes(nbytes);
}

// Moves `from`'s memory into t's released storage (from is left empty): a
// buffer filled elsewhere becomes t's only when it is complete.
inline void adopt_storage(const at::Tensor& t, at::Tensor& from) {
  c10::StorageImpl* src = from.storage().unsafeGetStorageImpl();
  c10::StorageImpl* dst = t.storage().unsafeGetStorageImpl();
  const size_t nbytes = src->nbytes();
  dst->set_data_ptr_noswap(src->set_data_ptr(at::DataPtr(nullptr, from.device())));
  dst->set_nbytes(nbytes);
  src->set_nbytes(0);
  from = at::Tensor();
}

}  // namespace detail
}  // namespace parallel
}  // namespace tessera
