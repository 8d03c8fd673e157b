// Streamed inference (infer/streamed_gpt.h) against the serial reference GPT
// (reference_gpt.h), with random biases and norms (gpt_random_weights):
// logits at every position, within 1e-5 relative, through the KV cache, from a
// safetensors file and from a checkpoint cut into region and flat pieces;
// weights in memory, streamed with prefetch and without; tensor-parallel
// over every rank of the test. The Llama family against the reference Llama
// (reference_llama.h) with random biases and norms, its architecture read
// from the file's metadata. Then what it refuses: damaged, truncated and
// missing weights, a budget too small, bad options; and the sampler. The
// comparisons compute on TESSERA_TEST_DEVICE (the reference on the CPU); the
// budget's tests measure this process's memory and stay on the CPU.
#include "gpt_weights.h"
#include "llama_weights.h"
#include "reference_gpt.h"
#include "test_util.h"

#include "tessera/core/process_memory.h"
#include "tessera/core/atomic_file.h"
#include "tessera/train/checkpoint.h"
#include "tessera/infer/generation.h"
#include "tessera/core/safetensors.h"
#include "tessera/infer/streamed_gpt.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include <csignal>
#include <filesystem>
#include <fstream>

namespace tessera {
namespace {

namespace fs = std::filesystem;
using infer::StoredWeights;
using infer::StreamedGPT;
using infer::StreamedGPTOptions;

models::GPTConfig config() {
  models::GPTConfig c = models::GPTConfig::preset("tiny");  // vocab 101: not divisible by 2 ranks
  c.layers(3);
  return c;
}

// A directory every rank sees, emptied by rank 0; one per world size, as
// ctest runs the np1 and np2 variants at once.
std::string shared_dir(const std::string& name) {
  auto w = test::world();
  const std::string dir = ::testing::TempDir() + "tessera_streamed_" + name + "_np" + std::to_string(w->size());
  if (w->rank() == 0) {
    remove_tree(dir);
    fs::create_directories(dir);
  }
  w->barrier()->wait();
  return dir;
}

// The weights as one safetensors file (written by rank 0) and as a
// checkpoint whose pieces are spread over the ranks' files: each tensor's
// first rows as one region, the other rows as a region cut into two flat
// ranges (1-d tensors: two flat ranges).
struct Stored {
  std::string file, checkpoint;
};

Stored store(const std::string& name, const std::map<std::string, at::Tensor>& weights, int64_t heads) {
  auto w = test::world();
  Stored s{shared_dir(name) + "/gpt.safetensors", shared_dir(name) + "/ckpt"};
  if (w->rank() == 0) {
    std::vector<std::pair<std::string, at::Tensor>> list(weights.begin(), weights.end());
    write_safetensors(s.file, list, {{"tessera.checkpoint_metadata", R"({"gpt": {"heads": )" +
                                                                               std::to_string(heads) + "}}"}});
  }
  std::vector<train::TensorPiece> pieces;
  int index = 0;
  for (const auto& [n, t] : weights) {
    const auto shape = t.sizes().vec();
    std::vector<train::TensorPiece> mine;
    auto flat_pieces = [&, &name = n](std::vector<int64_t> off, std::vector<int64_t> len, const at::Tensor& region) {
      const int64_t k = region.numel() / 3;
      for (auto [b, e] : {std::pair<int64_t, int64_t>{0, k}, {k, region.numel()}})
        mine.push_back({"model/" + name, shape, off, len, b, e, region.reshape({-1}).narrow(0, b, e - b).clone()});
    };
    if (t.dim() >= 2 && shape[0] >= 2) {
      const int64_t half = shape[0] / 2;
      std::vector<int64_t> off(shape.size(), 0), len = shape;
      len[0] = half;
      mine.push_back({"model/" + n, shape, off, len, 0, -1, t.narrow(0, 0, half).clone()});
      off[0] = half;
      len[0] = shape[0] - half;
      flat_pieces(off, len, t.narrow(0, half, shape[0] - half));
    } else {
      flat_pieces(std::vector<int64_t>(shape.size(), 0), shape, t);
    }
    for (auto& p : mine)
      if (index++ % w->size() == w->rank()) pieces.push_back(std::move(p));
  }
  train::save_checkpoint(s.checkpoint, pieces, R"({"gpt": {"heads": )" + std::to_string(heads) + "}}", w);
  return s;
}

comm::CommunicatorPtr tp_group() {
  auto w = test::world();
  return w->size() > 1 ? w : nullptr;
}

// The reference's logits of prompt + the tokens fed after it, [b, s, vocab].
at::Tensor reference_logits(const std::map<std::string, at::Tensor>& weights, const at::Tensor& ids) {
  test::ReferenceGPT ref(test::reference_config(config()));
  ref->load_full_state(weights);
  at::NoGradGuard no_grad;
  return ref->forward(ids);
}

// Prefill of 5 tokens, then 4 tokens one at a time, then 3 at once: every
// position's logits, [b, 12, vocab].
at::Tensor streamed_logits(StreamedGPT& model, const at::Tensor& ids) {
  model.reset(ids.size(0));
  std::vector<at::Tensor> out{model.forward(ids.narrow(1, 0, 5))};
  for (int64_t i = 5; i < 9; ++i) out.push_back(model.forward(ids.narrow(1, i, 1)));
  out.push_back(model.forward(ids.narrow(1, 9, 3)));
  return at::cat(out, 1);
}

TEST(StreamedGPT, LogitsEqualTheSerialModelFromEverySourceAndPlan) {
  const auto weights = test::gpt_random_weights(config(), 17);
  const Stored s = store("equal", weights, config().heads());
  const at::Tensor ids = test::seeded_token_ids(5, config().vocab(), 2, 12);
  const at::Tensor expected = reference_logits(weights, ids);
  at::Tensor in_memory;
  for (const std::string& path : {s.file, s.checkpoint}) {
    auto stored = std::make_shared<StoredWeights>(path);
    EXPECT_EQ(infer::gpt_config_from_weights(*stored).heads(), config().heads());
    struct Plan {
      const char* name;
      StreamedGPTOptions options;
    };
    const auto base = StreamedGPTOptions().batch(2).max_length(16).group(tp_group()).device(test::device());
    for (const auto& plan : {Plan{"in memory", base}, Plan{"prefetch 2", StreamedGPTOptions(base).resident_if_fits(false).buffers(2)},
                             Plan{"prefetch 3", StreamedGPTOptions(base).resident_if_fits(false).buffers(3)},
                             Plan{"no prefetch", StreamedGPTOptions(base).resident_if_fits(false).prefetch(false)}}) {
      SCOPED_TRACE(path + ", " + plan.name);
      StreamedGPT model(stored, plan.options);
      EXPECT_EQ(model.plan().resident, std::string(plan.name) == "in memory");
      const at::Tensor got = streamed_logits(model, ids);
      EXPECT_LE(test::rel_error(got, expected), 1e-5);
      if (!in_memory.defined()) in_memory = got;
      // The same operations whatever the source and the plan.
      EXPECT_TRUE(got.equal(in_memory));
      if (!model.plan().resident) {  // every unit read once per forward, into its buffers only
        const auto& st = model.stats();
        EXPECT_EQ(st.forwards, 6);
        EXPECT_GE(st.bytes_read, 6 * model.plan().weight_bytes * 9 / 10);
        EXPECT_EQ(model.plan().buffers, plan.options.prefetch() ? plan.options.buffers() : 1);
      }
    }
  }
}

// Rotary positions through the KV cache (each new token rotated by its
// place), grouped-query attention whose cache holds the kv heads, RMSNorm,
// q/k/v biases (Qwen 2), q/k norms and head_dim != hidden / heads (Qwen 3),
// llama3 rope scaling; every weight random. Tensor-parallel at 2 ranks.
TEST(StreamedGPT, LlamaFamilyEqualsTheReferenceThroughTheKVCache) {
  auto w = test::world();
  for (const std::string preset : {"llama-tiny", "qwen2-tiny", "qwen3-tiny"}) {
    SCOPED_TRACE(preset);
    const models::GPTConfig c = models::GPTConfig::preset(preset);
    const auto hf = test::random_llama_weights(test::reference_llama_config(c), 23);
    const std::string file = shared_dir("llama_" + preset) + "/model.safetensors";
    if (w->rank() == 0) {
      const auto weights = test::to_tessera(hf, c);
      std::vector<std::pair<std::string, at::Tensor>> list(weights.begin(), weights.end());
      write_safetensors(file, list, {{"tessera.checkpoint_metadata", R"({"gpt": )" + c.to_json() + "}"}});
    }
    w->barrier()->wait();
    const at::Tensor ids = test::seeded_token_ids(5, c.vocab(), 2, 12);
    test::ReferenceLlama reference(test::reference_llama_config(c));
    reference->load_state(hf);
    at::Tensor expected;
    {
      at::NoGradGuard no_grad;
      expected = reference->forward(ids);
    }
    auto stored = std::make_shared<StoredWeights>(file);
    const models::GPTConfig read = infer::gpt_config_from_weights(*stored);
    EXPECT_EQ(read.to_json(), models::GPTConfig(c).dropout(0).to_json()) << "the recorded architecture";
    for (bool resident : {true, false}) {
      StreamedGPT model(stored, StreamedGPTOptions()
                                    .batch(2)
                                    .max_length(12)
                                    .resident_if_fits(resident)
                                    .device(test::device())
                                    .group(w->size() == 2 ? w : nullptr));
      EXPECT_LE(test::rel_error(streamed_logits(model, ids), expected), 1e-5) << (resident ? "resident" : "streamed");
    }
  }
}

TEST(StreamedGPT, GreedyGenerationFollowsTheSerialModel) {
  const auto weights = test::gpt_random_weights(config(), 23);
  const Stored s = store("greedy", weights, config().heads());
  StreamedGPT model(
      std::make_shared<StoredWeights>(s.file),
      StreamedGPTOptions().batch(2).max_length(20).resident_if_fits(false).group(tp_group()).device(test::device()));
  const at::Tensor prompt = test::seeded_token_ids(9, config().vocab(), 2, 4);
  const auto gen = infer::generate(model, prompt, 10, infer::SamplingOptions().temperature(0), true);
  ASSERT_EQ(gen.tokens.sizes(), (std::vector<int64_t>{2, 10}));
  // Each token is the argmax of the reference's logits over everything before it.
  const at::Tensor all = at::cat({prompt, gen.tokens}, 1);
  const at::Tensor ref = reference_logits(weights, all.narrow(1, 0, 13));
  for (int64_t i = 0; i < 10; ++i) {
    EXPECT_TRUE(ref.select(1, 3 + i).argmax(1).equal(gen.tokens.select(1, i))) << "token " << i;
    EXPECT_LE(test::rel_error(gen.logits[i], ref.select(1, 3 + i)), 1e-5) << "token " << i;
  }
}

// bf16 weights (train_gpt --precision bf16 saves them so): read as stored,
// computed in float; equal to the reference given the same rounded weights.
TEST(StreamedGPT, Bf16WeightsComputeInFloat) {
  auto weights = test::gpt_random_weights(config(), 29);
  for (auto& entry : weights) entry.second = entry.second.to(at::kBFloat16);
  const Stored s = store("bf16", weights, config().heads());
  std::map<std::string, at::Tensor> rounded;
  for (const auto& [name, t] : weights) rounded[name] = t.to(at::kFloat);
  const at::Tensor ids = test::seeded_token_ids(6, config().vocab(), 2, 12);
  const at::Tensor expected = reference_logits(rounded, ids);
  for (const std::string& path : {s.file, s.checkpoint}) {
    SCOPED_TRACE(path);
    auto stored = std::make_shared<StoredWeights>(path);
    EXPECT_EQ(stored->dtype("h.0.attn.c_attn.weight"), at::kBFloat16);
    StreamedGPT model(
        stored,
        StreamedGPTOptions().batch(2).max_length(12).resident_if_fits(false).group(tp_group()).device(test::device()));
    const at::Tensor got = streamed_logits(model, ids);
    EXPECT_EQ(got.scalar_type(), at::kFloat);
    EXPECT_LE(test::rel_error(got, expected), 1e-5);
    // About half the bytes the same weights take in fp32 (blocks and head, this rank's share).
    int64_t fp32 = 0;
    for (const auto& [name, t] : weights)
      if (name.rfind("h.", 0) == 0 || name == "wte.weight") fp32 += t.numel() * 4 / test::world()->size();
    EXPECT_LT(model.plan().weight_bytes, fp32 * 6 / 10);
  }
}

TEST(StreamedGPT, SamplingDrawsFromTheTopKAtTheTemperature) {
  at::Tensor logits = at::tensor({0.0, 3.0, 1.0, 2.5, -1.0, 2.9}, at::kFloat).repeat({4000, 1});
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  using infer::SamplingOptions;
  EXPECT_TRUE(infer::sample_tokens(logits, SamplingOptions().temperature(0), gen).eq(1).all().item<bool>());
  EXPECT_TRUE(infer::sample_tokens(logits, SamplingOptions().top_k(1), gen).eq(1).all().item<bool>());
  // Top 3 (tokens 1, 5, 3) at temperature 0.5: frequencies follow softmax(2 · logits) over them.
  const at::Tensor drawn = infer::sample_tokens(logits, SamplingOptions().top_k(3).temperature(0.5), gen);
  const at::Tensor counts = at::bincount(drawn, {}, 6).to(at::kDouble) / 4000;
  const at::Tensor p = at::softmax(at::tensor({3.0, 2.5, 2.9}, at::kDouble) * 2, 0);
  EXPECT_EQ(counts[0].item<double>() + counts[2].item<double>() + counts[4].item<double>(), 0.0);
  EXPECT_NEAR(counts[1].item<double>(), p[0].item<double>(), 0.03);
  EXPECT_NEAR(counts[3].item<double>(), p[1].item<double>(), 0.03);
  EXPECT_NEAR(counts[5].item<double>(), p[2].item<double>(), 0.03);
  // The same seed, the same tokens.
  auto g1 = at::make_generator<at::CPUGeneratorImpl>(7), g2 = at::make_generator<at::CPUGeneratorImpl>(7);
  EXPECT_TRUE(infer::sample_tokens(logits, SamplingOptions(), g1).equal(infer::sample_tokens(logits, SamplingOptions(), g2)));
  EXPECT_TRUE(test::throws_with([&] { infer::sample_tokens(logits, SamplingOptions().temperature(-1), gen); },
                                "temperature must be >= 0"));
  EXPECT_TRUE(test::throws_with([&] { infer::sample_tokens(logits, SamplingOptions().top_k(7), gen); },
                                "top_k must lie in [0, 6]"));
}

// Flips one byte of `name`'s data in a safetensors file.
void damage(const std::string& file, const std::string& name) {
  const auto loc = SafetensorsFile(file).location(name);
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(loc.offset + loc.bytes / 2);
  char byte = 0;
  f.read(&byte, 1);
  byte = static_cast<char>(byte ^ 0x40);
  f.seekp(loc.offset + loc.bytes / 2);
  f.write(&byte, 1);
}

TEST(StreamedGPT, RefusesDamagedTruncatedAndMissingWeights) {
  auto w = test::world();
  const auto weights = test::gpt_random_weights(config(), 31);
  const Stored s = store("damaged", weights, config().heads());
  const std::string dir = fs::path(s.file).parent_path().string();
  const auto options = StreamedGPTOptions().group(tp_group()).max_length(8);
  EXPECT_TRUE(test::throws_with([&] { StoredWeights(dir + "/missing.safetensors"); }, "do not exist"));
  EXPECT_TRUE(test::throws_with([&] { StoredWeights(dir + "/no-checkpoint"); }, "do not exist"));
  // A truncated file: refused when opened, naming the tensor past its end.
  if (w->rank() == 0) {
    fs::copy_file(s.file, dir + "/truncated.safetensors");
    fs::resize_file(dir + "/truncated.safetensors", fs::file_size(s.file) - 100);
  }
  w->barrier()->wait();
  EXPECT_TRUE(test::throws_with([&] { StoredWeights(dir + "/truncated.safetensors"); }, "truncated"));
  // A flipped byte in a tensor every rank reads whole: refused at the first
  // forward that reads it (streamed) or when built (in memory), on every rank.
  if (w->rank() == 0) {
    fs::copy_file(s.file, dir + "/damaged.safetensors");
    damage(dir + "/damaged.safetensors", "h.1.ln_2.bias");
  }
  w->barrier()->wait();
  auto damaged = std::make_shared<StoredWeights>(dir + "/damaged.safetensors");
  EXPECT_TRUE(test::throws_with([&] { StreamedGPT model(damaged, options); }, "tensor 'h.1.ln_2.bias' has checksum"));
  StreamedGPT streamed(std::make_shared<StoredWeights>(dir + "/damaged.safetensors"), StreamedGPTOptions(options).resident_if_fits(false));
  streamed.reset(1);
  const at::Tensor ids = at::zeros({1, 2}, at::kLong);
  EXPECT_TRUE(test::throws_with([&] { streamed.forward(ids); }, "is damaged"));
  EXPECT_TRUE(test::throws_with([&] { streamed.forward(ids); }, "an earlier forward failed"));
  // Weights that are not a GPT, or do not say their heads.
  if (w->rank() == 0) {
    write_safetensors(dir + "/not-gpt.safetensors", {{"w", at::zeros({2})}});
    std::vector<std::pair<std::string, at::Tensor>> list(weights.begin(), weights.end());
    write_safetensors(dir + "/no-heads.safetensors", list);
  }
  w->barrier()->wait();
  EXPECT_TRUE(test::throws_with(
      [&] { StreamedGPT(std::make_shared<StoredWeights>(dir + "/not-gpt.safetensors"), options); },
      "'wte.weight' is missing"));
  EXPECT_TRUE(test::throws_with(
      [&] { StreamedGPT(std::make_shared<StoredWeights>(dir + "/no-heads.safetensors"), options); }, "(--heads)"));
  StreamedGPT with_heads(std::make_shared<StoredWeights>(dir + "/no-heads.safetensors"), StreamedGPTOptions(options).heads(4));
  EXPECT_EQ(with_heads.config().heads(), 4);
}

TEST(StreamedGPT, RefusesABudgetItCannotKeepAndBadOptions) {
  const auto weights = test::gpt_random_weights(config(), 37);
  const Stored s = store("budget", weights, config().heads());
  auto stored = std::make_shared<StoredWeights>(s.file);
  const auto options = StreamedGPTOptions().group(tp_group());
  // Less than this process holds already: no plan fits; the message says what would.
  const int64_t now = resident_bytes();
  ASSERT_GT(now, 0);
  const std::string error = test::error_of([&] { StreamedGPT(stored, StreamedGPTOptions(options).max_memory(now / 2)); });
  EXPECT_NE(error.find("cannot hold the plan"), std::string::npos) << error;
  EXPECT_NE(error.find("The smallest budget that works is"), std::string::npos) << error;
  EXPECT_TRUE(test::throws_with([&] { StreamedGPT(stored, StreamedGPTOptions(options).buffers(1)); }, "with prefetch it must be >= 2"));
  EXPECT_TRUE(test::throws_with([&] { StreamedGPT(stored, StreamedGPTOptions(options).prefetch(false).buffers(3)); },
                                "without prefetch leave it 0"));
  EXPECT_TRUE(test::throws_with([&] { StreamedGPT(stored, StreamedGPTOptions(options).max_length(33)); }, "max_length 33 must lie in"));
  EXPECT_TRUE(test::throws_with([&] { StreamedGPT(stored, StreamedGPTOptions(options).heads(5)); }, "not divisible by 5 heads"));
  EXPECT_TRUE(
      test::throws_with([&] { StreamedGPT(stored, StreamedGPTOptions(options).device(c10::Device("cuda:99"))); },
                        "device cuda:99 is refused: this process sees"));
  StreamedGPT model(stored, StreamedGPTOptions(options).max_length(4).batch(2));
  EXPECT_TRUE(test::throws_with([&] { model.reset(3); }, "batch 3 must lie in [1, 2]"));
  model.reset(1);
  EXPECT_TRUE(test::throws_with([&] { model.forward(at::zeros({1, 5}, at::kLong)); }, "exceed max_length 4"));
  EXPECT_TRUE(test::throws_with([&] { model.forward(at::full({1, 1}, 101, at::kLong)); }, "must lie in [0, 101)"));
  EXPECT_TRUE(test::throws_with([&] { model.forward(at::zeros({2, 1}, at::kLong)); }, "ids must be int64 [1"));
}

// The generated text's file on a full disk: an error, and the earlier file whole.
TEST(StreamedGPT, AnOutputFileOnAFullDiskLeavesTheEarlierOne) {
  auto w = test::world();
  if (w->rank() != 0) return;
  const std::string dir = ::testing::TempDir() + "tessera_full_output_np" + std::to_string(w->size());
  ::mkdir(dir.c_str(), 0700);
  const bool mounted = ::mount("tmpfs", dir.c_str(), "tmpfs", 0, "size=64k") == 0;
  struct rlimit old_limit {};
  ::getrlimit(RLIMIT_FSIZE, &old_limit);
  if (!mounted) {
    std::cout << "[ INFO     ] cannot mount a tmpfs here; limiting the file size to 64 KiB instead\n";
    ::signal(SIGXFSZ, SIG_IGN);
    struct rlimit small = old_limit;
    small.rlim_cur = 64 << 10;
    ::setrlimit(RLIMIT_FSIZE, &small);
  }
  const std::string path = dir + "/generated.json";
  write_file_atomically(path, "{\"tokens\": [1, 2, 3]}");
  EXPECT_TRUE(test::throws_with([&] { write_file_atomically(path, std::string(100 << 10, 'x')); },
                                "was left as it was"));
  {
    std::ifstream in(path);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_EQ(text, "{\"tokens\": [1, 2, 3]}");
  }
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  if (mounted) {
    ::umount(dir.c_str());
  } else {
    ::setrlimit(RLIMIT_FSIZE, &old_limit);
  }
  remove_tree(dir);
}

}  // namespace
}  // namespace tessera
