#include "tessera/context/hosts.h"

#include <ATen/ATen.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <map>

namespace tessera {
namespace context {
namespace {

std::string host_name() {
  char name[HOST_NAME_MAX + 1] = {0};
  TORCH_CHECK(gethostname(name, sizeof(name) - 1) == 0, "gethostname failed: cannot tell which ranks share a host");
  return name;
}

// FNV-1a, the same in every process.
int64_t hash_of(const std::string& text) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : text) {
    h ^= c;
    h *= 0x100000001b3ULL;
  }
  return static_cast<int64_t>(h & 0x7fffffffffffffffULL);
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

HostMap map_hosts(comm::Communicator& world) {
  auto control = world.control();
  at::Tensor mine = at::full({1}, hash_of(host_name()), at::kLong);
  at::Tensor all = at::empty({control->size()}, at::kLong);
  control->all_gather(all, mine)->wait();
  HostMap map;
  std::map<int64_t, int> index;
  const int64_t* h = all.data_ptr<int64_t>();
  for (int r = 0; r < control->size(); ++r) {
    auto it = index.emplace(h[r], static_cast<int>(index.size())).first;
    map.host_of_rank.push_back(it->second);
  }
  return map;
}

}  // namespace context
}  // namespace tessera
