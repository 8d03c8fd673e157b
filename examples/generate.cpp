// tessera_generate: text from a GPT whose weights stay on disk (a
// safetensors file, e.g. tessera_consolidate's, or a checkpoint directory),
// under a memory budget per process; with several ranks, tensor-parallel
// over all of them (docs/offload.md, "Inference").
//
//   tessera_generate --weights gpt.safetensors --max-memory 512M --tokens 64 --prompt-text "Once"
//   mpirun -np 2 tessera_generate --weights ckpt/final --prompt 1,2,3 --temperature 0 --out gen.json
//
// Flags (defaults in brackets):
//   --weights PATH        safetensors file or checkpoint directory (required)
//   --heads N             attention heads, when the weights' metadata does not say
//   --prompt IDS          token ids, comma-separated [0]
//   --prompt-text TEXT    the prompt as bytes (byte-level vocabularies of 256, as train_gpt's)
//   --tokens N            tokens to generate [32]
//   --batch B             sequences, each from the same prompt [1]
//   --temperature T       0: greedy [0.8]
//   --top-k K             sample among the K most likely; 0: all [0]
//   --seed S              [1]
//   --max-memory SIZE     per process, e.g. 300M, 2G; 0: no limit [0]
//   --stream              stream the weights even when the budget holds them all
//   --no-prefetch         read each layer when it is needed, not ahead
//   --buffers K           streaming buffers with prefetch; refused with --no-prefetch [2]
//   --io-threads N        reader threads per file [2]
//   --drop-cache          drop what was read from the page cache: every read goes to the disk
//   --out FILE            the tokens, text and measurements as JSON (written atomically)
//   --logits-out FILE     every step's logits as safetensors ("step.N" [batch, vocab])
// Rank 0 prints one JSON line of measurements; the peak resident memory is
// the largest over the ranks.
#include "example_main.h"

#include <tessera/comm/factory.h>
#include <tessera/core/process_memory.h>
#include <tessera/train/atomic_file.h>
#include <tessera/train/generation.h>
#include <tessera/train/safetensors.h>

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

int run(int argc, char** argv) {
  std::map<std::string, std::string> a = {
      {"weights", ""}, {"heads", "0"},        {"prompt", "0"},       {"prompt-text", ""}, {"tokens", "32"},
      {"batch", "1"},  {"temperature", "0.8"}, {"top-k", "0"},        {"seed", "1"},       {"max-memory", "0"},
      {"buffers", "0"}, {"io-threads", "2"},  {"out", ""},           {"logits-out", ""}};
  bool stream = false, prefetch = true, drop_cache = false;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    TORCH_CHECK(flag.rfind("--", 0) == 0, "expected a flag, got '", flag, "'; see examples/generate.cpp");
    const std::string key = flag.substr(2);
    if (key == "stream" || key == "no-prefetch" || key == "drop-cache") {
      (key == "stream" ? stream : key == "drop-cache" ? drop_cache : prefetch) = key != "no-prefetch";
      continue;
    }
    TORCH_CHECK(a.count(key), "unknown flag ", flag, "; see the comment at the top of examples/generate.cpp");
    TORCH_CHECK(i + 1 < argc, flag, " needs a value");
    a[key] = argv[++i];
  }
  TORCH_CHECK(!a["weights"].empty(), "--weights is required: a safetensors file or a checkpoint directory");
  auto number = [&](const std::string& key) {
    try {
      return std::stod(a[key]);
    } catch (const std::exception&) {
      TORCH_CHECK(false, "--", key, " takes a number, got '", a[key], "'");
    }
  };
  const int64_t max_memory = parse_size(a["max-memory"]);
  auto world = tessera::comm::make_world_communicator();
  auto weights = std::make_shared<tessera::train::StoredWeights>(
      a["weights"], tessera::train::StoredWeightsOptions{static_cast<int>(number("io-threads")), "model/", drop_cache});
  std::vector<int64_t> prompt_ids;
  if (!a["prompt-text"].empty()) {
    for (unsigned char ch : a["prompt-text"]) prompt_ids.push_back(ch);
  } else {
    prompt_ids = parse_ids(a["prompt"]);
  }
  const int64_t batch = static_cast<int64_t>(number("batch")), tokens = static_cast<int64_t>(number("tokens"));
  const int64_t length = static_cast<int64_t>(prompt_ids.size()) + tokens;
  const int64_t context = tessera::train::gpt_config_from_weights(*weights, static_cast<int64_t>(number("heads"))).context;
  TORCH_CHECK(tokens >= 1 && length <= context, "the prompt's ", prompt_ids.size(), " tokens and ", tokens,
              " new ones must fit in the model's context of ", context, "; generate fewer (and at least one) tokens");
  tessera::train::StreamedGPT model(weights, tessera::train::StreamedGPTOptions()
                                                 .max_memory(max_memory)
                                                 .resident_if_fits(!stream)
                                                 .prefetch(prefetch)
                                                 .buffers(static_cast<int64_t>(number("buffers")))
                                                 .batch(batch)
                                                 .max_length(length)
                                                 .heads(static_cast<int64_t>(number("heads")))
                                                 .group(world->size() > 1 ? world : nullptr));
  const auto& c = model.config();
  const bool rank0 = world->rank() == 0;
  if (rank0)
    fmt::print(stderr, "tessera_generate: GPT {} layers, hidden {}, {} heads, vocab {} on {} rank(s); {}\n", c.layers,
               c.hidden, c.heads, c.vocab, world->size(), model.plan().describe());
  const at::Tensor prompt = at::tensor(prompt_ids, at::kLong).unsqueeze(0).repeat({batch, 1});
  model.reset_stats();
  const auto gen = tessera::train::generate(model, prompt, tokens,
                                            tessera::train::SamplingOptions()
                                                .temperature(number("temperature"))
                                                .top_k(static_cast<int64_t>(number("top-k")))
                                                .seed(static_cast<uint64_t>(number("seed"))),
                                            !a["logits-out"].empty());
  at::Tensor peak = at::full({1}, tessera::peak_resident_bytes(), at::kLong);
  world->control()->all_reduce(peak, {tessera::comm::ReduceOp::kMax})->wait();
  if (!rank0) return 0;

  const auto& st = model.stats();
  Json out = {{"weights", a["weights"]},
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
  if (c.vocab == 256)
    for (int64_t id : rows[0]) text += static_cast<char>(id);
  fmt::print("{}\n", out.dump());
  if (c.vocab == 256) fmt::print(stderr, "{}{}\n", a["prompt-text"], text);
  if (!a["out"].empty()) {
    Json file = out;
    file["tokens"] = rows;
    if (c.vocab == 256) file["text"] = text;
    tessera::train::write_file_atomically(a["out"], file.dump(1) + "\n");
  }
  if (!a["logits-out"].empty()) {
    std::vector<std::pair<std::string, at::Tensor>> steps;
    for (size_t i = 0; i < gen.logits.size(); ++i) steps.emplace_back("step." + std::to_string(i), gen.logits[i]);
    tessera::train::write_safetensors(a["logits-out"], steps);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return tessera_examples::run_example(argc, argv, "tessera_generate", run); }
