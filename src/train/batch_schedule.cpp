#include "tessera/train/batch_schedule.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <sstream>

namespace tessera {
namespace train {

namespace {

int64_t parse_int(const std::string& word, const std::string& part, const std::string& text) {
  size_t used = 0;
  int64_t v = 0;
  try {
    v = std::stoll(word, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  TORCH_CHECK(!word.empty() && used == word.size(), "batch schedule '", text, "': '", part,
              "' is not KEY:BATCH with two integers (for example \"0:512,100:1024\")");
  return v;
}

}  // namespace

BatchSchedule BatchSchedule::constant(int64_t batch) {
  TORCH_CHECK(batch >= 1, "BatchSchedule: the batch must be >= 1, got ", batch);
  BatchSchedule s;
  s.changes_.emplace_back(0, batch);
  return s;
}

BatchSchedule BatchSchedule::parse(const std::string& text) {
  BatchSchedule s;
  std::stringstream in(text);
  std::string part;
  while (std::getline(in, part, ',')) {
    const size_t colon = part.find(':');
    TORCH_CHECK(colon != std::string::npos, "batch schedule '", text, "': '", part,
                "' has no ':'; write KEY:BATCH pairs separated by commas (for example \"0:512,100:1024\")");
    const int64_t key = parse_int(part.substr(0, colon), part, text);
    const int64_t batch = parse_int(part.substr(colon + 1), part, text);
    TORCH_CHECK(batch >= 1, "batch schedule '", text, "': the batch in '", part, "' must be >= 1");
    if (s.changes_.empty()) {
      TORCH_CHECK(key == 0, "batch schedule '", text, "': the first key must be 0 (the batch from the start), got ",
                  key);
    } else {
      TORCH_CHECK(key > s.changes_.back().first, "batch schedule '", text, "': keys must increase, but ", key,
                  " follows ", s.changes_.back().first);
    }
    s.changes_.emplace_back(key, batch);
  }
  TORCH_CHECK(!s.changes_.empty(), "batch schedule '", text, "' is empty; write KEY:BATCH pairs such as \"0:512\"");
  return s;
}

int64_t BatchSchedule::at(int64_t key) const {
  TORCH_CHECK(key >= 0, "BatchSchedule::at: the key must be >= 0, got ", key);
  auto it = std::upper_bound(changes_.begin(), changes_.end(), key,
                             [](int64_t k, const std::pair<int64_t, int64_t>& c) { return k < c.first; });
  return std::prev(it)->second;
}

int64_t BatchSchedule::largest() const {
  int64_t most = 0;
  for (const auto& c : changes_) most = std::max(most, c.second);
  return most;
}

std::string BatchSchedule::to_string() const {
  std::ostringstream out;
  for (size_t i = 0; i < changes_.size(); ++i) out << (i ? "," : "") << changes_[i].first << ':' << changes_[i].second;
  return out.str();
}

}  // namespace train
}  // namespace tessera
