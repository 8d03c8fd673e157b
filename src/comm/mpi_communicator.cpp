#include "tessera/comm/mpi_communicator.h"

#include "mpi_types.h"
#include "op_checks.h"
#include "progress_thread.h"
#include "tessera/comm/mpi_check.h"
#include "tessera/core/logging.h"
#include "waiting.h"

#include <ATen/ATen.h>
#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>
#endif

#include <unistd.h>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <initializer_list>

// LeakSanitizer (make test-sanitize) is told of the one deliberate leak below.
#if defined(__SANITIZE_ADDRESS__)
#define TESSERA_LSAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TESSERA_LSAN 1
#endif
#endif
#ifdef TESSERA_LSAN
#include <sanitizer/lsan_interface.h>
#endif

namespace tessera {
namespace comm {
namespace {

bool query_cuda_aware() {
#if defined(MPIX_CUDA_AWARE_SUPPORT) && MPIX_CUDA_AWARE_SUPPORT
  return MPIX_Query_cuda_support() == 1;
#else
  return false;
#endif
}

int to_int_count(const Communicator& comm, OpType op, int64_t count) {
  TORCH_CHECK(count <= INT_MAX, op_type_name(op), " on communicator '", comm.name(), "': ", count,
              " elements exceed MPI's int count limit (", INT_MAX, "); split the tensor");
  return static_cast<int>(count);
}

std::vector<int> to_int_counts(const Communicator& comm, OpType op, const std::vector<int64_t>& v) {
  std::vector<int> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = to_int_count(comm, op, v[i]);
  return out;
}

// A tensor as MPI sees it: itself when MPI can read its memory, otherwise a
// host copy that is written back to the device tensor when the op finishes.
struct Staged {
  at::Tensor tensor;
  at::Tensor host;
  bool staged = false;

  Staged(const at::Tensor& t, bool cuda_aware, bool copy_in) : tensor(t) {
    staged = !t.device().is_cpu() && !(cuda_aware && t.is_cuda());
    if (!staged) {
      host = t;
    } else {
      host = copy_in ? t.to(at::kCPU) : at::empty(t.sizes(), t.options().device(at::kCPU));
    }
  }
  void* data() const { return host.data_ptr(); }
  void copy_back() const {
    if (staged) tensor.copy_(host);
  }
};

// Note [MPI work completion]
// A Work owns its MPI requests and the tensors they use. finish() runs once,
// on the thread that observes completion: it applies what MPI cannot do
// itself (average, copy back to the device) before the result is visible.
// Waits are timed (Note [Timeouts]); a Work that timed out, or whose
// communicators were aborted, is abandoned: its requests and buffers are
// leaked on purpose, because MPI may still write into them.
class MpiWork : public Work {
 public:
  MpiWork(detail::OpInfo op, std::vector<MPI_Request> requests, std::vector<at::Tensor> keep_alive,
          std::function<void()> finish)
      : op_(std::move(op)),
        requests_(std::move(requests)),
        keep_alive_(std::move(keep_alive)),
        finish_(std::move(finish)) {}

  ~MpiWork() override {
    if (done_ || mpi_finalized()) return;
    if (!abandoned_ && !(op_.comm->abort && op_.comm->abort->aborted())) {
      try {
        wait();
        return;
      } catch (const std::exception& e) {
        log_message(LogLevel::kError, -1, std::string("MPI work failed while being destroyed: ") + e.what());
      }
    }
    abandon();
  }

  void wait() override {
    if (done_) return;
    try {
      wait_requests(requests_, op_);
    } catch (...) {
      abandon();
      throw;
    }
    complete();
  }

  bool is_completed() override {
    if (done_) return true;
    int flag = 0;
    TESSERA_MPI_CHECK(MPI_Testall(static_cast<int>(requests_.size()), requests_.data(), &flag, MPI_STATUSES_IGNORE));
    if (flag) complete();
    return done_;
  }

  // Polls the requests until done; throws TimeoutError after the timeout.
  static void wait_requests(std::vector<MPI_Request>& requests, const detail::OpInfo& op) {
    const int n = static_cast<int>(requests.size());
    if (op.comm->timeout.count() == 0 && !op.comm->abort->aborted()) {
      TESSERA_MPI_CHECK(MPI_Waitall(n, requests.data(), MPI_STATUSES_IGNORE));
      return;
    }
    detail::wait_until(
        [&] {
          int flag = 0;
          TESSERA_MPI_CHECK(MPI_Testall(n, requests.data(), &flag, MPI_STATUSES_IGNORE));
          return flag != 0;
        },
        op);
  }

 private:
  void complete() {
    done_ = true;
    detail::end_op(op_, OpState::kCompleted);
    if (finish_) finish_();
    keep_alive_.clear();
  }
  void abandon() {
    if (abandoned_) return;
    abandoned_ = true;
    // A timed-out entry keeps its state.
    detail::end_op(op_, OpState::kAbandoned);
    auto* leaked = new std::vector<at::Tensor>(std::move(keep_alive_));  // see the class comment
#ifdef TESSERA_LSAN
    __lsan_ignore_object(leaked);
#else
    (void)leaked;
#endif
  }

  detail::OpInfo op_;
  std::vector<MPI_Request> requests_;
  std::vector<at::Tensor> keep_alive_;
  std::function<void()> finish_;
  bool done_ = false;
  bool abandoned_ = false;
};

// Issues `nonblocking` and returns its Work, or, for a synchronous call,
// waits for it (timed) or, with no timeout, calls `blocking` (MPI's tuned
// blocking algorithms); either way `finish` runs after MPI has completed.
// The synchronous paths allocate nothing (the benchmark's small sizes
// measure their overhead).
template <typename Finish, typename Blocking, typename NonBlocking>
WorkPtr issue(const detail::OpInfo& op, bool async, Finish&& finish, std::initializer_list<at::Tensor> keep_alive,
              Blocking&& blocking, NonBlocking&& nonblocking) {
  if (!async && op.comm->timeout.count() == 0) {
    const auto start = std::chrono::steady_clock::now();
    blocking();
    if (const auto& recorder = op.comm->abort->recorder()) recorder->add_wait(std::chrono::steady_clock::now() - start);
    detail::end_op(op, OpState::kCompleted);
    finish();
    return completed_work();
  }
  MPI_Request request = MPI_REQUEST_NULL;
  nonblocking(&request);
  auto work = std::make_shared<MpiWork>(op, std::vector<MPI_Request>{request}, std::vector<at::Tensor>(keep_alive),
                                        std::function<void()>(std::forward<Finish>(finish)));
  if (async) return work;
  work->wait();
  return completed_work();
}

const auto kNothing = [] {};

}  // namespace

bool MpiOptions::synchronous_sends_from_env() {
  const char* value = std::getenv("TESSERA_MPI_SYNC_SENDS");
  return value != nullptr && std::strcmp(value, "") != 0 && std::strcmp(value, "0") != 0;
}

std::chrono::microseconds MpiOptions::progress_from_env() {
  const char* value = std::getenv("TESSERA_PROGRESS_US");
  if (value == nullptr || *value == '\0') return std::chrono::microseconds(0);
  const std::string text(value);
  const bool digits = text.size() <= 9 && text.find_first_not_of("0123456789") == std::string::npos;
  TORCH_CHECK(digits, "TESSERA_PROGRESS_US='", text.substr(0, 40),
              "' is not a whole number of microseconds between the progress thread's probes (Note [A progress "
              "thread]); use e.g. 200, or 0 for no thread");
  return std::chrono::microseconds(std::stoll(text));
}

namespace {

// Collective over comm: each member's host name (gethostname), by world rank;
// ranks outside comm stay "".
std::vector<std::string> host_names_by_world_rank(MPI_Comm comm) {
  constexpr int kLen = 64;
  char mine[kLen] = {0};
  ::gethostname(mine, kLen - 1);
  int size = 0, world_size = 0;
  TESSERA_MPI_CHECK(MPI_Comm_size(comm, &size));
  TESSERA_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world_size));
  std::vector<char> all(static_cast<size_t>(size) * kLen);
  TESSERA_MPI_CHECK(MPI_Allgather(mine, kLen, MPI_CHAR, all.data(), kLen, MPI_CHAR, comm));
  MPI_Group group = MPI_GROUP_NULL, world_group = MPI_GROUP_NULL;
  TESSERA_MPI_CHECK(MPI_Comm_group(comm, &group));
  TESSERA_MPI_CHECK(MPI_Comm_group(MPI_COMM_WORLD, &world_group));
  std::vector<int> ranks(static_cast<size_t>(size)), world(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) ranks[static_cast<size_t>(r)] = r;
  TESSERA_MPI_CHECK(MPI_Group_translate_ranks(group, size, ranks.data(), world_group, world.data()));
  MPI_Group_free(&group);
  MPI_Group_free(&world_group);
  std::vector<std::string> out(static_cast<size_t>(world_size));
  for (int r = 0; r < size; ++r) {
    const int w = world[static_cast<size_t>(r)];
    if (w >= 0 && w < world_size) out[static_cast<size_t>(w)] = std::string(&all[static_cast<size_t>(r) * kLen]);
  }
  return out;
}

}  // namespace

std::shared_ptr<MpiCommunicator> MpiCommunicator::create(MPI_Comm comm, const std::string& name,
                                                         const MpiOptions& options) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  TORCH_CHECK(initialized, "MpiCommunicator::create('", name,
              "'): MPI is not initialized; create a tessera::comm::MpiRuntime first");
  MPI_Comm dup = MPI_COMM_NULL;
  TESSERA_MPI_CHECK(MPI_Comm_dup(comm, &dup));
  MpiOptions resolved = options;
  if (!resolved.abort) {
    resolved.abort = detail::AbortState::create(resolved.flight_recorder);
    resolved.abort->set_hosts(host_names_by_world_rank(dup));
    if (resolved.progress.count() > 0 && !resolved.progress_thread)
      resolved.progress_thread = std::make_shared<detail::ProgressThread>(dup, resolved.progress);
  }
  return std::shared_ptr<MpiCommunicator>(
      new MpiCommunicator(dup, name, std::make_shared<MpiTypes>(), std::move(resolved), /*with_control=*/true));
}

MpiCommunicator::MpiCommunicator(MPI_Comm comm, std::string name, std::shared_ptr<MpiTypes> types,
                                 MpiOptions options, bool with_control)
    : comm_(comm), name_(std::move(name)), types_(std::move(types)), options_(std::move(options)) {
  TESSERA_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
  TESSERA_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
  TESSERA_MPI_CHECK(MPI_Comm_size(comm_, &size_));
  cuda_aware_ = query_cuda_aware();
  info_ = detail::make_comm_info(comm_, name_, with_control ? "mpi" : "mpi control", options_.timeout, options_.abort);
  if (with_control) {
    MPI_Comm dup = MPI_COMM_NULL;
    TESSERA_MPI_CHECK(MPI_Comm_dup(comm_, &dup));
    // The control channel is MPI under every backend: blocking sends model
    // NCCL's, so they stay on the device channel.
    MpiOptions control = options_;
    control.synchronous_sends = false;
    control_ = std::shared_ptr<MpiCommunicator>(new MpiCommunicator(dup, name_, types_, control, false));
  }
}

MpiCommunicator::~MpiCommunicator() {
  // Freeing a communicator with abandoned operations is left to the end of
  // the process (Note [Timeouts]).
  if (comm_ != MPI_COMM_NULL && !mpi_finalized() && !options_.abort->aborted()) MPI_Comm_free(&comm_);
}

int64_t MpiCommunicator::progress_probes() const {
  return options_.progress_thread ? options_.progress_thread->probes() : -1;
}

detail::OpInfo MpiCommunicator::begin(const char* op, int64_t bytes, const char* dtype, std::vector<int> peers) {
  detail::check_not_aborted(*info_, op);
  return detail::begin_op(info_, op, ++seq_, std::move(peers), bytes, dtype);
}

detail::OpInfo MpiCommunicator::begin(const char* op, const at::Tensor& tensor, std::vector<int> peers) {
  const bool defined = tensor.defined();
  return begin(op, defined ? static_cast<int64_t>(tensor.nbytes()) : 0,
               defined ? c10::toString(tensor.scalar_type()) : "", std::move(peers));
}

std::shared_ptr<FlightRecorder> MpiCommunicator::flight_recorder() const { return options_.abort->recorder(); }

std::shared_ptr<FaultInjector> MpiCommunicator::fault_injector() const { return options_.abort->faults(); }

CommunicatorPtr MpiCommunicator::control() {
  if (control_) return control_;
  return shared_from_this();
}

WorkPtr MpiCommunicator::all_reduce(at::Tensor& tensor, const AllReduceOptions& options) {
  const OpType op = OpType::kAllReduce;
  validate_all_reduce(*this, tensor, options.op);
  const Staged buf(tensor, cuda_aware_, true);
  const int count = to_int_count(*this, op, tensor.numel());
  MPI_Datatype type = types_->datatype(tensor.scalar_type());
  MPI_Op mpi_op = types_->op(options.op, tensor.scalar_type());
  const bool avg = options.op == ReduceOp::kAvg;
  const int n = size_;
  auto finish = [buf, avg, n]() {
    if (avg) buf.host.div_(n);
    buf.copy_back();
  };
  return issue(
      begin("all_reduce", tensor), options.async, finish, {buf.host, tensor},
      [&] { TESSERA_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, buf.data(), count, type, mpi_op, comm_)); },
      [&](MPI_Request* r) {
        TESSERA_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, buf.data(), count, type, mpi_op, comm_, r));
      });
}

WorkPtr MpiCommunicator::broadcast(at::Tensor& tensor, const BroadcastOptions& options) {
  const OpType op = OpType::kBroadcast;
  validate_broadcast(*this, tensor, options.root);
  const bool is_root = rank_ == options.root;
  const Staged buf(tensor, cuda_aware_, is_root);
  const int count = to_int_count(*this, op, tensor.numel());
  MPI_Datatype type = types_->datatype(tensor.scalar_type());
  const int root = options.root;
  // The root's tensor is unchanged: writing it back would bump its version,
  // and autograd refuses a saved tensor (an attention output) changed so.
  auto finish = [buf, is_root]() {
    if (!is_root) buf.copy_back();
  };
  return issue(
      begin("broadcast", tensor), options.async, finish, {buf.host, tensor},
      [&] { TESSERA_MPI_CHECK(MPI_Bcast(buf.data(), count, type, root, comm_)); },
      [&](MPI_Request* r) { TESSERA_MPI_CHECK(MPI_Ibcast(buf.data(), count, type, root, comm_, r)); });
}

WorkPtr MpiCommunicator::reduce(at::Tensor& tensor, const ReduceOptions& options) {
  const OpType op = OpType::kReduce;
  validate_reduce(*this, tensor, options.root, options.op);
  const bool is_root = rank_ == options.root;
  const Staged buf(tensor, cuda_aware_, true);
  const int count = to_int_count(*this, op, tensor.numel());
  MPI_Datatype type = types_->datatype(tensor.scalar_type());
  MPI_Op mpi_op = types_->op(options.op, tensor.scalar_type());
  const bool avg = options.op == ReduceOp::kAvg;
  const int n = size_;
  const int root = options.root;
  // Only the root receives; MPI_IN_PLACE there keeps the other ranks' tensors unchanged.
  void* send = is_root ? MPI_IN_PLACE : buf.data();
  void* recv = is_root ? buf.data() : nullptr;
  auto finish = [buf, avg, n, is_root]() {
    if (!is_root) return;
    if (avg) buf.host.div_(n);
    buf.copy_back();
  };
  return issue(
      begin("reduce", tensor), options.async, finish, {buf.host, tensor},
      [&] { TESSERA_MPI_CHECK(MPI_Reduce(send, recv, count, type, mpi_op, root, comm_)); },
      [&](MPI_Request* r) { TESSERA_MPI_CHECK(MPI_Ireduce(send, recv, count, type, mpi_op, root, comm_, r)); });
}

WorkPtr MpiCommunicator::all_gather(at::Tensor& output, const at::Tensor& input, const AllGatherOptions& options) {
  const OpType op = OpType::kAllGather;
  validate_all_gather(*this, output, input);
  const int count = to_int_count(*this, op, input.numel());
  MPI_Datatype type = types_->datatype(input.scalar_type());
  // An input that already sits at this rank's place in the output (as ZeRO's
  // flat buffers do) is gathered in place, which MPI requires for aliasing.
  const int64_t bytes = input.numel() * static_cast<int64_t>(input.element_size());
  const bool in_place =
      input.device() == output.device() && input.data_ptr() == static_cast<char*>(output.data_ptr()) + rank_ * bytes;
  const Staged out(output, cuda_aware_, in_place);
  const Staged in(input, cuda_aware_, !in_place);
  const void* send = in_place ? MPI_IN_PLACE : in.data();
  auto finish = [out]() { out.copy_back(); };
  return issue(
      begin("all_gather", output), options.async, finish, {out.host, in.host, output, input},
      [&] { TESSERA_MPI_CHECK(MPI_Allgather(send, count, type, out.data(), count, type, comm_)); },
      [&](MPI_Request* r) { TESSERA_MPI_CHECK(MPI_Iallgather(send, count, type, out.data(), count, type, comm_, r)); });
}

WorkPtr MpiCommunicator::reduce_scatter(at::Tensor& output, const at::Tensor& input,
                                        const ReduceScatterOptions& options) {
  const OpType op = OpType::kReduceScatter;
  validate_reduce_scatter(*this, output, input, options.op);
  const int count = to_int_count(*this, op, output.numel());
  MPI_Datatype type = types_->datatype(input.scalar_type());
  MPI_Op mpi_op = types_->op(options.op, input.scalar_type());
  const Staged out(output, cuda_aware_, false);
  const Staged in(input, cuda_aware_, true);
  const bool avg = options.op == ReduceOp::kAvg;
  const int n = size_;
  auto finish = [out, avg, n]() {
    if (avg) out.host.div_(n);
    out.copy_back();
  };
  return issue(
      begin("reduce_scatter", input), options.async, finish, {out.host, in.host, output, input},
      [&] { TESSERA_MPI_CHECK(MPI_Reduce_scatter_block(in.data(), out.data(), count, type, mpi_op, comm_)); },
      [&](MPI_Request* r) {
        TESSERA_MPI_CHECK(MPI_Ireduce_scatter_block(in.data(), out.data(), count, type, mpi_op, comm_, r));
      });
}

WorkPtr MpiCommunicator::all_to_all(at::Tensor& output, const at::Tensor& input, const AllToAllOptions& options) {
  const OpType op = OpType::kAllToAll;
  const AllToAllLayout layout = validate_all_to_all(*this, output, input, options);
  MPI_Datatype type = types_->datatype(input.scalar_type());
  const Staged out(output, cuda_aware_, false);
  const Staged in(input, cuda_aware_, true);
  auto finish = [out]() { out.copy_back(); };

  if (layout.equal) {
    const int count = to_int_count(*this, op, layout.send_counts.empty() ? 0 : layout.send_counts[0]);
    return issue(
        begin("all_to_all", input), options.async, finish, {out.host, in.host, output, input},
        [&] { TESSERA_MPI_CHECK(MPI_Alltoall(in.data(), count, type, out.data(), count, type, comm_)); },
        [&](MPI_Request* r) {
          TESSERA_MPI_CHECK(MPI_Ialltoall(in.data(), count, type, out.data(), count, type, comm_, r));
        });
  }
  // MPI_Ialltoallv reads the count arrays until completion: the Work keeps them.
  auto counts = std::make_shared<std::vector<std::vector<int>>>(std::vector<std::vector<int>>{
      to_int_counts(*this, op, layout.send_counts), to_int_counts(*this, op, layout.send_displs),
      to_int_counts(*this, op, layout.recv_counts), to_int_counts(*this, op, layout.recv_displs)});
  auto& c = *counts;
  auto finish_v = [out, counts]() { out.copy_back(); };
  return issue(
      begin("all_to_all", input), options.async, finish_v, {out.host, in.host, output, input},
      [&] {
        TESSERA_MPI_CHECK(MPI_Alltoallv(in.data(), c[0].data(), c[1].data(), type, out.data(), c[2].data(), c[3].data(),
                                        type, comm_));
      },
      [&](MPI_Request* r) {
        TESSERA_MPI_CHECK(MPI_Ialltoallv(in.data(), c[0].data(), c[1].data(), type, out.data(), c[2].data(),
                                         c[3].data(), type, comm_, r));
      });
}

WorkPtr MpiCommunicator::send(const at::Tensor& tensor, int dst, const SendOptions& options) {
  const OpType op = OpType::kSend;
  check_tensor(*this, op, tensor, "input");
  check_rank(*this, op, "destination", dst, false);
  const Staged buf(tensor, cuda_aware_, true);
  const int count = to_int_count(*this, op, tensor.numel());
  MPI_Datatype type = types_->datatype(tensor.scalar_type());
  if (options_.synchronous_sends) {  // blocks until the receive is posted, asynchronous or not
    MPI_Request request = MPI_REQUEST_NULL;
    const detail::OpInfo info = begin("send", tensor, {dst});
    TESSERA_MPI_CHECK(MPI_Issend(buf.data(), count, type, dst, 0, comm_, &request));
    MpiWork(info, {request}, {buf.host, tensor}, nullptr).wait();
    return completed_work();
  }
  return issue(
      begin("send", tensor, {dst}), options.async, kNothing, {buf.host, tensor},
      [&] { TESSERA_MPI_CHECK(MPI_Send(buf.data(), count, type, dst, 0, comm_)); },
      [&](MPI_Request* r) { TESSERA_MPI_CHECK(MPI_Isend(buf.data(), count, type, dst, 0, comm_, r)); });
}

WorkPtr MpiCommunicator::recv(at::Tensor& tensor, int src, const RecvOptions& options) {
  const OpType op = OpType::kRecv;
  check_tensor(*this, op, tensor, "output");
  check_rank(*this, op, "source", src, false);
  const Staged buf(tensor, cuda_aware_, false);
  const int count = to_int_count(*this, op, tensor.numel());
  MPI_Datatype type = types_->datatype(tensor.scalar_type());
  auto finish = [buf]() { buf.copy_back(); };
  return issue(
      begin("recv", tensor, {src}), options.async, finish, {buf.host, tensor},
      [&] { TESSERA_MPI_CHECK(MPI_Recv(buf.data(), count, type, src, 0, comm_, MPI_STATUS_IGNORE)); },
      [&](MPI_Request* r) { TESSERA_MPI_CHECK(MPI_Irecv(buf.data(), count, type, src, 0, comm_, r)); });
}

WorkPtr MpiCommunicator::barrier(const BarrierOptions& options) {
  return issue(
      begin("barrier", at::Tensor()), options.async, kNothing, {}, [&] { TESSERA_MPI_CHECK(MPI_Barrier(comm_)); },
      [&](MPI_Request* r) { TESSERA_MPI_CHECK(MPI_Ibarrier(comm_, r)); });
}

WorkPtr MpiCommunicator::batch_isend_irecv(const std::vector<P2POp>& ops) {
  validate_batch(*this, ops);
  std::vector<int> peers;
  int64_t bytes = 0;
  for (const auto& o : ops) {
    peers.push_back(o.peer);
    bytes += static_cast<int64_t>(o.tensor.nbytes());
  }
  const detail::OpInfo info = begin(
      "batch_isend_irecv", bytes, ops.empty() ? "" : c10::toString(ops.front().tensor.scalar_type()), std::move(peers));
  std::vector<MPI_Request> requests;
  std::vector<at::Tensor> keep_alive;
  auto staged = std::make_shared<std::vector<Staged>>();
  // Receives first, then sends, each kind in the listed order.
  for (const auto kind : {P2POp::Kind::kRecv, P2POp::Kind::kSend}) {
    for (const auto& o : ops) {
      if (o.kind != kind) continue;
      const bool is_send = kind == P2POp::Kind::kSend;
      const OpType op = is_send ? OpType::kSend : OpType::kRecv;
      Staged buf(o.tensor, cuda_aware_, is_send);
      const int count = to_int_count(*this, op, o.tensor.numel());
      MPI_Datatype type = types_->datatype(o.tensor.scalar_type());
      MPI_Request r = MPI_REQUEST_NULL;
      if (!is_send) {
        TESSERA_MPI_CHECK(MPI_Irecv(buf.data(), count, type, o.peer, 0, comm_, &r));
        staged->push_back(buf);
      } else if (options_.synchronous_sends) {
        TESSERA_MPI_CHECK(MPI_Issend(buf.data(), count, type, o.peer, 0, comm_, &r));
      } else {
        TESSERA_MPI_CHECK(MPI_Isend(buf.data(), count, type, o.peer, 0, comm_, &r));
      }
      requests.push_back(r);
      keep_alive.push_back(buf.host);
      keep_alive.push_back(o.tensor);
    }
  }
  auto finish = [staged] {
    for (const auto& b : *staged) b.copy_back();
  };
  return std::make_shared<MpiWork>(info, std::move(requests), std::move(keep_alive), finish);
}

CommunicatorPtr MpiCommunicator::split(int color, int key, const std::string& name) {
  MPI_Comm child = MPI_COMM_NULL;
  TESSERA_MPI_CHECK(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &child));
  if (child == MPI_COMM_NULL) return nullptr;
  return std::shared_ptr<MpiCommunicator>(new MpiCommunicator(child, name, types_, options_, control_ != nullptr));
}

}  // namespace comm
}  // namespace tessera
