#pragma once
// A global batch size that changes in steps over training, for
// ElasticTrainer::adapt (docs/elastic.md): "0:512,100:1024,200:4096" is 512
// rows from 0, 1024 from 100 and 4096 from 200 on. The keys are whatever
// the caller counts (steps, epochs); a warm-up ramp is written as its steps.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace tessera {
namespace train {

class BatchSchedule {
 public:
  // One batch for every key.
  static BatchSchedule constant(int64_t batch);
  // "K:B,K:B,...": the first key 0, keys increasing, batches >= 1; throws
  // naming the part that breaks a rule.
  static BatchSchedule parse(const std::string& text);

  // The batch in force at `key` (the last change at or before it).
  int64_t at(int64_t key) const;
  int64_t largest() const;
  const std::vector<std::pair<int64_t, int64_t>>& changes() const { return changes_; }
  // The text parse() reads back.
  std::string to_string() const;

 private:
  std::vector<std::pair<int64_t, int64_t>> changes_;  // (key, batch), keys increasing
};

}  // namespace train
}  // namespace tessera
