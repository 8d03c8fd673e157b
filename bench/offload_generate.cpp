// offload_generate: inference of a GPT whose weights are 4x the memory
// budget. Writes a randomly initialised GPT (GPT-2 medium's shape by
// default: 24 layers, hidden 1024, vocab 50257, 355 M parameters, 1.42 GB
// in fp32) as one safetensors file, then runs tessera_generate on it as
// separate processes, so that each one's peak resident memory is its own:
//
//   1. in memory: no budget, every weight read once (the baseline);
//   2. a budget of a quarter of the weights' bytes, with prefetch;
//   3. the same budget without prefetch;
//   4, 5. both again with every read from the disk (--drop-cache: the
//      pages read are dropped from the page cache);
//   6. (--tp N) the budget per rank, tensor-parallel over N ranks (mpirun).
//
// Each greedy, the same prompt and tokens; the logits of every step are
// compared with the in-memory run's. Prints one JSON object per run and a
// summary: peak RSS against the budget, decode tokens/s, the fraction of
// the disk reads hidden behind compute, the largest logit difference, and
// the read-bound rate (bytes per token over the measured read bandwidth).
//
//   offload_generate --dir /scratch/og --tp 2
//
// Every option and its default: offload_generate --help (docs/cli.md).
// Not an MPI program itself: it launches tessera_generate (and mpirun for
// --tp), so its options are parsed without examples/example_main.h's frame,
// which starts MPI.
#include <tessera/core/cli.h>
#include <tessera/core/remove_tree.h>
#include <tessera/core/safetensors.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#ifndef TESSERA_GENERATE_PATH
#error "TESSERA_GENERATE_PATH: the tessera_generate binary (set by bench/CMakeLists.txt)"
#endif

namespace {

using Json = nlohmann::json;
namespace fs = std::filesystem;

// models::GPT's names and shapes (Note [GPT full weights]), N(0, 0.02) weights,
// biases 0.01 · N(0, 1), LayerNorm 1 + 0.1 · N(0, 1).
std::vector<std::pair<std::string, at::Tensor>> random_gpt(int64_t layers, int64_t h, int64_t vocab, int64_t context) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1234);
  auto normal = [&](std::vector<int64_t> shape, double std) { return at::normal(0.0, std, shape, gen); };
  std::vector<std::pair<std::string, at::Tensor>> w;
  w.emplace_back("wte.weight", normal({vocab, h}, 0.02));
  w.emplace_back("wpe.weight", normal({context, h}, 0.01));
  for (int64_t i = 0; i < layers; ++i) {
    const std::string p = "h." + std::to_string(i) + ".";
    w.emplace_back(p + "ln_1.weight", 1 + normal({h}, 0.1));
    w.emplace_back(p + "ln_1.bias", normal({h}, 0.01));
    w.emplace_back(p + "attn.c_attn.weight", normal({3 * h, h}, 0.02));
    w.emplace_back(p + "attn.c_attn.bias", normal({3 * h}, 0.01));
    w.emplace_back(p + "attn.c_proj.weight", normal({h, h}, 0.02 / std::sqrt(2.0 * layers)));
    w.emplace_back(p + "attn.c_proj.bias", normal({h}, 0.01));
    w.emplace_back(p + "ln_2.weight", 1 + normal({h}, 0.1));
    w.emplace_back(p + "ln_2.bias", normal({h}, 0.01));
    w.emplace_back(p + "mlp.c_fc.weight", normal({4 * h, h}, 0.02));
    w.emplace_back(p + "mlp.c_fc.bias", normal({4 * h}, 0.01));
    w.emplace_back(p + "mlp.c_proj.weight", normal({h, 4 * h}, 0.02 / std::sqrt(2.0 * layers)));
    w.emplace_back(p + "mlp.c_proj.bias", normal({h}, 0.01));
  }
  w.emplace_back("ln_f.weight", 1 + normal({h}, 0.1));
  w.emplace_back("ln_f.bias", normal({h}, 0.01));
  return w;
}

// Runs a command, returns the JSON line it printed last.
Json run(const std::string& command, const std::string& out) {
  const int status = std::system((command + " > " + out + " 2> " + out + ".err").c_str());
  std::ifstream in(out), err(out + ".err");
  std::string line, last, errors((std::istreambuf_iterator<char>(err)), std::istreambuf_iterator<char>());
  while (std::getline(in, line))
    if (!line.empty() && line[0] == '{') last = line;
  TORCH_CHECK(status == 0 && !last.empty(), "offload_generate: '", command, "' failed (status ", status, "): ", errors);
  return Json::parse(last);
}

double max_difference(const std::string& a, const std::string& b) {
  tessera::SafetensorsFile fa(a), fb(b);
  double worst = 0;
  for (const auto& name : fa.names())
    worst = std::max(worst, (fa.read(name) - fb.read(name)).abs().max().item<double>());
  return worst;
}

struct Args {
  std::string dir = "/tmp/tessera_offload_generate";
  int64_t layers = 24, hidden = 1024, heads = 16, vocab = 50257, context = 1024, prompt = 8, tokens = 16;
  double fraction = 0.25;
  int64_t tp = 0, keep = 0;
  std::string generate = TESSERA_GENERATE_PATH;
};

tessera::cli::Command command(Args& a) {
  tessera::cli::Command c("offload_generate",
                          "tessera_generate on a GPT 4x the memory budget: peak memory, tokens/s and logits against "
                          "the weights in memory");
  c.group("Model");
  c.add("layers", &a.layers, "GPT blocks of the random GPT");
  c.add("hidden", &a.hidden, "hidden size");
  c.add("heads", &a.heads, "attention heads");
  c.add("vocab", &a.vocab, "vocabulary");
  c.add("context", &a.context, "context length: rows of the position embedding");
  c.group("Runs");
  c.add("prompt", &a.prompt, "tokens in the prompt");
  c.add("tokens", &a.tokens, "tokens to generate (greedy)");
  c.add("fraction", &a.fraction, "the memory budget as a fraction of the weights' bytes");
  c.add("tp", &a.tp, "ranks of the tensor-parallel run under mpirun; 0 or 1: no such run");
  c.group("Files");
  c.add("dir", &a.dir, "directory of the weights file, the outputs and the logits");
  c.add("keep", &a.keep, "1: keep --dir afterwards; 0: remove it");
  c.add("generate", &a.generate, "the tessera_generate binary");
  c.default_text("generate", "this build's tessera_generate");
  return c;
}

int main_body(const Args& a) {
  fs::create_directories(a.dir);
  const std::string weights = a.dir + "/gpt.safetensors";
  int64_t bytes = 0;
  {
    auto w = random_gpt(a.layers, a.hidden, a.vocab, a.context);
    for (const auto& t : w) bytes += t.second.numel() * 4;
    if (!fs::exists(weights) || static_cast<int64_t>(fs::file_size(weights)) < bytes)
      tessera::write_safetensors(
          weights, w, {{"tessera.checkpoint_metadata", fmt::format(R"({{"gpt": {{"heads": {}}}}})", a.heads)}});
  }
  const int64_t budget = static_cast<int64_t>(static_cast<double>(bytes) * a.fraction);
  std::string prompt;
  for (int64_t i = 0; i < a.prompt; ++i) prompt += (i ? "," : "") + std::to_string((i * 7919) % a.vocab);
  const std::string common = fmt::format(" --weights {} --prompt {} --tokens {} --temperature 0 --logits-out ",
                                         weights, prompt, a.tokens);
  struct Run {
    std::string name, launcher, flags;
  };
  std::vector<Run> runs = {{"in_memory", "", ""},
                           {"budget_prefetch", "", fmt::format(" --max-memory {} --stream", budget)},
                           {"budget_no_prefetch", "", fmt::format(" --max-memory {} --stream --no-prefetch", budget)},
                           {"budget_prefetch_disk", "", fmt::format(" --max-memory {} --stream --drop-cache", budget)},
                           {"budget_no_prefetch_disk", "",
                            fmt::format(" --max-memory {} --stream --no-prefetch --drop-cache", budget)}};
  if (a.tp > 1)
    runs.push_back({fmt::format("budget_prefetch_tp{}", a.tp),
                    fmt::format("mpirun -np {} --oversubscribe ", a.tp),
                    fmt::format(" --max-memory {} --stream", budget)});
  Json summary = {{"bench", "offload_generate"}, {"weights_bytes", bytes}, {"budget_bytes", budget}};
  for (const auto& r : runs) {
    const std::string logits = a.dir + "/" + r.name + ".logits.safetensors";
    Json j = run(r.launcher + a.generate + common + logits + r.flags, a.dir + "/" + r.name + ".out");
    j["run"] = r.name;
    j["max_logit_difference_vs_in_memory"] = max_difference(logits, a.dir + "/in_memory.logits.safetensors");
    j["peak_rss_within_budget"] = r.name == "in_memory" ? Json(nullptr) : Json(j["peak_rss_bytes"] <= budget);
    // Streamed, a token reads every weight: the rate the measured read bandwidth allows.
    const double bandwidth = j["read_s"].get<double>() > 0 ? j["bytes_read"].get<double>() / j["read_s"].get<double>() : 0;
    j["read_bandwidth_gbps"] = bandwidth / 1e9;
    if (r.name != "in_memory" && bandwidth > 0) j["read_bound_tokens_per_s"] = bandwidth / static_cast<double>(bytes);
    fmt::print("{}\n", j.dump());
    summary[r.name] = {{"decode_tokens_per_s", j["decode_tokens_per_s"]},
                       {"peak_rss_mb", j["peak_rss_bytes"].get<double>() / 1048576.0},
                       {"hidden_fraction", j["hidden_fraction"]},
                       {"max_logit_difference", j["max_logit_difference_vs_in_memory"]}};
  }
  fmt::print("{}\n", summary.dump());
  if (a.keep == 0) tessera::remove_tree(a.dir);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  tessera::cli::Command c = command(a);
  try {
    const tessera::cli::Parsed parsed = c.parse(argc, argv);
    if (!parsed.run) {
      fmt::print("{}", parsed.text);
      return 0;
    }
    return main_body(a);
  } catch (const c10::Error& e) {
    fmt::print(stderr, "offload_generate: error: {}\n", e.what_without_backtrace());
    return 1;
  }
}
