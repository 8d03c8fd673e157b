#include "tessera/context/hosts.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <map>

namespace tessera {
namespace context {
namespace {

std::string host_name() {
  char name[HOST_NAME_MAX + 1] = {0};
  TORCH_CHECK(gethostname(name, sizeof(name) - 1) == 0, "gethostname failed: cannot tell which ranks share a host");
  return name;
}

}  // namespace

int HostMap::hosts() const {
  return host_of_rank.empty() ? 0 : *std::max_element(host_of_rank.begin(), host_of_rank.end()) + 1;
}

int HostMap::ranks_on(int host) const {
  return static_cast<int>(std::count(host_of_rank.begin(), host_of_rank.end(), host));
}

int HostMap::fewest_ranks_per_host() const {
  int fewest = static_cast<int>(host_of_rank.size());
  for (int h = 0; h < hosts(); ++h) fewest = std::min(fewest, ranks_on(h));
  return fewest;
}

std::string HostMap::describe() const {
  if (hosts() == 1) return fmt::format("1 host ({})", names.at(0));
  std::string out = fmt::format("{} hosts:", hosts());
  for (int h = 0; h < hosts(); ++h) {
    // Ranks of host h as ranges: "0-1,4".
    std::string ranks;
    const int n = static_cast<int>(host_of_rank.size());
    for (int r = 0; r < n; ++r) {
      if (host_of_rank[r] != h) continue;
      int last = r;
      while (last + 1 < n && host_of_rank[last + 1] == h) ++last;
      ranks += (ranks.empty() ? "" : ",") + (last > r ? fmt::format("{}-{}", r, last) : std::to_string(r));
      r = last;
    }
    out += fmt::format("{} {} ranks {}", h == 0 ? "" : ",", names[h], ranks);
  }
  return out;
}

bool host_reductions_from_env() {
  const char* v = std::getenv("TESSERA_HOST_REDUCTIONS");
  if (v == nullptr || *v == '\0') return true;
  const std::string s(v);
  TORCH_CHECK(s == "hierarchical" || s == "flat", "TESSERA_HOST_REDUCTIONS='", s,
              "' is not a choice: 'hierarchical' (data-parallel all-reduces inside each host, then across hosts; "
              "the default) or 'flat'");
  return s == "hierarchical";
}

HostMap map_hosts(comm::Communicator& world) {
  const std::vector<std::string> all = comm::all_gather_strings(world, host_name());
  HostMap map;
  std::map<std::string, int> index;
  for (const std::string& name : all) {
    auto [it, added] = index.emplace(name, static_cast<int>(index.size()));
    if (added) map.names.push_back(name);
    map.host_of_rank.push_back(it->second);
  }
  return map;
}

}  // namespace context
}  // namespace tessera
