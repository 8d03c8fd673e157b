// The text formats users write: the first byte picks one, the rest is the
// text. ParallelConfig JSON (--config), sharding specs (--spec), pipeline
// schedules, batch schedules (--batch-schedule), grid orders, tensor and
// sequence modes, cluster descriptions (--cluster FILE.json), Hugging Face
// config.json, and comm_bench JSON lines.
#include "fuzz_input.h"

#include "tessera/context/parallel_config.h"
#include "tessera/models/huggingface.h"
#include "tessera/parallel/pipeline_schedule.h"
#include "tessera/parallel/sharding_spec.h"
#include "tessera/planner/cluster.h"
#include "tessera/train/batch_schedule.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tessera;
  if (size == 0) return 0;
  const std::string t = fuzz::text(data + 1, size - 1);
  switch (data[0] % 9) {
    case 0:
      return fuzz::run([&] { context::config_from_json(t); });
    case 1:
      return fuzz::run([&] {
        const auto spec = parallel::ShardingSpec::parse(t);
        for (int dp : {1, 2, 4, 6, 8}) {
          try {
            spec.resolve(dp);
          } catch (const c10::Error&) {
          }
        }
        spec.to_string();
      });
    case 2:
      return fuzz::run([&] { parallel::parse_schedule_kind(t); });
    case 3:
      return fuzz::run([&] {
        const auto s = train::BatchSchedule::parse(t);
        s.at(0), s.at(1000000), s.largest(), s.to_string();
      });
    case 4:
      return fuzz::run([&] { context::parse_order(t); });
    case 5:
      return fuzz::run([&] {
        context::parse_tensor_mode(t);
      });
    case 6:
      return fuzz::run([&] { planner::ClusterDesc::from_json(t).to_json(); });
    case 7:
      return fuzz::run([&] { models::hf_config_from_json(t, "config.json"); });
    default:
      return fuzz::run([&] { planner::ClusterDesc::from_comm_bench(t, planner::ClusterDesc()); });
  }
}
