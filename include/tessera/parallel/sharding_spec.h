#pragma once
// Where each model state lives across the data-parallel group (AMSP): the
// parameters, the gradients and the optimizer states each choose Replicate,
// Shard (over the whole data group) or PartialShard(k) (shard inside groups of
// k data ranks, replicate across them; k may be "the data group's ranks on
// one host", P(host), resolved where the hosts are known). See
// docs/data-parallel.md.
#include <string>

namespace tessera {
namespace parallel {

class Placement {
 public:
  enum class Kind { kReplicate, kShard, kPartialShard };

  static Placement replicate() { return Placement(Kind::kReplicate, 1); }
  static Placement shard() { return Placement(Kind::kShard, 0); }
  // k of P(host): the data group's ranks on one host, unknown until on_hosts.
  static constexpr int kPerHost = -1;

  static Placement partial_shard(int k);  // k >= 1 or kPerHost

  Kind kind() const { return kind_; }
  // k of PartialShard(k); 1 for Replicate, 0 for Shard (= the data size),
  // kPerHost for P(host).
  int k() const { return k_; }
  bool per_host() const { return kind_ == Kind::kPartialShard && k_ == kPerHost; }
  // How many ranks one copy is split over at data-parallel size dp (P(host):
  // kPerHost, which resolve refuses).
  int degree(int dp) const { return kind_ == Kind::kShard ? dp : k_; }
  // "R", "S", "P(k)", "P(host)".
  std::string to_string() const;
  // Accepts "R", "S", "P(k)", "Pk", "P(host)" and the words replicate, shard.
  static Placement parse(const std::string& text);

  bool operator==(const Placement& other) const { return kind_ == other.kind_ && k_ == other.k_; }
  bool operator!=(const Placement& other) const { return !(*this == other); }

 private:
  Placement(Kind kind, int k) : kind_(kind), k_(k) {}
  Kind kind_;
  int k_;
};

struct ShardDegrees {
  int params = 1;
  int grads = 1;
  int optim = 1;
};

struct ShardingSpec {
  Placement params = Placement::replicate();
  Placement grads = Placement::replicate();
  Placement optim_states = Placement::replicate();

  // Presets (docs/data-parallel.md says what each moves and holds).
  static ShardingSpec ddp();
  static ShardingSpec zero1();
  static ShardingSpec zero2();
  static ShardingSpec zero3();
  // k = Placement::kPerHost: the data group's ranks on one host (AMSP's
  // and MiCS's choice; on one host, the whole group).
  static ShardingSpec mics(int k);  // also HSDP: {P(k), P(k), P(k)}
  static ShardingSpec hpz(int k);   // ZeRO++ hpZ-like: {P(k), S, S}

  // A preset name ("ddp", "zero1", "zero2", "zero3", "fsdp", "mics:k",
  // "hsdp:k", "hpz:k"; "mics", "hsdp" and "hpz" alone take k = P(host)) or
  // three placements "{R,S,S}" / "R,P(2),S" / "P(host),S,S".
  static ShardingSpec parse(const std::string& text);

  // Whether a placement is P(host), which resolve cannot lay out until
  // on_hosts gives the ranks per host.
  bool per_host() const { return params.per_host() || grads.per_host() || optim_states.per_host(); }
  // This spec with P(host) replaced by P(ranks_per_host): the data group's
  // ranks on each host, each host's ranks a contiguous block of the group
  // (parallel::spec_on_hosts checks that and finds the number).
  ShardingSpec on_hosts(int ranks_per_host) const;

  // Checks the rules against data-parallel size dp and returns the degrees.
  // Throws, naming the values and the rule, if
  //  - a placement is P(host) (call on_hosts first),
  //  - a degree does not divide dp (or P(k) has k < 1 or k > dp),
  //  - params ≤ grads ≤ optimizer states is broken (AMSP's rule: a state is
  //    never sharded finer than the states derived from it),
  //  - one degree does not divide the next (the nested shard layout needs it).
  ShardDegrees resolve(int dp) const;

  // "{R,S,S}".
  std::string to_string() const;
  bool operator==(const ShardingSpec& other) const {
    return params == other.params && grads == other.grads && optim_states == other.optim_states;
  }
};

}  // namespace parallel
}  // namespace tessera
