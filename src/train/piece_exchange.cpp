#include "tessera/train/piece_exchange.h"

#include "tessera/comm/agree.h"

#include <ATen/ATen.h>
#include <c10/util/accumulate.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <functional>

namespace tessera {
namespace train {
namespace {

using Json = nlohmann::json;

Json box_json(const PieceBox& b) { return {{"o", b.offset}, {"l", b.length}, {"b", b.begin}, {"e", b.end}}; }

PieceBox box_from(const Json& j) {
  PieceBox b;
  b.offset = j.at("o").get<std::vector<int64_t>>();
  b.length = j.at("l").get<std::vector<int64_t>>();
  b.begin = j.at("b").get<int64_t>();
  b.end = j.at("e").get<int64_t>();
  return b;
}

// How the common elements of two pieces are found (Note [Piece exchange]).
enum class Path { kNone, kRange, kBox, kIndex };

struct Overlap {
  Path path = Path::kNone;
  int64_t count = 0;
  int64_t lo = 0;                       // kRange: first common element, flat in the box
  std::vector<int64_t> offset, length;  // kBox / kIndex: the boxes' intersection
};

// Row-major flat index in `box` of every element of the box [offset, offset +
// length), shaped like it.
at::Tensor flat_indices(const PieceBox& box, const std::vector<int64_t>& offset, const std::vector<int64_t>& length) {
  const size_t nd = length.size();
  at::Tensor out = at::zeros(length, at::kLong);
  int64_t stride = 1;
  for (size_t d = nd; d-- > 0;) {
    std::vector<int64_t> shape(nd, 1);
    shape[d] = length[d];
    out.add_(at::arange(offset[d] - box.offset[d], offset[d] - box.offset[d] + length[d], at::kLong).view(shape) *
             stride);
    stride *= box.length[d];
  }
  return out;
}

// The intersection of the boxes, cut to the rows (dimension 0) that both
// flat ranges touch, so that index lists stay as small as the data.
bool intersect(const PieceBox& a, const PieceBox& b, std::vector<int64_t>& offset, std::vector<int64_t>& length) {
  const size_t nd = a.length.size();
  offset.assign(nd, 0);
  length.assign(nd, 0);
  for (size_t d = 0; d < nd; ++d) {
    int64_t lo = std::max(a.offset[d], b.offset[d]);
    int64_t hi = std::min(a.offset[d] + a.length[d], b.offset[d] + b.length[d]);
    if (d == 0) {
      for (const PieceBox* p : {&a, &b}) {
        const int64_t row =
            std::max<int64_t>(1, c10::multiply_integers(p->length) / std::max<int64_t>(1, p->length[0]));
        lo = std::max(lo, p->offset[0] + p->begin / row);
        hi = std::min(hi, p->offset[0] + (p->end + row - 1) / row);
      }
    }
    if (lo >= hi) return false;
    offset[d] = lo;
    length[d] = hi - lo;
  }
  return true;
}

Overlap overlap(const PieceBox& a, const PieceBox& b) {
  Overlap o;
  if (a.offset == b.offset && a.length == b.length) {
    o.lo = std::max(a.begin, b.begin);
    o.count = std::max<int64_t>(0, std::min(a.end, b.end) - o.lo);
    o.path = o.count > 0 ? Path::kRange : Path::kNone;
    return o;
  }
  if (!intersect(a, b, o.offset, o.length)) return o;
  const bool whole_a = a.begin == 0 && a.end == c10::multiply_integers(a.length);
  const bool whole_b = b.begin == 0 && b.end == c10::multiply_integers(b.length);
  if (whole_a && whole_b) {
    o.path = Path::kBox;
    o.count = c10::multiply_integers(o.length);
    return o;
  }
  const at::Tensor fa = flat_indices(a, o.offset, o.length), fb = flat_indices(b, o.offset, o.length);
  o.count = ((fa >= a.begin) & (fa < a.end) & (fb >= b.begin) & (fb < b.end)).sum().item<int64_t>();
  o.path = o.count > 0 ? Path::kIndex : Path::kNone;
  return o;
}

// Positions in `mine`'s data (its flat range) of the common elements, in
// the canonical order: row-major over the intersection.
at::Tensor index_in(const PieceBox& mine, const PieceBox& other, const Overlap& o) {
  const at::Tensor fm = flat_indices(mine, o.offset, o.length), fo = flat_indices(other, o.offset, o.length);
  const at::Tensor keep = (fm >= mine.begin) & (fm < mine.end) & (fo >= other.begin) & (fo < other.end);
  return fm.masked_select(keep) - mine.begin;
}

at::Tensor strided_view(const PieceBox& mine, const at::Tensor& data, const Overlap& o) {
  at::Tensor v = data.view(mine.length);
  for (size_t d = 0; d < o.length.size(); ++d)
    v = v.narrow(static_cast<int64_t>(d), o.offset[d] - mine.offset[d], o.length[d]);
  return v;
}

// The common elements out of `data` (the flat range of `mine`), contiguous.
at::Tensor take(const PieceBox& mine, const at::Tensor& data, const PieceBox& other, const Overlap& o) {
  switch (o.path) {
    case Path::kRange:
      return data.narrow(0, o.lo - mine.begin, o.count);
    case Path::kBox:
      return strided_view(mine, data, o).contiguous().view({-1});
    case Path::kIndex:
      return data.index_select(0, index_in(mine, other, o).to(data.device()));
    case Path::kNone:
      break;
  }
  TORCH_INTERNAL_ASSERT(false, "take: no common elements");
}

void put(const PieceBox& mine, at::Tensor& data, const PieceBox& other, const Overlap& o, const at::Tensor& values) {
  switch (o.path) {
    case Path::kRange:
      data.narrow(0, o.lo - mine.begin, o.count).copy_(values);
      return;
    case Path::kBox:
      strided_view(mine, data, o).copy_(values.view(o.length));
      return;
    case Path::kIndex:
      data.index_copy_(0, index_in(mine, other, o).to(data.device()), values);
      return;
    case Path::kNone:
      break;
  }
  TORCH_INTERNAL_ASSERT(false, "put: no common elements");
}

int64_t element_size(at::ScalarType t) { return static_cast<int64_t>(c10::elementSize(t)); }

// One planned transfer: elements of held piece (src, held_index) that
// request (dst, request_index) wants.
struct Transfer {
  int src = 0, dst = 0;
  int held_index = 0, request_index = 0;
  const PieceBox* held = nullptr;
  PieceBox request;
  Overlap common;
  at::ScalarType dtype = at::kFloat;
  int64_t bytes() const { return common.count * element_size(dtype); }
};

constexpr int64_t kChunkBytes = int64_t(1) << 30;

// Splits a byte buffer's send or receive into ops of at most kChunkBytes.
void add_ops(std::vector<comm::P2POp>& ops, comm::P2POp::Kind kind, const at::Tensor& buffer, int peer) {
  for (int64_t at = 0; at < buffer.numel(); at += kChunkBytes) {
    comm::P2POp op;
    op.kind = kind;
    op.tensor = buffer.narrow(0, at, std::min(kChunkBytes, buffer.numel() - at));
    op.peer = peer;
    ops.push_back(op);
  }
}

}  // namespace

PieceBox box_of(const std::vector<int64_t>& full_shape, const std::vector<int64_t>& offset,
                const std::vector<int64_t>& length, int64_t flat_begin, int64_t flat_end) {
  PieceBox b;
  if (offset.empty()) {
    b.offset.assign(full_shape.size(), 0);
    b.length = full_shape;
  } else {
    b.offset = offset;
    b.length = length;
  }
  TORCH_CHECK(b.offset.size() == full_shape.size() && b.length.size() == full_shape.size(),
              "a piece's region has ", b.offset.size(), " offsets and ", b.length.size(), " lengths for a tensor of ",
              full_shape.size(), " dimensions");
  const int64_t n = c10::multiply_integers(b.length);
  b.begin = flat_end < 0 ? 0 : flat_begin;
  b.end = flat_end < 0 ? n : flat_end;
  TORCH_CHECK(b.begin >= 0 && b.begin <= b.end && b.end <= n, "a piece's flat range [", b.begin, ", ", b.end,
              ") lies outside its region of ", n, " elements");
  return b;
}

PieceDirectory PieceDirectory::gather(comm::Communicator& world, const std::vector<TensorPiece>& held,
                                      const std::string& metadata) {
  Json mine = Json::object();
  mine["meta"] = metadata;
  Json pieces = Json::array();
  for (const auto& p : held) {
    const PieceBox b = box_of(p.full_shape, p.offset, p.length, p.flat_begin, p.flat_end);
    TORCH_CHECK(p.data.numel() == b.end - b.begin, "piece '", p.name, "' holds ", p.data.numel(),
                " elements for a flat range of ", b.end - b.begin);
    pieces.push_back({{"n", p.name},
                      {"s", p.full_shape},
                      {"t", static_cast<int>(p.data.scalar_type())},
                      {"x", box_json(b)}});
  }
  mine["held"] = std::move(pieces);
  PieceDirectory out;
  const auto all = comm::all_gather_strings(world, mine.dump());
  for (size_t r = 0; r < all.size(); ++r) {
    const Json j = Json::parse(all[r]);
    out.metadata_.push_back(j.at("meta").get<std::string>());
    int index = 0;
    for (const auto& p : j.at("held")) {
      const std::string name = p.at("n").get<std::string>();
      Tensor& t = out.tensors_[name];
      const auto shape = p.at("s").get<std::vector<int64_t>>();
      const auto dtype = static_cast<at::ScalarType>(p.at("t").get<int>());
      if (t.holders.empty()) {
        t.shape = shape;
        t.dtype = dtype;
      }
      TORCH_CHECK(t.shape == shape && t.dtype == dtype, "piece exchange: rank ", r, " holds '", name, "' as ",
                  c10::IntArrayRef(shape), " ", c10::toString(dtype), ", another rank as ", c10::IntArrayRef(t.shape),
                  " ", c10::toString(t.dtype), "; the ranks run different models");
      t.holders.push_back({static_cast<int>(r), index++, box_from(p.at("x"))});
    }
  }
  return out;
}

std::vector<std::string> PieceDirectory::names(const std::string& prefix) const {
  std::vector<std::string> out;
  for (const auto& t : tensors_)
    if (t.first.compare(0, prefix.size(), prefix) == 0) out.push_back(t.first);
  return out;
}

const PieceDirectory::Tensor& PieceDirectory::at(const std::string& name) const {
  auto it = tensors_.find(name);
  TORCH_CHECK(it != tensors_.end(), "piece exchange: no rank holds '", name, "'");
  return it->second;
}

ExchangedPieces::ExchangedPieces(PieceDirectory directory, std::string what)
    : directory_(std::move(directory)), what_(std::move(what)) {}

std::vector<std::string> ExchangedPieces::names(const std::string& prefix) const { return directory_.names(prefix); }

bool ExchangedPieces::contains(const std::string& name) const { return directory_.contains(name); }

std::vector<int64_t> ExchangedPieces::full_shape(const std::string& name) const { return directory_.at(name).shape; }

void ExchangedPieces::add(const std::string& name, PieceBox box, at::Tensor data) {
  pieces_[name].emplace_back(std::move(box), std::move(data));
}

at::Tensor ExchangedPieces::flat(const std::string& name, const std::vector<int64_t>& offset,
                                 const std::vector<int64_t>& length, int64_t begin, int64_t end) const {
  const PieceBox want = box_of(full_shape(name), offset, length, begin, end);
  auto it = pieces_.find(name);
  if (it != pieces_.end())
    for (const auto& [box, data] : it->second)
      if (box == want) return data;
  TORCH_CHECK(false, what_, ": this rank did not ask for that part of '", name,
              "'; the pieces it loads must be the ones it requested");
}

at::Tensor ExchangedPieces::full(const std::string& name) const {
  const auto shape = full_shape(name);
  return flat(name, {}, {}, 0, -1).view(shape);
}

namespace {

// Who sends what to whom: the same plan on every rank, from the same lists.
struct TransferPlan {
  int me = 0;
  std::vector<Transfer> sends, receives;  // this rank's
  std::string refusal;                    // of this rank's own requests
};

// A tensor's held pieces, identical boxes grouped, each group in rank order.
std::vector<std::vector<const PieceDirectory::Holder*>> distinct_pieces(const PieceDirectory::Tensor& tensor) {
  std::vector<std::vector<const PieceDirectory::Holder*>> distinct;
  for (const auto& h : tensor.holders) {
    auto same = std::find_if(distinct.begin(), distinct.end(), [&](const auto& g) { return g[0]->box == h.box; });
    if (same == distinct.end()) {
      distinct.push_back({&h});
    } else {
      same->push_back(&h);
    }
  }
  return distinct;
}

// The transfers of rank dst's j-th request that this rank takes part in;
// on dst itself, the request's buffer in `out` and whether it is covered.
void plan_request(TransferPlan& plan, const PieceDirectory& directory, const Json& request_json, int dst, size_t j,
                  ExchangedPieces& out, const c10::Device& device) {
  const bool mine = dst == plan.me;
  const std::string name = request_json.at("n").get<std::string>();
  auto refuse = [&](const std::string& why) {
    if (mine && plan.refusal.empty()) plan.refusal = why;
  };
  if (!directory.contains(name)) return refuse("no rank holds '" + name + "'");
  const auto& tensor = directory.at(name);
  PieceBox request;
  try {
    request = box_of(tensor.shape, request_json.at("o").get<std::vector<int64_t>>(),
                     request_json.at("l").get<std::vector<int64_t>>(), request_json.at("b").get<int64_t>(),
                     request_json.at("e").get<int64_t>());
  } catch (const c10::Error& e) {
    return refuse("a request for '" + name + "': " + e.what_without_backtrace());
  }
  int64_t covered = 0;
  for (const auto& group : distinct_pieces(tensor)) {
    const PieceDirectory::Holder* from = group[(static_cast<size_t>(dst) * 131 + j) % group.size()];
    for (const auto* h : group)
      if (h->rank == dst) from = h;
    if (!mine && from->rank != plan.me) continue;
    Transfer t;
    t.common = overlap(from->box, request);
    if (t.common.count == 0) continue;
    t.src = from->rank;
    t.dst = dst;
    t.held_index = from->index;
    t.request_index = static_cast<int>(j);
    t.held = &from->box;
    t.request = request;
    t.dtype = tensor.dtype;
    covered += t.common.count;
    if (t.src == plan.me) plan.sends.push_back(t);
    if (mine && t.src != plan.me) plan.receives.push_back(t);
  }
  if (!mine) return;
  if (covered != request.end - request.begin)
    refuse("'" + name + "': " + std::to_string(covered) + " of the " + std::to_string(request.end - request.begin) +
           " elements asked for are held by the running ranks (pieces that overlap or leave holes)");
  out.add(name, request, at::empty({request.end - request.begin}, at::TensorOptions(tensor.dtype).device(device)));
}

// Local copies, then one buffer per peer and direction, sent in one batch.
PieceExchangeStats move_pieces(const comm::CommunicatorPtr& world, const TransferPlan& plan,
                               const std::vector<TensorPiece>& held, const Json& my_requests, ExchangedPieces& out,
                               const c10::Device& device) {
  const int me = plan.me, n = world->size();
  auto request_tensor = [&](const Transfer& t) {
    const std::string name = my_requests[static_cast<size_t>(t.request_index)].at("n").get<std::string>();
    return out.flat(name, t.request.offset, t.request.length, t.request.begin, t.request.end);
  };
  PieceExchangeStats s;
  std::vector<at::Tensor> outgoing(static_cast<size_t>(n)), incoming(static_cast<size_t>(n));
  std::vector<std::vector<at::Tensor>> parts(static_cast<size_t>(n));
  std::vector<int64_t> incoming_bytes(static_cast<size_t>(n), 0);
  for (const auto& t : plan.sends) {
    const at::Tensor values = take(*t.held, held[static_cast<size_t>(t.held_index)].data.reshape({-1}), t.request,
                                   t.common);
    if (t.dst == me) {
      at::Tensor dst = request_tensor(t);
      put(t.request, dst, *t.held, t.common, values.to(device));
      s.bytes_copied += t.bytes();
    } else {
      parts[static_cast<size_t>(t.dst)].push_back(values.to(device).contiguous().view(at::kByte));
    }
  }
  for (const auto& t : plan.receives) incoming_bytes[static_cast<size_t>(t.src)] += t.bytes();
  std::vector<comm::P2POp> ops;
  for (int peer = 0; peer < n; ++peer) {
    const auto p = static_cast<size_t>(peer);
    if (incoming_bytes[p] > 0) {
      incoming[p] = at::empty({incoming_bytes[p]}, at::TensorOptions(at::kByte).device(device));
      add_ops(ops, comm::P2POp::Kind::kRecv, incoming[p], peer);
      s.bytes_received += incoming_bytes[p];
    }
    if (!parts[p].empty()) {
      outgoing[p] = at::cat(parts[p]);
      parts[p].clear();
      add_ops(ops, comm::P2POp::Kind::kSend, outgoing[p], peer);
      s.bytes_sent += outgoing[p].numel();
      ++s.messages;
    }
  }
  if (!ops.empty()) world->batch_isend_irecv(ops)->wait();
  // Sends were planned in (request rank, request, held piece) order on every
  // rank, so each buffer unpacks in the order the receiver planned it.
  std::vector<int64_t> at_byte(static_cast<size_t>(n), 0);
  for (const auto& t : plan.receives) {
    const auto p = static_cast<size_t>(t.src);
    at::Tensor values = at::empty({t.common.count}, at::TensorOptions(t.dtype).device(device));
    values.view(at::kByte).copy_(incoming[p].narrow(0, at_byte[p], t.bytes()));
    at_byte[p] += t.bytes();
    at::Tensor dst = request_tensor(t);
    put(t.request, dst, *t.held, t.common, values);
  }
  return s;
}

}  // namespace

ExchangedPieces exchange_pieces(const comm::CommunicatorPtr& world, const PieceDirectory& directory,
                                const std::vector<TensorPiece>& held, const std::vector<infer::PieceRequest>& wanted,
                                const c10::Device& device, const std::string& what, PieceExchangeStats* stats) {
  const auto start = std::chrono::steady_clock::now();
  const int n = world->size();
  TORCH_CHECK(directory.world_size() == n, "exchange_pieces: the directory was gathered over ",
              directory.world_size(), " ranks, the communicator has ", n);
  Json mine = Json::array();
  for (const auto& r : wanted)
    mine.push_back({{"n", r.name}, {"o", r.offset}, {"l", r.length}, {"b", r.flat_begin}, {"e", r.flat_end}});
  const auto all = comm::all_gather_strings(*world, mine.dump());

  TransferPlan plan;
  plan.me = world->rank();
  ExchangedPieces out(directory, what);
  for (int dst = 0; dst < n; ++dst) {
    const Json requests = Json::parse(all[static_cast<size_t>(dst)]);
    for (size_t j = 0; j < requests.size(); ++j) plan_request(plan, directory, requests[j], dst, j, out, device);
  }
  comm::on_every_rank(world, "live resharding", [&] { TORCH_CHECK(plan.refusal.empty(), what, ": ", plan.refusal); });
  PieceExchangeStats s = move_pieces(world, plan, held, Json::parse(all[static_cast<size_t>(plan.me)]), out, device);
  s.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (stats != nullptr) *stats = s;
  return out;
}

}  // namespace train
}  // namespace tessera
