// ShardedModule's layout decision (Note [Module layout]) in one process:
// groups that refuse every communication stand in for an 8-rank data group
// and a 2-rank replica group, so the decision is shown to need none.
#include "tessera/nn/placement.h"
#include "tessera/parallel/module_layout.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace tessera {
namespace parallel {
namespace {

// A group of `size` ranks that throws on any communication.
class NoTraffic : public comm::Communicator {
 public:
  NoTraffic(int size, std::string name) : size_(size), name_(std::move(name)) {}
  int rank() const override { return 0; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }
  std::string backend() const override { return "none"; }
  comm::WorkPtr all_reduce(at::Tensor&, const comm::AllReduceOptions&) override { return refuse(); }
  comm::WorkPtr broadcast(at::Tensor&, const comm::BroadcastOptions&) override { return refuse(); }
  comm::WorkPtr reduce(at::Tensor&, const comm::ReduceOptions&) override { return refuse(); }
  comm::WorkPtr all_gather(at::Tensor&, const at::Tensor&, const comm::AllGatherOptions&) override { return refuse(); }
  comm::WorkPtr reduce_scatter(at::Tensor&, const at::Tensor&, const comm::ReduceScatterOptions&) override {
    return refuse();
  }
  comm::WorkPtr all_to_all(at::Tensor&, const at::Tensor&, const comm::AllToAllOptions&) override { return refuse(); }
  comm::WorkPtr send(const at::Tensor&, int, const comm::SendOptions&) override { return refuse(); }
  comm::WorkPtr recv(at::Tensor&, int, const comm::RecvOptions&) override { return refuse(); }
  comm::WorkPtr barrier(const comm::BarrierOptions&) override { return refuse(); }
  comm::WorkPtr batch_isend_irecv(const std::vector<comm::P2POp>&) override { return refuse(); }
  bool sends_wait_for_receiver() const override { return false; }
  comm::CommunicatorPtr control() override { return nullptr; }
  comm::CommunicatorPtr split(int, int, const std::string&) override { return refuse(), nullptr; }

 private:
  comm::WorkPtr refuse() const {
    TORCH_CHECK(false, "communication on '", name_, "' while laying out a module");
  }
  int size_;
  std::string name_;
};

torch::nn::Sequential three_layers() {
  return torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::Linear(8, 8), torch::nn::Linear(8, 2));
}

std::vector<std::string> names(const PlannedBucket& b) {
  std::vector<std::string> out;
  for (const auto& s : b.slots) out.push_back(s.name);
  return out;
}

TEST(ModuleLayout, Zero3UnitsAreTheSequentialsChildrenInReverse) {
  auto data = std::make_shared<NoTraffic>(8, "data");
  auto net = three_layers();
  const ModuleLayout m = plan_module_layout(*net, data, nullptr, ShardedModuleOptions().spec(ShardingSpec::zero3()));
  ASSERT_EQ(m.layouts.size(), 1u);
  EXPECT_EQ(m.layouts[0].degrees.params, 8);
  EXPECT_TRUE(m.materialize);
  EXPECT_EQ(m.unit_names, (std::vector<std::string>{"0", "1", "2"}));
  EXPECT_FALSE(m.has_root_unit);
  ASSERT_EQ(m.buckets.size(), 3u);
  // Units reduce last to first; a bucket holds its unit in reverse registration order.
  EXPECT_EQ(m.unit_buckets[2], std::vector<size_t>{0});
  EXPECT_EQ(m.unit_buckets[0], std::vector<size_t>{2});
  EXPECT_EQ(names(m.buckets[0]), (std::vector<std::string>{"2.bias", "2.weight"}));
}

TEST(ModuleLayout, DdpBucketsAreCappedAndOneUnit) {
  auto data = std::make_shared<NoTraffic>(4, "data");
  auto net = three_layers();
  // 8·8 floats = 256 bytes: a cap of 300 bytes cuts before the second weight.
  const ModuleLayout m = plan_module_layout(*net, data, nullptr, ShardedModuleOptions().bucket_bytes(300));
  EXPECT_FALSE(m.materialize);
  EXPECT_EQ(m.unit_names, std::vector<std::string>{""});
  ASSERT_GE(m.buckets.size(), 2u);
  EXPECT_EQ(names(m.buckets[0]).front(), "2.bias");
  int64_t total = 0;
  for (const auto& b : m.buckets) total += static_cast<int64_t>(b.slots.size());
  EXPECT_EQ(total, 6);
}

TEST(ModuleLayout, ReplicaGroupsGetLayoutsOfTheirOwn) {
  auto data = std::make_shared<NoTraffic>(4, "data");
  auto experts = std::make_shared<NoTraffic>(2, "expert_data");
  auto net = three_layers();
  nn::NamedPlacements placements = nn::placements_of(*net, [](const at::Tensor& param) {
    nn::ParamPlacement p;
    p.param = param;
    p.full_shape = param.sizes().vec();
    return p;
  });
  for (auto& [name, p] : placements)
    if (name.rfind("1.", 0) == 0) p.replica_group = experts;  // layer 1 as an expert's
  const ModuleLayout m =
      plan_module_layout(*net, data, nullptr, ShardedModuleOptions().spec(ShardingSpec::zero2()).placements(placements));
  ASSERT_EQ(m.layouts.size(), 2u);
  EXPECT_EQ(m.layouts[1].group, experts);
  EXPECT_EQ(m.layouts[1].degrees.optim, 2);  // the spec over the replica group's 2 ranks
  for (const auto& b : m.buckets)
    for (const auto& s : b.slots) EXPECT_EQ(b.layout, s.name.rfind("1.", 0) == 0 ? 1u : 0u) << s.name;
  // The wrapper's own buckets come first (Note [Module layout]).
  EXPECT_EQ(m.buckets.front().layout, 0u);
  auto odd = std::make_shared<NoTraffic>(3, "odd");
  for (auto& [name, p] : placements)
    if (p.replica_group) p.replica_group = odd;
  EXPECT_ERROR_CONTAINS(plan_module_layout(*net, data, nullptr, ShardedModuleOptions().placements(placements)),
                        "replica group of 3 ranks, which does not divide the wrapper's group of 4");
  EXPECT_ERROR_CONTAINS(plan_module_layout(*net, data, nullptr, ShardedModuleOptions().units({"nope"})),
                        "unit 'nope' is not a submodule name");
}

}  // namespace
}  // namespace parallel
}  // namespace tessera
