#include "tessera/parallel/sharding_spec.h"

#include "tessera/core/error.h"

#include <algorithm>
#include <cctype>
#include <vector>

namespace tessera {
namespace parallel {
namespace {

std::string lower_trimmed(std::string text) {
  text.erase(std::remove_if(text.begin(), text.end(), [](unsigned char c) { return std::isspace(c); }), text.end());
  std::transform(text.begin(), text.end(), text.begin(), [](unsigned char c) { return std::tolower(c); });
  return text;
}

int parse_positive(const std::string& digits, const std::string& context) {
  TORCH_CHECK(
      !digits.empty() && std::all_of(digits.begin(), digits.end(), [](unsigned char c) { return std::isdigit(c); }),
      "sharding: expected a positive integer in '", context, "', got '", digits, "'");
  // Nine digits always fit an int; a group of a billion ranks or more is no
  // group a job has.
  TORCH_CHECK(digits.size() <= 9, "sharding: the group size ", digits.substr(0, 20), digits.size() > 20 ? "..." : "",
              " in '", context.substr(0, 80), "' is larger than any job");
  return std::stoi(digits);
}

}  // namespace

Placement Placement::partial_shard(int k) {
  TORCH_CHECK(k >= 1 || k == kPerHost, "PartialShard(k) needs k >= 1 (or P(host)), got k = ", k);
  return Placement(Kind::kPartialShard, k);
}

std::string Placement::to_string() const {
  switch (kind_) {
    case Kind::kReplicate:
      return "R";
    case Kind::kShard:
      return "S";
    case Kind::kPartialShard:
      return k_ == kPerHost ? "P(host)" : "P(" + std::to_string(k_) + ")";
  }
  return "?";
}

Placement Placement::parse(const std::string& text) {
  const std::string t = lower_trimmed(text);
  if (t == "r" || t == "replicate") return replicate();
  if (t == "s" || t == "shard") return shard();
  if (!t.empty() && t[0] == 'p') {
    std::string digits = t.substr(1);
    if (digits.size() >= 2 && digits.front() == '(' && digits.back() == ')')
      digits = digits.substr(1, digits.size() - 2);
    if (digits == "host") return partial_shard(kPerHost);
    return partial_shard(parse_positive(digits, text));
  }
  TORCH_CHECK(false, "sharding: unknown placement '", text, "'; use R (replicate), S (shard) or P(k) (partial shard)");
}

ShardingSpec ShardingSpec::ddp() { return {Placement::replicate(), Placement::replicate(), Placement::replicate()}; }
ShardingSpec ShardingSpec::zero1() { return {Placement::replicate(), Placement::replicate(), Placement::shard()}; }
ShardingSpec ShardingSpec::zero2() { return {Placement::replicate(), Placement::shard(), Placement::shard()}; }
ShardingSpec ShardingSpec::zero3() { return {Placement::shard(), Placement::shard(), Placement::shard()}; }
ShardingSpec ShardingSpec::mics(int k) {
  return {Placement::partial_shard(k), Placement::partial_shard(k), Placement::partial_shard(k)};
}
ShardingSpec ShardingSpec::hpz(int k) { return {Placement::partial_shard(k), Placement::shard(), Placement::shard()}; }

ShardingSpec ShardingSpec::parse(const std::string& text) {
  const std::string t = lower_trimmed(text);
  if (t == "ddp") return ddp();
  if (t == "zero1") return zero1();
  if (t == "zero2") return zero2();
  if (t == "zero3" || t == "fsdp") return zero3();
  if (t == "mics" || t == "hsdp") return mics(Placement::kPerHost);
  if (t == "hpz") return hpz(Placement::kPerHost);
  const auto colon = t.find(':');
  if (colon != std::string::npos) {
    const std::string name = t.substr(0, colon);
    const std::string after = t.substr(colon + 1);
    const int k = after == "host" ? Placement::kPerHost : parse_positive(after, text);
    if (name == "mics" || name == "hsdp") return mics(k);
    if (name == "hpz") return hpz(k);
  }
  std::string body = t;
  if (body.size() >= 2 && body.front() == '{' && body.back() == '}') body = body.substr(1, body.size() - 2);
  std::vector<std::string> parts;
  size_t start = 0;
  int depth = 0;
  for (size_t i = 0; i <= body.size(); ++i) {
    if (i < body.size() && body[i] == '(') ++depth;
    if (i < body.size() && body[i] == ')') --depth;
    if (i == body.size() || (body[i] == ',' && depth == 0)) {
      parts.push_back(body.substr(start, i - start));
      start = i + 1;
    }
  }
  TORCH_CHECK(parts.size() == 3, "sharding: cannot read '", text,
              "'; use a preset (ddp, zero1, zero2, zero3, fsdp, mics[:k], hsdp[:k], hpz[:k]) or three placements such "
              "as {R,S,S}, {P(2),S,S} or {P(host),S,S} for parameters, gradients and optimizer states");
  return {Placement::parse(parts[0]), Placement::parse(parts[1]), Placement::parse(parts[2])};
}

ShardingSpec ShardingSpec::on_hosts(int ranks_per_host) const {
  TORCH_CHECK(ranks_per_host >= 1, "sharding spec ", to_string(), ": the ranks per host must be >= 1, got ",
              ranks_per_host);
  ShardingSpec out = *this;
  for (Placement* p : {&out.params, &out.grads, &out.optim_states})
    if (p->per_host()) *p = Placement::partial_shard(ranks_per_host);
  return out;
}

ShardDegrees ShardingSpec::resolve(int dp) const {
  TORCH_CHECK(dp >= 1, "sharding: the data-parallel size must be >= 1, got ", dp);
  TORCH_CHECK(!per_host(), "sharding spec ", to_string(),
              " shards inside a host, and the data group's ranks per host are not known here; ShardedModule and "
              "train_gpt find them from the hosts the group spans, elsewhere call ShardingSpec::on_hosts(ranks per "
              "host) first");
  const ShardDegrees d{params.degree(dp), grads.degree(dp), optim_states.degree(dp)};
  const std::pair<const char*, const Placement*> states[] = {
      {"parameters", &params}, {"gradients", &grads}, {"optimizer states", &optim_states}};
  for (const auto& s : states) {
    const int k = s.second->degree(dp);
    TORCH_CHECK(k >= 1 && k <= dp && dp % k == 0, "sharding spec ", to_string(), ": the ", s.first, " placement ",
                s.second->to_string(), " shards over ", k, " ranks, which does not divide the data-parallel size ", dp,
                "; choose k among the divisors of ", dp);
  }
  TORCH_CHECK(d.params <= d.grads && d.grads <= d.optim, "sharding spec ", to_string(),
              " breaks the rule shard(params) <= shard(grads) <= shard(optimizer states): degrees ", d.params, ", ",
              d.grads, ", ", d.optim, " at data-parallel size ", dp,
              "; a state may be sharded at most as finely as the states computed from it");
  TORCH_CHECK(d.grads % d.params == 0 && d.optim % d.grads == 0, "sharding spec ", to_string(), ": degrees ", d.params,
              ", ", d.grads, ", ", d.optim, " at data-parallel size ", dp,
              " must each divide the next so that every shard lies inside the coarser one; pick k that divide each "
              "other");
  return d;
}

std::string ShardingSpec::to_string() const {
  std::string out = "{";
  out += params.to_string();
  out += ',';
  out += grads.to_string();
  out += ',';
  out += optim_states.to_string();
  out += '}';
  return out;
}

}  // namespace parallel
}  // namespace tessera
