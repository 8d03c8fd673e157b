#pragma once
// StreamedGPT: inference of a GPT (models::GPT's weights, Note [GPT full
// weights]; GPT-2 or any Llama-family architecture the weights' metadata
// records: RMSNorm, rotary positions, grouped-query attention whose KV cache
// holds the kv heads only, q/k norms, SwiGLU; no experts) whose weights stay
// on disk, in a process whose memory is a fraction of them. Layers are read one at a time into a few buffers, the
// next layer's weights while this one computes; with a budget that holds
// them all, every weight is read once and stays in memory. Optionally
// tensor-parallel over a group: each rank reads and computes its heads, its
// MLP columns and its vocabulary rows only. A KV cache makes each
// generated token one pass over the layers (infer/generation.h).
//
//   auto weights = std::make_shared<StoredWeights>("gpt.safetensors");
//   StreamedGPT model(weights, StreamedGPTOptions().max_memory(512 << 20).max_length(64));
//   model.reset(1);
//   at::Tensor logits = model.forward(prompt);   // [1, t, vocab]
//
// Note [Streamed inference]
// Units. A block's tensors (this rank's shard) are one unit; the LM
// head (the token embedding when tied) is cut into chunks of vocabulary
// rows no larger than a block; ln_f is always in memory; token and
// position embeddings are read a row per token as tokens arrive.
// Plan. The budget is for the whole process, as the kernel counts it
// (VmRSS): the engine measures what the process holds when it is built
// (LibTorch's code, the runtime) and plans the rest: the KV cache for
// batch × max_length positions, working memory for a forward of max_length
// tokens (an estimate of its activations and logits), a margin for the
// allocator, and the weights. If every weight fits, all stay in memory
// (read once, at construction). Otherwise `buffers` buffers of the largest
// unit's size hold the units in turn; a budget too small even for that is
// refused with each term and the smallest budget that works.
// Prefetch. Loads are numbered g = 0, 1, 2, ... over the units of every
// forward in order; load g goes into buffer g mod K and is issued when the
// compute of load g - K is done, so K - 1 loads are in flight while one
// unit computes; the ring runs on from the last head chunk of one forward
// into the first block of the next. Without prefetch (one buffer) each
// load is issued when its unit is needed. What the compute waits for a load
// is the stall; hidden_fraction() = 1 - stall / read time.
// Note [Streamed inference on a device]
// With a CUDA device the weights are still read into host memory (the
// buffers, or every unit when resident), and each unit is copied to the
// device, converted to float, when it computes; the KV cache, embeddings
// read, activations and logits live on the device, and forward() returns
// the logits in host memory. max_memory stays the host process's budget:
// its plan then holds the baseline, the weights or buffers and the margin,
// not the KV cache or working memory, which are the device's. The device's
// own memory is not planned.
// Tensor parallelism. Ranks split heads (c_attn rows, whose [3h, h] layout
// groups q, k, v per head; or q_proj rows and kv_proj rows, grouped per kv
// head), MLP columns (c_gate and c_fc rows, c_proj columns) and
// vocabulary rows; an all-reduce after each block's two projections adds
// the partial sums, and one after the head assembles the logits. Every
// rank passes the same ids and gets the same full logits.
#include "tessera/comm/communicator.h"
#include "tessera/models/gpt.h"
#include "tessera/infer/generation.h"
#include "tessera/infer/stored_weights.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/arg.h>

#include <cstdint>
#include <memory>
#include <string>

namespace tessera {
namespace infer {

struct StreamedGPTOptions {
  // Bytes for the whole process (VmRSS) per rank; 0: no limit, every
  // weight stays in memory.
  TORCH_ARG(int64_t, max_memory) = 0;
  // With a budget that holds every weight, read them once and keep them;
  // false: stream them anyway (to measure streaming, or to keep the
  // process small).
  TORCH_ARG(bool, resident_if_fits) = true;
  // Read the next units while one computes (Note [Streamed inference]).
  TORCH_ARG(bool, prefetch) = true;
  // Buffers when streaming with prefetch (>= 2; buffers - 1 loads ahead).
  // 0: 2 with prefetch, 1 without; set without prefetch, it is refused.
  TORCH_ARG(int64_t, buffers) = 0;
  // The most sequences per forward, and the positions the KV cache holds
  // (0: the model's context); both size the memory plan.
  TORCH_ARG(int64_t, batch) = 1;
  TORCH_ARG(int64_t, max_length) = 0;
  // Attention heads, when the weights' metadata does not say (shapes do not).
  TORCH_ARG(int64_t, heads) = 0;
  // Tensor-parallel ranks; null: this rank alone.
  TORCH_ARG(comm::CommunicatorPtr, group) = nullptr;
  // Where the forward computes (Note [Streamed inference on a device]).
  TORCH_ARG(c10::Device, device) = c10::Device(c10::kCPU);

 public:
  StreamedGPTOptions() = default;
};

struct StreamPlan {
  bool resident = false;         // every weight in memory
  int64_t buffers = 0;           // when streaming
  int64_t buffer_bytes = 0;      // each
  int64_t weight_bytes = 0;      // this rank's weights (its shards)
  int64_t kv_bytes = 0;
  int64_t work_bytes = 0;        // estimated activations of the largest forward
  int64_t margin_bytes = 0;
  int64_t baseline_bytes = 0;    // the process before the plan (VmRSS)
  int64_t units = 0, head_chunks = 0;
  int64_t planned_bytes() const;  // baseline + what the engine holds
  std::string describe() const;
};

struct StreamStats {
  int64_t forwards = 0, tokens = 0;
  int64_t bytes_read = 0;
  double read_seconds = 0;     // per load: from its submission to its last byte, summed
  double stall_seconds = 0;    // compute waiting for those loads
  double forward_seconds = 0;
  double hidden_fraction() const;  // 1 - stall / read; 1 with nothing read
};

class StreamedGPT : public TokenModel {
 public:
  // Collective over options.group. Throws on every rank of the group if the
  // weights are not a GPT, or the budget cannot hold the plan.
  StreamedGPT(std::shared_ptr<StoredWeights> weights, StreamedGPTOptions options = {});
  ~StreamedGPT() override;  // waits for the reads in flight
  StreamedGPT(const StreamedGPT&) = delete;
  StreamedGPT& operator=(const StreamedGPT&) = delete;

  const models::GPTConfig& config() const;
  const StreamPlan& plan() const;
  const StreamStats& stats() const;
  void reset_stats();
  const comm::CommunicatorPtr& group() const override;

  // Empties the KV cache for `batch` (<= options.batch) new sequences.
  void reset(int64_t batch) override;
  // Tokens each sequence holds in the cache.
  int64_t position() const;
  // ids [batch, t] continue every sequence at position(); returns logits
  // [batch, t, vocab] in float over the whole vocabulary, on every rank.
  // Collective over the group. After a failure (a damaged file) the model
  // refuses further calls.
  at::Tensor forward(const at::Tensor& ids) override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A GPT's config from stored weights: the architecture its metadata records
// ({"gpt": GPTConfig::to_json()}, or under "extra" where Trainer::save put the
// caller's metadata, as train_gpt's), checked against the shapes; without
// one, GPT-2 from the shapes with heads from the metadata ({"gpt": {"heads":
// H}}) or `heads` (> 0 wins). Refuses weights that are not a dense GPT,
// naming what is missing.
models::GPTConfig gpt_config_from_weights(const StoredWeights& weights, int64_t heads = 0);

}  // namespace infer
}  // namespace tessera
