#pragma once
// Live resharding's transport: the state pieces of a running job (Note
// [Checkpoint layout]) sent straight to the ranks of another layout, in
// memory, without files.
//
// Note [Piece exchange]
// 1. Every rank says which pieces it holds (name, box, flat range, dtype;
//    no data): PieceDirectory::gather, one all-gather of strings on the
//    control channel. Ranks that hold nothing (idle ones) take part too.
// 2. Every rank says which pieces it wants (infer::PieceRequest: name, box, flat
//    range), from the directory's names (a fresh optimizer cannot say which
//    states it will have); a second all-gather of strings.
// 3. Every rank plans the same transfers from the same lists: for each
//    request and each distinct held piece of its tensor that overlaps it,
//    one holder sends the common elements. Pieces held alike by several
//    ranks (data-parallel replicas) are sent once: by the requester itself
//    when it holds one (a local copy, nothing on the wire), otherwise by a
//    holder chosen by the request, so that the sending is spread. The
//    common elements of two pieces are taken in row-major order of the
//    intersection of their boxes: a slice when the boxes are equal (ZeRO
//    ranges of the same tensor-parallel shard), a strided box when both are
//    whole boxes (tensor-parallel shards of another size), index lists
//    otherwise. A request whose elements are not all held is refused on
//    every rank, naming the tensor.
// 4. Each pair of ranks exchanges one byte buffer per direction (split at
//    1 GiB), all posted as one batch_isend_irecv on the device channel, so
//    the order in which ranks get there cannot deadlock.
#include "tessera/comm/communicator.h"
#include "tessera/train/checkpoint.h"
#include "tessera/infer/piece_source.h"

#include <c10/core/Device.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace tessera {
namespace train {

// A piece's place in its full tensor, spelled out: every dimension's offset
// and length, and the flat range resolved.
struct PieceBox {
  std::vector<int64_t> offset, length;
  int64_t begin = 0, end = 0;
  bool operator==(const PieceBox& other) const {
    return offset == other.offset && length == other.length && begin == other.begin && end == other.end;
  }
};

PieceBox box_of(const std::vector<int64_t>& full_shape, const std::vector<int64_t>& offset,
                const std::vector<int64_t>& length, int64_t flat_begin, int64_t flat_end);

// Every rank's held pieces (without data), on every rank.
class PieceDirectory {
 public:
  // Collective over `world`. `metadata` is any text this rank adds (the
  // trainer's step and loss-scaler state); metadata(r) returns rank r's.
  static PieceDirectory gather(comm::Communicator& world, const std::vector<TensorPiece>& held,
                               const std::string& metadata = "");

  struct Holder {
    int rank = 0;
    int index = 0;  // in that rank's held list
    PieceBox box;
  };
  struct Tensor {
    std::vector<int64_t> shape;
    at::ScalarType dtype = at::kFloat;
    std::vector<Holder> holders;
  };

  std::vector<std::string> names(const std::string& prefix = "") const;
  bool contains(const std::string& name) const { return tensors_.count(name) > 0; }
  const Tensor& at(const std::string& name) const;
  const std::string& metadata(int rank) const { return metadata_.at(static_cast<size_t>(rank)); }
  int world_size() const { return static_cast<int>(metadata_.size()); }

 private:
  std::map<std::string, Tensor> tensors_;
  std::vector<std::string> metadata_;
};

struct PieceExchangeStats {
  int64_t bytes_sent = 0;      // to other ranks
  int64_t bytes_received = 0;  // from other ranks
  int64_t bytes_copied = 0;    // held and wanted by this rank
  int64_t messages = 0;        // sent
  double seconds = 0;
};

// The pieces a rank asked for, as an infer::PieceSource: names and shapes are the
// directory's; flat() and full() answer the requests exactly.
class ExchangedPieces : public infer::PieceSource {
 public:
  ExchangedPieces(PieceDirectory directory, std::string what);
  std::string describe() const override { return what_; }
  std::vector<std::string> names(const std::string& prefix = "") const override;
  bool contains(const std::string& name) const override;
  std::vector<int64_t> full_shape(const std::string& name) const override;
  at::Tensor full(const std::string& name) const override;
  at::Tensor flat(const std::string& name, const std::vector<int64_t>& offset, const std::vector<int64_t>& length,
                  int64_t begin, int64_t end) const override;

  // Used by exchange_pieces.
  void add(const std::string& name, PieceBox box, at::Tensor data);

 private:
  PieceDirectory directory_;
  std::string what_;
  std::map<std::string, std::vector<std::pair<PieceBox, at::Tensor>>> pieces_;
};

// Collective over `world` (Note [Piece exchange]): returns this rank's
// requests filled, in tensors on `device`. `directory` must be the one
// gathered from these `held` lists; `what` names the source in errors.
ExchangedPieces exchange_pieces(const comm::CommunicatorPtr& world, const PieceDirectory& directory,
                                const std::vector<TensorPiece>& held, const std::vector<infer::PieceRequest>& wanted,
                                const c10::Device& device, const std::string& what,
                                PieceExchangeStats* stats = nullptr);

}  // namespace train
}  // namespace tessera
