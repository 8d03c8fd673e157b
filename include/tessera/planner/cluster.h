#pragma once
// What the planner needs to know of the machines: ranks per node, memory and
// compute per rank, and for each collective the bus bandwidth and the
// latency of one call inside a node and across nodes (docs/planner.md).
// From a JSON file, from comm_bench's JSON lines, or a preset.
#include "tessera/comm/communicator.h"

#include <map>
#include <string>

namespace tessera {
namespace planner {

// One call of `bytes` bus bytes over n ranks costs
// latency · steps(op, n) + bytes / bandwidth seconds.
struct Link {
  double bandwidth = 0;  // bus bytes per second
  double latency = 0;    // seconds per algorithm step (hop)
};

// Algorithm steps of one call over n ranks, as NCCL runs them: rings for
// all-gather, reduce-scatter and all-to-all (n - 1), trees for all-reduce
// (2 log2 n), broadcast and reduce (log2 n), one hop for a send.
double latency_steps(comm::OpType op, int n);

// Note [Links across nodes]
// `inter` gives a node's bandwidth out of the node (all of its NICs) as the
// bus bandwidth one collective reaches when every rank of the node is in
// it. A group with g of its ranks in each node shares the node's NICs with
// the gpus_per_node / g groups like it that run at the same time (every data
// replica of a sharded plan reduces at once), so one of its ranks gets
// min(intra, inter · g / gpus_per_node). A group inside one node uses `intra`.
struct ClusterDesc {
  std::string name = "cluster";
  int gpus_per_node = 8;  // ranks per node
  int nodes = 1;
  // What the ranks of a node compute on, when they share it (Note [Shared
  // compute] in estimate.cpp): CPU ranks on fewer cores. 0: one per rank.
  int compute_units = 0;
  double memory_bytes = 80e9;    // per rank
  double peak_flops = 312e12;    // per rank, for MFU
  double achieved_flops = 0;     // what the model reaches per rank, all ranks at once; 0: peak_flops
  // Seconds per block and micro-batch (forward and backward) that do not
  // shrink with the micro-batch or the tensor split: operator dispatch and
  // kernel launches. Measured with the rate (train_gpt --plan); 0: none.
  double block_overhead = 0;
  double memory_bandwidth = 2e12;  // per rank, bytes per second (optimizer step)
  double host_bandwidth = 25e9;  // per rank, device <-> host (offload)
  double host_flops = 0;         // per rank, the CPU optimizer step under offload (bytes/s of states); 0: memory_bandwidth
  // Fraction of gradient reduction and prefetched gathers that hides behind
  // backward and forward compute (1: all of it, as on GPUs with a
  // communication stream; measured on a CPU machine).
  double overlap = 1.0;
  // Fraction of a pipeline message between nodes that moves while both its
  // ends compute (1: a copy engine or NCCL moves it; 0: CPU ranks over MPI,
  // Note [Messages nothing moves] in src/planner/estimate.cpp).
  double message_overlap = 1.0;
  // Data-parallel all-reduces of a group spanning nodes go inside each node
  // first and across nodes once (comm::HierarchicalCommunicator; false:
  // TESSERA_HOST_REDUCTIONS=flat).
  bool host_reductions = true;
  Link intra_default{150e9, 3e-6};
  Link inter_default{80e9, 6e-6};
  std::map<comm::OpType, Link> intra, inter;

  int world() const { return gpus_per_node * nodes; }
  // A rank's rate while every rank of its node computes.
  double compute_rate() const { return achieved_flops > 0 ? achieved_flops : peak_flops; }
  // A rank's rate while it computes alone (ranks per unit times the above).
  double solo_rate() const;
  const Link& link(comm::OpType op, bool across_nodes) const;
  // Seconds of `calls` calls that put `bus_bytes` on the wire from one rank,
  // over a group with `per_node` of its ranks in each node it spans (Note
  // [Links across nodes]).
  double seconds(comm::OpType op, int ranks, double calls, double bus_bytes, int nodes_spanned, int per_node) const;

  // Reads
  //   {"name": "...", "gpus_per_node": 8, "nodes": 128, "memory_gb": 80,
  //    "peak_tflops": 312, "achieved_tflops": 190, "memory_bandwidth_gbs": 2039,
  //    "host_bandwidth_gbs": 25, "overlap": 1.0, "message_overlap": 1.0,
  //    "host_reductions": true,
  //    "intra": {"default": {"bandwidth_gbs": 150, "latency_us": 10},
  //              "all_to_all": {...}},
  //    "inter": {"default": {"bandwidth_gbs": 100, "latency_us": 20}}}
  // GB are 1e9 bytes; every key optional. Unknown keys throw, naming them.
  static ClusterDesc from_json(const std::string& text);
  static ClusterDesc from_json_file(const std::string& path);
  // comm_bench's JSON lines (bench/comm_bench.cpp) for one node: per
  // operation, the bus bandwidth of its largest size, and the time of its
  // smallest over latency_steps as the latency per step.
  static ClusterDesc from_comm_bench(const std::string& jsonl, ClusterDesc base);
  static ClusterDesc from_comm_bench_file(const std::string& path, ClusterDesc base);
  // "a800-amsp": AMSP's cluster (128 nodes × 8 A800-80GB, NVLink 400 GB/s,
  // 4 × 200 Gb/s HDR InfiniBand per node); "h100-1024": 128 nodes × 8
  // H100-80GB SXM (NVLink 900 GB/s, 8 × 400 Gb/s NDR per node).
  static ClusterDesc preset(const std::string& name);
  // A file when the name ends in .json, else a preset.
  static ClusterDesc load(const std::string& preset_or_file);
  std::string to_json() const;
};

}  // namespace planner
}  // namespace tessera
