#pragma once
// What the planner's commands print (tessera_plan, train_gpt --plan): the
// search's header, its ranked plans, the first plan's breakdown, and why
// the first beats the second; as text or as JSON lines.
#include "tessera/planner/search.h"

#include <string>

namespace tessera {
namespace planner {

// Memory per component, time per phase, and every collective of a plan.
std::string breakdown(const Estimate& e);

// One line: how much faster `first` is than `second` and where the
// difference comes from (pipeline, exposed data traffic, optimizer, memory).
std::string why_first(const Estimate& first, const Estimate& second);

// The whole report of a search: model, cluster and batch, counts, the
// ranked plans with the first's breakdown, and why_first. With json, one
// object per line: {"rank": i, "estimate": {...}} and {"why": "..."}.
std::string search_report(const ModelDesc& model, const ClusterDesc& cluster, const SearchOptions& options,
                          const SearchResult& result, bool json);

}  // namespace planner
}  // namespace tessera
