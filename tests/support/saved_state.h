#pragma once
// A trainer's whole state (model, optimizer moments, step counts: the pieces
// of Trainer::state_pieces()) as full tensors, assembled by the test itself:
// every rank writes its pieces into a plain safetensors file of its own, and
// every rank reads all of them. The checkpoint writer, its index and its
// reader are not involved, so a resharding test can hold a loaded state
// against the saved one bit for bit with nothing of the path under test on
// the reference side.
#include "test_util.h"

#include "tessera/core/safetensors.h"
#include "tessera/train/checkpoint.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace tessera {
namespace test {

// The piece's elements of `full`, flattened: its region (all of `full` when
// it has no offset), then the flat range of that region.
inline at::Tensor piece_of(const at::Tensor& full, const train::TensorPiece& p) {
  at::Tensor region = full;
  for (size_t d = 0; d < p.offset.size(); ++d) region = region.narrow(static_cast<int64_t>(d), p.offset[d], p.length[d]);
  at::Tensor flat = region.reshape({-1});
  const int64_t end = p.flat_end < 0 ? flat.numel() : p.flat_end;
  return flat.narrow(0, p.flat_begin, end - p.flat_begin);
}

namespace detail {
inline std::string join(const std::vector<int64_t>& v) {
  std::string s;
  for (int64_t x : v) s += (s.empty() ? "" : ",") + std::to_string(x);
  return s;
}
inline std::vector<int64_t> split(const std::string& s) {
  std::vector<int64_t> v;
  std::stringstream in(s);
  for (std::string x; std::getline(in, x, ',');) v.push_back(std::stoll(x));
  return v;
}
}  // namespace detail

// Every rank's `pieces` as full tensors, on every rank. Each element must be
// covered by some piece (replicas may cover it more than once; they must
// agree). Collective over the world; `dir` is shared by all ranks.
inline std::map<std::string, at::Tensor> gather_state(const std::vector<train::TensorPiece>& pieces,
                                                      const std::string& dir) {
  auto w = world();
  if (w->rank() == 0) {
    remove_tree(dir);
    std::filesystem::create_directories(dir);
  }
  w->barrier()->wait();
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  std::map<std::string, std::string> meta;  // index -> name;full_shape;offset;length;flat_begin;flat_end
  for (size_t i = 0; i < pieces.size(); ++i) {
    const auto& p = pieces[i];
    tensors.emplace_back(std::to_string(i), p.data.detach().cpu().contiguous().reshape({-1}));
    meta[std::to_string(i)] = p.name + ";" + detail::join(p.full_shape) + ";" + detail::join(p.offset) + ";" +
                              detail::join(p.length) + ";" + std::to_string(p.flat_begin) + ";" +
                              std::to_string(p.flat_end);
  }
  write_safetensors(dir + "/rank" + std::to_string(w->rank()) + ".safetensors", tensors, meta);
  w->barrier()->wait();
  std::map<std::string, at::Tensor> full, covered;
  for (int r = 0; r < w->size(); ++r) {
    SafetensorsFile f(dir + "/rank" + std::to_string(r) + ".safetensors");
    for (const auto& [key, text] : f.metadata()) {
      if (!f.contains(key)) continue;  // the writer's own metadata
      std::vector<std::string> field;
      std::stringstream in(text);
      for (std::string x; std::getline(in, x, ';');) field.push_back(x);
      while (field.size() < 6) field.emplace_back();
      train::TensorPiece p;
      p.name = field[0], p.full_shape = detail::split(field[1]), p.offset = detail::split(field[2]);
      p.length = detail::split(field[3]), p.flat_begin = std::stoll(field[4]), p.flat_end = std::stoll(field[5]);
      const at::Tensor data = f.read(key);
      if (!full.count(p.name)) {
        full[p.name] = at::zeros(p.full_shape, data.options());
        covered[p.name] = at::zeros(p.full_shape, at::kInt);
      }
      // Views of a contiguous full tensor: narrowed regions, flattened by a
      // contiguous copy, written back.
      at::Tensor region = full[p.name], seen = covered[p.name];
      for (size_t d = 0; d < p.offset.size(); ++d) {
        region = region.narrow(static_cast<int64_t>(d), p.offset[d], p.length[d]);
        seen = seen.narrow(static_cast<int64_t>(d), p.offset[d], p.length[d]);
      }
      at::Tensor flat = region.contiguous().reshape({-1}), flat_seen = seen.contiguous().reshape({-1});
      const int64_t end = p.flat_end < 0 ? flat.numel() : p.flat_end;
      at::Tensor dst = flat.narrow(0, p.flat_begin, end - p.flat_begin);
      at::Tensor dst_seen = flat_seen.narrow(0, p.flat_begin, end - p.flat_begin);
      const at::Tensor again = dst_seen.gt(0);
      EXPECT_TRUE(dst.masked_select(again).equal(data.masked_select(again)))
          << p.name << ": replicas disagree (rank " << r << ")";
      dst.copy_(data);
      dst_seen.add_(1);
      region.copy_(flat.view(region.sizes()));
      seen.copy_(flat_seen.view(seen.sizes()));
    }
  }
  for (const auto& [name, seen] : covered)
    EXPECT_TRUE(seen.gt(0).all().item<bool>()) << name << ": some elements are in no rank's piece";
  w->barrier()->wait();
  return full;
}

// Every element of `pieces` equal, bit for bit, to the same elements of
// `full`, and every tensor of `full` present in them.
inline void expect_state_equal(const std::vector<train::TensorPiece>& pieces,
                               const std::map<std::string, at::Tensor>& full) {
  std::map<std::string, bool> seen;
  for (const auto& [name, value] : full) seen[name] = false;
  for (const auto& p : pieces) {
    auto it = full.find(p.name);
    if (it == full.end()) {
      ADD_FAILURE() << p.name << " is not in the saved state";
      continue;
    }
    seen[p.name] = true;
    const at::Tensor got = p.data.detach().cpu().reshape({-1});
    const at::Tensor want = piece_of(it->second, p);
    EXPECT_TRUE(got.scalar_type() == want.scalar_type() && got.equal(want))
        << p.name << " at offset [" << detail::join(p.offset) << "] flat " << p.flat_begin << ".." << p.flat_end
        << ": largest difference " << (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>();
  }
  // A tensor no rank holds after the load is a lost tensor (a rank holds at
  // least one piece of each of its model's tensors).
  at::Tensor holders = at::zeros({static_cast<int64_t>(seen.size())}, at::kFloat);
  int64_t i = 0;
  for (const auto& entry : seen) holders[i++] = entry.second ? 1.0 : 0.0;
  world()->all_reduce(holders)->wait();  // sums
  i = 0;
  for (const auto& entry : seen)
    EXPECT_GE(holders[i++].item<double>(), 1) << entry.first << " is held by no rank after the load";
}

}  // namespace test
}  // namespace tessera
