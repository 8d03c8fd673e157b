// tessera_generate: text from a GPT whose weights stay on disk (a
// safetensors file, e.g. tessera_consolidate's, or a checkpoint directory),
// under a memory budget per process; with several ranks, tensor-parallel
// over all of them (docs/offload.md, "Inference").
//
//   tessera_generate --weights gpt.safetensors --max-memory 512M --tokens 64 --prompt-text "Once"
//   mpirun -np 2 tessera_generate --weights ckpt/final --prompt 1,2,3 --temperature 0 --out gen.json
//   tessera_generate --model hf:Llama-3.2-1B --prompt 128000,791 --tokens 16
//
// Every option and its default: tessera_generate --help (docs/cli.md).
// Rank 0 prints one JSON line of measurements; the peak resident memory is
// the largest over the ranks.
#include "example_main.h"

#include <tessera/comm/factory.h>
#include <tessera/core/process_memory.h>
#include <tessera/core/atomic_file.h>
#include <tessera/infer/streamed_gpt.h>
#include <tessera/core/safetensors.h>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <map>
#include <sstream>

namespace {

using Json = nlohmann::json;

int64_t parse_size(const std::string& text) {
  size_t used = 0;
  double v = -1;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
  }
  const std::string unit = text.substr(used);
  const std::map<std::string, double> units = {{"", 1}, {"K", 1024.0}, {"M", 1024.0 * 1024}, {"G", 1024.0 * 1024 * 1024}};
  TORCH_CHECK(v >= 0 && units.count(unit), "--max-memory takes a size such as 300M or 2G (K, M, G: powers of ",
              "1024; 0: no limit), got '", text, "'");
  return static_cast<int64_t>(v * units.at(unit));
}

std::vector<int64_t> parse_ids(const std::string& text) {
  std::vector<int64_t> ids;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    try {
      size_t used = 0;
      ids.push_back(std::stoll(item, &used));
      TORCH_CHECK(used == item.size(), "");
    } catch (const std::exception&) {
      TORCH_CHECK(false, "--prompt takes token ids separated by commas, got '", text, "'");
    }
  }
  TORCH_CHECK(!ids.empty(), "--prompt is empty; give at least one token id");
  return ids;
}

struct Args {
  std::string weights, model, prompt = "0", prompt_text, out, logits_out;
  int64_t heads = 0, tokens = 32, batch = 1, top_k = 0, max_memory = 0, buffers = 0, io_threads = 2;
  uint64_t seed = 1;
  double temperature = 0.8;
  bool stream = false, no_prefetch = false, drop_cache = false;
};

tessera::cli::Command command(Args& a) {
  tessera::cli::Command c("tessera_generate", "text from a GPT whose weights stay on disk, under a memory budget");
  c.add("weights", &a.weights, "a safetensors file or a checkpoint directory (this or --model)");
  c.add("model", &a.model, "hf:DIR, a Hugging Face model directory of the Llama family (docs/huggingface.md)");
  c.add("heads", &a.heads, "attention heads, when the weights' metadata does not say; 0: the metadata's");
  c.add("prompt", &a.prompt, "token ids, comma-separated");
  c.add("prompt-text", &a.prompt_text, "the prompt as bytes (byte-level vocabularies of 256, as train_gpt's)");
  c.add("tokens", &a.tokens, "tokens to generate");
  c.add("batch", &a.batch, "sequences, each from the same prompt");
  c.add("temperature", &a.temperature, "sampling temperature; 0: greedy");
  c.add("top-k", &a.top_k, "sample among the k most likely tokens; 0: all");
  c.add("seed", &a.seed, "the sampler's seed");
  c.add("max-memory", &a.max_memory, "bytes per process, e.g. 300M or 2G (K, M, G: powers of 1024); 0: no limit",
        "SIZE", parse_size, [](int64_t v) { return std::to_string(v); });
  c.add("stream", &a.stream, "stream the weights even when the budget holds them all");
  c.add("no-prefetch", &a.no_prefetch, "read each layer when it is needed, not ahead");
  c.add("buffers", &a.buffers, "streaming buffers with prefetch; 0: 2 (refused with --no-prefetch)");
  c.add("io-threads", &a.io_threads, "reader threads per file");
  c.add("drop-cache", &a.drop_cache, "drop what was read from the page cache: every read goes to the disk");
  c.add("out", &a.out, "the tokens, text and measurements as JSON (written atomically)");
  c.add("logits-out", &a.logits_out, "every step's logits as safetensors (\"step.N\" [batch, vocab])");
  return c;
}


// "GPT 4 layers, hidden 128, 4 heads", and what differs from GPT-2's architecture.
std::string describe(const tessera::models::GPTConfig& c) {
  std::string s = fmt::format("GPT {} layers, hidden {}, {} heads", c.layers(), c.hidden(), c.heads());
  if (c.grouped_attention()) s += fmt::format(" ({} key/value)", c.num_kv_heads());
  if (c.norm() == tessera::nn::NormKind::kRMSNorm) s += ", RMSNorm";
  if (c.positions() == tessera::models::Positions::kRotary) s += ", rotary";
  if (c.qk_norm()) s += ", q/k norms";
  if (c.mlp() == tessera::nn::MLPKind::kSwiGLU) s += ", SwiGLU";
  return s;
}

int run(Args a) {
  TORCH_CHECK(a.weights.empty() != a.model.empty(), "give one of --weights (a safetensors file or a checkpoint "
              "directory) and --model hf:DIR (a Hugging Face model directory)");
  if (!a.model.empty()) {
    TORCH_CHECK(a.model.rfind("hf:", 0) == 0, "--model takes hf:DIR, a Hugging Face model directory; got '", a.model,
                "'");
    a.weights = a.model;
  }
  const int64_t max_memory = a.max_memory;
  const bool prefetch = !a.no_prefetch, drop_cache = a.drop_cache;
  auto world = tessera::comm::make_world_communicator();
  auto weights = std::make_shared<tessera::infer::StoredWeights>(
      a.weights, tessera::infer::StoredWeightsOptions().io_threads(static_cast<int>(a.io_threads)).drop_cache(drop_cache));
  std::vector<int64_t> prompt_ids;
  if (!a.prompt_text.empty()) {
    for (unsigned char ch : a.prompt_text) prompt_ids.push_back(ch);
  } else {
    prompt_ids = parse_ids(a.prompt);
  }
  const int64_t batch = a.batch, tokens = a.tokens;
  const int64_t length = static_cast<int64_t>(prompt_ids.size()) + tokens;
  const int64_t context = tessera::infer::gpt_config_from_weights(*weights, a.heads).context();
  TORCH_CHECK(tokens >= 1 && length <= context, "the prompt's ", prompt_ids.size(), " tokens and ", tokens,
              " new ones must fit in the model's context of ", context, "; generate fewer (and at least one) tokens");
  tessera::infer::StreamedGPT model(weights, tessera::infer::StreamedGPTOptions()
                                                 .max_memory(max_memory)
                                                 .resident_if_fits(!a.stream)
                                                 .prefetch(prefetch)
                                                 .buffers(a.buffers)
                                                 .batch(batch)
                                                 .max_length(length)
                                                 .heads(a.heads)
                                                 .group(world->size() > 1 ? world : nullptr));
  const auto& c = model.config();
  const bool rank0 = world->rank() == 0;
  if (rank0)
    fmt::print(stderr, "tessera_generate: {}, vocab {} on {} rank(s); {}\n", describe(c), c.vocab(), world->size(),
               model.plan().describe());
  const at::Tensor prompt = at::tensor(prompt_ids, at::kLong).unsqueeze(0).repeat({batch, 1});
  model.reset_stats();
  const auto gen = tessera::infer::generate(model, prompt, tokens,
                                            tessera::infer::SamplingOptions()
                                                .temperature(a.temperature)
                                                .top_k(a.top_k)
                                                .seed(a.seed),
                                            !a.logits_out.empty());
  at::Tensor peak = at::full({1}, tessera::peak_resident_bytes(), at::kLong);
  world->control()->all_reduce(peak, {tessera::comm::ReduceOp::kMax})->wait();
  if (!rank0) return 0;

  const auto& st = model.stats();
  Json out = {{"weights", a.weights},
              {"ranks", world->size()},
              {"parameters_bytes", model.plan().weight_bytes},
              {"resident", model.plan().resident},
              {"prefetch", prefetch},
              {"drop_cache", drop_cache},
              {"buffers", model.plan().buffers},
              {"max_memory", max_memory},
              {"planned_bytes", model.plan().planned_bytes()},
              {"peak_rss_bytes", peak.item<int64_t>()},
              {"prefill_s", gen.prefill_seconds},
              {"decode_tokens_per_s", gen.decode_tokens_per_second()},
              {"bytes_read", st.bytes_read},
              {"read_s", st.read_seconds},
              {"stall_s", st.stall_seconds},
              {"hidden_fraction", st.hidden_fraction()}};
  std::vector<std::vector<int64_t>> rows;
  std::string text;
  for (int64_t b = 0; b < batch; ++b) {
    const at::Tensor row = gen.tokens[b].contiguous();
    rows.emplace_back(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + row.numel());
  }
  if (c.vocab() == 256)
    for (int64_t id : rows[0]) text += static_cast<char>(id);
  fmt::print("{}\n", out.dump());
  if (c.vocab() == 256) fmt::print(stderr, "{}{}\n", a.prompt_text, text);
  if (!a.out.empty()) {
    Json file = out;
    file["tokens"] = rows;
    if (c.vocab() == 256) file["text"] = text;
    tessera::write_file_atomically(a.out, file.dump(1) + "\n");
  }
  if (!a.logits_out.empty()) {
    std::vector<std::pair<std::string, at::Tensor>> steps;
    for (size_t i = 0; i < gen.logits.size(); ++i) steps.emplace_back("step." + std::to_string(i), gen.logits[i]);
    tessera::write_safetensors(a.logits_out, steps);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  tessera::cli::Command c = command(a);
  return tessera_examples::run_command(argc, argv, c, [&] { return run(a); });
}
