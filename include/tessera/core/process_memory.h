#pragma once
// This process's resident memory as the kernel counts it (/proc/self/status):
// what a memory budget for the whole process is checked against (streamed
// inference, docs/offload.md) and what benchmarks report.
#include <cstdint>

namespace tessera {

// VmRSS: resident now, in bytes; -1 where /proc is not available.
int64_t resident_bytes();
// VmHWM: the peak resident size since the process started, in bytes; -1
// where /proc is not available.
int64_t peak_resident_bytes();

}  // namespace tessera
