// Hugging Face directories into tessera (infer::HFCheckpoint) without
// transformers: the Llama family's directories written from the
// plain-LibTorch reference (reference_llama.h, Hugging Face's names and
// layouts) load through Trainer::load_weights at 2 ranks (tensor-parallel)
// into weights equal to the test's own mapping (llama_weights.h) and logits
// equal to the reference's; GPT-2's Conv1D layout against a mapping written
// here; every refusal of a bad directory or config.json names its cause.
// hf_checkpoint_check.py does the same against transformers itself.
#include "llama_weights.h"
#include "support/full_logits.h"
#include "support/test_util.h"

#include "tessera/core/atomic_file.h"
#include "tessera/core/safetensors.h"
#include "tessera/infer/hf_checkpoint.h"
#include "tessera/models/huggingface.h"
#include "tessera/nn/layer_factory.h"
#include "tessera/optim/by_name.h"
#include "tessera/train/token_data.h"
#include "tessera/train/trainer.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

namespace tessera {
namespace {

namespace fs = std::filesystem;
using Weights = std::map<std::string, at::Tensor>;

// A directory of this test's, made by rank 0 and seen by every rank.
std::string scratch(const std::string& name) {
  const std::string dir = (fs::temp_directory_path() / ("tessera-hf-test-" + name)).string();
  if (test::world()->rank() == 0) {
    remove_tree(dir);
    fs::create_directories(dir);
  }
  test::world()->barrier()->wait();
  return dir;
}

// A Hugging Face directory: config.json and the tensors, in `files` shards.
void write_dir(const std::string& dir, const std::string& config_json, const Weights& tensors, int files) {
  if (test::world()->rank() == 0) {
    fs::create_directories(dir);
    write_file_atomically(dir + "/config.json", config_json);
    if (files == 1) {
      std::vector<std::pair<std::string, at::Tensor>> all(tensors.begin(), tensors.end());
      write_safetensors(dir + "/model.safetensors", all, {{"format", "pt"}});
    } else {
      nlohmann::json index = {{"metadata", nlohmann::json::object()}, {"weight_map", nlohmann::json::object()}};
      std::vector<std::vector<std::pair<std::string, at::Tensor>>> shards(files);
      int k = 0;
      for (const auto& [name, t] : tensors) {
        const std::string file = "model-0000" + std::to_string(k % files + 1) + "-of-0000" + std::to_string(files) +
                                 ".safetensors";
        shards[k % files].emplace_back(name, t);
        index["weight_map"][name] = file;
        ++k;
      }
      for (int f = 0; f < files; ++f)
        write_safetensors(dir + "/model-0000" + std::to_string(f + 1) + "-of-0000" + std::to_string(files) +
                              ".safetensors",
                          shards[f], {{"format", "pt"}});
      write_file_atomically(dir + "/model.safetensors.index.json", index.dump());
    }
  }
  test::world()->barrier()->wait();
}

// A trainer (AdamW) of `gpt`, moved to the test device, whose weights come from `source`.
std::unique_ptr<train::Trainer> loaded_trainer(const context::ParallelContextPtr& ctx,
                                               const std::shared_ptr<models::GPTImpl>& gpt,
                                               const infer::HFCheckpoint& source) {
  gpt->to(test::device());
  auto trainer = std::make_unique<train::Trainer>(
      ctx, train::gpt_train_model(gpt),
      [](const std::vector<std::pair<std::string, at::Tensor>>& named) {
        return optim::make_optimizer(optim::OptimizerByName().name("adamw"), named);
      },
      train::TrainerOptions());
  trainer->load_weights(source);
  return trainer;
}

std::string llama_config_json(const models::GPTConfig& c) {
  return models::hf_config_json(models::hf_architecture_for(c), c, "", "float32");
}

class HFLlamaFamily : public ::testing::TestWithParam<const char*> {};

// Weights and logits of a Llama-family directory loaded at tp 2 (or dp 2 for
// Mixtral's experts) through the trainer.
TEST_P(HFLlamaFamily, LoadsAtTwoRanksIntoTheReferenceWeightsAndLogits) {
  models::GPTConfig c = models::GPTConfig::preset(GetParam());
  const auto ref_config = test::reference_llama_config(c);
  const Weights hf = test::random_llama_weights(ref_config, 21);
  const std::string dir = scratch(GetParam());
  write_dir(dir, llama_config_json(c), hf, 3);

  infer::HFCheckpoint source(dir);
  ASSERT_EQ(source.config().to_json(), models::GPTConfig(c).context(source.config().context()).to_json());
  const int world = test::world()->size();
  auto ctx = context::ParallelContext::create(test::world(), context::ParallelConfig().tensor(world));
  auto factory = nn::make_layer_factory(ctx, false, false);
  auto gpt = std::make_shared<models::GPTImpl>(c, factory);
  const auto trainer = loaded_trainer(ctx, gpt, source);
  const Weights expected = test::to_tessera(hf, c);
  const Weights got = gpt->full_state();
  ASSERT_EQ(got.size(), expected.size());
  for (const auto& [name, t] : got)
    EXPECT_TRUE(at::equal(t.cpu(), expected.at(name))) << name << " is not the mapped tensor";

  const at::Tensor ids = at::randint(c.vocab(), {2, 12}, at::make_generator<at::CPUGeneratorImpl>(5));
  test::ReferenceLlama reference(ref_config);
  reference->load_state(hf);
  at::NoGradGuard no_grad;
  gpt->eval();
  const at::Tensor logits = test::full_logits(gpt->forward(ids.to(test::device())), ctx, *factory, c.vocab());
  EXPECT_LE(test::rel_error(logits, reference->forward(ids)), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Presets, HFLlamaFamily,
                         ::testing::Values("llama-tiny", "mistral-tiny", "qwen2-tiny", "qwen3-tiny", "mixtral-tiny"));

// Imported at tp 2, saved as a tessera checkpoint, exported by both ranks in
// shards: every Hugging Face tensor comes back bit for bit (fp32), or
// rounded once (bf16), and config.json is the imported one.
TEST(HFExport, ACheckpointOfAnImportedModelExportsTheSameTensors) {
  for (const char* preset : {"llama-tiny", "mixtral-tiny"}) {
    const models::GPTConfig c = models::GPTConfig::preset(preset);
    const Weights hf = test::random_llama_weights(test::reference_llama_config(c), 31);
    const std::string dir = scratch(std::string("export-") + preset);
    const std::string config = llama_config_json(c);
    write_dir(dir + "/in", config, hf, 1);
    infer::HFCheckpoint source(dir + "/in");
    auto ctx = context::ParallelContext::create(test::world(), context::ParallelConfig().tensor(test::world()->size()));
    auto gpt = std::make_shared<models::GPTImpl>(source.config(), nn::make_layer_factory(ctx, false, false));
    const auto trainer = loaded_trainer(ctx, gpt, source);
    nlohmann::json meta = {{"gpt", nlohmann::json::parse(source.config().to_json())}, {"hf", source.hf().json}};
    trainer->save(dir + "/ckpt", meta.dump());
    for (const auto dtype : {at::kFloat, at::kBFloat16}) {
      const std::string out = dir + "/out";
      const auto stats = infer::export_hf(dir + "/ckpt", out, test::world(),
                                          infer::HFExportOptions().shard_bytes(20000).dtype(dtype));
      EXPECT_GT(stats.shards, 2);
      EXPECT_FALSE(fs::exists(out + ".partial"));
      const auto index = nlohmann::json::parse(std::ifstream(out + "/model.safetensors.index.json"));
      EXPECT_EQ(index["weight_map"].size(), hf.size());
      for (const auto& [name, t] : hf) {
        const std::string file = out + "/" + index["weight_map"].at(name).get<std::string>();
        const at::Tensor got = SafetensorsFile(file).read(name);
        EXPECT_EQ(got.scalar_type(), dtype) << name;
        EXPECT_TRUE(at::equal(got, t.to(dtype))) << preset << " " << name << " is not the imported tensor";
      }
      auto written = nlohmann::json::parse(std::ifstream(out + "/config.json"));
      EXPECT_EQ(written["dtype"], infer::hf_dtype_name(dtype));
      written["dtype"] = "float32";
      EXPECT_EQ(written, nlohmann::json::parse(config)) << "config.json is the imported one, its dtype aside";
      // Every rank reads this export before rank 0 starts the next one in
      // the same place (its staging directory would show up here).
      test::world()->barrier();
    }
  }
}

// A box of a packed tensor reads only its rows: kv_proj rows of one kv head,
// c_attn rows of one head (tensor-parallel shards), an expert's rows.
TEST(HFCheckpoint, BoxesEqualTheMappedTensorsBoxes) {
  for (const char* preset : {"llama-tiny", "mixtral-tiny", "qwen2-tiny"}) {
    models::GPTConfig c = models::GPTConfig::preset(preset);
    c.kv_heads(std::string(preset) == "qwen2-tiny" ? 4 : 2);  // qwen2: multi-head, so c_attn
    const Weights hf = test::random_llama_weights(test::reference_llama_config(c), 3);
    const std::string dir = scratch(std::string("box-") + preset);
    write_dir(dir, llama_config_json(c), hf, 1);
    infer::HFCheckpoint source(dir);
    const Weights full = test::to_tessera(hf, c);
    for (const auto& [name, t] : full) {
      std::vector<int64_t> offset(t.dim(), 0), length = t.sizes().vec();
      offset[0] = t.size(0) / 4, length[0] = t.size(0) / 2;  // a middle band of rows
      if (t.dim() > 1) offset.back() = 1, length.back() = t.size(-1) - 2;
      at::Tensor want = t;
      for (int64_t d = 0; d < t.dim(); ++d) want = want.narrow(d, offset[d], length[d]);
      EXPECT_TRUE(at::equal(source.region("model/" + name, offset, length), want)) << preset << " " << name;
    }
  }
}

// GPT-2: Conv1D [in, out] weights, q/k/v in column blocks; tessera packs q,
// k, v per head in rows. Mapped here on its own, then compared.
TEST(HFCheckpoint, GPT2ConvOneDWeightsAreTransposedAndRepackedPerHead) {
  const int64_t h = 32, heads = 4, d = 8, f = 128, vocab = 101, positions = 24;
  const std::string config = R"({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 101,
    "n_embd": 32, "n_layer": 1, "n_head": 4, "n_positions": 24, "n_inner": null, "activation_function": "gelu_new",
    "layer_norm_epsilon": 1e-05, "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1, "scale_attn_weights": true,
    "bos_token_id": 50256, "tie_word_embeddings": true})";
  Weights hf;
  int64_t seed = 40;
  auto add = [&](const std::string& name, std::vector<int64_t> shape) { hf[name] = test::seeded_randn(shape, ++seed); };
  add("transformer.wte.weight", {vocab, h});
  add("transformer.wpe.weight", {positions, h});
  for (const char* n : {"ln_f.weight", "ln_f.bias", "h.0.ln_1.weight", "h.0.ln_1.bias", "h.0.ln_2.weight",
                        "h.0.ln_2.bias", "h.0.attn.c_proj.bias", "h.0.mlp.c_proj.bias"})
    add(std::string("transformer.") + n, {h});
  add("transformer.h.0.attn.c_attn.weight", {h, 3 * h});
  add("transformer.h.0.attn.c_attn.bias", {3 * h});
  add("transformer.h.0.attn.c_proj.weight", {h, h});
  add("transformer.h.0.mlp.c_fc.weight", {h, f});
  add("transformer.h.0.mlp.c_fc.bias", {f});
  add("transformer.h.0.mlp.c_proj.weight", {f, h});
  hf["transformer.h.0.attn.bias"] = at::ones({1, 1, positions, positions});  // a causal-mask buffer, skipped
  const std::string dir = scratch("gpt2");
  write_dir(dir, config, hf, 1);
  infer::HFCheckpoint source(dir);
  EXPECT_EQ(source.config().mlp(), nn::MLPKind::kGeluTanh);
  EXPECT_TRUE(source.config().tied());
  const std::string p = "transformer.h.0.";
  // [in, 3h] -> rows (q, k, v) x heads x d -> per head (q, k, v).
  const at::Tensor c_attn =
      hf[p + "attn.c_attn.weight"].t().reshape({3, heads, d, h}).transpose(0, 1).reshape({3 * h, h});
  const at::Tensor c_attn_bias = hf[p + "attn.c_attn.bias"].reshape({3, heads, d}).transpose(0, 1).reshape({3 * h});
  EXPECT_TRUE(at::equal(source.full("model/h.0.attn.c_attn.weight"), c_attn));
  EXPECT_TRUE(at::equal(source.full("model/h.0.attn.c_attn.bias"), c_attn_bias));
  EXPECT_TRUE(at::equal(source.full("model/h.0.mlp.c_fc.weight"), hf[p + "mlp.c_fc.weight"].t()));
  EXPECT_TRUE(at::equal(source.full("model/h.0.mlp.c_proj.weight"), hf[p + "mlp.c_proj.weight"].t()));
  EXPECT_TRUE(at::equal(source.full("model/wpe.weight"), hf["transformer.wpe.weight"]));
  // A tensor-parallel shard of c_attn: the rows of head 2, columns 8..23.
  EXPECT_TRUE(at::equal(source.region("model/h.0.attn.c_attn.weight", {2 * 3 * d, 8}, {3 * d, 16}),
                        c_attn.narrow(0, 2 * 3 * d, 3 * d).narrow(1, 8, 16)));
}

TEST(HFCheckpoint, BadDirectoriesAndConfigsAreRefusedByName) {
  const models::GPTConfig c = models::GPTConfig::preset("llama-tiny");
  const Weights hf = test::random_llama_weights(test::reference_llama_config(c), 9);
  const std::string good = llama_config_json(c);
  auto with = [&](const std::string& key, const nlohmann::json& value) {
    nlohmann::json j = nlohmann::json::parse(good);
    j[key] = value;
    return j.dump();
  };
  auto refused = [&](const std::string& name, const std::string& config, const Weights& tensors, int files,
                     const std::string& needle) {
    const std::string dir = scratch("bad-" + name);
    write_dir(dir, config, tensors, files);
    EXPECT_TRUE(test::throws_with([&] { infer::HFCheckpoint bad(dir); }, needle)) << name;
  };
  refused("key", with("quantization_config", {{"bits", 4}}), hf, 1, "\"quantization_config\"");
  refused("rope", with("rope_parameters", {{"rope_type", "yarn"}, {"factor", 4.0}, {"rope_theta", 1e4}}), hf, 1,
          "rope type 'yarn'");
  refused("act", with("hidden_act", "gelu"), hf, 1, "\"hidden_act\" is \"gelu\"");
  refused("bias", with("attention_bias", true), hf, 1, "\"attention_bias\" is true");
  refused("arch", with("architectures", {"FalconForCausalLM"}), hf, 1, "'FalconForCausalLM' is not one tessera reads");
  refused("missing-arg", with("hidden_size", nullptr), hf, 1, "needs \"hidden_size\"");
  Weights wrong = hf;
  wrong["model.layers.0.mlp.up_proj.weight"] = at::zeros({49, 32});
  refused("shape", good, wrong, 1, "'model.layers.0.mlp.up_proj.weight' has shape [49, 32]");
  Weights extra = hf;
  extra["model.layers.0.self_attn.o_proj.bias"] = at::zeros({32});
  refused("extra", good, extra, 1, "'model.layers.0.self_attn.o_proj.bias', which is not a weight");
  Weights fewer = hf;
  fewer.erase("model.norm.weight");
  refused("fewer", good, fewer, 1, "no tensor 'model.norm.weight'");
  // A shard the index names that is not there.
  const std::string dir = scratch("bad-shard");
  write_dir(dir, good, hf, 2);
  if (test::world()->rank() == 0) fs::remove(dir + "/model-00002-of-00002.safetensors");
  test::world()->barrier()->wait();
  EXPECT_TRUE(test::throws_with([&] { infer::HFCheckpoint bad(dir); }, "shard model-00002-of-00002.safetensors"));
  // A sliding window shorter than the sequence: refused when the run's sequence is known.
  const auto windowed = models::hf_config_from_json(with("sliding_window", 8), "config.json");
  EXPECT_TRUE(test::throws_with([&] { windowed.check_sequence(16); }, "sliding window is 8 tokens"));
  windowed.check_sequence(8);
}

// Qwen 2 MoE's config.json (as transformers 5 writes it): fine-grained
// experts at top k, not renormalized, a gated shared expert, experts every
// decoder_sparse_step-th block; what tessera cannot carry out is refused by
// name. A model with a gated shared expert exports as Qwen 2 MoE.
TEST(HFCheckpoint, Qwen2MoeConfigMapsItsExpertsAndRefusesWhatItCannotCarryOut) {
  const nlohmann::json base = {{"architectures", {"Qwen2MoeForCausalLM"}},
                               {"model_type", "qwen2_moe"},
                               {"vocab_size", 101},
                               {"hidden_size", 32},
                               {"intermediate_size", 48},
                               {"num_hidden_layers", 2},
                               {"num_attention_heads", 4},
                               {"num_key_value_heads", 2},
                               {"hidden_act", "silu"},
                               {"rms_norm_eps", 1e-6},
                               {"rope_parameters", {{"rope_theta", 10000.0}, {"rope_type", "default"}}},
                               {"use_sliding_window", false},
                               {"sliding_window", 0},
                               {"max_window_layers", 28},
                               {"layer_types", {"full_attention", "full_attention"}},
                               {"decoder_sparse_step", 1},
                               {"moe_intermediate_size", 24},
                               {"shared_expert_intermediate_size", 40},
                               {"num_experts_per_tok", 3},
                               {"num_experts", 6},
                               {"norm_topk_prob", false},
                               {"output_router_logits", false},
                               {"router_aux_loss_coef", 0.001},
                               {"mlp_only_layers", nlohmann::json::array()},
                               {"qkv_bias", true}};
  auto with = [&](const std::string& key, const nlohmann::json& value) {
    nlohmann::json j = base;
    j[key] = value;
    return j.dump();
  };
  const models::HFConfig read = models::hf_config_from_json(base.dump(), "config.json");
  const models::GPTConfig& c = read.model;
  EXPECT_EQ(read.architecture, models::HFArchitecture::kQwen2Moe);
  EXPECT_EQ(c.experts(), 6);
  EXPECT_EQ(c.top_k(), 3);
  EXPECT_FALSE(c.renormalize());
  EXPECT_EQ(c.ffn(), 24) << "the experts' width";
  EXPECT_EQ(c.shared_expert_ffn(), 40);
  EXPECT_TRUE(c.shared_expert_gate());
  EXPECT_TRUE(c.qkv_bias());
  EXPECT_EQ(c.moe_every(), 1);
  EXPECT_EQ(models::hf_architecture_for(c), models::HFArchitecture::kQwen2Moe);
  const auto table = models::hf_table(models::HFArchitecture::kQwen2Moe, c);
  EXPECT_EQ(table.at("h.1.mlp.shared_expert_gate.weight").parts.at(0).name,
            "model.layers.1.mlp.shared_expert_gate.weight");
  EXPECT_EQ(table.at("h.0.mlp.c_fc.weight").parts.at(5).name, "model.layers.0.mlp.experts.5.up_proj.weight");
  nlohmann::json every_other = base;
  every_other["decoder_sparse_step"] = 2;
  every_other["intermediate_size"] = 24;
  EXPECT_EQ(models::hf_config_from_json(every_other.dump(), "config.json").model.moe_every(), 2);
  EXPECT_TRUE(test::throws_with([&] { models::hf_config_from_json(with("decoder_sparse_step", 2), "config.json"); },
                                "\"decoder_sparse_step\" is 2, so dense blocks of width intermediate_size (48)"));
  EXPECT_TRUE(test::throws_with([&] { models::hf_config_from_json(with("mlp_only_layers", {1}), "config.json"); },
                                "\"mlp_only_layers\" is [1]"));
  EXPECT_TRUE(test::throws_with([&] { models::hf_config_from_json(with("qkv_bias", false), "config.json"); },
                                "\"qkv_bias\" is false"));
  EXPECT_TRUE(test::throws_with([&] { models::hf_config_from_json(with("num_experts", nullptr), "config.json"); },
                                "needs \"num_experts\""));
  EXPECT_TRUE(
      test::throws_with([&] { models::hf_config_from_json(with("shared_expert_intermediate_size", 0), "config.json"); },
                        "\"shared_expert_intermediate_size\" is 0; Qwen 2 MoE's shared expert needs a positive width"));
  // Experts with q/k/v biases but no shared expert: no architecture has them.
  EXPECT_TRUE(test::throws_with(
      [&] { models::hf_architecture_for(models::GPTConfig(c).shared_expert_ffn(0).shared_expert_gate(false)); },
      "no Hugging Face architecture expresses these experts"));
}

// Token files with tokenize.py's metadata: the declared dtype and vocabulary;
// an id beyond it refused.
TEST(TokenMetadata, DeclaredVocabularyAndDtypeAreReadAndChecked) {
  const std::string dir = scratch("tokens");
  const std::string path = dir + "/train.bin";
  if (test::world()->rank() == 0) {
    std::vector<uint32_t> ids(3000);
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<uint32_t>(70000 + i % 100);
    std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(ids.data()), ids.size() * 4);
    write_file_atomically(path + ".json", R"({"dtype": "uint32", "vocab_size": 70100})");
    std::ofstream(dir + "/bad.bin", std::ios::binary).write(reinterpret_cast<const char*>(ids.data()), ids.size() * 4);
    write_file_atomically(dir + "/bad.bin.json", R"({"dtype": "uint32", "vocab_size": 70050})");
  }
  test::world()->barrier()->wait();
  const auto data = train::TokenData::load(path);
  EXPECT_EQ(data.vocab(), 70100);
  EXPECT_EQ(data.needed_vocab(), 70100);
  EXPECT_EQ(data.tokens().max().item<int64_t>(), 70099);
  EXPECT_TRUE(test::throws_with([&] { train::TokenData::load(dir + "/bad.bin"); },
                                "holds id 70099, but its metadata"));
}

}  // namespace
}  // namespace tessera
