#include "tessera/comm/flight_trace.h"

#include "tessera/comm/flight_recorder.h"

#include "flight_files.h"

#include <c10/util/Exception.h>
#include <dirent.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <tuple>

namespace tessera {
namespace comm {
namespace {

using nlohmann::json;

// One communicator as one member recorded it.
struct Member {
  int world_rank = 0;
  int64_t last_issued = 0;
  int64_t last_completed = 0;
  int64_t collectives = 0;
  std::vector<const json*> entries;  // this communicator's, oldest first
};

// (name, backend, world ranks, occurrence on the recording rank): one group.
using GroupKey = std::tuple<std::string, std::string, std::vector<int>, int>;

std::string rank_list(const std::vector<int>& ranks) {
  std::string out;
  for (int r : ranks) out += (out.empty() ? "" : ", ") + std::to_string(r);
  return out;
}

std::string describe_entry(const json& e) {
  std::string out = fmt::format("{} #{}", e.at("op").get<std::string>(), e.at("seq").get<int64_t>());
  const int64_t bytes = e.at("bytes").get<int64_t>();
  const std::string dtype = e.at("dtype").get<std::string>();
  if (bytes > 0) out += fmt::format(" ({} bytes{})", bytes, dtype.empty() ? "" : " of " + dtype);
  return out;
}

// What must agree across ranks for one collective: the op, and the size
// except for all_to_all, whose splits differ by rank.
std::string signature(const json& e) {
  const std::string op = e.at("op").get<std::string>();
  if (op == "all_to_all") return op;
  return fmt::format("{} of {} bytes", op, e.at("bytes").get<int64_t>());
}

json read_record(const std::string& path) {
  std::ifstream f(path);
  TORCH_CHECK(f.good(), "tessera_trace: cannot read ", path);
  json record = json::parse(f, nullptr, /*allow_exceptions=*/false);
  TORCH_CHECK(record.is_object() && record.contains("rank") && record.contains("entries") &&
                  record.contains("communicators") && record["entries"].is_array() &&
                  record["communicators"].is_array(),
              "tessera_trace: ", path, " is not a flight record (JSON with rank, communicators and entries)");
  return record;
}

}  // namespace

std::string FlightVerdict::text() const {
  std::string out = fmt::format("flight records of {} of {} ranks read", ranks_read.size(), world_size);
  if (!missing.empty()) out += fmt::format("; none from world rank(s) {}", rank_list(missing));
  out += "\n";
  if (!behind.empty()) out += fmt::format("behind: world rank(s) {}\n", rank_list(behind));
  if (findings.empty()) out += "no operation was left waiting: every rank had completed every operation it issued\n";
  for (const auto& f : findings) out += "- " + f + "\n";
  return out;
}

FlightVerdict analyze_flight_records(const std::string& dir, int64_t since_us) {
  std::map<int, json> records;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d)) {
      int rank = -1;
      if (!detail::parse_record_name(e->d_name, &rank)) continue;
      json record = read_record(dir + "/" + e->d_name);
      if (record.value("dumped_us", int64_t{0}) >= since_us) records[rank] = std::move(record);
    }
    ::closedir(d);
  }
  TORCH_CHECK(!records.empty(), "tessera_trace: no flight record (flight-rank-R.json) in '", dir,
              "'; records are written where TESSERA_TRACE_DIR points, or beside train_gpt's --metrics");

  FlightVerdict verdict;
  for (const auto& [rank, record] : records) {
    verdict.ranks_read.push_back(rank);
    verdict.world_size = std::max({verdict.world_size, record.value("world_size", 1), rank + 1});
  }
  std::set<int> read(verdict.ranks_read.begin(), verdict.ranks_read.end());
  for (int r = 0; r < verdict.world_size; ++r)
    if (!read.count(r)) verdict.missing.push_back(r);

  std::map<GroupKey, std::map<int, Member>> groups;
  for (const auto& [rank, record] : records) {
    std::map<std::tuple<std::string, std::string, std::vector<int>>, int> seen;
    std::vector<Member*> by_index;
    for (const auto& c : record["communicators"]) {
      auto base = std::make_tuple(c.at("name").get<std::string>(), c.at("backend").get<std::string>(),
                                  c.at("world_ranks").get<std::vector<int>>());
      const int occurrence = seen[base]++;
      Member& m = groups[std::tuple_cat(base, std::make_tuple(occurrence))][rank];
      m.world_rank = rank;
      m.last_issued = c.at("last_issued").get<int64_t>();
      m.last_completed = c.at("last_completed").get<int64_t>();
      m.collectives = c.value("collectives", int64_t{0});
      by_index.push_back(&m);
    }
    for (const auto& e : record["entries"]) {
      const int comm = e.at("comm").get<int>();
      TORCH_CHECK(comm >= 0 && comm < static_cast<int>(by_index.size()), "tessera_trace: rank ", rank,
                  "'s record names communicator ", comm, " of ", by_index.size());
      by_index[static_cast<size_t>(comm)]->entries.push_back(&e);
    }
  }

  // behind: every rank some waiter waited for; waiting_ranks: ranks waiting
  // themselves (not stuck); causes: stuck or without a record.
  std::set<int> behind, waiting_ranks, causes;
  std::vector<std::string> stalls, mismatches;
  std::vector<std::pair<std::string, std::vector<int>>> waits;  // a finding, and the ranks it puts behind
  for (const auto& [key, members] : groups) {
    const auto& [name, backend, world_ranks, occurrence] = key;
    if (world_ranks.size() < 2) continue;
    const std::string group = fmt::format("'{}' ({}, world ranks {}{})", name, backend, rank_list(world_ranks),
                                          occurrence > 0 ? fmt::format(", the {}th of that name", occurrence + 1) : "");
    // The n-th collective must be the same on every member (sizes too, but
    // for all_to_all, whose splits differ by rank).
    std::map<int64_t, std::map<std::string, std::vector<int>>> by_collective;
    for (const auto& [rank, m] : members)
      for (const json* e : m.entries) {
        const int64_t n = e->at("collective").get<int64_t>();
        if (n == 0) continue;
        by_collective[n][signature(*e)].push_back(rank);
      }
    for (const auto& [n, variants] : by_collective) {
      if (variants.size() < 2) continue;
      std::string what;
      for (const auto& [desc, ranks] : variants)
        what += fmt::format("{}world rank(s) {}: {}", what.empty() ? "" : "; ", rank_list(ranks), desc);
      mismatches.push_back(
          fmt::format("on {} collective number {} differs between ranks ({}): they called "
                      "different collectives or sizes, or the same ones in a different order",
                      group, n, what));
    }
    // Each member's first operation still waiting.
    std::map<int, const json*> pending;
    for (const auto& [rank, m] : members) {
      for (const json* e : m.entries) {
        const std::string state = e->at("state").get<std::string>();
        // NCCL completes one communicator's operations in order: an earlier one is done.
        const bool done = state == "completed" || state == "abandoned" ||
                          (backend == "nccl" && e->at("seq").get<int64_t>() <= m.last_completed);
        if (!done) {
          pending[rank] = e;
          break;
        }
      }
    }
    auto last_seen = [&](const Member& m) {
      const json* last = m.entries.empty() ? nullptr : m.entries.back();
      return last
                 ? fmt::format("its last there was {}, {}", describe_entry(*last), last->at("state").get<std::string>())
                 : std::string("it had issued nothing there");
    };
    // When the group's first member gave up on any of its operations.
    int64_t group_gave_up = -1;
    std::set<int> gave_up_here;
    for (const auto& [rank, m] : members)
      for (const json* e : m.entries)
        if (e->at("state").get<std::string>() == "timed out") {
          const int64_t end = e->at("end_us").get<int64_t>();
          group_gave_up = group_gave_up < 0 ? end : std::min(group_gave_up, end);
          gave_up_here.insert(rank);
        }
    // Waiters grouped by what they wait in: the collective number, or -1 - their world rank for point-to-point.
    std::map<int64_t, std::vector<int>> waiting;
    for (const auto& [rank, e] : pending) {
      const int64_t n = e->at("collective").get<int64_t>();
      waiting[n > 0 ? n : -1 - rank].push_back(rank);
    }
    for (const auto& [n, waiters] : waiting) {
      const json& first = *pending.at(waiters.front());
      double waited = 0;
      for (int r : waiters) {
        const json& e = *pending.at(r);
        if (e.at("end_us").get<int64_t>() > 0)
          waited = std::max(
              waited, 1e-6 * static_cast<double>(e.at("end_us").get<int64_t>() - e.at("start_us").get<int64_t>()));
      }
      // Who the waiters needed: every member for a collective, the peers for point-to-point.
      std::vector<int> needed;
      if (n > 0) {
        needed = world_ranks;
      } else {
        for (int p : first.at("peers").get<std::vector<int>>())
          if (p >= 0 && p < static_cast<int>(world_ranks.size())) needed.push_back(world_ranks[static_cast<size_t>(p)]);
      }
      std::vector<int> late, unknown, also_waiting;
      std::string late_detail;
      for (int r : needed) {
        if (std::find(waiters.begin(), waiters.end(), r) != waiters.end()) continue;
        const auto it = members.find(r);
        if (it == members.end()) {
          unknown.push_back(r);
          continue;
        }
        const bool reached = n > 0 ? it->second.collectives >= n : pending.count(r) > 0;
        if (reached) {
          also_waiting.push_back(r);
          continue;
        }
        late.push_back(r);
        late_detail += fmt::format("; world rank {}: {}", r, last_seen(it->second));
      }
      // Note [Stuck inside an operation]: a waiter that entered about when
      // the ones that gave up did, and was still inside half their wait
      // later without giving up itself, hangs in the operation itself.
      int64_t latest_gave_up = -1, gave_up_after = -1;
      for (int r : waiters) {
        const json& e = *pending.at(r);
        if (e.at("state").get<std::string>() != "timed out") continue;
        latest_gave_up = std::max(latest_gave_up, e.at("start_us").get<int64_t>());
        const int64_t wait = e.at("end_us").get<int64_t>() - e.at("start_us").get<int64_t>();
        gave_up_after = gave_up_after < 0 ? wait : std::min(gave_up_after, wait);
      }
      std::vector<int> stuck;
      for (int r : waiters) {
        const json& e = *pending.at(r);
        if (latest_gave_up < 0 || e.at("state").get<std::string>() != "issued") continue;
        const int64_t start = e.at("start_us").get<int64_t>();
        const int64_t open = records.at(r).value("dumped_us", int64_t{0}) - start;
        if (start <= latest_gave_up + gave_up_after / 2 && open >= gave_up_after / 2) stuck.push_back(r);
      }
      // Marked by the rank's own watcher (Note [Overdue operations]).
      for (int r : waiters) {
        const json& e = *pending.at(r);
        if (e.value("overdue", false) && std::find(stuck.begin(), stuck.end(), r) == stuck.end()) stuck.push_back(r);
      }
      // Note [Arriving after the others gave up]
      // A waiter that entered only after a member had given up, on this
      // operation or an earlier one of the group, was late by more than the
      // timeout: a rank stopped, then continued at the end, enters the
      // operation the others gave up on and, when that completes among the
      // ranks still inside it, the next ones, before its record is written.
      // The members that gave up earlier never issue those: they are not
      // behind for it.
      std::vector<int> arrived_late;
      for (int r : waiters)
        if (group_gave_up >= 0 && pending.at(r)->at("start_us").get<int64_t>() > group_gave_up)
          arrived_late.push_back(r);
      if (!arrived_late.empty() && arrived_late.size() == waiters.size())
        late.erase(std::remove_if(late.begin(), late.end(), [&](int r) { return gave_up_here.count(r) > 0; }),
                   late.end());
      std::string sentence =
          fmt::format("on {} world rank(s) {} waited in {}{}", group, rank_list(waiters), describe_entry(first),
                      waited > 0 ? fmt::format(" and gave up after {:.1f} s", waited) : "");
      auto has = [](const std::vector<int>& v, int r) { return std::find(v.begin(), v.end(), r) != v.end(); };
      for (int r : waiters)
        if (!has(stuck, r) && !has(arrived_late, r)) waiting_ranks.insert(r);
      for (const auto* v : {&stuck, &unknown, &arrived_late}) causes.insert(v->begin(), v->end());
      std::string sep = ": ";  // between the parts of the sentence
      if (!stuck.empty()) {
        sentence += sep + fmt::format(
                              "world rank(s) {} entered it with the ranks that gave up and were still inside it, "
                              "without giving up, when they wrote their record, so they are stuck inside it",
                              rank_list(stuck));
        behind.insert(stuck.begin(), stuck.end());
        sep = "; ";
      }
      if (!arrived_late.empty()) {
        sentence += sep + fmt::format(
                              "world rank(s) {} entered it only after a rank had given up on it or an earlier "
                              "operation here, so they are behind "
                              "by more than the timeout",
                              rank_list(arrived_late));
        behind.insert(arrived_late.begin(), arrived_late.end());
        sep = "; ";
      }
      if (!late.empty()) {
        sentence += sep + fmt::format("world rank(s) {} had not {} it, so they are behind{}", rank_list(late),
                                      n > 0 ? "issued" : "posted the matching operation for", late_detail);
        behind.insert(late.begin(), late.end());
        sep = "; ";
      }
      const bool named_here = sep == "; ";
      if (!unknown.empty()) {
        sentence += sep + fmt::format("world rank(s) {} wrote no record (died, stopped or killed before writing)",
                                      rank_list(unknown));
        behind.insert(unknown.begin(), unknown.end());
      }
      if (!named_here && unknown.empty())
        sentence += fmt::format(
            ": {} it too, so no rank fell behind here: the transport stalled, or the ranks "
            "wait on each other",
            also_waiting.empty() ? "every member issued" : "world rank(s) " + rank_list(also_waiting) + " issued");
      {
        std::vector<int> put_behind = late;
        put_behind.insert(put_behind.end(), stuck.begin(), stuck.end());
        put_behind.insert(put_behind.end(), arrived_late.begin(), arrived_late.end());
        put_behind.insert(put_behind.end(), unknown.begin(), unknown.end());
        waits.emplace_back(sentence, put_behind);
      }
    }
  }
  // A rank behind in one group because it waits in another is a victim:
  // the ones named are those stuck, without a record, or waiting nowhere
  // (all that are behind, if every one of them waits).
  std::set<int> named;
  for (int r : behind)
    if (causes.count(r) || !waiting_ranks.count(r)) named.insert(r);
  if (named.empty()) named = behind;
  std::vector<int> victims;
  for (int r : behind)
    if (!named.count(r)) victims.push_back(r);
  // The waits that put a named rank behind first.
  for (int first = 1; first >= 0; --first)
    for (const auto& [sentence, ranks] : waits) {
      const bool names = std::any_of(ranks.begin(), ranks.end(), [&](int r) { return named.count(r) > 0; });
      if (names == (first == 1)) stalls.push_back(sentence);
    }
  if (!victims.empty())
    stalls.push_back(
        fmt::format("world rank(s) {} are behind only because they wait in another operation, "
                    "for the rank(s) above",
                    rank_list(victims)));
  // What each rank named was last seen doing.
  for (int r : named) {
    const auto it = records.find(r);
    if (it == records.end()) continue;
    const json* latest = nullptr;
    std::string where;
    for (const auto& c_e : it->second["entries"]) {
      if (latest == nullptr || c_e.at("start_us").get<int64_t>() >= latest->at("start_us").get<int64_t>()) {
        latest = &c_e;
        where = it->second["communicators"][c_e.at("comm").get<size_t>()].at("name").get<std::string>();
      }
    }
    const std::string reason = it->second.value("reason", "");
    stalls.push_back(fmt::format(
        "world rank {}'s latest operation anywhere: {}; its record was written because: {}", r,
        latest ? fmt::format("{} on '{}', {}", describe_entry(*latest), where, latest->at("state").get<std::string>())
               : std::string("none"),
        reason));
  }
  verdict.behind.assign(named.begin(), named.end());
  for (auto* list : {&stalls, &mismatches}) verdict.findings.insert(verdict.findings.end(), list->begin(), list->end());
  return verdict;
}

}  // namespace comm
}  // namespace tessera
