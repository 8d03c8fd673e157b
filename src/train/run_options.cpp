#include "tessera/train/run_options.h"

#include "tessera/context/launch.h"
#include "tessera/optim/by_name.h"
#include "tessera/train/batch_schedule.h"

#include <ATen/Context.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace tessera {
namespace train {
namespace {

using context::ParallelConfig;
using parallel::Offload;

std::string show_capacity(const c10::optional<double>& c) { return c ? fmt::format("{}", *c) : "dropless"; }

c10::optional<double> parse_capacity(const std::string& text) {
  if (text == "dropless") return c10::nullopt;
  size_t used = 0;
  double v = -1;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  TORCH_CHECK(used == text.size() && !text.empty(), "--capacity-factor must be a positive number or 'dropless', got '",
              text, "'");
  return v;
}

void grid_options(cli::Command& c, RunOptions& r) {
  c.group("Layout");
  context::add_grid_options(c, r.grid());
  c.add("sequence-parallel", &r.sequence_parallel(), "Megatron's sequence-parallel variant of the 1D layers");
  c.add("expert-tensor-parallel", &r.expert_tensor_parallel(),
        "split each expert's matrices over the tensor group instead of running whole experts on every tensor rank");
  c.add("spec", &r.spec(),
        "sharding spec: ddp, zero1, zero2, zero3, fsdp, mics[:k], hpz[:k] (k omitted: the data ranks of a host), or "
        "{P,G,O}",
        "SPEC", parallel::ShardingSpec::parse, [](const parallel::ShardingSpec& s) { return s.to_string(); });
  c.add(
      "bucket-mb", &r.bucket_mb(),
      "gradient buckets in MiB when gradients are not sharded (the first closes at 1 MiB); smaller ones start reducing "
      "earlier in backward");
  c.default_text("bucket-mb", "25, or a sixteenth of the gradient where the data group spans hosts");
  c.add("schedule", &r.schedule(), "pipeline schedule", "gpipe|1f1b|interleaved|zb-h1|zb-h2|zb-v|dualpipev",
        parallel::parse_schedule_kind, [](parallel::ScheduleKind k) { return parallel::to_string(k); });
  c.add("microbatches", &r.microbatches(), "pipeline micro-batches per step");
  c.default_text("microbatches", "2 x --pp");
  c.add("chunks", &r.chunks(), "pipeline stages per rank (interleaved: 2 or more; zb-v, dualpipev: 2)");
  c.add("accumulation", &r.accumulation(), "micro-batches per step without a pipeline");
  c.add("checkpoint-activations", &r.model().checkpoint_activations(),
        "recompute each block's activations in backward instead of keeping them");
  c.add("offload", &r.offload(), "optimizer states and fp32 masters: on the device, in host memory, or on disk",
        "none|host|disk", parallel::parse_offload, parallel::offload_name);
  c.add("offload-dir", &r.offload_dir(), "a directory on a local disk, for --offload disk");
  c.add("offload-params", &r.offload_params(), "parameter shards in host memory between uses (ZeRO-3 offload)");
  c.add("device", &r.device(), "where the model and its states live: cpu, cuda (the local rank's GPU) or cuda:N");
  c.add("backend", &r.backend(),
        "collectives: auto (NCCL for a GPU when built with it), mpi (ranks may share a GPU), nccl", "auto|mpi|nccl",
        comm::backend_from_name, comm::backend_name);
}

using ConfigField = std::function<void(models::GPTConfig& to, const models::GPTConfig& from)>;
#define TESSERA_FIELD(name) [](models::GPTConfig& to, const models::GPTConfig& from) { to.name(from.name()); }

// The model flags that a --model preset also sets, and how each is copied.
const std::vector<std::pair<std::string, ConfigField>>& preset_fields() {
  static const std::vector<std::pair<std::string, ConfigField>> fields = {
      {"layers", TESSERA_FIELD(layers)},
      {"heads", TESSERA_FIELD(heads)},
      {"hidden", TESSERA_FIELD(hidden)},
      {"kv-heads", TESSERA_FIELD(kv_heads)},
      {"head-dim", TESSERA_FIELD(head_dim)},
      {"ffn", TESSERA_FIELD(ffn)},
      {"norm", TESSERA_FIELD(norm)},
      {"norm-eps", TESSERA_FIELD(norm_eps)},
      {"positions", TESSERA_FIELD(positions)},
      {"rope-theta", TESSERA_FIELD(rope_theta)},
      {"mlp", TESSERA_FIELD(mlp)},
      {"bias", TESSERA_FIELD(bias)},
      {"qkv-bias", TESSERA_FIELD(qkv_bias)},
      {"qk-norm", TESSERA_FIELD(qk_norm)},
      {"tied", TESSERA_FIELD(tied)},
      {"experts", TESSERA_FIELD(experts)},
      {"top-k", TESSERA_FIELD(top_k)},
      {"renormalize", TESSERA_FIELD(renormalize)},
      {"moe-every", TESSERA_FIELD(moe_every)},
      {"capacity-factor", TESSERA_FIELD(capacity_factor)},
      {"drop-policy", TESSERA_FIELD(drop_policy)},
      {"aux-loss-coef", TESSERA_FIELD(aux_loss_coef)},
      {"z-loss-coef", TESSERA_FIELD(z_loss_coef)},
      {"shared-expert-ffn", TESSERA_FIELD(shared_expert_ffn)},
      {"shared-expert-gate", TESSERA_FIELD(shared_expert_gate)},
      {"expert-compute", TESSERA_FIELD(expert_compute)}};
  return fields;
}
#undef TESSERA_FIELD

// --model PRESET: the preset's architecture and sizes, with the model flags
// given beside it on top. The training window (--seq), the vocabulary (the
// data's), dropout and checkpointing stay the run's.
void apply_model_preset(const cli::Command& parsed, RunOptions& r) {
  if (r.model_preset().empty()) return;
  const models::GPTConfig& m = r.model();
  models::GPTConfig p = models::GPTConfig::preset(r.model_preset());
  p.context(m.context()).vocab(m.vocab()).dropout(m.dropout()).checkpoint_activations(m.checkpoint_activations());
  for (const auto& [flag, copy] : preset_fields())
    if (parsed.given(flag)) copy(p, m);
  r.model(p);
}

void model_options(cli::Command& c, RunOptions& r) {
  models::GPTConfig& m = r.model();
  c.group("Model");
  c.add("model", &r.model_preset(), "start from a preset's architecture and sizes (docs/models.md); the model flags "
        "given beside it win", models::GPTConfig::preset_names());
  c.add("init-from", &r.init_from(), "hf:DIR: a Hugging Face model directory gives the architecture (its "
        "config.json) and the initial weights (docs/huggingface.md)");
  c.add("layers", &m.layers(), "transformer blocks");
  c.add("heads", &m.heads(), "attention heads");
  c.add("kv-heads", &m.kv_heads(), "key/value heads (grouped-query attention); 0: as many as heads");
  c.add("head-dim", &m.head_dim(), "dimension of a head; 0: hidden / heads");
  c.add("hidden", &m.hidden(), "hidden size");
  c.add("ffn", &m.ffn(), "MLP width; 0: 4 x hidden");
  c.add_enum("norm", &m.norm(), "normalization", {"layernorm", "rmsnorm"},
             {nn::NormKind::kLayerNorm, nn::NormKind::kRMSNorm});
  c.add("norm-eps", &m.norm_eps(), "the norms' epsilon");
  c.add_enum("positions", &m.positions(), "learned position embeddings, or rotary ones on q and k",
             {"learned", "rotary"}, {models::Positions::kLearned, models::Positions::kRotary});
  c.add("rope-theta", &m.rope_theta(), "rotary base");
  c.add_enum("mlp", &m.mlp(), "MLP: GELU, SwiGLU (Llama), or GELU's tanh approximation (GPT-2's gelu_new)",
             {"gelu", "swiglu", "gelu-tanh"}, {nn::MLPKind::kGelu, nn::MLPKind::kSwiGLU, nn::MLPKind::kGeluTanh});
  c.add("bias", &m.bias(), "biases on the attention output and MLP linears");
  c.add("qkv-bias", &m.qkv_bias(), "biases on the q/k/v projection");
  c.add("qk-norm", &m.qk_norm(), "RMSNorm on each head's q and k (Qwen 3)");
  c.add("tied", &m.tied(), "the LM head shares the token embedding");
  c.add("seq", &m.context(), "sequence length of a training window, and the model's context");
  c.add("dropout", &m.dropout(), "dropout probability");
  c.add("experts", &m.experts(), "experts per mixture-of-experts block; 0: a dense model");
  c.add("top-k", &m.top_k(), "experts each token is routed to");
  c.add("renormalize", &m.renormalize(), "renormalize the top-k gates to sum to 1 (Mixtral)");
  c.add("moe-every", &m.moe_every(), "every n-th block has experts");
  c.add("capacity-factor", &m.capacity_factor(), "expert capacity over the mean load", "FLOAT|dropless",
        parse_capacity, show_capacity);
  c.add_enum("drop-policy", &m.drop_policy(), "which assignments over capacity are dropped",
             {"position", "probability"}, {nn::MoEDropPolicy::kPosition, nn::MoEDropPolicy::kProbability});
  c.add("aux-loss-coef", &m.aux_loss_coef(), "load-balancing loss coefficient");
  c.add("z-loss-coef", &m.z_loss_coef(), "router z-loss coefficient");
  c.add("shared-expert-ffn", &m.shared_expert_ffn(),
        "width of the shared experts every token passes through beside its routed ones (DeepSeekMoE, Qwen-MoE); 0: "
        "none");
  c.add("shared-expert-gate", &m.shared_expert_gate(), "scale the shared experts' output by a per-token sigmoid gate");
  c.add_enum("expert-compute", &m.expert_compute(),
             "each expert over exactly its routed rows, or all padded to the busiest in one batched matmul",
             {"grouped", "padded"}, {nn::MoEExpertCompute::kGrouped, nn::MoEExpertCompute::kPadded});
}

void optimizer_options(cli::Command& c, RunOptions& r) {
  c.group("Optimization");
  c.add_enum("precision", &r.precision(), "parameters and gradients in fp32, or bf16 with fp32 masters",
             {"fp32", "bf16"}, {Precision::kFp32, Precision::kBf16});
  c.add("optimizer", &r.optimizer(), "the optimizer (sgd with momentum 0.9)", optim::optimizer_names());
  c.add("lr", &r.lr(), "peak learning rate");
  c.add("warmup", &r.warmup(), "linear warm-up steps");
  c.default_text("warmup", "10% of --steps");
  c.add("decay", &r.decay(), "learning-rate decay after the warm-up", "constant|cosine|linear|polynomial",
        lr_decay_from_string, lr_decay_name);
  c.add("min-lr-ratio", &r.min_lr_ratio(), "the decay's end, as a fraction of the peak");
  c.add("weight-decay", &r.weight_decay(), "decoupled weight decay (not for sgd)");
  c.add("clip", &r.clip(), "global gradient-norm clipping; 0: none");
  c.add("seed", &r.grid().seed(), "initial weights, data windows and dropout streams");
}

void data_options(cli::Command& c, RunOptions& r) {
  c.group("Data and output");
  c.add("data", &r.data(), "a text file or directory (bytes), or token ids (.bin)");
  c.add("data-format", &r.data_format(), "how --data is read; auto: uint16 for .bin, text otherwise",
        "auto|text|uint16|uint32", parse_token_format, token_format_name);
  c.add("steps", &r.steps(), "optimizer steps");
  c.add("batch", &r.batch(), "global batch in sequences");
  c.add("batch-schedule", &r.batch_schedule(), "elastic: STEP:BATCH,... sets the global batch from each step on");
  c.add("min-rows-per-replica", &r.min_rows_per_replica(), "elastic: the fewest rows a data replica trains");
  c.add("save", &r.save(), "checkpoint directory (DIR/step-N, DIR/final)");
  c.add("save-every", &r.save_every(), "steps between checkpoints; 0: only the final one");
  c.add("resume", &r.resume(), "a checkpoint to continue from, in any layout");
  c.add("metrics", &r.metrics(), "JSON lines of every step and evaluation");
  c.add("consolidate", &r.consolidate(), "the final weights as one safetensors file");
  c.add("export-hf", &r.export_hf(), "the final weights as a Hugging Face model directory (transformers loads it)");
  c.add("export-dtype", &r.export_dtype(), "--export-hf's dtype: float32, bfloat16 or float16; empty: the "
        "checkpoint's (float32)");
  c.add("export-shard-mb", &r.export_shard_mb(), "--export-hf's largest shard file, in MB (10^6 bytes)");
  c.add("sample", &r.sample(), "tokens sampled from the final model; 0: none");
  c.add("eval-every", &r.eval_every(), "steps between validation losses; 0: none");
  c.add("log-every", &r.log_every(), "steps between progress lines");
  c.add("straggler-threshold", &r.straggler_threshold(), "name the slowest rank in the progress line when its "
        "compute exceeds the median rank's by this fraction of the step; 0: off");
  c.add("rank-times", &r.rank_times(), "every rank's compute and wait seconds per step in --metrics (\"ranks\" lines)");
  c.add("link-probe-every", &r.link_probe_every(),
        "on several hosts, steps between timed exchanges of 1 MiB between them; from 3 hosts on, a host whose "
        "every exchange is over twice as slow as the median host's is named in the progress line; 0: never");
}

void planner_options(cli::Command& c, RunOptions& r) {
  c.group("Planner");
  c.add_enum("plan", &r.plan(), "auto: the planner chooses the layout; flags: it predicts the flags' layout",
             {"auto", "flags", "none"}, {PlanMode::kAuto, PlanMode::kFlags, PlanMode::kNone});
  c.add("cluster", &r.cluster(), "the collectives' rates: a preset (a800-amsp, h100-1024) or a JSON file");
  c.add("comm-bench", &r.comm_bench(), "the collectives' rates measured by comm_bench --json on these ranks");
  c.add("memory-gb", &r.memory_gb(), "memory per rank the plan must fit; 0: the cluster's");
  c.add("overlap", &r.overlap(), "fraction of data-parallel traffic hidden behind compute");
  c.add("plan-top", &r.plan_top(), "plans --plan auto lists");
}

}  // namespace

RunOptions::RunOptions() {
  grid_.seed(1);
  model_.vocab(256).context(64).layers(4).heads(4).hidden(128);
}

bool RunOptions::was_given(const std::string& option) const {
  return std::find(given_.begin(), given_.end(), option) != given_.end();
}

int64_t warmup_for(int64_t steps) { return steps / 10; }

std::string RunOptions::hf_init_dir() const {
  if (init_from().empty()) return "";
  TORCH_CHECK(init_from().rfind("hf:", 0) == 0 && init_from().size() > 3, "--init-from takes hf:DIR (a Hugging "
              "Face model directory), got '", init_from(), "'; to continue a tessera checkpoint use --resume DIR");
  return init_from().substr(3);
}

int64_t RunOptions::warmup_steps() const { return warmup() >= 0 ? warmup() : warmup_for(steps()); }

int64_t RunOptions::pipeline_microbatches() const {
  return microbatches() > 0 ? microbatches() : 2 * int64_t{grid().pipeline()};
}

const std::vector<std::string>& planned_options() {
  static const std::vector<std::string> names = {"dp",           "pp",
                                                 "tp",           "tp-mode",
                                                 "tp-depth",     "sp",
                                                 "sp-mode",      "sp-ulysses",
                                                 "ep",           "expert-tensor-parallel",
                                                 "spec",         "schedule",
                                                 "microbatches", "chunks",
                                                 "accumulation", "checkpoint-activations",
                                                 "offload"};
  return names;
}

TrainerOptions RunOptions::trainer_options() const {
  return TrainerOptions()
      .spec(spec())
      .pipeline(parallel::PipelineOptions()
                    .schedule(schedule())
                    .microbatches(static_cast<int>(pipeline_microbatches()))
                    .chunks(chunks()))
      .accumulation(accumulation())
      .offload(offload())
      .disk(parallel::DiskOffloadOptions().dir(offload_dir()))
      .offload_params(offload_params())
      .clip_grad_norm(clip())
      .bucket_bytes(static_cast<int64_t>(bucket_mb() * (1 << 20)))
      .rank_times(straggler_threshold() > 0 || rank_times())
      .lr(LrSchedule()
              .peak(lr())
              .warmup_steps(warmup_steps())
              .total_steps(steps())
              .decay(decay())
              .min_ratio(min_lr_ratio()));
}

c10::Device RunOptions::resolved_device() const {
  const std::string& d = device();
  const bool cuda = d == "cuda" || d.rfind("cuda:", 0) == 0;
  TORCH_CHECK(d == "cpu" || cuda, "--device must be cpu, cuda or cuda:N, got '", d, "'");
  if (!cuda) {
    TORCH_CHECK(backend() != comm::Backend::kNccl,
                "--backend nccl needs GPU tensors: add --device cuda, or use --backend mpi (or auto) on the CPU");
    return c10::Device(c10::kCPU);
  }
  const int gpus = at::hasCUDA() ? static_cast<int>(at::getNumGPUs()) : 0;
  TORCH_CHECK(gpus > 0, "--device ", d,
              ", but this process sees no CUDA device (a LibTorch without CUDA, no GPU, or "
              "CUDA_VISIBLE_DEVICES empty); run where a GPU is, or --device cpu");
  TORCH_CHECK(backend() != comm::Backend::kNccl || comm::nccl_available(),
              "--backend nccl, but this tessera was built without NCCL (TESSERA_WITH_NCCL=OFF); use --backend mpi, "
              "or rebuild with NCCL");
  if (d == "cuda") return context::pick_device(context::detect_launch(), gpus);
  int index = -1;
  size_t used = 0;
  try {
    index = std::stoi(d.substr(5), &used);
  } catch (const std::exception&) {
    used = 0;
  }
  TORCH_CHECK(used == d.size() - 5 && used > 0 && index >= 0,
              "--device must be cpu, cuda or cuda:N with N a GPU index, got '", d, "'");
  TORCH_CHECK(index < gpus, "--device ", d, ", but this process sees ", gpus, " CUDA device(s), 0 to ", gpus - 1,
              "; pick one of them, or --device cuda for the local rank's");
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
}

void RunOptions::check(int world_size) const {
  for (const auto& [name, value] : {std::pair<const char*, int64_t>{"steps", steps()},
                                    {"batch", batch()},
                                    {"seq", seq()},
                                    {"layers", model().layers()},
                                    {"heads", model().heads()},
                                    {"hidden", model().hidden()},
                                    {"accumulation", accumulation()},
                                    {"log-every", log_every()},
                                    {"min-rows-per-replica", min_rows_per_replica()}})
    TORCH_CHECK(value >= 1, "--", name, " must be >= 1, got ", value);
  for (const auto& [name, value] : {std::pair<const char*, int64_t>{"sample", sample()},
                                    {"eval-every", eval_every()},
                                    {"link-probe-every", link_probe_every()},
                                    {"save-every", save_every()}})
    TORCH_CHECK(value >= 0, "--", name, " must be >= 0 (0: never), got ", value);
  TORCH_CHECK(warmup() >= -1, "--warmup must be >= 0, got ", warmup());
  TORCH_CHECK(straggler_threshold() >= 0 && std::isfinite(straggler_threshold()),
              "--straggler-threshold must be a fraction >= 0 (0: off), got ", straggler_threshold());
  if (!hf_init_dir().empty()) {
    // The architecture is config.json's; a flag beside it would be ignored.
    for (const char* flag :
         {"model",       "layers",    "heads",         "kv-heads",    "head-dim",          "hidden",
          "ffn",         "norm",      "norm-eps",      "positions",   "rope-theta",        "mlp",
          "bias",        "qkv-bias",  "qk-norm",       "tied",        "experts",           "top-k",
          "renormalize", "moe-every", "aux-loss-coef", "z-loss-coef", "shared-expert-ffn", "shared-expert-gate"})
      TORCH_CHECK(!was_given(flag), "--", flag, " with --init-from: the architecture comes from ", hf_init_dir(),
                  "/config.json; leave --", flag, " out");
  }
  TORCH_CHECK(export_shard_mb() >= 1, "--export-shard-mb must be >= 1, got ", export_shard_mb());
  TORCH_CHECK(export_dtype().empty() || export_dtype() == "float32" || export_dtype() == "bfloat16" ||
                  export_dtype() == "float16",
              "--export-dtype must be float32, bfloat16 or float16 (empty: the checkpoint's), got '", export_dtype(),
              "'");
  TORCH_CHECK(export_dtype().empty() || !export_hf().empty(), "--export-dtype is only read with --export-hf DIR");
  TORCH_CHECK(!was_given("export-shard-mb") || !export_hf().empty(),
              "--export-shard-mb is only read with --export-hf DIR");
  model().check();  // the architecture's rules (kv heads, rotary head dimension, MoE options on a dense model)
  TORCH_CHECK(!was_given("rope-theta") || model().positions() == models::Positions::kRotary,
              "--rope-theta is only read with rotary positions; add --positions rotary (or a Llama-family --model)");
  TORCH_CHECK((offload() == Offload::kDisk) == !offload_dir().empty(),
              offload() == Offload::kDisk ? "--offload disk needs --offload-dir DIR (a directory on a local disk)"
                                          : "--offload-dir is only read with --offload disk");
  TORCH_CHECK(!offload_params() || offload() != Offload::kNone, "--offload-params keeps parameter shards in host "
              "memory, where the optimizer must step too: add --offload host (or disk)");
  TORCH_CHECK(save_every() == 0 || !save().empty(), "--save-every ", save_every(),
              " needs --save DIR, where the checkpoints go");
  if (elastic()) {
    TORCH_CHECK(!was_given("dp"), "--dp ", grid().data(), " with --batch-schedule: the schedule chooses the data size "
                "(the largest that gives every replica --min-rows-per-replica rows); leave --dp out");
    TORCH_CHECK(!was_given("batch"), "--batch ", batch(), " with --batch-schedule: the schedule sets the batch of "
                "every step; give one of the two");
    BatchSchedule::parse(batch_schedule());
  } else {
    TORCH_CHECK(!was_given("min-rows-per-replica"), "--min-rows-per-replica is only read with --batch-schedule");
  }
  TORCH_CHECK(bucket_mb() == 0 || (bucket_mb() * (1 << 20) >= 1 && bucket_mb() <= 1 << 20), "--bucket-mb ", bucket_mb(),
              ": a bucket holds at least one byte and at most 1 TiB (0: the default, 25, or a sixteenth "
              "of the gradient across hosts)");
  TORCH_CHECK(!was_given("bucket-mb") || plan() == PlanMode::kNone,
              "--bucket-mb with --plan: the planner models the default buckets; drop one of them");
  for (const char* k : {"cluster", "comm-bench", "memory-gb", "overlap", "plan-top"})
    TORCH_CHECK(!was_given(k) || plan() != PlanMode::kNone, "--", k, " is only read with --plan auto|flags");
  TORCH_CHECK(!was_given("plan-top") || plan() == PlanMode::kAuto, "--plan-top is only read with --plan auto");
  if (plan() == PlanMode::kNone) return;
  TORCH_CHECK(device() == "cpu", "--plan with --device ", device(),
              ": the planner measures the step on this machine's CPU cores (docs/planner.md) and would predict a "
              "CPU run; drop --plan, or plan on the CPU");
  TORCH_CHECK(!elastic(), "--plan with --batch-schedule: the planner plans one fixed layout; drop one of them");
  TORCH_CHECK(!sequence_parallel(),
              "--plan with --sequence-parallel: the planner does not model Megatron's "
              "sequence-parallel variant yet; drop one of them");
  TORCH_CHECK(resume().empty() || plan() == PlanMode::kFlags,
              "--plan auto with --resume: the plan could differ "
              "from the checkpoint's layout; give the layout flags and --plan flags");
  TORCH_CHECK(overlap() >= 0 && overlap() <= 1, "--overlap is a fraction in [0, 1], got ", overlap());
  if (plan() == PlanMode::kAuto)
    for (const auto& k : planned_options())
      TORCH_CHECK(!was_given(k), "--", k, " with --plan auto: the planner chooses it; drop --", k,
                  " or use --plan flags to have your layout predicted");
}

cli::Command run_command(const std::string& name, const std::string& summary, RunOptions& run) {
  cli::Command c(name, summary);
  grid_options(c, run);
  model_options(c, run);
  c.on_parsed([&run](const cli::Command& parsed) { apply_model_preset(parsed, run); });
  optimizer_options(c, run);
  data_options(c, run);
  planner_options(c, run);
  c.on_parsed([&run](const cli::Command& parsed) { run.given(parsed.given()); });
  return c;
}

}  // namespace train
}  // namespace tessera
