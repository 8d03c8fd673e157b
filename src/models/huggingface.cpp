#include "tessera/models/huggingface.h"

#include "core/json_int.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <set>
#include <type_traits>

namespace tessera {
namespace models {

namespace {

using Json = nlohmann::json;

struct Known {
  HFArchitecture architecture;
  const char* name;
  const char* model_type;
};
constexpr Known kKnown[] = {{HFArchitecture::kGPT2, "GPT2LMHeadModel", "gpt2"},
                            {HFArchitecture::kLlama, "LlamaForCausalLM", "llama"},
                            {HFArchitecture::kMistral, "MistralForCausalLM", "mistral"},
                            {HFArchitecture::kQwen2, "Qwen2ForCausalLM", "qwen2"},
                            {HFArchitecture::kQwen3, "Qwen3ForCausalLM", "qwen3"},
                            {HFArchitecture::kMixtral, "MixtralForCausalLM", "mixtral"},
                            {HFArchitecture::kQwen2Moe, "Qwen2MoeForCausalLM", "qwen2_moe"}};

const Known& known(HFArchitecture a) {
  for (const auto& k : kKnown)
    if (k.architecture == a) return k;
  TORCH_INTERNAL_ASSERT(false, "unlisted Hugging Face architecture");
}

std::string known_names() {
  std::string s;
  for (const auto& k : kKnown) s += (s.empty() ? "" : ", ") + std::string(k.name);
  return s;
}

// Keys that name or describe the file and do not change the model's math;
// kept and written back on export.
const std::set<std::string> kMetadata = {
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "bos_token_id", "eos_token_id",
    "pad_token_id", "initializer_range", "use_cache", "_name_or_path", "tokenizer_class", "output_attentions",
    "output_hidden_states", "return_dict", "pretraining_tp", "output_router_logits", "max_window_layers",
    "task_specific_params", "n_ctx", "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
    "reorder_and_upcast_attn", "_from_model_config"};
// Training-time dropouts: the run's --dropout decides them (docs/huggingface.md).
const std::set<std::string> kRunDecided = {"attention_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop",
                                           "summary_first_dropout"};

// A JSON value as T; an integer key must hold a JSON integer (json_int).
template <typename T>
T as(const Json& v) {
  if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) return static_cast<T>(json_int(v));
  return v.get<T>();
}

// Reads config.json's keys, remembering which were handled.
class Keys {
 public:
  Keys(const Json& j, std::string where, std::string arch) : j_(j), where_(std::move(where)), arch_(std::move(arch)) {}

  // The value, or null when absent or null.
  const Json* get(const std::string& key) {
    handled_.insert(key);
    auto it = j_.find(key);
    return it == j_.end() || it->is_null() ? nullptr : &*it;
  }
  template <typename T>
  T value(const std::string& key, T fallback) {
    const Json* v = get(key);
    if (v == nullptr) return fallback;
    try {
      return as<T>(*v);
    } catch (const std::exception&) {
      TORCH_CHECK(false, where_, ": \"", key, "\" is ", v->dump(), ", not a value of the expected type");
    }
  }
  template <typename T>
  T required(const std::string& key) {
    TORCH_CHECK(j_.contains(key) && !j_.at(key).is_null(), where_, ": ", arch_, " needs \"", key,
                "\", which is missing");
    return value<T>(key, T{});
  }
  // A key tessera carries out only at one value.
  template <typename T>
  void must_be(const std::string& key, T expected, const std::string& why) {
    const Json* v = get(key);
    if (v == nullptr) return;
    bool equal = false;
    try {
      equal = as<T>(*v) == expected;
    } catch (const std::exception&) {
    }
    TORCH_CHECK(equal, where_, ": \"", key, "\" is ", v->dump(), ", which tessera does not carry out for ", arch_,
                ": ", why);
  }
  // Refuses every key not handled, kept as metadata or left to the run.
  void refuse_unhandled() const {
    for (auto it = j_.begin(); it != j_.end(); ++it) {
      const std::string& k = it.key();
      if (handled_.count(k) || kMetadata.count(k) || kRunDecided.count(k)) continue;
      TORCH_CHECK(false, where_, ": config key \"", k, "\" (", it.value().dump(), ") is not carried out by tessera's ",
                  arch_, "; remove it if the model does not depend on it (docs/huggingface.md lists the keys read)");
    }
  }
  const std::string& where() const { return where_; }

 private:
  const Json& j_;
  std::string where_, arch_;
  std::set<std::string> handled_;
};

// rope_parameters (transformers 5) or rope_theta + rope_scaling (4.x).
void read_rope(Keys& keys, const Json& j, GPTConfig& c, double default_theta) {
  c.rope_theta(keys.value<double>("rope_theta", default_theta));
  const Json* params = keys.get("rope_parameters");
  const Json* scaling = keys.get("rope_scaling");
  const Json* rope = params != nullptr ? params : scaling;
  if (rope == nullptr) return;
  TORCH_CHECK(rope->is_object(), keys.where(), ": rope parameters must be an object, got ", rope->dump());
  const std::string key = params != nullptr ? "rope_parameters" : "rope_scaling";
  if (rope->contains("rope_theta")) c.rope_theta(rope->at("rope_theta").get<double>());
  const std::string type = rope->value("rope_type", rope->value("type", std::string("default")));
  std::set<std::string> read = {"rope_theta", "rope_type", "type"};
  if (type == "llama3") {
    nn::Llama3RopeScaling s;
    s.factor(rope->value("factor", s.factor())).low_freq_factor(rope->value("low_freq_factor", s.low_freq_factor()));
    s.high_freq_factor(rope->value("high_freq_factor", s.high_freq_factor()));
    s.original_context(rope->value("original_max_position_embeddings", s.original_context()));
    c.rope_scaling(s);
    read.insert({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"});
  } else {
    TORCH_CHECK(type == "default", keys.where(), ": \"", key, "\" has rope type '", type,
                "'; tessera carries out the default rotary frequencies and Llama 3's scaling (\"llama3\") only");
  }
  for (auto it = rope->begin(); it != rope->end(); ++it)
    TORCH_CHECK(read.count(it.key()) || (it.key() == "partial_rotary_factor" && it.value() == 1.0), keys.where(),
                ": \"", key, "\" has \"", it.key(), "\" (", it.value().dump(), "), which tessera does not carry out");
  (void)j;
}

// A window no shorter than the sequence attends to everything: carried out
// by refusing longer sequences (HFConfig::check_sequence).
int64_t read_window(Keys& keys, bool needs_use_flag) {
  const int64_t window = keys.value<int64_t>("sliding_window", 0);
  bool used = window > 0;
  if (needs_use_flag) {
    const bool flag = keys.value<bool>("use_sliding_window", false);
    used = used && flag;
  }
  if (const Json* types = keys.get("layer_types")) {
    for (const auto& t : *types) {
      const std::string type = t.get<std::string>();
      TORCH_CHECK(type == "full_attention" || type == "sliding_attention", keys.where(), ": layer type '", type,
                  "' in \"layer_types\" is not carried out (full_attention and sliding_attention are)");
      used = used || type == "sliding_attention";
    }
  }
  return used ? window : 0;
}

HFConfig llama_family(const Json& j, HFArchitecture a, const std::string& where) {
  const std::string arch = known(a).name;
  Keys keys(j, where, arch);
  GPTConfig c;
  const bool mixtral = a == HFArchitecture::kMixtral, qwen2_moe = a == HFArchitecture::kQwen2Moe;
  c.norm(nn::NormKind::kRMSNorm).positions(Positions::kRotary).mlp(nn::MLPKind::kSwiGLU).bias(false).qkv_bias(false);
  c.vocab(keys.required<int64_t>("vocab_size")).hidden(keys.required<int64_t>("hidden_size"));
  c.ffn(keys.required<int64_t>("intermediate_size")).layers(keys.required<int64_t>("num_hidden_layers"));
  c.heads(keys.required<int64_t>("num_attention_heads"));
  c.kv_heads(keys.value<int64_t>("num_key_value_heads", c.heads()));
  c.head_dim(keys.value<int64_t>("head_dim", 0));
  c.norm_eps(keys.value<double>("rms_norm_eps", mixtral ? 1e-5 : 1e-6));
  c.context(keys.value<int64_t>("max_position_embeddings", 2048));
  c.tied(keys.value<bool>("tie_word_embeddings", false));
  keys.must_be<std::string>("hidden_act", "silu", "the MLP is SwiGLU (silu)");
  read_rope(keys, j, c, mixtral ? 1e6 : 10000.0);
  HFConfig out;
  out.architecture = a;
  out.sliding_window = read_window(keys, a == HFArchitecture::kQwen2 || a == HFArchitecture::kQwen3 || qwen2_moe);
  if (a == HFArchitecture::kLlama) {
    keys.must_be<bool>("attention_bias", false, "biases on q, k, v and o; tessera's q/k/v biases are Qwen 2's and "
                                                "o_proj has none");
    keys.must_be<bool>("mlp_bias", false, "the MLP has no biases");
  }
  if (a == HFArchitecture::kQwen2) c.qkv_bias(true);
  if (qwen2_moe) {
    // Experts every decoder_sparse_step-th block, as moe_every; the experts'
    // width moe_intermediate_size is the config's ffn, so the dense blocks
    // between them (intermediate_size) must have the same width.
    keys.must_be<bool>("qkv_bias", true, "Qwen 2 MoE's q, k and v have biases");
    c.qkv_bias(true);
    const int64_t every = keys.value<int64_t>("decoder_sparse_step", 1);
    const int64_t expert_ffn = keys.required<int64_t>("moe_intermediate_size");
    TORCH_CHECK(every == 1 || expert_ffn == c.ffn(), keys.where(), ": \"decoder_sparse_step\" is ", every,
                ", so dense blocks of width intermediate_size (", c.ffn(), ") sit between expert blocks of width ",
                "moe_intermediate_size (", expert_ffn, "); tessera's blocks share one width: use equal widths or a ",
                "step of 1");
    const Json* only = keys.get("mlp_only_layers");
    TORCH_CHECK(only == nullptr || (only->is_array() && only->empty()), keys.where(), ": \"mlp_only_layers\" is ",
                only == nullptr ? "" : only->dump(), "; tessera places experts by decoder_sparse_step alone");
    c.ffn(expert_ffn).moe_every(every);
    c.experts(keys.required<int64_t>("num_experts")).top_k(keys.value<int64_t>("num_experts_per_tok", 4));
    c.renormalize(keys.value<bool>("norm_topk_prob", false));
    // The block always has its gated shared expert (transformers builds one of any width).
    c.shared_expert_ffn(keys.required<int64_t>("shared_expert_intermediate_size")).shared_expert_gate(true);
    TORCH_CHECK(c.shared_expert_ffn() > 0, keys.where(), ": \"shared_expert_intermediate_size\" is ",
                c.shared_expert_ffn(), "; Qwen 2 MoE's shared expert needs a positive width");
    c.aux_loss_coef(keys.value<double>("router_aux_loss_coef", 0.001)).z_loss_coef(0);
  }
  if (a == HFArchitecture::kQwen3) {
    c.qk_norm(true);
    keys.must_be<bool>("attention_bias", false, "Qwen 3's attention has no biases in tessera");
  }
  if (mixtral) {
    c.experts(keys.required<int64_t>("num_local_experts")).top_k(keys.value<int64_t>("num_experts_per_tok", 2));
    c.renormalize(true).aux_loss_coef(keys.value<double>("router_aux_loss_coef", 0.001)).z_loss_coef(0);
    keys.must_be<double>("router_jitter_noise", 0.0, "routing is without jitter");
  }
  keys.refuse_unhandled();
  out.model = c;
  return out;
}

HFConfig gpt2(const Json& j, const std::string& where) {
  Keys keys(j, where, "GPT2LMHeadModel");
  GPTConfig c;
  c.vocab(keys.required<int64_t>("vocab_size")).hidden(keys.required<int64_t>("n_embd"));
  c.layers(keys.required<int64_t>("n_layer")).heads(keys.required<int64_t>("n_head"));
  c.context(keys.required<int64_t>("n_positions"));
  c.ffn(keys.value<int64_t>("n_inner", 0)).norm_eps(keys.value<double>("layer_norm_epsilon", 1e-5));
  c.tied(keys.value<bool>("tie_word_embeddings", true));
  const std::string act = keys.value<std::string>("activation_function", "gelu_new");
  if (act == "gelu_new" || act == "gelu_pytorch_tanh") {
    c.mlp(nn::MLPKind::kGeluTanh);
  } else {
    TORCH_CHECK(act == "gelu", where, ": \"activation_function\" is '", act,
                "'; tessera carries out gelu, gelu_new and gelu_pytorch_tanh");
    c.mlp(nn::MLPKind::kGelu);
  }
  keys.must_be<bool>("scale_attn_weights", true, "attention scores are scaled by 1/sqrt(head_dim)");
  keys.must_be<bool>("scale_attn_by_inverse_layer_idx", false, "attention scores are not scaled per layer");
  keys.must_be<bool>("add_cross_attention", false, "the decoder has no cross-attention");
  keys.refuse_unhandled();
  HFConfig out;
  out.architecture = HFArchitecture::kGPT2;
  out.model = c;
  return out;
}

std::string dtype_of(const Json& j) {
  for (const char* key : {"dtype", "torch_dtype"})
    if (j.contains(key) && j.at(key).is_string()) return j.at(key).get<std::string>();
  return "";
}

std::vector<int64_t> with_first(int64_t first, std::vector<int64_t> rest) {
  rest.insert(rest.begin(), first);
  return rest;
}

}  // namespace

std::string hf_architecture_name(HFArchitecture architecture) { return known(architecture).name; }

HFArchitecture hf_architecture_for(const GPTConfig& c) {
  const bool llama_like = c.norm() == nn::NormKind::kRMSNorm && c.positions() == Positions::kRotary &&
                          c.mlp() == nn::MLPKind::kSwiGLU && !c.bias();
  const bool gpt2_like = c.norm() == nn::NormKind::kLayerNorm && c.positions() == Positions::kLearned &&
                         c.mlp() != nn::MLPKind::kSwiGLU && c.bias() && c.qkv_bias() && !c.grouped_attention() &&
                         c.dim_per_head() * c.heads() == c.hidden() && !c.qk_norm() && c.experts() == 0;
  if (gpt2_like) return HFArchitecture::kGPT2;
  TORCH_CHECK(llama_like, "no Hugging Face architecture expresses this model (", c.to_json(),
              "): GPT-2 is LayerNorm, learned positions, GELU and biases; the Llama family RMSNorm, rotary positions, "
              "SwiGLU and no biases on o_proj and the MLP");
  if (c.experts() > 0) {
    // Qwen 2 MoE: q/k/v biases and a gated shared expert.
    if (c.qkv_bias() && !c.qk_norm() && c.shared_expert_ffn() > 0 && c.shared_expert_gate())
      return HFArchitecture::kQwen2Moe;
    TORCH_CHECK(!c.qkv_bias() && !c.qk_norm() && c.moe_every() == 1 && c.renormalize() && c.shared_expert_ffn() == 0,
                "no Hugging Face architecture expresses these experts: MixtralForCausalLM has experts in every block, "
                "renormalized top-k, no shared experts and no q/k/v biases or q/k norms; Qwen2MoeForCausalLM has "
                "q/k/v biases and a gated shared expert");
    return HFArchitecture::kMixtral;
  }
  TORCH_CHECK(!(c.qkv_bias() && c.qk_norm()), "no Hugging Face architecture has both q/k/v biases and q/k norms");
  if (c.qkv_bias()) return HFArchitecture::kQwen2;
  if (c.qk_norm()) return HFArchitecture::kQwen3;
  return HFArchitecture::kLlama;
}

void HFConfig::check_sequence(int64_t seq) const {
  TORCH_CHECK(sliding_window == 0 || seq <= sliding_window, "the model's sliding window is ", sliding_window,
              " tokens and the sequence is ", seq, "; tessera attends to the whole sequence, so it runs sequences no "
              "longer than the window: lower --seq to at most ", sliding_window);
  TORCH_CHECK(model.positions() != Positions::kLearned || seq <= model.context(), "the sequence (", seq,
              ") is longer than the model's ", model.context(), " learned positions; lower --seq");
}

namespace {

HFConfig read_hf_config(const Json& j, const std::string& text, const std::string& where);

}  // namespace

HFConfig hf_config_from_json(const std::string& text, const std::string& where) {
  Json j;
  try {
    j = Json::parse(text);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, where, " is not JSON: ", e.what());
  }
  TORCH_CHECK(j.is_object(), where, ": a JSON object expected");
  // A key of the wrong type ("model_type": 5) is refused as a key with a
  // value tessera cannot read, naming the file.
  try {
    return read_hf_config(j, text, where);
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, where, ": a value has the wrong type (", e.what(), ")");
  }
}

namespace {

HFConfig read_hf_config(const Json& j, const std::string& text, const std::string& where) {
  std::string name;
  if (j.contains("architectures") && j["architectures"].is_array() && !j["architectures"].empty()) {
    TORCH_CHECK(j["architectures"].size() == 1, where, ": \"architectures\" lists ", j["architectures"].dump(),
                "; tessera reads one");
    name = j["architectures"][0].get<std::string>();
  }
  const std::string type = j.value("model_type", std::string());
  const Known* found = nullptr;
  for (const auto& k : kKnown)
    if ((!name.empty() && name == k.name) || (name.empty() && type == k.model_type)) found = &k;
  TORCH_CHECK(found != nullptr, where, ": architecture '", name.empty() ? type : name,
              "' is not one tessera reads; it reads ", known_names());
  HFConfig out = found->architecture == HFArchitecture::kGPT2 ? gpt2(j, where)
                                                              : llama_family(j, found->architecture, where);
  out.json = text;
  out.dtype = dtype_of(j);
  out.model.check();
  return out;
}

}  // namespace

std::string hf_config_json(HFArchitecture a, const GPTConfig& c, const std::string& original,
                           const std::string& dtype) {
  Json j = original.empty() ? Json::object() : Json::parse(original);
  if (original.empty()) {
    const Known& k = known(a);
    j["architectures"] = {k.name};
    j["model_type"] = k.model_type;
    j["vocab_size"] = c.vocab();
    j["tie_word_embeddings"] = c.tied();
    // No tokenizer is known: no special ids (the classes' defaults may lie
    // outside the vocabulary), except GPT-2's <|endoftext|> in its own vocabulary.
    const bool gpt2_vocab = a == HFArchitecture::kGPT2 && c.vocab() > 50256;
    j["bos_token_id"] = gpt2_vocab ? Json(50256) : Json(nullptr);
    j["eos_token_id"] = gpt2_vocab ? Json(50256) : Json(nullptr);
    if (a == HFArchitecture::kGPT2) {
      j["n_embd"] = c.hidden(), j["n_layer"] = c.layers(), j["n_head"] = c.heads(), j["n_positions"] = c.context();
      j["n_inner"] = c.ffn_size(), j["layer_norm_epsilon"] = c.norm_eps();
      j["activation_function"] = c.mlp() == nn::MLPKind::kGeluTanh ? "gelu_new" : "gelu";
      for (const char* p : {"resid_pdrop", "embd_pdrop", "attn_pdrop"}) j[p] = c.dropout();
    } else {
      j["hidden_size"] = c.hidden(), j["intermediate_size"] = c.ffn_size(), j["num_hidden_layers"] = c.layers();
      j["num_attention_heads"] = c.heads(), j["num_key_value_heads"] = c.num_kv_heads();
      j["head_dim"] = c.dim_per_head(), j["rms_norm_eps"] = c.norm_eps(), j["hidden_act"] = "silu";
      j["max_position_embeddings"] = c.context(), j["attention_dropout"] = c.dropout();
      Json rope = {{"rope_theta", c.rope_theta()}, {"rope_type", "default"}};
      if (c.rope_scaling()) {
        const auto& s = *c.rope_scaling();
        rope = {{"rope_theta", c.rope_theta()},          {"rope_type", "llama3"},
                {"factor", s.factor()},                  {"low_freq_factor", s.low_freq_factor()},
                {"high_freq_factor", s.high_freq_factor()}, {"original_max_position_embeddings", s.original_context()}};
      }
      j["rope_parameters"] = rope;
      if (a == HFArchitecture::kMixtral) {
        j["num_local_experts"] = c.experts(), j["num_experts_per_tok"] = c.top_k();
        j["router_aux_loss_coef"] = c.aux_loss_coef();
      }
      if (a == HFArchitecture::kQwen2Moe) {
        j["num_experts"] = c.experts(), j["num_experts_per_tok"] = c.top_k(), j["norm_topk_prob"] = c.renormalize();
        j["moe_intermediate_size"] = c.ffn_size(), j["decoder_sparse_step"] = c.moe_every();
        j["shared_expert_intermediate_size"] = c.shared_expert_ffn(), j["mlp_only_layers"] = Json::array();
        j["router_aux_loss_coef"] = c.aux_loss_coef(), j["qkv_bias"] = true;
      }
      if (a == HFArchitecture::kLlama) j["attention_bias"] = false, j["mlp_bias"] = false;
      if (a == HFArchitecture::kQwen3) j["attention_bias"] = false;
    }
  }
  if (j.contains("torch_dtype")) j["torch_dtype"] = dtype;
  j["dtype"] = dtype;
  return j.dump(2);
}

std::string hf_generation_config_json(const std::string& config_json) {
  const Json c = Json::parse(config_json);
  Json g = {{"_from_model_config", true}};
  for (const char* key : {"bos_token_id", "eos_token_id", "pad_token_id"})
    if (c.contains(key) && !c[key].is_null()) g[key] = c[key];
  if (c.contains("transformers_version")) g["transformers_version"] = c["transformers_version"];
  return g.dump(2);
}

namespace {

using Table = std::map<std::string, HFEntry>;
using Kind = HFPart::Kind;

// A tensor renamed whole.
void renamed(Table& t, const std::string& name, const std::string& hf, const std::vector<int64_t>& shape) {
  t[name] = HFEntry{shape, {HFPart{hf, Kind::kRows, 0, shape[0], std::vector<int64_t>(shape.size(), 0)}}};
}

void gpt2_table(Table& t, const GPTConfig& c, const std::string& p) {
  const int64_t h = c.hidden(), heads = c.heads(), d = c.dim_per_head(), f = c.ffn_size();
  renamed(t, "wte.weight", p + "wte.weight", {c.vocab(), h});
  renamed(t, "wpe.weight", p + "wpe.weight", {c.context(), h});
  renamed(t, "ln_f.weight", p + "ln_f.weight", {h});
  renamed(t, "ln_f.bias", p + "ln_f.bias", {h});
  if (!c.tied()) renamed(t, "lm_head.weight", "lm_head.weight", {c.vocab(), h});
  // Conv1D [in, out] -> Linear [out, in].
  auto transposed = [&](const std::string& name, const std::string& hf, int64_t out, int64_t in) {
    t[name] = HFEntry{{out, in}, {HFPart{hf, Kind::kTransposed, 0, out, {0, 0}}}};
  };
  for (int64_t i = 0; i < c.layers(); ++i) {
    const std::string tp = "h." + std::to_string(i) + ".", hp = p + tp;
    for (const char* n : {"ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias", "attn.c_proj.bias",
                          "mlp.c_proj.bias"})
      renamed(t, tp + n, hp + n, {h});
    renamed(t, tp + "mlp.c_fc.bias", hp + "mlp.c_fc.bias", {f});
    transposed(tp + "attn.c_proj.weight", hp + "attn.c_proj.weight", h, h);
    transposed(tp + "mlp.c_fc.weight", hp + "mlp.c_fc.weight", f, h);
    transposed(tp + "mlp.c_proj.weight", hp + "mlp.c_proj.weight", h, f);
    // Hugging Face: columns q (all heads), k, v; tessera: rows q, k, v per head.
    HFEntry w{{3 * h, h}, {}}, b{{3 * h}, {}};
    for (int64_t head = 0; head < heads; ++head)
      for (int64_t what = 0; what < 3; ++what) {
        const int64_t row = (3 * head + what) * d, col = what * h + head * d;
        w.parts.push_back(HFPart{hp + "attn.c_attn.weight", Kind::kTransposed, row, d, {0, col}});
        b.parts.push_back(HFPart{hp + "attn.c_attn.bias", Kind::kRows, row, d, {col}});
      }
    t[tp + "attn.c_attn.weight"] = std::move(w);
    t[tp + "attn.c_attn.bias"] = std::move(b);
  }
}

// q, k, v of one block (weight or bias): q renamed and k, v rows per kv head
// (grouped), or q, k, v rows per head (c_attn).
void llama_qkv(Table& t, const GPTConfig& c, const std::string& tp, const std::string& hp, const std::string& kind) {
  const int64_t h = c.hidden(), heads = c.heads(), kv = c.num_kv_heads(), d = c.dim_per_head();
  const bool weight = kind == "weight";
  auto rows_of = [&](const std::string& x, int64_t row, int64_t from) {
    return HFPart{hp + "self_attn." + x + "_proj." + kind, Kind::kRows, row, d,
                  weight ? std::vector<int64_t>{from, 0} : std::vector<int64_t>{from}};
  };
  auto shape = [&](int64_t rows) { return weight ? std::vector<int64_t>{rows, h} : std::vector<int64_t>{rows}; };
  if (c.grouped_attention()) {
    renamed(t, tp + "attn.q_proj." + kind, hp + "self_attn.q_proj." + kind, shape(heads * d));
    HFEntry e{shape(2 * kv * d), {}};
    for (int64_t g = 0; g < kv; ++g) {
      e.parts.push_back(rows_of("k", 2 * g * d, g * d));
      e.parts.push_back(rows_of("v", (2 * g + 1) * d, g * d));
    }
    t[tp + "attn.kv_proj." + kind] = std::move(e);
    return;
  }
  HFEntry e{shape(3 * heads * d), {}};
  for (int64_t head = 0; head < heads; ++head) {
    e.parts.push_back(rows_of("q", 3 * head * d, head * d));
    e.parts.push_back(rows_of("k", (3 * head + 1) * d, head * d));
    e.parts.push_back(rows_of("v", (3 * head + 2) * d, head * d));
  }
  t[tp + "attn.c_attn." + kind] = std::move(e);
}

// The experts of one block: expert e's gate / up / down matrix is row e of
// c_gate / c_fc / c_proj. Mixtral names them block_sparse_moe.experts.e.w1,
// w3, w2; Qwen 2 MoE mlp.experts.e.gate_proj, up_proj, down_proj, beside
// its shared expert (an MLP of those names) and the shared expert's gate.
void moe_experts(Table& t, HFArchitecture a, const GPTConfig& c, const std::string& tp, const std::string& hp) {
  const int64_t h = c.hidden(), f = c.ffn_size();
  const bool mixtral = a == HFArchitecture::kMixtral;
  const std::string moe = hp + (mixtral ? "block_sparse_moe." : "mlp.");
  renamed(t, tp + "mlp.router.weight", moe + "gate.weight", {c.experts(), h});
  auto experts = [&](const std::string& name, const char* w, int64_t out, int64_t in) {
    HFEntry e{{c.experts(), out, in}, {}};
    for (int64_t x = 0; x < c.experts(); ++x)
      e.parts.push_back(HFPart{moe + "experts." + std::to_string(x) + "." + w + ".weight", Kind::kExpert, x, 1,
                               {0, 0}});
    t[name] = std::move(e);
  };
  experts(tp + "mlp.c_gate.weight", mixtral ? "w1" : "gate_proj", f, h);
  experts(tp + "mlp.c_fc.weight", mixtral ? "w3" : "up_proj", f, h);
  experts(tp + "mlp.c_proj.weight", mixtral ? "w2" : "down_proj", h, f);
  if (c.shared_expert_ffn() > 0) {
    const int64_t s = c.shared_expert_ffn();
    renamed(t, tp + "mlp.shared_expert.c_gate.weight", moe + "shared_expert.gate_proj.weight", {s, h});
    renamed(t, tp + "mlp.shared_expert.c_fc.weight", moe + "shared_expert.up_proj.weight", {s, h});
    renamed(t, tp + "mlp.shared_expert.c_proj.weight", moe + "shared_expert.down_proj.weight", {h, s});
    if (c.shared_expert_gate())
      renamed(t, tp + "mlp.shared_expert_gate.weight", moe + "shared_expert_gate.weight", {1, h});
  }
}

void llama_table(Table& t, HFArchitecture a, const GPTConfig& c) {
  const int64_t h = c.hidden(), heads = c.heads(), d = c.dim_per_head(), f = c.ffn_size();
  renamed(t, "wte.weight", "model.embed_tokens.weight", {c.vocab(), h});
  renamed(t, "ln_f.weight", "model.norm.weight", {h});
  if (!c.tied()) renamed(t, "lm_head.weight", "lm_head.weight", {c.vocab(), h});
  for (int64_t i = 0; i < c.layers(); ++i) {
    const std::string tp = "h." + std::to_string(i) + ".", hp = "model.layers." + std::to_string(i) + ".";
    renamed(t, tp + "ln_1.weight", hp + "input_layernorm.weight", {h});
    renamed(t, tp + "ln_2.weight", hp + "post_attention_layernorm.weight", {h});
    renamed(t, tp + "attn.c_proj.weight", hp + "self_attn.o_proj.weight", {h, heads * d});
    if (c.qk_norm()) {
      renamed(t, tp + "attn.q_norm.weight", hp + "self_attn.q_norm.weight", {d});
      renamed(t, tp + "attn.k_norm.weight", hp + "self_attn.k_norm.weight", {d});
    }
    llama_qkv(t, c, tp, hp, "weight");
    if (c.qkv_bias()) llama_qkv(t, c, tp, hp, "bias");
    if (c.moe_block(i)) {
      moe_experts(t, a, c, tp, hp);
    } else {
      renamed(t, tp + "mlp.c_gate.weight", hp + "mlp.gate_proj.weight", {f, h});
      renamed(t, tp + "mlp.c_fc.weight", hp + "mlp.up_proj.weight", {f, h});
      renamed(t, tp + "mlp.c_proj.weight", hp + "mlp.down_proj.weight", {h, f});
    }
  }
}

}  // namespace

std::map<std::string, HFEntry> hf_table(HFArchitecture a, const GPTConfig& c, const std::string& gpt2_prefix) {
  Table t;
  if (a == HFArchitecture::kGPT2)
    gpt2_table(t, c, gpt2_prefix);
  else
    llama_table(t, a, c);
  return t;
}

std::map<std::string, std::vector<int64_t>> hf_shapes(const std::map<std::string, HFEntry>& table) {
  std::map<std::string, std::vector<int64_t>> out;
  for (const auto& [name, entry] : table)
    for (const auto& p : entry.parts) {
      // The part's box in the Hugging Face tensor: its far corner.
      std::vector<int64_t> rest(entry.shape.begin() + 1, entry.shape.end()), end;
      switch (p.kind) {
        case HFPart::Kind::kRows:
          end = with_first(p.rows, rest);
          break;
        case HFPart::Kind::kTransposed:
          end = {rest.at(0), p.rows};
          break;
        case HFPart::Kind::kExpert:
          end = rest;
          break;
      }
      for (size_t i = 0; i < end.size(); ++i) end[i] += p.offset.at(i);
      auto& shape = out[p.name];
      if (shape.empty()) shape.assign(end.size(), 0);
      for (size_t i = 0; i < end.size(); ++i) shape[i] = std::max(shape[i], end[i]);
    }
  return out;
}

bool hf_ignored_tensor(HFArchitecture a, const std::string& name) {
  if (a != HFArchitecture::kGPT2) return false;
  auto ends_with = [&](const std::string& s) {
    return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
  };
  return ends_with(".attn.bias") || ends_with(".attn.masked_bias");
}

}  // namespace models
}  // namespace tessera
