#pragma once
// Thread budget of one rank.
//
// With several ranks on one machine, LibTorch's intra-op pool and the BLAS
// library's own pool must both be limited, or the ranks oversubscribe the
// cores (Debian's LibTorch calls OpenBLAS, which keeps a separate pool that
// torch::set_num_threads does not touch).
namespace tessera {

// Sets LibTorch's intra-op threads and, when the loaded BLAS is OpenBLAS (or
// exposes openblas_set_num_threads), its threads to `threads`.
// Returns true when a BLAS thread count was set as well.
bool limit_threads(int threads);

}  // namespace tessera
