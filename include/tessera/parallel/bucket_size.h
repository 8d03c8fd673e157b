#pragma once
// The default size of the gradient buckets of replicated parameters.
//
// Note [Buckets across hosts]
// A bucket's reduction hides behind the backward that follows it; the last
// bucket, posted when backward ends, has nothing left to hide behind. With
// DDP's 25 MiB buckets (and the first at 1 MiB: Note [The first bucket]) a
// model under 26 MiB has two, so most of its gradient crosses the hosts'
// links after backward. Where the group reduces by host, the next bucket
// reduces inside its host while one crosses (Note [Reductions in bucket
// order per link]), so smaller buckets keep the link busy during backward
// and leave less for after it. There the default is a sixteenth of the
// gradient: about a sixteenth of the link time is left after backward, and
// sixteen buckets' stages (2(H - 1) + 2 each over H hosts) add little
// latency. At least 256 KiB, four times the smallest reduction that goes
// by host (HierarchicalCommunicator::kMinElements floats: a bucket cut at
// tensors ends below its cap, and one under that size would go flat); at
// most 25 MiB, so large models keep DDP's buckets (already more than
// sixteen). Inside one host the reduction is fast and 25 MiB stays.
// Measured on 2 emulated hosts x 2 ranks at 200 Mbit/s, the 3.4 MB demo
// GPT, step ms by bucket MiB in two interleaved rounds (LibTorch 2.15):
// 25: 384-393, 1: 334-336, 0.5: 284-311, 0.25: 267-295, 0.1: 261-270,
// 0.05: 253-259, 0.025: 271-278; at 1 Gbit/s every size took 197-239 ms.
#include <cstdint>

namespace tessera {
namespace parallel {

constexpr int64_t kDdpBucketBytes = int64_t(25) << 20;
constexpr int64_t kFirstBucketBytes = int64_t(1) << 20;  // Note [The first bucket]
constexpr int64_t kBucketsAcrossHosts = 16;
constexpr int64_t kMinBucketBytes = int64_t(256) << 10;

// The cap that ShardedModuleOptions::bucket_bytes = 0 (the default) stands
// for, for `gradient_bytes` of replicated gradients.
int64_t default_bucket_bytes(int64_t gradient_bytes, bool across_hosts);

// Buckets of `gradient_bytes` under `cap`, the first closing at
// min(cap, kFirstBucketBytes), for tensors small against the cap.
int64_t bucket_count(int64_t gradient_bytes, int64_t cap);

}  // namespace parallel
}  // namespace tessera
