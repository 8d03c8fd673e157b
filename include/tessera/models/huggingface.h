#pragma once
// Hugging Face checkpoints of the decoder (models::GPT): what config.json
// says in GPTConfig's terms and back, and one name/layout table per
// architecture between tessera's full-state names (Note [GPT full weights])
// and the tensors of model.safetensors. Reading and writing the files is
// infer/hf_checkpoint.h's; docs/huggingface.md.
//
// Note [Hugging Face tables]
// Each tessera tensor is a stack along its first dimension of parts, each
// part a box of one Hugging Face tensor:
//   kRows        rows [begin, begin + rows) are hf[offset + i, offset' + ...]:
//                renamed tensors (o_proj, gate_proj, norms), and the row
//                blocks of q/k/v per head that tessera packs (c_attn: q, k, v
//                of head h; kv_proj: k, v of kv head g);
//   kTransposed  the same rows read from a transposed matrix: GPT-2's Conv1D
//                stores [in, out], tessera's Linear [out, in];
//   kExpert      row `begin` (one expert of the stacked [E, out, in]) is a
//                whole Hugging Face tensor (Mixtral's experts.e.w1/w3/w2).
// Every element of every Hugging Face weight belongs to exactly one part, so
// one table reads (import) and writes (export); the Hugging Face tensors'
// shapes follow from it.
#include "tessera/models/gpt.h"

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace tessera {
namespace models {

enum class HFArchitecture { kGPT2, kLlama, kMistral, kQwen2, kQwen3, kMixtral, kQwen2Moe };

// "LlamaForCausalLM", ...
std::string hf_architecture_name(HFArchitecture architecture);
// The architecture whose config.json expresses `config` (export of a model
// that was not imported); throws naming what none of them has.
HFArchitecture hf_architecture_for(const GPTConfig& config);

// A config.json read: the model, and what the run must respect.
struct HFConfig {
  HFArchitecture architecture = HFArchitecture::kLlama;
  // The model (its context: max_position_embeddings, n_positions for GPT-2).
  GPTConfig model;
  // The file's text, written back on export.
  std::string json;
  // The attention window (0: none); sequences longer than it are refused.
  int64_t sliding_window = 0;
  std::string dtype;  // "float32", "bfloat16", ... ("" when it does not say)

  // Refuses a training or inference sequence length the model cannot run
  // as written (longer than a sliding window, or than GPT-2's positions).
  void check_sequence(int64_t seq) const;
};

// Parses config.json's text. Every key is carried out, kept as metadata
// that does not change the model, or refused by name (docs/huggingface.md).
// `where` names the file in messages.
HFConfig hf_config_from_json(const std::string& json, const std::string& where);

// config.json for `config`: the original (`original`, may be empty) with
// the model's values, or a fresh one for `architecture`; "dtype" (and
// "torch_dtype") set to `dtype` ("float32", "bfloat16", "float16").
std::string hf_config_json(HFArchitecture architecture, const GPTConfig& config, const std::string& original,
                           const std::string& dtype);
// generation_config.json: the bos/eos/pad ids of `config_json`.
std::string hf_generation_config_json(const std::string& config_json);

struct HFPart {
  enum class Kind { kRows, kTransposed, kExpert };
  std::string name;  // the Hugging Face tensor
  Kind kind = Kind::kRows;
  int64_t begin = 0, rows = 0;  // along tessera's first dimension
  std::vector<int64_t> offset;  // where the part starts in the Hugging Face tensor
};

struct HFEntry {
  std::vector<int64_t> shape;  // tessera's full shape
  std::vector<HFPart> parts;
};

// tessera full-state name -> its parts (Note [Hugging Face tables]).
// `gpt2_prefix`: "transformer." (transformers' GPT2LMHeadModel) or "" (the
// original OpenAI files' names).
std::map<std::string, HFEntry> hf_table(HFArchitecture architecture, const GPTConfig& config,
                                        const std::string& gpt2_prefix = "transformer.");

// The Hugging Face tensors the table reads and writes, with their shapes, in
// the order transformers lists them (sorted by name).
std::map<std::string, std::vector<int64_t>> hf_shapes(const std::map<std::string, HFEntry>& table);

// Hugging Face tensors that are not weights and are skipped on import
// (GPT-2's causal-mask buffers "h.N.attn.bias" / "h.N.attn.masked_bias").
bool hf_ignored_tensor(HFArchitecture architecture, const std::string& name);

}  // namespace models
}  // namespace tessera
