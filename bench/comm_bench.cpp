// comm_bench: tessera's collectives against the raw MPI calls they map to,
// in the manner of nccl-tests: sizes from --min-bytes to --max-bytes, times
// --factor; warm-up; timed iterations; time, algbw, busbw and the number of
// wrong elements per size and operation; the raw MPI call timed in the same
// run, on the same buffers, interleaved with tessera's in rounds (alternating
// which goes first) so that drift and noise hit both alike.
//
//   mpirun -np 4 comm_bench --json --ops all_reduce,all_gather --max-bytes 64M
//
// Every option and its default: comm_bench --help (docs/cli.md).
//
// Note [Bus bandwidth]
// algbw = bytes / time, with bytes the nccl-tests "size" of the operation
// (the full buffer: output of all_gather, input of reduce_scatter).
// busbw = algbw * factor, the bandwidth a ring implementation puts on each
// link: all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all (n-1)/n;
// broadcast, reduce 1. Times are per iteration, the maximum over ranks of the
// median over rounds. ratio = tessera busbw / MPI busbw, as the median over
// rounds of the ratio within each round's back-to-back pair.
//
// Note [NCCL baseline]
// --backend nccl runs tessera's NCCL communicator on this rank's GPU against
// a raw NCCL communicator of its own (ncclCommInitRank on an id broadcast over
// MPI), on the same CUDA buffers, each call on its side's stream; a timed loop
// ends with cudaDeviceSynchronize, so both sides are timed to completion.
// all_to_all on raw NCCL is one group of ncclSend/ncclRecv per peer, the
// usual way to write it. Built where the NCCL backend is (TESSERA_BENCH_NCCL).
#include "bench_util.h"
#include "example_main.h"

#include <tessera/tessera.h>

#include <ATen/ATen.h>

#include <fmt/format.h>
#include <mpi.h>

#if TESSERA_BENCH_NCCL
#include <tessera/comm/nccl_check.h>

#include <cuda_runtime.h>
#include <nccl.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace {

using tessera::comm::Communicator;
using tessera::comm::MpiCommunicator;

struct Args {
  bool json = false;
  int64_t min_bytes = 8;
  int64_t max_bytes = 64 << 20;
  int factor = 2;
  int rounds = 41;
  int warmup = 3;
  double round_ms = 10;  // target duration of one timed round
  std::string dtype = "float32";
  std::string ops = "all_reduce,all_gather,reduce_scatter,broadcast,reduce,all_to_all";
  std::string backend = "mpi";
};

// "64M" -> 64 << 20: an integer with an optional K, M or G (powers of 1024),
// the value of `flag`.
int64_t parse_bytes(const std::string& s, const std::string& flag) {
  int64_t mult = 1;
  std::string digits = s;
  const char last = s.empty() ? '\0' : s.back();
  if (last == 'K' || last == 'k') mult = 1 << 10;
  if (last == 'M' || last == 'm') mult = 1 << 20;
  if (last == 'G' || last == 'g') mult = int64_t{1} << 30;
  if (mult != 1) digits.pop_back();
  const bool digits_only =
      !digits.empty() && digits.size() <= 18 && digits.find_first_not_of("0123456789") == std::string::npos;
  TORCH_CHECK(digits_only && std::stoll(digits) <= std::numeric_limits<int64_t>::max() / mult, flag,
              " takes a size: an integer with an optional K, M or G (powers of 1024), e.g. 8 or 64M; got '", s, "'");
  return std::stoll(digits) * mult;
}

// The inverse of parse_bytes, for --help: 67108864 -> "64M".
std::string show_bytes(int64_t bytes) {
  if (bytes > 0 && bytes % (int64_t{1} << 30) == 0) return std::to_string(bytes >> 30) + "G";
  if (bytes > 0 && bytes % (int64_t{1} << 20) == 0) return std::to_string(bytes >> 20) + "M";
  if (bytes > 0 && bytes % (int64_t{1} << 10) == 0) return std::to_string(bytes >> 10) + "K";
  return std::to_string(bytes);
}

tessera::cli::Command command(Args& a) {
  tessera::cli::Command c("comm_bench",
                          "bus bandwidth of every collective over message sizes against raw MPI (nccl-tests' "
                          "algbw/busbw)");
  c.group("Sizes");
  c.add("min-bytes", &a.min_bytes, "smallest message, e.g. 8 or 4K (K, M, G: powers of 1024)", "SIZE",
        [](const std::string& t) { return parse_bytes(t, "--min-bytes"); }, show_bytes);
  c.add("max-bytes", &a.max_bytes, "largest message, e.g. 64M (K, M, G: powers of 1024)", "SIZE",
        [](const std::string& t) { return parse_bytes(t, "--max-bytes"); }, show_bytes);
  c.add("factor", &a.factor, "each size is the previous one times this");
  c.add("dtype", &a.dtype, "element type of the buffers", {"float32", "float64", "int32", "int64"});
  c.add("ops", &a.ops, "collectives to time, comma-separated");
  c.add("backend", &a.backend,
        "mpi: CPU buffers against raw MPI; nccl: this rank's GPU against raw NCCL (builds with the NCCL backend)",
        {"mpi", "nccl"});
  c.group("Timing");
  c.add("rounds", &a.rounds, "timed rounds per size; the median is reported");
  c.add("warmup", &a.warmup, "untimed calls of each side before the rounds");
  c.add("round-ms", &a.round_ms, "target duration of one timed round in milliseconds (sets the iterations)");
  c.group("Output");
  c.add("json", &a.json, "one JSON object per line instead of the table");
  return c;
}

MPI_Datatype mpi_type(c10::ScalarType t) {
  switch (t) {
    case c10::kFloat:
      return MPI_FLOAT;
    case c10::kDouble:
      return MPI_DOUBLE;
    case c10::kInt:
      return MPI_INT32_T;
    case c10::kLong:
      return MPI_INT64_T;
    default:
      TORCH_CHECK(false, "comm_bench baselines support float32, float64, int32 and int64");
  }
}

#if TESSERA_BENCH_NCCL
ncclDataType_t nccl_type(c10::ScalarType t) {
  switch (t) {
    case c10::kFloat:
      return ncclFloat32;
    case c10::kDouble:
      return ncclFloat64;
    case c10::kInt:
      return ncclInt32;
    case c10::kLong:
      return ncclInt64;
    default:
      TORCH_CHECK(false, "comm_bench baselines support float32, float64, int32 and int64");
  }
}

// The raw NCCL side (Note [NCCL baseline]): a communicator and a stream of
// its own, destroyed with it.
class RawNccl {
 public:
  RawNccl(MPI_Comm comm, int device) {
    int rank = 0, size = 0;
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
    ncclUniqueId id;
    if (rank == 0) TESSERA_NCCL_CHECK(ncclGetUniqueId(&id));
    MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, comm);
    TESSERA_CUDA_CHECK(cudaSetDevice(device));
    TESSERA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    TESSERA_NCCL_CHECK(ncclCommInitRank(&comm_, size, id, rank));
  }
  ~RawNccl() {
    ncclCommDestroy(comm_);
    cudaStreamDestroy(stream_);
  }
  RawNccl(const RawNccl&) = delete;
  RawNccl& operator=(const RawNccl&) = delete;
  ncclComm_t comm() const { return comm_; }
  cudaStream_t stream() const { return stream_; }

 private:
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
};
#endif

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// One operation at one size: buffers, tessera's call, the baseline call, the
// busbw factor, and a correctness check.
struct Bench {
  std::string op;
  int64_t bytes = 0;  // nccl-tests size
  double bus_factor = 1;
  std::function<void()> tessera_call;
  std::function<void()> baseline_call;  // raw MPI, or raw NCCL (use_nccl_baseline)
  std::function<int64_t()> count_wrong;  // runs tessera once on known data
  std::vector<at::Tensor> buffers;       // {tensor} or {input, output}
};

Bench make_bench(const std::string& op, int64_t count, c10::ScalarType dtype, Communicator& comm, MPI_Comm raw,
                 const c10::Device& device) {
  const int n = comm.size(), r = comm.rank();
  const double nd = n;
  auto o = at::TensorOptions().dtype(dtype).device(device);
  const int64_t esize = c10::elementSize(dtype);
  MPI_Datatype type = mpi_type(dtype);
  Bench b;
  b.op = op;
  // Sizes follow nccl-tests: count elements in the full buffer, divisible by n.
  if (op == "all_reduce") {
    at::Tensor t = at::zeros({count}, o);
    b.buffers = {t};
    b.bytes = count * esize;
    b.bus_factor = 2 * (nd - 1) / nd;
    b.tessera_call = [&comm, t]() mutable { comm.all_reduce(t); };
    b.baseline_call = [=]() { MPI_Allreduce(MPI_IN_PLACE, t.data_ptr(), count, type, MPI_SUM, raw); };
    b.count_wrong = [&comm, t, r, n]() mutable {
      t.fill_(r + 1);
      comm.all_reduce(t);
      return t.ne(n * (n + 1) / 2).sum().item<int64_t>();
    };
  } else if (op == "all_gather") {
    const int64_t per = count / n;
    at::Tensor in = at::zeros({per}, o), out = at::zeros({per * n}, o);
    b.buffers = {in, out};
    b.bytes = per * n * esize;
    b.bus_factor = (nd - 1) / nd;
    b.tessera_call = [&comm, in, out]() mutable { comm.all_gather(out, in); };
    b.baseline_call = [=]() { MPI_Allgather(in.data_ptr(), per, type, out.data_ptr(), per, type, raw); };
    b.count_wrong = [&comm, in, out, r, n, per, dtype]() mutable {
      in.fill_(r);
      comm.all_gather(out, in);
      at::Tensor want = at::arange(n, at::kLong).repeat_interleave(per).to(out.options());
      return out.ne(want).sum().item<int64_t>();
    };
  } else if (op == "reduce_scatter") {
    const int64_t per = count / n;
    at::Tensor in = at::zeros({per * n}, o), out = at::zeros({per}, o);
    b.buffers = {in, out};
    b.bytes = per * n * esize;
    b.bus_factor = (nd - 1) / nd;
    b.tessera_call = [&comm, in, out]() mutable { comm.reduce_scatter(out, in); };
    b.baseline_call = [=]() { MPI_Reduce_scatter_block(in.data_ptr(), out.data_ptr(), per, type, MPI_SUM, raw); };
    b.count_wrong = [&comm, in, out, r, n]() mutable {
      in.fill_(r + 1);
      comm.reduce_scatter(out, in);
      return out.ne(n * (n + 1) / 2).sum().item<int64_t>();
    };
  } else if (op == "all_to_all") {
    const int64_t per = count / n;
    at::Tensor in = at::zeros({per * n}, o), out = at::zeros({per * n}, o);
    b.buffers = {in, out};
    b.bytes = per * n * esize;
    b.bus_factor = (nd - 1) / nd;
    b.tessera_call = [&comm, in, out]() mutable { comm.all_to_all(out, in); };
    b.baseline_call = [=]() { MPI_Alltoall(in.data_ptr(), per, type, out.data_ptr(), per, type, raw); };
    b.count_wrong = [&comm, in, out, r, n, per, dtype]() mutable {
      in.copy_((at::arange(n, at::kLong) * 100 + r).repeat_interleave(per).to(in.options()));
      comm.all_to_all(out, in);
      at::Tensor want = (at::arange(n, at::kLong) + 100 * r).repeat_interleave(per).to(out.options());
      return out.ne(want).sum().item<int64_t>();
    };
  } else if (op == "broadcast") {
    at::Tensor t = at::zeros({count}, o);
    b.buffers = {t};
    b.bytes = count * esize;
    b.tessera_call = [&comm, t]() mutable { comm.broadcast(t); };
    b.baseline_call = [=]() { MPI_Bcast(t.data_ptr(), count, type, 0, raw); };
    b.count_wrong = [&comm, t, r]() mutable {
      t.fill_(r == 0 ? 3 : 0);
      comm.broadcast(t);
      return t.ne(3).sum().item<int64_t>();
    };
  } else if (op == "reduce") {
    at::Tensor t = at::zeros({count}, o);
    b.buffers = {t};
    b.bytes = count * esize;
    b.tessera_call = [&comm, t]() mutable { comm.reduce(t); };
    b.baseline_call = [=]() {
      if (r == 0)
        MPI_Reduce(MPI_IN_PLACE, t.data_ptr(), count, type, MPI_SUM, 0, raw);
      else
        MPI_Reduce(t.data_ptr(), nullptr, count, type, MPI_SUM, 0, raw);
    };
    b.count_wrong = [&comm, t, r, n]() mutable {
      t.fill_(r + 1);
      comm.reduce(t);
      return r == 0 ? t.ne(n * (n + 1) / 2).sum().item<int64_t>() : int64_t{0};
    };
  } else {
    TORCH_CHECK(false, "unknown op '", op,
                "'; ops: all_reduce, all_gather, reduce_scatter, broadcast, reduce, all_to_all");
  }
  return b;
}

#if TESSERA_BENCH_NCCL
// Replaces b.baseline_call with the same operation on raw NCCL, on b's buffers.
void use_nccl_baseline(Bench& b, int64_t count, c10::ScalarType dtype, int n, const RawNccl& nccl) {
  const std::string& op = b.op;
  const std::vector<at::Tensor>& buffers = b.buffers;
  const ncclDataType_t type = nccl_type(dtype);
  ncclComm_t c = nccl.comm();
  cudaStream_t s = nccl.stream();
  const int64_t esize = c10::elementSize(dtype);
  if (op == "all_reduce") {
    at::Tensor t = buffers.at(0);
    b.baseline_call = [=] { TESSERA_NCCL_CHECK(ncclAllReduce(t.data_ptr(), t.data_ptr(), count, type, ncclSum, c, s)); };
  } else if (op == "all_gather") {
    at::Tensor in = buffers.at(0), out = buffers.at(1);
    b.baseline_call = [=] { TESSERA_NCCL_CHECK(ncclAllGather(in.data_ptr(), out.data_ptr(), count / n, type, c, s)); };
  } else if (op == "reduce_scatter") {
    at::Tensor in = buffers.at(0), out = buffers.at(1);
    b.baseline_call = [=] {
      TESSERA_NCCL_CHECK(ncclReduceScatter(in.data_ptr(), out.data_ptr(), count / n, type, ncclSum, c, s));
    };
  } else if (op == "all_to_all") {
    at::Tensor in = buffers.at(0), out = buffers.at(1);
    b.baseline_call = [=] {
      const int64_t per = count / n;
      auto* src = static_cast<char*>(in.data_ptr());
      auto* dst = static_cast<char*>(out.data_ptr());
      TESSERA_NCCL_CHECK(ncclGroupStart());
      for (int peer = 0; peer < n; ++peer) {
        TESSERA_NCCL_CHECK(ncclSend(src + peer * per * esize, per, type, peer, c, s));
        TESSERA_NCCL_CHECK(ncclRecv(dst + peer * per * esize, per, type, peer, c, s));
      }
      TESSERA_NCCL_CHECK(ncclGroupEnd());
    };
  } else if (op == "broadcast") {
    at::Tensor t = buffers.at(0);
    b.baseline_call = [=] { TESSERA_NCCL_CHECK(ncclBroadcast(t.data_ptr(), t.data_ptr(), count, type, 0, c, s)); };
  } else if (op == "reduce") {
    at::Tensor t = buffers.at(0);
    b.baseline_call = [=] { TESSERA_NCCL_CHECK(ncclReduce(t.data_ptr(), t.data_ptr(), count, type, ncclSum, 0, c, s)); };
  }
}
#endif

// Seconds per call: the maximum over ranks of this rank's mean over iters;
// `sync` waits for the device (GPU work is timed to completion).
double time_calls(const std::function<void()>& call, int iters, MPI_Comm raw, const std::function<void()>& sync) {
  sync();
  MPI_Barrier(raw);
  const double start = now();
  for (int i = 0; i < iters; ++i) call();
  sync();
  double t = (now() - start) / iters, worst = 0;
  MPI_Allreduce(&t, &worst, 1, MPI_DOUBLE, MPI_MAX, raw);
  return worst;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int run(const Args& args) {
  TORCH_CHECK(args.factor >= 2 && args.rounds >= 1 && args.min_bytes >= 1 && args.max_bytes >= args.min_bytes,
              "need --factor >= 2, --rounds >= 1 and 1 <= --min-bytes <= --max-bytes");
  std::vector<std::string> ops;
  std::stringstream listed(args.ops);
  for (std::string op; std::getline(listed, op, ',');) ops.push_back(op);
  const c10::ScalarType dtype = tessera::dtype_from_name(args.dtype);
  const bool nccl = args.backend == "nccl";
#if !TESSERA_BENCH_NCCL
  TORCH_CHECK(!nccl, "--backend nccl: this comm_bench was built without the NCCL backend (a LibTorch with CUDA, "
                     "nccl.h and the CUDA runtime are needed at build time); use --backend mpi");
#endif
  tessera::comm::CommunicatorPtr comm;
  c10::Device device = c10::kCPU;
  MPI_Comm raw;
  MPI_Comm_dup(MPI_COMM_WORLD, &raw);
  std::function<void()> sync = [] {};
#if TESSERA_BENCH_NCCL
  std::unique_ptr<RawNccl> raw_nccl;
  if (nccl) {
    device = tessera::context::local_device();
    TORCH_CHECK(device.is_cuda(), "--backend nccl needs a CUDA device; LibTorch sees none on this rank");
    comm = tessera::comm::NcclCommunicator::create(MPI_COMM_WORLD, device.index(), "world");
    raw_nccl = std::make_unique<RawNccl>(raw, device.index());
    sync = [] { TESSERA_CUDA_CHECK(cudaDeviceSynchronize()); };
  }
#endif
  if (!nccl) comm = MpiCommunicator::world();
  const int n = comm->size(), rank = comm->rank();
  const int64_t esize = c10::elementSize(dtype);
  if (rank == 0 && !args.json) {
    fmt::print("# comm_bench: {} ranks, backend {} on {}, dtype {}, {} rounds, tessera {} (LibTorch {})\n", n,
               args.backend, device.str(), args.dtype, args.rounds, TESSERA_VERSION, tessera::torch_version_string());
    fmt::print("# {:<15}{:>12}{:>12}{:>11}{:>11}{:>9}{:>12}{:>11}{:>9}\n", "op", "bytes", "time_us", "algbw", "busbw",
               "#wrong", nccl ? "nccl_us" : "mpi_us", nccl ? "nccl_busbw" : "mpi_busbw", "ratio");
  }
  for (const auto& op : ops) {
    for (int64_t bytes = args.min_bytes; bytes <= args.max_bytes; bytes *= args.factor) {
      int64_t count = std::max<int64_t>(bytes / esize, 1);
      if (op != "all_reduce" && op != "broadcast" && op != "reduce") count = std::max<int64_t>(count / n * n, n);
      Bench b = make_bench(op, count, dtype, *comm, raw, device);
#if TESSERA_BENCH_NCCL
      if (nccl) use_nccl_baseline(b, count, dtype, n, *raw_nccl);
#endif
      // Calibrate: enough iterations for --round-ms per round, at least 1.
      for (int i = 0; i < args.warmup; ++i) {
        b.tessera_call();
        b.baseline_call();
      }
      const double one = time_calls(b.tessera_call, 1, raw, sync);
      const int iters = static_cast<int>(std::clamp(args.round_ms * 1e-3 / std::max(one, 1e-7), 1.0, 2000.0));
      std::vector<double> ours, theirs;
      // Which of the two goes first alternates, so neither profits from
      // always following the other (warm caches, a neighbour's timing).
      for (int round = 0; round < args.rounds; ++round) {
        if (round % 2 == 0) ours.push_back(time_calls(b.tessera_call, iters, raw, sync));
        theirs.push_back(time_calls(b.baseline_call, iters, raw, sync));
        if (round % 2 == 1) ours.push_back(time_calls(b.tessera_call, iters, raw, sync));
      }
      int64_t wrong = b.count_wrong(), total_wrong = 0;
      MPI_Allreduce(&wrong, &total_wrong, 1, MPI_INT64_T, MPI_SUM, raw);
      // The ratio is the median of per-round ratios: each round's pair ran
      // back to back, so slow drift of the machine cancels within a pair.
      std::vector<double> paired;
      for (int round = 0; round < args.rounds; ++round) paired.push_back(theirs[round] / ours[round]);
      const double ratio = median(paired);
      const double t = median(ours), tb = median(theirs);
      const double algbw = b.bytes / t / 1e9, busbw = algbw * b.bus_factor;
      const double base_busbw = b.bytes / tb / 1e9 * b.bus_factor;
      if (rank != 0) continue;
      if (args.json) {
        fmt::print(
            "{{\"op\": \"{}\", \"bytes\": {}, \"dtype\": \"{}\", \"ranks\": {}, \"iters\": {}, \"rounds\": {}, "
            "\"backend\": \"{}\", \"device\": \"{}\", \"baseline\": \"{}\", "
            "\"time_us\": {:.3f}, \"algbw_gbps\": {:.4f}, \"busbw_gbps\": {:.4f}, "
            "\"baseline_time_us\": {:.3f}, \"baseline_busbw_gbps\": {:.4f}, \"ratio\": {:.4f}, "
            "\"wrong\": {}}}\n",
            op, b.bytes, args.dtype, n, iters, args.rounds, args.backend, device.str(), nccl ? "raw NCCL" : "raw MPI",
            t * 1e6, algbw, busbw, tb * 1e6, base_busbw, ratio, total_wrong);
      } else {
        fmt::print("  {:<15}{:>12}{:>12.2f}{:>11.3f}{:>11.3f}{:>9}{:>12.2f}{:>11.3f}{:>9.3f}\n", op, b.bytes, t * 1e6,
                   algbw, busbw, total_wrong, tb * 1e6, base_busbw, ratio);
      }
      std::fflush(stdout);
    }
  }
#if TESSERA_BENCH_NCCL
  raw_nccl.reset();
#endif
  comm.reset();
  MPI_Comm_free(&raw);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  tessera::cli::Command c = command(a);
  return tessera_examples::run_command(argc, argv, c, [&] { return run(a); });
}
