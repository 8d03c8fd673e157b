// ParallelConfig: names, resolve() rules and their messages, flags, JSON;
// and launch detection, which is the rest of start-up.
#include "tessera/context/launch.h"
#include "tessera/context/parallel_config.h"

#include "test_util.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

namespace tessera {
namespace context {
namespace {

ParallelConfig from_args(std::vector<const char*> args) {
  args.insert(args.begin(), "prog");
  return config_from_args(static_cast<int>(args.size()), args.data());
}

TEST(ParallelConfigNames, RoundTrip) {
  for (TensorMode m : {TensorMode::k1D, TensorMode::k2D, TensorMode::k2p5D, TensorMode::k3D}) {
    EXPECT_EQ(parse_tensor_mode(tensor_mode_name(m)), m);
  }
  EXPECT_EQ(tensor_mode_name(TensorMode::k2p5D), "2.5d");
  EXPECT_EQ(parse_tensor_mode("2D"), TensorMode::k2D);
  for (SequenceMode m : {SequenceMode::kUlysses, SequenceMode::kRing, SequenceMode::kRsa, SequenceMode::kHybrid}) {
    EXPECT_EQ(parse_sequence_mode(sequence_mode_name(m)), m);
  }
  EXPECT_ERROR_CONTAINS(parse_tensor_mode("4d"), "unknown tensor mode '4d'", "1d, 2d, 2.5d, 3d");
  EXPECT_ERROR_CONTAINS(parse_sequence_mode("megatron"), "unknown sequence mode 'megatron'", "ulysses, ring");
}

TEST(ParallelConfig, DefaultsAndBuilder) {
  const ParallelConfig defaults;
  EXPECT_EQ(defaults.data(), 0);
  EXPECT_EQ(defaults.pipeline(), 1);
  EXPECT_EQ(defaults.tensor(), 1);
  EXPECT_EQ(defaults.tensor_mode(), TensorMode::k1D);
  EXPECT_EQ(defaults.tensor_depth(), 1);
  EXPECT_EQ(defaults.sequence(), 1);
  EXPECT_EQ(defaults.sequence_mode(), SequenceMode::kUlysses);
  EXPECT_EQ(defaults.expert(), 1);
  EXPECT_EQ(defaults.order(), "tp-sp-dp-pp");
  EXPECT_EQ(defaults.seed(), 42u);

  const ParallelConfig c = ParallelConfig().data(2).tensor(4).tensor_mode(TensorMode::k2D);
  EXPECT_EQ(c.data(), 2);
  EXPECT_EQ(c.tensor(), 4);
  EXPECT_EQ(c.size(Dim::kTensor), 4);
  EXPECT_EQ(to_string(defaults), "dp=auto pp=1 tp=1(1d) sp=1(ulysses) ep=1 order=tp-sp-dp-pp seed=42");
  EXPECT_EQ(to_string(resolve(ParallelConfig().pipeline(2).tensor(2), 8)),
            "dp=2 pp=2 tp=2(1d) sp=1(ulysses) ep=1 order=tp-sp-dp-pp seed=42");
  EXPECT_EQ(to_string(ParallelConfig()
                          .data(1)
                          .tensor(8)
                          .tensor_mode(TensorMode::k2p5D)
                          .tensor_depth(2)
                          .sequence_mode(SequenceMode::kRing)),
            "dp=1 pp=1 tp=8(2.5d,depth=2) sp=1(ring) ep=1 order=tp-sp-dp-pp seed=42");
}

TEST(ParallelConfigResolve, DerivesOrChecksData) {
  EXPECT_EQ(resolve(ParallelConfig().tensor(2).pipeline(2), 8).data(), 2);
  EXPECT_EQ(resolve(ParallelConfig(), 5).data(), 5);
  const ParallelConfig explicit_data = ParallelConfig().data(4).tensor(2);
  EXPECT_EQ(resolve(explicit_data, 8), explicit_data);
  EXPECT_EQ(resolve(ParallelConfig().tensor(8).tensor_mode(TensorMode::k2p5D).tensor_depth(2), 8).data(), 1);
  EXPECT_EQ(resolve(ParallelConfig().tensor(4).tensor_mode(TensorMode::k2p5D), 4).data(), 1);
  EXPECT_EQ(resolve(ParallelConfig().tensor(27).tensor_mode(TensorMode::k3D), 54).data(), 2);
  EXPECT_EQ(resolve(ParallelConfig().tensor(1).tensor_mode(TensorMode::k2D), 3).data(), 3);
  EXPECT_EQ(resolve(ParallelConfig().expert(4), 8).data(), 8);
}

TEST(ParallelConfigResolve, WorldMustBeTheProduct) {
  EXPECT_ERROR_CONTAINS(resolve(ParallelConfig().data(2).tensor(2), 8), "world size 8", "does not equal",
                        "2*1*2*1 = 4");
  EXPECT_ERROR_CONTAINS(resolve(ParallelConfig().tensor(3), 8), "world size 8",
                        "not divisible by pipeline*tensor*sequence = 3");
  EXPECT_ERROR_CONTAINS(resolve(ParallelConfig(), 0), "world size 0");
}

TEST(ParallelConfigResolve, SizesMustBePositive) {
  EXPECT_ERROR_CONTAINS(resolve(ParallelConfig().pipeline(0), 4), "pipeline size 0", "at least 1");
  EXPECT_ERROR_CONTAINS(resolve(ParallelConfig().tensor(-2), 4), "tensor size -2");
  EXPECT_ERROR_CONTAINS(resolve(ParallelConfig().sequence(0), 4), "sequence size 0");
  EXPECT_ERROR_CONTAINS(resolve(ParallelConfig().expert(0), 4), "expert size 0");
  EXPECT_ERROR_CONTAINS(resolve(ParallelConfig().data(-1), 4), "data size -1");
}

TEST(ParallelConfigResolve, TensorModeShapes) {
  EXPECT_ERROR_CONTAINS(resolve(ParallelConfig().tensor(8).tensor_mode(TensorMode::k2D), 8),
                        "tensor size 8 is not a perfect square, which tensor mode 2d requires");
  EXPECT_ERROR_CONTAINS(resolve(ParallelConfig().tensor(4).tensor_mode(TensorMode::k3D), 4),
                        "tensor size 4 is not a perfect cube, which tensor mode 3d requires");
  EXPECT_ERROR_CONTAINS(resolve(ParallelConfig().tensor(8).tensor_mode(TensorMode::k2p5D).tensor_depth(3), 8),
                        "tensor size 8 is not divisible by tensor depth 3", "2.5d");
  EXPECT_ERROR_CONTAINS(resolve(ParallelConfig().tensor(12).tensor_mode(TensorMode::k2p5D).tensor_depth(2), 12),
                        "tensor size 12 divided by tensor depth 2 is 6", "not a perfect square", "2.5d");
  EXPECT_ERROR_CONTAINS(resolve(ParallelConfig().tensor(8).tensor_mode(TensorMode::k2p5D).tensor_depth(0), 8),
                        "tensor depth 0", "at least 1");
  EXPECT_ERROR_CONTAINS(resolve(ParallelConfig().tensor(4).tensor_mode(TensorMode::k2D).tensor_depth(2), 4),
                        "tensor depth 2", "tensor mode 2d", "only tensor mode 2.5d");
  EXPECT_ERROR_CONTAINS(resolve(ParallelConfig().tensor(2).tensor_depth(2), 2), "tensor depth 2", "tensor mode 1d");
}

TEST(ParallelConfigResolve, ExpertMustDivideData) {
  EXPECT_ERROR_CONTAINS(resolve(ParallelConfig().data(4).expert(3), 4), "expert size 3 does not divide data size 4");
  EXPECT_ERROR_CONTAINS(resolve(ParallelConfig().tensor(2).expert(3), 8), "expert size 3 does not divide data size 4");
}

// Hybrid: 1 < ulysses < sequence, dividing it; no Ulysses size elsewhere.
TEST(ParallelConfigResolve, HybridUlyssesSize) {
  const ParallelConfig hybrid = ParallelConfig().sequence(4).sequence_mode(SequenceMode::kHybrid);
  EXPECT_EQ(resolve(ParallelConfig(hybrid).sequence_ulysses(2), 8).data(), 2);
  EXPECT_EQ(to_string(ParallelConfig(hybrid).sequence_ulysses(2).sequence_split(SequenceSplit::kZigzag)),
            "dp=auto pp=1 tp=1(1d) sp=4(hybrid,ulysses=2,zigzag) ep=1 order=tp-sp-dp-pp seed=42");
  EXPECT_ERROR_CONTAINS(resolve(hybrid, 4), "sequence ulysses size 1 does not fit sequence size 4",
                        "1 < ulysses < sequence", "mode ring for ulysses 1");
  EXPECT_ERROR_CONTAINS(resolve(ParallelConfig(hybrid).sequence_ulysses(4), 4), "ulysses size 4 does not fit",
                        "mode ulysses for ulysses = sequence");
  EXPECT_ERROR_CONTAINS(resolve(ParallelConfig(hybrid).sequence(6).sequence_ulysses(4), 6),
                        "ulysses size 4 does not fit sequence size 6", "dividing it");
  EXPECT_ERROR_CONTAINS(resolve(ParallelConfig().sequence(4).sequence_mode(SequenceMode::kRing).sequence_ulysses(2), 4),
                        "sequence ulysses size 2 is set but sequence mode ring", "only sequence mode hybrid");
  EXPECT_EQ(resolve(ParallelConfig().sequence_mode(SequenceMode::kHybrid), 2).data(), 2) << "sp 1: nothing to split";
}

TEST(ParallelConfigResolve, OrderIsAPermutation) {
  EXPECT_EQ(parse_order("pp-dp-sp-tp"), (std::vector<Dim>{Dim::kPipeline, Dim::kData, Dim::kSequence, Dim::kTensor}));
  EXPECT_ERROR_CONTAINS(resolve(ParallelConfig().order("tp-sp-dp"), 1), "order 'tp-sp-dp' is missing dimension 'pp'",
                        "tp, sp, dp, pp");
  EXPECT_ERROR_CONTAINS(resolve(ParallelConfig().order("tp-tp-dp-pp"), 1), "repeats dimension 'tp'", "exactly once");
  EXPECT_ERROR_CONTAINS(resolve(ParallelConfig().order("tp-sp-dp-xx"), 1), "unknown dimension 'xx'", "tp, sp, dp, pp");
  EXPECT_ERROR_CONTAINS(resolve(ParallelConfig().order("tp-sp-dp-pp-ep"), 1), "unknown dimension 'ep'");
  EXPECT_ERROR_CONTAINS(resolve(ParallelConfig().order("tp,sp,dp,pp"), 1), "unknown dimension 'tp,sp,dp,pp'");
  EXPECT_ERROR_CONTAINS(resolve(ParallelConfig().order("tp-sp-dp-pp-"), 1), "empty dimension");
  EXPECT_ERROR_CONTAINS(resolve(ParallelConfig().order(""), 1), "missing dimension 'tp'");
}

TEST(ParallelConfigFlags, ReadsEveryFlag) {
  const ParallelConfig c =
      from_args({"--dp", "2",       "--pp=3",           "--tp",       "8",      "--tp-mode",    "2.5d", "--tp-depth=2",
                 "--sp", "4",       "--sp-mode=hybrid", "--sp-split", "zigzag", "--sp-ulysses", "2",    "--ep",
                 "2",    "--order", "dp-tp-sp-pp",      "--seed",     "7"});
  const ParallelConfig expected = ParallelConfig()
                                      .data(2)
                                      .pipeline(3)
                                      .tensor(8)
                                      .tensor_mode(TensorMode::k2p5D)
                                      .tensor_depth(2)
                                      .sequence(4)
                                      .sequence_mode(SequenceMode::kHybrid)
                                      .sequence_split(SequenceSplit::kZigzag)
                                      .sequence_ulysses(2)
                                      .expert(2)
                                      .order("dp-tp-sp-pp")
                                      .seed(7);
  EXPECT_EQ(c, expected) << to_string(c);
}

TEST(ParallelConfigFlags, IgnoresOtherArguments) {
  const ParallelConfig c =
      from_args({"train.bin", "--lr", "0.1", "--tp", "2", "--verbose", "--batch=32", "-x", "--", "--dp", "99"});
  EXPECT_EQ(c, ParallelConfig().tensor(2));
  EXPECT_EQ(from_args({}), ParallelConfig());
  // Over a base config: only the given flags change.
  const char* argv[] = {"prog", "--pp", "2"};
  EXPECT_EQ(config_from_args(3, argv, ParallelConfig().tensor(4).seed(9)),
            ParallelConfig().tensor(4).seed(9).pipeline(2));
}

TEST(ParallelConfigFlags, RejectsBadValues) {
  EXPECT_ERROR_CONTAINS(from_args({"--tp"}), "flag --tp is missing its value");
  EXPECT_ERROR_CONTAINS(from_args({"--tp", "--dp", "2"}), "flag --tp is missing its value");
  EXPECT_ERROR_CONTAINS(from_args({"--order="}), "flag --order is missing its value");
  EXPECT_ERROR_CONTAINS(from_args({"--dp", "two"}), "flag --dp expects an integer, got 'two'");
  EXPECT_ERROR_CONTAINS(from_args({"--pp=2x"}), "flag --pp expects an integer, got '2x'");
  EXPECT_ERROR_CONTAINS(from_args({"--tp", "1.5"}), "got '1.5'");
  EXPECT_ERROR_CONTAINS(from_args({"--ep", "99999999999"}), "flag --ep expects an integer");
  EXPECT_ERROR_CONTAINS(from_args({"--seed", "-1"}), "flag --seed expects a non-negative integer");
  EXPECT_ERROR_CONTAINS(from_args({"--tp-mode", "4d"}), "unknown tensor mode '4d'");
  EXPECT_ERROR_CONTAINS(from_args({"--sp-mode=zigzag"}), "unknown sequence mode 'zigzag'");
  // Negative sizes parse; resolve() rejects them with the rule.
  EXPECT_ERROR_CONTAINS(resolve(from_args({"--pp", "-1"}), 4), "pipeline size -1");
}

TEST(ParallelConfigJson, ReadsEveryKey) {
  const ParallelConfig c = config_from_json(R"({
      "data": 2, "pipeline": 3,
      "tensor": {"size": 8, "mode": "2.5d", "depth": 2},
      "sequence": {"size": 4, "mode": "hybrid", "split": "zigzag", "ulysses": 2},
      "expert": 2, "order": "dp-tp-sp-pp", "seed": 18446744073709551615})");
  const ParallelConfig expected = ParallelConfig()
                                      .data(2)
                                      .pipeline(3)
                                      .tensor(8)
                                      .tensor_mode(TensorMode::k2p5D)
                                      .tensor_depth(2)
                                      .sequence(4)
                                      .sequence_mode(SequenceMode::kHybrid)
                                      .sequence_split(SequenceSplit::kZigzag)
                                      .sequence_ulysses(2)
                                      .expert(2)
                                      .order("dp-tp-sp-pp")
                                      .seed(18446744073709551615ULL);
  EXPECT_EQ(c, expected) << to_string(c);
  EXPECT_EQ(config_from_json(R"({"tensor": 4, "sequence": 2})"), ParallelConfig().tensor(4).sequence(2));
  EXPECT_EQ(config_from_json("{}"), ParallelConfig());
  EXPECT_EQ(config_from_json(R"({"tensor": {"mode": "3d"}})"), ParallelConfig().tensor_mode(TensorMode::k3D));
}

TEST(ParallelConfigJson, RejectsUnknownKeysAndBadValues) {
  EXPECT_ERROR_CONTAINS(config_from_json(R"({"pipline": 2})"), "unknown parallel config key 'pipline'", "pipeline");
  EXPECT_ERROR_CONTAINS(config_from_json(R"({"tensor": {"sise": 2}})"), "unknown parallel config key 'tensor.sise'");
  EXPECT_ERROR_CONTAINS(config_from_json(R"({"sequence": {"depth": 2}})"), "'sequence.depth'");
  EXPECT_ERROR_CONTAINS(config_from_json(R"({"data": "2"})"), "key 'data' must be an integer");
  EXPECT_ERROR_CONTAINS(config_from_json(R"({"data": 2.5})"), "key 'data' must be an integer");
  EXPECT_ERROR_CONTAINS(config_from_json(R"({"expert": 4294967296})"), "'expert' is out of range");
  EXPECT_ERROR_CONTAINS(config_from_json(R"({"seed": -3})"), "'seed' must be a non-negative");
  EXPECT_ERROR_CONTAINS(config_from_json(R"({"order": 5})"), "key 'order' must be a string");
  EXPECT_ERROR_CONTAINS(config_from_json(R"({"tensor": {"mode": "2.75d"}})"), "unknown tensor mode '2.75d'");
  EXPECT_ERROR_CONTAINS(config_from_json(R"({"tensor": "big"})"), "key 'tensor' must be an integer");
  EXPECT_ERROR_CONTAINS(config_from_json("[1, 2]"), "must be a JSON object");
  EXPECT_ERROR_CONTAINS(config_from_json("{\"data\": "), "not valid JSON");
}

TEST(ParallelConfigJson, ReadsFiles) {
  const std::string path = ::testing::TempDir() + "tessera_parallel_config_test.json";
  {
    std::ofstream out(path);
    out << R"({"tensor": {"size": 4, "mode": "2d"}, "pipeline": 2})";
  }
  EXPECT_EQ(config_from_json_file(path), ParallelConfig().tensor(4).tensor_mode(TensorMode::k2D).pipeline(2));
  {
    std::ofstream out(path);
    out << R"({"tensor": {"size": 4, "modes": "2d"}})";
  }
  EXPECT_ERROR_CONTAINS(config_from_json_file(path), path.c_str(), "'tensor.modes'");
  std::remove(path.c_str());
  EXPECT_ERROR_CONTAINS(config_from_json_file(path), "cannot open parallel config file");
}

TEST(Launch, DefaultsWithoutLauncher) {
  const LaunchInfo info = detect_launch(std::map<std::string, std::string>{});
  EXPECT_EQ(info.local_rank, 0);
  EXPECT_EQ(info.local_size, 1);
  EXPECT_EQ(info.launcher, "none");
}

TEST(Launch, ReadsEachLauncher) {
  LaunchInfo info = detect_launch({{"OMPI_COMM_WORLD_LOCAL_RANK", "3"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}});
  EXPECT_EQ(info.launcher, "openmpi");
  EXPECT_EQ(info.local_rank, 3);
  EXPECT_EQ(info.local_size, 4);

  info = detect_launch({{"MPI_LOCALRANKID", "1"}, {"MPI_LOCALNRANKS", "2"}});
  EXPECT_EQ(info.launcher, "mpich");
  EXPECT_EQ(info.local_rank, 1);

  info = detect_launch({{"SLURM_LOCALID", "2"}, {"SLURM_NTASKS_PER_NODE", "8"}});
  EXPECT_EQ(info.launcher, "slurm");
  EXPECT_EQ(info.local_size, 8);

  // Node 3 of "4(x2),2(x2)" runs 2 tasks.
  info = detect_launch({{"SLURM_LOCALID", "1"}, {"SLURM_TASKS_PER_NODE", "4(x2),2(x2)"}, {"SLURM_NODEID", "3"}});
  EXPECT_EQ(info.local_size, 2);
  info = detect_launch({{"SLURM_LOCALID", "1"}, {"SLURM_TASKS_PER_NODE", "4(x2),2(x2)"}, {"SLURM_NODEID", "1"}});
  EXPECT_EQ(info.local_size, 4);

  info = detect_launch({{"LOCAL_RANK", "5"}, {"LOCAL_WORLD_SIZE", "8"}});
  EXPECT_EQ(info.launcher, "torchrun");
  EXPECT_EQ(info.local_rank, 5);
}

TEST(Launch, MpiWinsOverInheritedSlurm) {
  const LaunchInfo info = detect_launch({{"SLURM_LOCALID", "0"},
                                         {"SLURM_TASKS_PER_NODE", "1"},
                                         {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
                                         {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}});
  EXPECT_EQ(info.launcher, "openmpi");
  EXPECT_EQ(info.local_rank, 2);
}

TEST(Launch, RejectsBrokenEnvironments) {
  EXPECT_ERROR_CONTAINS(detect_launch({{"LOCAL_RANK", "1"}}), "LOCAL_RANK is set", "LOCAL_WORLD_SIZE is not");
  EXPECT_ERROR_CONTAINS(detect_launch({{"LOCAL_RANK", "x"}, {"LOCAL_WORLD_SIZE", "2"}}),
                        "LOCAL_RANK='x' is not a non-negative integer");
  EXPECT_ERROR_CONTAINS(detect_launch({{"MPI_LOCALRANKID", "4"}, {"MPI_LOCALNRANKS", "4"}}), "local rank 4",
                        "local size 4");
  EXPECT_ERROR_CONTAINS(detect_launch({{"SLURM_LOCALID", "0"}}), "SLURM_TASKS_PER_NODE");
  EXPECT_ERROR_CONTAINS(detect_launch({{"SLURM_LOCALID", "0"}, {"SLURM_TASKS_PER_NODE", "2"}, {"SLURM_NODEID", "1"}}),
                        "no entry for node 1");
}

TEST(Launch, PicksDevice) {
  LaunchInfo info;
  info.local_rank = 5;
  info.local_size = 8;
  EXPECT_EQ(pick_device(info, 0), c10::Device(c10::DeviceType::CPU));
  EXPECT_EQ(pick_device(info, 4), c10::Device(c10::DeviceType::CUDA, 1));
  EXPECT_EQ(pick_device(info, 8), c10::Device(c10::DeviceType::CUDA, 5));
  EXPECT_ERROR_CONTAINS(pick_device(info, -1), "CUDA device count -1");
}

}  // namespace
}  // namespace context
}  // namespace tessera
