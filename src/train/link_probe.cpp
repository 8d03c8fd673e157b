#include "tessera/train/link_probe.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>

namespace tessera {
namespace train {

LinkProbe name_slow_host(const std::vector<std::vector<double>>& pair_seconds, double factor) {
  const size_t h = pair_seconds.size();
  TORCH_CHECK(h >= 2, "link probe: needs two hosts or more, got ", h);
  TORCH_CHECK(std::isfinite(factor) && factor > 1, "link probe: the factor must be > 1, got ", factor);
  LinkProbe out;
  out.host_seconds.assign(h, std::numeric_limits<double>::infinity());
  for (size_t i = 0; i < h; ++i) {
    TORCH_CHECK(pair_seconds[i].size() == h, "link probe: row ", i, " has ", pair_seconds[i].size(), " times for ", h,
                " hosts");
    for (size_t j = 0; j < h; ++j) {
      if (i == j) continue;
      const double t = pair_seconds[i][j];
      TORCH_CHECK(std::isfinite(t) && t > 0, "link probe: the exchange of hosts ", i, " and ", j, " took ", t, " s");
      out.host_seconds[i] = std::min(out.host_seconds[i], t);
    }
  }
  if (h < 3) return out;  // one path: neither end can be told from the other
  std::vector<double> sorted = out.host_seconds;
  const size_t middle = (h - 1) / 2;
  std::nth_element(sorted.begin(), sorted.begin() + static_cast<std::ptrdiff_t>(middle), sorted.end());
  const double median = sorted[middle];
  const size_t slowest = static_cast<size_t>(std::max_element(out.host_seconds.begin(), out.host_seconds.end()) -
                                             out.host_seconds.begin());
  out.slowdown = out.host_seconds[slowest] / median;
  if (out.slowdown > factor) out.slow_host = static_cast<int>(slowest);
  return out;
}

// Each pair's exchanges, the fastest kept (Note [Slow links]).
constexpr int kExchanges = 3;

LinkProbe probe_links(comm::Communicator& world, const context::HostMap& hosts, int64_t bytes, double factor) {
  const int n = world.size(), h = hosts.hosts(), me = world.rank();
  TORCH_CHECK(h >= 2, "link probe: the run is on one host; there is no link between hosts to probe");
  TORCH_CHECK(bytes >= 4, "link probe: bytes must be >= 4, got ", bytes);
  TORCH_CHECK(static_cast<int>(hosts.host_of_rank.size()) == n, "link probe: the host map has ",
              hosts.host_of_rank.size(), " ranks for a world of ", n);
  std::vector<int> leader(static_cast<size_t>(h), -1);  // the lowest rank of each host
  for (int r = n - 1; r >= 0; --r) leader[static_cast<size_t>(hosts.host_of_rank[static_cast<size_t>(r)])] = r;
  const int my_host = hosts.host_of_rank[static_cast<size_t>(me)];
  const bool leads = leader[static_cast<size_t>(my_host)] == me;
  auto control = world.control();
  const at::Tensor out = at::ones({bytes / 4}, at::kFloat);
  const at::Tensor in = at::empty({bytes / 4}, at::kFloat);
  at::Tensor mine = at::zeros({h}, at::kDouble);  // a leader's seconds with each host
  // The circle method on an even count (a bye where h is odd): round k pairs
  // the fixed last slot with k and (k + t) with (k - t) for t = 1 .. e/2 - 1.
  const int e = h + h % 2;
  for (int k = 0; k < e - 1; ++k) {
    int partner = -1;
    for (int t = 0; t < e / 2; ++t) {
      const int a = t == 0 ? e - 1 : (k + t) % (e - 1), b = t == 0 ? k : (k - t + e - 1) % (e - 1);
      if (a == my_host) partner = b;
      if (b == my_host) partner = a;
    }
    if (partner >= h) partner = -1;  // the bye
    for (int rep = 0; rep < kExchanges; ++rep) {
      control->barrier()->wait();
      if (!leads || partner < 0) continue;
      const int peer = leader[static_cast<size_t>(partner)];
      std::vector<comm::P2POp> ops{{comm::P2POp::Kind::kSend, out, peer}, {comm::P2POp::Kind::kRecv, in, peer}};
      const auto t0 = std::chrono::steady_clock::now();
      control->batch_isend_irecv(ops)->wait();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      double& best = mine.data_ptr<double>()[partner];
      best = rep == 0 ? s : std::min(best, s);
    }
  }
  at::Tensor all = at::empty({n * h}, at::kDouble);
  control->all_gather(all, mine);
  const double* a = all.data_ptr<double>();
  std::vector<std::vector<double>> pairs(static_cast<size_t>(h), std::vector<double>(static_cast<size_t>(h), 0.0));
  for (int i = 0; i < h; ++i)
    for (int j = 0; j < h; ++j)
      if (i != j) {
        // Both ends timed the same exchange (Note [Slow links]): the one that
        // posted later timed the transfer alone.
        const double ij = a[leader[static_cast<size_t>(i)] * h + j], ji = a[leader[static_cast<size_t>(j)] * h + i];
        pairs[static_cast<size_t>(i)][static_cast<size_t>(j)] = std::min(ij, ji);
      }
  return name_slow_host(pairs, factor);
}

}  // namespace train
}  // namespace tessera
