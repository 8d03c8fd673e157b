#include "tessera/parallel/bucket_size.h"

#include <algorithm>

namespace tessera {
namespace parallel {

int64_t default_bucket_bytes(int64_t gradient_bytes, bool across_hosts) {
  if (!across_hosts) return kDdpBucketBytes;
  return std::clamp(gradient_bytes / kBucketsAcrossHosts, kMinBucketBytes, kDdpBucketBytes);
}

int64_t bucket_count(int64_t gradient_bytes, int64_t cap) {
  const int64_t first = std::min(cap, kFirstBucketBytes);
  if (gradient_bytes <= first) return 1;
  return 1 + (gradient_bytes - first + cap - 1) / cap;
}

}  // namespace parallel
}  // namespace tessera
