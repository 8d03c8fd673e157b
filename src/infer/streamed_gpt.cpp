#include "tessera/infer/streamed_gpt.h"

#include "tessera/comm/agree.h"
#include "tessera/comm/functional.h"
#include "tessera/core/process_memory.h"
#include "tessera/nn/rms_norm.h"
#include "tessera/nn/rotary.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <tuple>
#include <vector>

namespace tessera {
namespace infer {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int64_t kAlign = 64;
constexpr double kMiB = 1024.0 * 1024.0;

bool starts_with(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

// The tensors of a block, by their names after "h.<i>.", as the architecture
// has them (Note [GPT full weights]).
std::vector<std::string> block_tensors(const models::GPTConfig& c) {
  std::vector<std::string> t;
  auto linear = [&](const std::string& name, bool bias) {
    t.push_back(name + ".weight");
    if (bias) t.push_back(name + ".bias");
  };
  const bool layer_norm = c.norm() == nn::NormKind::kLayerNorm;
  linear("ln_1", layer_norm);
  if (c.grouped_attention()) {
    linear("attn.q_proj", c.qkv_bias());
    linear("attn.kv_proj", c.qkv_bias());
  } else {
    linear("attn.c_attn", c.qkv_bias());
  }
  if (c.qk_norm()) t.insert(t.end(), {"attn.q_norm.weight", "attn.k_norm.weight"});
  linear("attn.c_proj", c.bias());
  linear("ln_2", layer_norm);
  if (c.mlp() == nn::MLPKind::kSwiGLU) linear("mlp.c_gate", c.bias());
  linear("mlp.c_fc", c.bias());
  linear("mlp.c_proj", c.bias());
  return t;
}

// A tensor of a unit's map, or undefined (an absent bias).
at::Tensor optional(const std::map<std::string, at::Tensor>& p, const std::string& name) {
  auto it = p.find(name);
  return it == p.end() ? at::Tensor() : it->second;
}

int64_t aligned(int64_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }
double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// The weights of one unit, read into one buffer.
struct Unit {
  std::vector<std::string> names;  // of each read ("h.<i>." left out; "table" for a head chunk)
  std::vector<StoredWeights::ReadPlan> reads;
  std::vector<int64_t> offsets;  // of each read in the buffer
  int64_t bytes = 0;
  int64_t head_row = -1;  // a head chunk: its first vocabulary row
};

struct Load {
  std::vector<IoWork> works;
  Clock::time_point issued;
};

}  // namespace

int64_t StreamPlan::planned_bytes() const {
  return baseline_bytes + (resident ? weight_bytes : buffers * buffer_bytes) + kv_bytes + work_bytes + margin_bytes;
}

std::string StreamPlan::describe() const {
  const std::string weights = resident ? fmt::format("weights {:.1f} MiB in memory", weight_bytes / kMiB)
                                       : fmt::format("weights {:.1f} MiB streamed through {} buffers of {:.1f} MiB",
                                                     weight_bytes / kMiB, buffers, buffer_bytes / kMiB);
  return fmt::format(
      "{} ({} units, {} head chunks); process before {:.1f} MiB, KV cache {:.1f} MiB, working memory {:.1f} MiB, "
      "margin {:.1f} MiB: {:.1f} MiB planned",
      weights, units, head_chunks, baseline_bytes / kMiB, kv_bytes / kMiB, work_bytes / kMiB, margin_bytes / kMiB,
      planned_bytes() / kMiB);
}

double StreamStats::hidden_fraction() const {
  return read_seconds > 0 ? std::max(0.0, 1.0 - stall_seconds / read_seconds) : 1.0;
}

namespace {

// The "gpt" object of the weights' metadata (saved by hand, or through
// Trainer::save, which keeps the caller's under "extra"); empty if none.
nlohmann::json recorded_config(const StoredWeights& w) {
  nlohmann::json meta = nlohmann::json::object();
  try {
    meta = nlohmann::json::parse(w.metadata_json());
  } catch (const std::exception&) {
  }
  for (const auto& m : {meta, meta.is_object() ? meta.value("extra", nlohmann::json::object()) : meta})
    if (m.is_object() && m.contains("gpt") && m["gpt"].is_object()) return m["gpt"];
  return nlohmann::json::object();
}

// GPT-2 from the shapes, and the heads from `heads` or the metadata.
models::GPTConfig gpt2_from_shapes(const StoredWeights& w, int64_t heads, const nlohmann::json& recorded) {
  const std::string where = "weights " + w.path();
  const bool llama = w.contains("h.0.mlp.c_gate.weight") || w.contains("h.0.attn.q_proj.weight") ||
                     (w.contains("h.0.ln_1.weight") && !w.contains("h.0.ln_1.bias"));
  TORCH_CHECK(!llama, where, " hold a Llama-family model (RMSNorm, grouped-query attention or SwiGLU), but their "
              "metadata do not record its architecture (a \"gpt\" object as train_gpt's checkpoints carry: norm, "
              "positions, kv_heads, ...); save them through the trainer, or add it to the file's metadata");
  for (const char* name : {"wte.weight", "wpe.weight", "ln_f.weight", "h.0.ln_1.weight"})
    TORCH_CHECK(w.contains(name), where, " are not a GPT (models::GPT's names): '", name, "' is missing");
  models::GPTConfig c;
  c.vocab(w.shape("wte.weight").at(0));
  c.hidden(w.shape("wte.weight").at(1));
  c.context(w.shape("wpe.weight").at(0));
  c.layers(0);
  while (w.contains("h." + std::to_string(c.layers()) + ".ln_1.weight")) ++c.layers();
  c.tied(!w.contains("lm_head.weight"));
  if (heads <= 0 && recorded.contains("heads")) heads = recorded["heads"].get<int64_t>();
  TORCH_CHECK(heads > 0, where, " do not say how many attention heads the model has (their metadata has no "
                            "gpt.heads); pass it (--heads)");
  c.heads(heads);
  TORCH_CHECK(c.hidden() % c.heads() == 0, where, ": hidden size ", c.hidden(), " is not divisible by ", c.heads(),
              " heads");
  return c;
}

}  // namespace

models::GPTConfig gpt_config_from_weights(const StoredWeights& w, int64_t heads) {
  const std::string where = "weights " + w.path();
  for (const auto& name : w.names())
    TORCH_CHECK(name.find(".mlp.router") == std::string::npos && name.find(".mlp.experts") == std::string::npos,
                where, " hold mixture-of-experts blocks ('", name, "'), which streamed inference does not run yet");
  const nlohmann::json recorded = recorded_config(w);
  // Written with the architecture (train_gpt's), not only the heads (earlier GPT-2 checkpoints).
  const bool described = recorded.contains("norm") || recorded.contains("positions");
  models::GPTConfig c;
  if (described) {
    c = models::GPTConfig::from_json(recorded.dump());
    TORCH_CHECK(heads <= 0 || heads == c.heads(), where, " record ", c.heads(), " heads; --heads ", heads,
                " disagrees (leave it out)");
    const std::vector<int64_t> table = {c.vocab(), c.hidden()};
    TORCH_CHECK(w.contains("wte.weight") && w.shape("wte.weight") == table, where, ": wte.weight is not [", c.vocab(), ", ", c.hidden(), "] as the recorded architecture says");
    TORCH_CHECK(w.contains("h." + std::to_string(c.layers() - 1) + ".ln_1.weight") &&
                    !w.contains("h." + std::to_string(c.layers()) + ".ln_1.weight"),
                where, ": the blocks are not the ", c.layers(), " the recorded architecture says");
  } else {
    c = gpt2_from_shapes(w, heads, recorded);
  }
  c.dropout(0);
  for (const char* name : {"wte.weight", "ln_f.weight"})
    TORCH_CHECK(w.contains(name), where, " have no '", name, "'");
  TORCH_CHECK(c.tied() || w.contains("lm_head.weight"), where, " have no 'lm_head.weight' (the head is untied)");
  TORCH_CHECK(c.positions() != models::Positions::kLearned || w.contains("wpe.weight"), where,
              " have no 'wpe.weight' (learned positions)");
  for (int64_t i = 0; i < c.layers(); ++i)
    for (const auto& t : block_tensors(c))
      TORCH_CHECK(w.contains("h." + std::to_string(i) + "." + t), where, ": block ", i, " has no '", t, "'");
  return c;
}

struct StreamedGPT::Impl {
  std::shared_ptr<StoredWeights> w;
  StreamedGPTOptions o;
  models::GPTConfig c;
  comm::CommunicatorPtr group;
  int64_t tp = 1, rank = 0;
  int64_t lh = 0, lkv = 0, d = 0, lf = 0, v0 = 0, v1 = 0, max_length = 0;
  at::Tensor inverse_frequencies;  // rotary positions
  std::string head_name;
  std::vector<Unit> units;  // blocks, then head chunks
  StreamPlan plan;
  at::Tensor ln_f_w, ln_f_b;
  std::vector<at::Tensor> resident;  // per unit, when resident
  std::vector<at::Tensor> buffers;
  std::vector<Load> loads;  // per buffer
  int64_t next_issue = 0, next_use = 0;
  bool broken = false;
  std::vector<at::Tensor> k_cache, v_cache;  // per layer [batch, lkv, max_length, d]
  int64_t batch = 0, pos = 0;
  StreamStats stats;

  // This rank's part of block i: rows of the column-role linears (its heads,
  // kv heads, MLP columns), columns of the row-role ones, the rest whole.
  Unit block_unit(int64_t i) const {
    Unit u;
    const std::string p = "h." + std::to_string(i) + ".";
    const int64_t h = c.hidden(), a = lh * d;
    for (const auto& name : block_tensors(c)) {
      const bool weight = name.size() > 7 && name.compare(name.size() - 7, 7, ".weight") == 0;
      int64_t first = 0, rows = 0;  // rows > 0: a column-role layer's rows
      if (starts_with(name, "attn.c_attn.")) first = rank * 3 * a, rows = 3 * a;
      if (starts_with(name, "attn.q_proj.")) first = rank * a, rows = a;
      if (starts_with(name, "attn.kv_proj.")) first = rank * 2 * lkv * d, rows = 2 * lkv * d;
      if (starts_with(name, "mlp.c_gate.") || starts_with(name, "mlp.c_fc.")) first = rank * lf, rows = lf;
      const bool row_role = weight && (name == "attn.c_proj.weight" || name == "mlp.c_proj.weight");
      if (rows > 0)
        u.reads.push_back(weight ? w->plan(p + name, {first, 0}, {rows, h}) : w->plan(p + name, {first}, {rows}));
      else if (row_role)
        u.reads.push_back(name == "attn.c_proj.weight" ? w->plan(p + name, {0, rank * a}, {h, a})
                                                       : w->plan(p + name, {0, rank * lf}, {h, lf}));
      else
        u.reads.push_back(w->plan_whole(p + name));
      u.names.push_back(name);
      u.offsets.push_back(u.bytes);
      u.bytes += aligned(u.reads.back().bytes);
    }
    return u;
  }

  // A unit's tensors over its buffer, in float, by name.
  std::map<std::string, at::Tensor> tensors(int64_t unit, char* base) const {
    std::map<std::string, at::Tensor> out;
    const Unit& u = units[unit];
    for (size_t i = 0; i < u.reads.size(); ++i) {
      const auto& r = u.reads[i];
      out[u.names[i]] =
          at::from_blob(base + u.offsets[i], r.length, at::TensorOptions().dtype(r.dtype)).to(o.device(), at::kFloat);
    }
    return out;
  }

  void issue(int64_t seq) {
    const int64_t k = static_cast<int64_t>(buffers.size());
    Load& l = loads[seq % k];
    l.works.clear();
    l.issued = Clock::now();
    const int64_t unit = seq % static_cast<int64_t>(units.size());
    auto* base = static_cast<char*>(buffers[seq % k].data_ptr());
    const Unit& u = units[unit];
    for (size_t i = 0; i < u.reads.size(); ++i) {
      w->issue(u.reads[i], base + u.offsets[i], l.works);
      stats.bytes_read += u.reads[i].bytes;
    }
  }

  // Waits for a load and accounts for it; throws its I/O error.
  void finish(Load& l, const Unit& u, char* base, bool count_stall) {
    const auto t0 = Clock::now();
    Clock::time_point done = l.issued;
    for (const auto& work : l.works) {
      work.wait();
      done = std::max(done, work.finished_at());
    }
    if (count_stall) stats.stall_seconds += seconds(Clock::now() - t0);
    stats.read_seconds += seconds(done - l.issued);
    l.works.clear();
    for (size_t i = 0; i < u.reads.size(); ++i) w->complete(u.reads[i], base + u.offsets[i]);
  }

  // The next unit's weights, read (Note [Streamed inference]).
  std::map<std::string, at::Tensor> acquire(int64_t unit) {
    if (plan.resident) return tensors(unit, static_cast<char*>(resident[unit].data_ptr()));
    const int64_t seq = next_use, k = static_cast<int64_t>(buffers.size());
    TORCH_INTERNAL_ASSERT(seq % static_cast<int64_t>(units.size()) == unit, "streamed units out of order");
    while (next_issue <= seq) issue(next_issue++);
    char* base = static_cast<char*>(buffers[seq % k].data_ptr());
    // A damaged shard may be one rank's only: the group stops together.
    if (tp > 1)
      comm::on_every_rank(group, "StreamedGPT: reading weights", [&] { finish(loads[seq % k], units[unit], base, true); });
    else
      finish(loads[seq % k], units[unit], base, true);
    return tensors(unit, base);
  }

  void release() {
    const int64_t seq = next_use++;
    if (plan.resident || !o.prefetch()) return;
    const int64_t next = seq + static_cast<int64_t>(buffers.size());
    while (next_issue <= next) issue(next_issue++);
  }

  at::Tensor all_reduce(const at::Tensor& t) const { return tp > 1 ? comm::raw::all_reduce(t, *group) : t; }

  at::Tensor norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) const {
    if (c.norm() == nn::NormKind::kLayerNorm) return at::layer_norm(x, {x.size(-1)}, weight, bias, c.norm_eps());
    return weight * nn::rms_normalize(x, x.pow(2).mean(-1, /*keepdim=*/true), c.norm_eps());
  }

  // One block over t new tokens at positions [pos, pos + t); cos and sin of
  // those positions with rotary embeddings.
  at::Tensor block(int64_t layer, const std::map<std::string, at::Tensor>& p, const at::Tensor& x,
                   const at::Tensor& cos, const at::Tensor& sin) {
    const int64_t b = x.size(0), t = x.size(1);
    const at::Tensor a = norm(x, p.at("ln_1.weight"), optional(p, "ln_1.bias"));
    at::Tensor q, k, v;  // [b, heads, t, d]
    if (c.grouped_attention()) {
      q = at::linear(a, p.at("attn.q_proj.weight"), optional(p, "attn.q_proj.bias")).view({b, t, lh, d}).transpose(1, 2);
      const at::Tensor kv = at::linear(a, p.at("attn.kv_proj.weight"), optional(p, "attn.kv_proj.bias"))
                                .view({b, t, lkv, 2, d})
                                .permute({3, 0, 2, 1, 4});
      k = kv[0], v = kv[1];
    } else {
      const at::Tensor qkv = at::linear(a, p.at("attn.c_attn.weight"), optional(p, "attn.c_attn.bias"))
                                 .view({b, t, lh, 3, d})
                                 .permute({3, 0, 2, 1, 4});
      q = qkv[0], k = qkv[1], v = qkv[2];
    }
    if (c.qk_norm()) q = norm(q, p.at("attn.q_norm.weight"), {}), k = norm(k, p.at("attn.k_norm.weight"), {});
    if (cos.defined()) q = nn::apply_rotary(q, cos, sin), k = nn::apply_rotary(k, cos, sin);
    // The cache holds the kv heads themselves; they are repeated for the query heads when read.
    k_cache[layer].narrow(0, 0, b).narrow(2, pos, t).copy_(k);
    v_cache[layer].narrow(0, 0, b).narrow(2, pos, t).copy_(v);
    at::Tensor keys = k_cache[layer].narrow(0, 0, b).narrow(2, 0, pos + t);
    at::Tensor values = v_cache[layer].narrow(0, 0, b).narrow(2, 0, pos + t);
    if (lkv != lh) keys = keys.repeat_interleave(lh / lkv, 1), values = values.repeat_interleave(lh / lkv, 1);
    at::Tensor scores = at::matmul(q, keys.transpose(-2, -1)) / std::sqrt(static_cast<double>(d));
    if (t > 1) {  // query i (at pos + i) sees keys 0 .. pos + i
      const auto longs = at::TensorOptions(at::kLong).device(o.device());
      const at::Tensor q_pos = at::arange(pos, pos + t, longs).unsqueeze(1);
      const at::Tensor k_pos = at::arange(0, pos + t, longs).unsqueeze(0);
      scores = scores.masked_fill(k_pos > q_pos, -std::numeric_limits<float>::infinity());
    }
    const at::Tensor att = at::matmul(at::softmax(scores, -1), values).permute({0, 2, 1, 3}).reshape({b, t, lh * d});
    at::Tensor y = x + all_reduce(at::linear(att, p.at("attn.c_proj.weight")));
    if (c.bias()) y = y + p.at("attn.c_proj.bias");
    const at::Tensor n = norm(y, p.at("ln_2.weight"), optional(p, "ln_2.bias"));
    const at::Tensor up = at::linear(n, p.at("mlp.c_fc.weight"), optional(p, "mlp.c_fc.bias"));
    const at::Tensor m = c.mlp() == nn::MLPKind::kSwiGLU
                             ? at::silu(at::linear(n, p.at("mlp.c_gate.weight"), optional(p, "mlp.c_gate.bias"))) * up
                             : at::gelu(up, c.mlp() == nn::MLPKind::kGeluTanh ? "tanh" : "none");
    at::Tensor out = y + all_reduce(at::linear(m, p.at("mlp.c_proj.weight")));
    if (c.bias()) out = out + p.at("mlp.c_proj.bias");
    return out;
  }

  // Reads a box now, in float (small reads: embedding rows, ln_f).
  at::Tensor read_now(const std::vector<StoredWeights::ReadPlan>& plans) {
    std::vector<at::Tensor> parts;
    std::vector<IoWork> works;
    for (const auto& r : plans) {
      parts.push_back(at::empty(r.length, at::TensorOptions().dtype(r.dtype)));
      w->issue(r, parts.back().data_ptr(), works);
      stats.bytes_read += r.bytes;
    }
    for (const auto& work : works) work.wait();
    for (size_t i = 0; i < plans.size(); ++i) w->complete(plans[i], parts[i].data_ptr());
    return at::cat(parts).to(o.device(), at::kFloat);
  }

  // Rows of a [rows, hidden] table (token or position embedding).
  at::Tensor rows(const std::string& name, const at::Tensor& index) {
    std::vector<StoredWeights::ReadPlan> plans;
    const auto* ids = index.data_ptr<int64_t>();
    for (int64_t i = 0; i < index.numel(); ++i) plans.push_back(w->plan(name, {ids[i], 0}, {1, c.hidden()}));
    return read_now(plans);
  }

  at::Tensor run(const at::Tensor& ids) {
    const int64_t b = ids.size(0), t = ids.size(1);
    at::Tensor flat = ids.reshape({-1}).contiguous();
    const at::Tensor positions = at::arange(pos, pos + t, at::kLong);
    at::Tensor x = rows("wte.weight", flat).view({b, t, c.hidden()});
    at::Tensor cos, sin;
    if (c.positions() == models::Positions::kLearned)
      x = x + rows("wpe.weight", positions).unsqueeze(0);
    else
      std::tie(cos, sin) = nn::rotary_cos_sin(inverse_frequencies, positions, at::kFloat, o.device());
    for (int64_t i = 0; i < c.layers(); ++i) {
      x = block(i, acquire(i), x, cos, sin);
      release();
    }
    x = norm(x, ln_f_w, ln_f_b);
    at::Tensor logits = at::zeros({b, t, c.vocab()}, at::TensorOptions(at::kFloat).device(o.device()));
    for (int64_t unit = c.layers(); unit < static_cast<int64_t>(units.size()); ++unit) {
      const at::Tensor table = acquire(unit).at("table");
      logits.narrow(2, units[unit].head_row, table.size(0)).copy_(at::matmul(x, table.t()));
      release();
    }
    return all_reduce(logits).to(at::kCPU);
  }
};

StreamedGPT::StreamedGPT(std::shared_ptr<StoredWeights> weights, StreamedGPTOptions options)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.w = std::move(weights);
  m.o = std::move(options);
  m.group = m.o.group();
  comm::on_every_rank(m.group, "StreamedGPT", [&] {
    TORCH_CHECK(m.w != nullptr, "StreamedGPT needs weights");
    const int64_t baseline = resident_bytes();
    m.c = gpt_config_from_weights(*m.w, m.o.heads());
    m.tp = m.group ? m.group->size() : 1;
    m.rank = m.group ? m.group->rank() : 0;
    const auto& c = m.c;
    TORCH_CHECK(m.o.max_memory() >= 0, "StreamedGPT: max_memory must be >= 0 (0: no limit), got ", m.o.max_memory());
    TORCH_CHECK(m.o.batch() >= 1, "StreamedGPT: batch must be >= 1, got ", m.o.batch());
    const c10::Device& dev = m.o.device();
    const int64_t gpus = at::hasCUDA() ? static_cast<int64_t>(at::getNumGPUs()) : 0;
    TORCH_CHECK(dev.is_cpu() || (dev.is_cuda() && dev.has_index() && dev.index() < gpus), "StreamedGPT: device ",
                dev.str(), " is refused: ",
                dev.is_cuda() ? (dev.has_index() ? fmt::format("this process sees {} CUDA device(s)", gpus)
                                                 : std::string("name the CUDA device's index (cuda:0, ...)"))
                              : std::string("it computes on the CPU or a CUDA device"));
    TORCH_CHECK(m.o.buffers() == 0 || (m.o.prefetch() && m.o.buffers() >= 2), "StreamedGPT: buffers ",
                m.o.buffers(), " is refused: with prefetch it must be >= 2 (one computes while the others load), ",
                "without prefetch leave it 0 (one buffer)");
    m.max_length = m.o.max_length() == 0 ? c.context() : m.o.max_length();
    TORCH_CHECK(m.max_length >= 1 && m.max_length <= c.context(), "StreamedGPT: max_length ", m.o.max_length(),
                " must lie in [1, ", c.context(), "] (the context length; 0 means the context length)");
    const int64_t kv = c.num_kv_heads(), ffn = c.ffn_size();
    TORCH_CHECK(c.heads() % m.tp == 0 && kv % m.tp == 0 && ffn % m.tp == 0, "StreamedGPT: ", c.heads(), " heads, ",
                kv, " key/value heads and ", ffn, " MLP columns must be divisible by the ", m.tp,
                " tensor-parallel ranks (streamed inference splits kv heads; it does not replicate them)");
    m.d = c.dim_per_head();
    m.lh = c.heads() / m.tp;
    m.lkv = kv / m.tp;
    m.lf = ffn / m.tp;
    if (c.positions() == models::Positions::kRotary)
      m.inverse_frequencies =
          nn::rotary_inverse_frequencies(nn::RotaryOptions(m.d).theta(c.rope_theta()).scaling(c.rope_scaling()));
    m.v0 = m.rank * c.vocab() / m.tp;
    m.v1 = (m.rank + 1) * c.vocab() / m.tp;
    m.head_name = c.tied() ? "wte.weight" : "lm_head.weight";
    for (int64_t i = 0; i < c.layers(); ++i) m.units.push_back(m.block_unit(i));
    // Head chunks no larger than a block, so they share its buffers.
    const int64_t row_bytes = c.hidden() * static_cast<int64_t>(c10::elementSize(m.w->dtype(m.head_name)));
    const int64_t chunk = std::max<int64_t>(1, m.units[0].bytes / row_bytes);
    for (int64_t r = m.v0; r < m.v1; r += chunk) {
      Unit u;
      u.head_row = r;
      u.names.push_back("table");
      u.reads.push_back(m.w->plan(m.head_name, {r, 0}, {std::min(chunk, m.v1 - r), c.hidden()}));
      u.offsets.push_back(0);
      u.bytes = aligned(u.reads[0].bytes);
      m.units.push_back(std::move(u));
    }
    // The plan (Note [Streamed inference]).
    StreamPlan& p = m.plan;
    p.baseline_bytes = baseline;
    p.units = static_cast<int64_t>(m.units.size());
    p.head_chunks = p.units - c.layers();
    int64_t largest_tensor = 0;  // not float: converted when used
    for (const auto& u : m.units) {
      p.weight_bytes += u.bytes;
      p.buffer_bytes = std::max(p.buffer_bytes, u.bytes);
      for (const auto& r : u.reads)
        if (r.dtype != at::kFloat) largest_tensor = std::max(largest_tensor, r.bytes / int64_t(c10::elementSize(r.dtype)));
    }
    const int64_t b = m.o.batch(), len = m.max_length, h = c.hidden(), f = 4;
    p.kv_bytes = 2 * c.layers() * b * m.lkv * len * m.d * f;
    // A forward of max_length tokens: residual stream and norms, q/k/v, MLP
    // activations, scores and their softmax, full and chunk logits, and the
    // largest tensor converted to float when the weights are not float.
    const int64_t mlp = (c.mlp() == nn::MLPKind::kSwiGLU ? 3 : 2) * m.lf;
    const int64_t floats = b * len * (6 * h + 6 * m.lh * m.d + mlp + 2 * c.vocab() + p.buffer_bytes / row_bytes) +
                           2 * b * m.lh * len * len + 2 * largest_tensor;
    p.work_bytes = floats * f;
    if (!m.o.device().is_cpu()) p.kv_bytes = p.work_bytes = 0;  // the device's (Note [Streamed inference on a device])
    p.margin_bytes = std::max<int64_t>(16 << 20, m.o.max_memory() / 20);
    p.resident = m.o.resident_if_fits() &&
                 (m.o.max_memory() == 0 || p.baseline_bytes + p.weight_bytes + p.kv_bytes + p.work_bytes +
                                                   p.margin_bytes <= m.o.max_memory());
    if (!p.resident) {
      p.buffers = m.o.prefetch() ? std::min<int64_t>(m.o.buffers() == 0 ? 2 : m.o.buffers(), p.units) : 1;
      const int64_t one = p.baseline_bytes + p.buffer_bytes + p.kv_bytes + p.work_bytes + p.margin_bytes;
      TORCH_CHECK(m.o.max_memory() == 0 || p.planned_bytes() <= m.o.max_memory(), "StreamedGPT: a budget of ",
                  fmt::format("{:.1f}", m.o.max_memory() / kMiB), " MiB per rank cannot hold the plan: ",
                  p.describe(), ". The smallest budget that works is ",
                  fmt::format("{:.1f}", p.planned_bytes() / kMiB), " MiB (",
                  fmt::format("{:.1f}", one / kMiB),
                  " MiB without prefetch); raise max_memory, lower max_length or batch, or split the layers over "
                  "more tensor-parallel ranks");
    }
    // Allocate and (resident) read.
    m.ln_f_w = m.read_now({m.w->plan_whole("ln_f.weight")});
    if (c.norm() == nn::NormKind::kLayerNorm) m.ln_f_b = m.read_now({m.w->plan_whole("ln_f.bias")});
    for (int64_t i = 0; i < c.layers(); ++i) {
      m.k_cache.push_back(at::zeros({b, m.lkv, len, m.d}, at::TensorOptions(at::kFloat).device(m.o.device())));
      m.v_cache.push_back(at::zeros({b, m.lkv, len, m.d}, at::TensorOptions(at::kFloat).device(m.o.device())));
    }
    if (p.resident) {
      for (const auto& u : m.units) {
        m.resident.push_back(at::empty({u.bytes}, at::kByte));
        Load l;
        l.issued = Clock::now();
        char* base = static_cast<char*>(m.resident.back().data_ptr());
        for (size_t i = 0; i < u.reads.size(); ++i) {
          m.w->issue(u.reads[i], base + u.offsets[i], l.works);
          m.stats.bytes_read += u.reads[i].bytes;
        }
        m.finish(l, u, base, false);
      }
    } else {
      for (int64_t i = 0; i < p.buffers; ++i) m.buffers.push_back(at::empty({p.buffer_bytes}, at::kByte));
      m.loads.resize(p.buffers);
      if (m.o.prefetch())
        while (m.next_issue < p.buffers) m.issue(m.next_issue++);
    }
  });
  m.batch = m.o.batch();
}

StreamedGPT::~StreamedGPT() {
  for (auto& l : impl_->loads)
    for (const auto& work : l.works) try {
        work.wait();
      } catch (...) {  // a destructor does not throw; the error was or will not be needed
      }
}

const models::GPTConfig& StreamedGPT::config() const { return impl_->c; }
const StreamPlan& StreamedGPT::plan() const { return impl_->plan; }
const StreamStats& StreamedGPT::stats() const { return impl_->stats; }
void StreamedGPT::reset_stats() { impl_->stats = StreamStats{}; }
const comm::CommunicatorPtr& StreamedGPT::group() const { return impl_->group; }
int64_t StreamedGPT::position() const { return impl_->pos; }

void StreamedGPT::reset(int64_t batch) {
  TORCH_CHECK(batch >= 1 && batch <= impl_->o.batch(), "StreamedGPT::reset: batch ", batch, " must lie in [1, ",
              impl_->o.batch(), "] (options.batch sizes the KV cache)");
  impl_->batch = batch;
  impl_->pos = 0;
}

at::Tensor StreamedGPT::forward(const at::Tensor& ids) {
  Impl& m = *impl_;
  TORCH_CHECK(!m.broken, "StreamedGPT: an earlier forward failed (its error said why); build a new model");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == m.batch && ids.size(1) >= 1 && ids.scalar_type() == at::kLong,
              "StreamedGPT::forward: ids must be int64 [", m.batch, ", t >= 1] (the batch of the last reset), got ",
              ids.scalar_type(), " ", ids.sizes());
  TORCH_CHECK(m.pos + ids.size(1) <= m.max_length, "StreamedGPT::forward: ", ids.size(1), " tokens after ", m.pos,
              " exceed max_length ", m.max_length, "; reset() or build the model with a larger max_length");
  const at::Tensor cpu_ids = ids.to(at::kCPU).contiguous();
  TORCH_CHECK(cpu_ids.min().item<int64_t>() >= 0 && cpu_ids.max().item<int64_t>() < m.c.vocab(),
              "StreamedGPT::forward: token ids must lie in [0, ", m.c.vocab(), ")");
  const auto t0 = Clock::now();
  at::Tensor logits;
  try {
    logits = m.run(cpu_ids);
  } catch (...) {
    m.broken = true;
    throw;
  }
  m.pos += ids.size(1);
  m.stats.forwards += 1;
  m.stats.tokens += ids.numel();
  m.stats.forward_seconds += seconds(Clock::now() - t0);
  return logits;
}

}  // namespace infer
}  // namespace tessera
