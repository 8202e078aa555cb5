// The emulated device's NCCL (include/nccl.h): each operation carried by a non-blocking MPI
// operation between the processes whose emulated devices the communicator joins, posted when its
// stream reaches it and holding up that stream (only) until it completes, as NCCL's kernels do. A
// peer that never joins shows as a wait that sees nothing move (LOOM_CUDA_EMU_WAIT_TIMEOUT, or the
// communicator's own run.comm_timeout first). bf16 and fp16 are reduced through fp32, one rounding
// per step.
#include <mpi.h>
#include <nccl.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <cstdio>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "core/cuda/emu/runtime.hpp"
#include "core/base/dtype.hpp"

struct ncclComm {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0, size = 1;
};

namespace {

using loom::cuda_emu::rt::host_address;

constexpr std::uint32_t kMagic = 0x4e43434c;  // "NCCL"
constexpr int kTagBase = 0x4c4f;              // MPI_COMM_WORLD tags of the id exchange
struct IdContents {
  std::uint32_t magic;
  int root_world_rank;
  unsigned serial;
};
int group_depth = 0;

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

std::size_t type_bytes(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
    case ncclUint8:
      return 1;
    case ncclFloat16:
    case ncclBfloat16:
      return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32:
      return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64:
      return 8;
  }
  return 0;
}

// 16-bit floating-point reductions: MPI has no such types, so user operations on 2-byte words.
template <class T, bool Max>
void reduce16(void* in, void* inout, int* len, MPI_Datatype*) {
  auto* a = static_cast<T*>(in);
  auto* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) {
    const float x = loom::to_float(a[i]), y = loom::to_float(b[i]);
    const float r = Max ? (x > y ? x : y) : x + y;
    if constexpr (std::is_same_v<T, loom::bf16>)
      b[i] = loom::to_bf16(r);
    else
      b[i] = loom::to_f16(r);
  }
}
MPI_Op op16(ncclDataType_t t, ncclRedOp_t op) {
  static MPI_Op ops[2][2] = {{MPI_OP_NULL, MPI_OP_NULL}, {MPI_OP_NULL, MPI_OP_NULL}};
  const int ti = t == ncclBfloat16 ? 0 : 1, oi = op == ncclMax ? 1 : 0;
  if (ops[ti][oi] == MPI_OP_NULL) {
    MPI_User_function* f = ti == 0 ? (oi ? reduce16<loom::bf16, true> : reduce16<loom::bf16, false>)
                                   : (oi ? reduce16<loom::f16, true> : reduce16<loom::f16, false>);
    MPI_Op_create(f, 1, &ops[ti][oi]);
  }
  return ops[ti][oi];
}

MPI_Datatype mpi_type(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
      return MPI_INT8_T;
    case ncclUint8:
      return MPI_UINT8_T;
    case ncclInt32:
      return MPI_INT32_T;
    case ncclUint32:
      return MPI_UINT32_T;
    case ncclInt64:
      return MPI_INT64_T;
    case ncclUint64:
      return MPI_UINT64_T;
    case ncclFloat32:
      return MPI_FLOAT;
    case ncclFloat64:
      return MPI_DOUBLE;
    case ncclFloat16:
    case ncclBfloat16:
      return MPI_UINT16_T;
  }
  return MPI_DATATYPE_NULL;
}
MPI_Op mpi_op(ncclDataType_t t, ncclRedOp_t op) {
  if (t == ncclFloat16 || t == ncclBfloat16) return op16(t, op);
  return op == ncclMax ? MPI_MAX : op == ncclMin ? MPI_MIN : op == ncclProd ? MPI_PROD : MPI_SUM;
}

// Queues an operation on the stream: its MPI request is posted when the stream reaches it (its
// inputs are ready then), and the stream goes on once the request completes. Within a group, every
// operation is posted before any is waited for (at ncclGroupEnd), as NCCL runs a group's together.
// An operation in flight: its request, and a host copy of an input MPI must not see aliased by the
// output (kept until the request completes).
struct InFlight {
  MPI_Request request = MPI_REQUEST_NULL;
  std::vector<unsigned char> staged;
};
struct Pending {
  cudaStream_t stream;
  std::shared_ptr<InFlight> op;
  const char* what;  // the operation's name (a literal), which a stalled wait reports
};
std::vector<Pending> group_waits;

void queue_wait(const Pending& p) {
  loom::cuda_emu::rt::enqueue_step(p.stream, p.what, [op = p.op] {
    int done = 0;
    MPI_Test(&op->request, &done, MPI_STATUS_IGNORE);
    return done != 0;
  });
}

// What the emulator does not carry: a reduction MPI has no match for, or a count beyond an int.
bool emulated(ncclDataType_t type, ncclRedOp_t op, std::size_t count, const char* what) {
  const bool sixteen = type == ncclFloat16 || type == ncclBfloat16;
  std::string why;
  if (op == ncclAvg)
    why = "ncclAvg";
  else if (sixteen && op != ncclSum && op != ncclMax)
    why = "a 16-bit reduction other than sum and max";
  else if (count > static_cast<std::size_t>(std::numeric_limits<int>::max()))
    why = "a count beyond 2^31 - 1";
  if (why.empty()) return true;
  std::fprintf(stderr, "loom cuda emulator: %s: %s is not emulated\n", what, why.c_str());
  return false;
}

template <class Start>
ncclResult_t issue(const char* what, ncclComm_t comm, cudaStream_t stream, Start&& start) {
  if (!comm || comm->comm == MPI_COMM_NULL) return ncclInvalidArgument;
  auto op = std::make_shared<InFlight>();
  const std::string name = what;
  loom::cuda_emu::rt::enqueue_step(stream, what, [op, name, start] {
    try {
      start(op.get());
    } catch (const std::invalid_argument& e) {
      throw std::runtime_error(name + ": " + e.what());
    }
    return true;
  });
  const Pending p{stream, op, what};
  if (group_depth > 0)
    group_waits.push_back(p);
  else
    queue_wait(p);
  return ncclSuccess;
}

void* device(const void* p, std::size_t count, ncclDataType_t t, const char* what) {
  return host_address(p, count * type_bytes(t), what);
}

}  // namespace

extern "C" {

ncclResult_t ncclGetVersion(int* version) {
  *version = 0;  // "NCCL 0.0.0": the emulator, not a release
  return ncclSuccess;
}
const char* ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess:
      return "no error";
    case ncclInvalidArgument:
      return "invalid argument (emulated NCCL)";
    case ncclInvalidUsage:
      return "invalid usage (emulated NCCL)";
    default:
      return "internal error (emulated NCCL)";
  }
}
ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  static unsigned serial = 0;
  std::memset(id, 0, sizeof *id);
  const IdContents c{kMagic, world_rank(), serial++};
  std::memcpy(id->internal, &c, sizeof c);
  return ncclSuccess;
}
// The members find one another through the id's root (its MPI_COMM_WORLD rank), then make an MPI
// communicator of the group in NCCL rank order, collectively over the members only.
ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
  IdContents c;
  std::memcpy(&c, id.internal, sizeof c);
  if (c.magic != kMagic || nranks < 1 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
  const int tag = kTagBase + static_cast<int>(c.serial % 1024);
  std::vector<int> world(static_cast<std::size_t>(nranks), -1);
  const int me = world_rank();
  if (rank == 0) {
    if (me != c.root_world_rank) return ncclInvalidUsage;
    world[0] = me;
    for (int i = 1; i < nranks; ++i) {
      int pair[2];
      MPI_Recv(pair, 2, MPI_INT, MPI_ANY_SOURCE, tag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      if (pair[0] < 1 || pair[0] >= nranks) return ncclInvalidUsage;
      world[static_cast<std::size_t>(pair[0])] = pair[1];
    }
    for (int i = 1; i < nranks; ++i)
      MPI_Send(world.data(), nranks, MPI_INT, world[static_cast<std::size_t>(i)], tag, MPI_COMM_WORLD);
  } else {
    const int pair[2] = {rank, me};
    MPI_Send(pair, 2, MPI_INT, c.root_world_rank, tag, MPI_COMM_WORLD);
    MPI_Recv(world.data(), nranks, MPI_INT, c.root_world_rank, tag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  }
  MPI_Group all, members;
  MPI_Comm_group(MPI_COMM_WORLD, &all);
  MPI_Group_incl(all, nranks, world.data(), &members);
  auto made = std::make_unique<ncclComm>();
  MPI_Comm_create_group(MPI_COMM_WORLD, members, tag, &made->comm);
  MPI_Group_free(&members);
  MPI_Group_free(&all);
  made->rank = rank;
  made->size = nranks;
  *comm = made.release();
  return ncclSuccess;
}
ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (!comm) return ncclSuccess;
  cudaDeviceSynchronize();  // its operations complete first
  if (comm->comm != MPI_COMM_NULL) MPI_Comm_free(&comm->comm);
  delete comm;
  return ncclSuccess;
}
ncclResult_t ncclCommAbort(ncclComm_t comm) {
  (void)comm;  // kept (steps still queued hold it); its MPI communicator is left to MPI_Abort, which follows
  return ncclSuccess;
}
ncclResult_t ncclGroupStart() {
  ++group_depth;
  return ncclSuccess;
}
ncclResult_t ncclGroupEnd() {
  if (group_depth == 0) return ncclInvalidUsage;
  if (--group_depth == 0) {
    for (const Pending& p : group_waits) queue_wait(p);
    group_waits.clear();
  }
  return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void* send, void* recv, std::size_t count, ncclDataType_t type, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t stream) {
  if (!emulated(type, op, count, "ncclAllReduce")) return ncclInvalidArgument;
  return issue("ncclAllReduce", comm, stream, [=](InFlight* f) {
    void* out = device(recv, count, type, "ncclAllReduce's output");
    const void* in = send == recv ? MPI_IN_PLACE : device(send, count, type, "ncclAllReduce's input");
    MPI_Iallreduce(in, out, static_cast<int>(count), mpi_type(type), mpi_op(type, op), comm->comm, &f->request);
  });
}
ncclResult_t ncclReduceScatter(const void* send, void* recv, std::size_t count, ncclDataType_t type, ncclRedOp_t op,
                               ncclComm_t comm, cudaStream_t stream) {
  if (!emulated(type, op, count * std::size_t(comm ? comm->size : 1), "ncclReduceScatter")) return ncclInvalidArgument;
  return issue("ncclReduceScatter", comm, stream, [=](InFlight* f) {
    const void* in = device(send, count * std::size_t(comm->size), type, "ncclReduceScatter's input");
    void* out = device(recv, count, type, "ncclReduceScatter's output");
    // NCCL's in place is the output inside the input (ZeRO's shards do that); MPI forbids aliased
    // buffers and means another layout by MPI_IN_PLACE: reduce a copy of the input.
    const auto* bytes = static_cast<const unsigned char*>(in);
    f->staged.assign(bytes, bytes + count * std::size_t(comm->size) * type_bytes(type));
    in = f->staged.data();
    MPI_Ireduce_scatter_block(in, out, static_cast<int>(count), mpi_type(type), mpi_op(type, op), comm->comm,
                              &f->request);
  });
}
ncclResult_t ncclAllGather(const void* send, void* recv, std::size_t count, ncclDataType_t type, ncclComm_t comm,
                           cudaStream_t stream) {
  if (!emulated(type, ncclSum, count * std::size_t(comm ? comm->size : 1), "ncclAllGather")) return ncclInvalidArgument;
  return issue("ncclAllGather", comm, stream, [=](InFlight* f) {
    void* out = device(recv, count * std::size_t(comm->size), type, "ncclAllGather's output");
    const void* in = device(send, count, type, "ncclAllGather's input");
    if (in == static_cast<char*>(out) + std::size_t(comm->rank) * count * type_bytes(type)) in = MPI_IN_PLACE;
    MPI_Iallgather(in, static_cast<int>(count), mpi_type(type), out, static_cast<int>(count), mpi_type(type),
                   comm->comm, &f->request);
  });
}
ncclResult_t ncclBroadcast(const void* send, void* recv, std::size_t count, ncclDataType_t type, int root,
                           ncclComm_t comm, cudaStream_t stream) {
  if (!emulated(type, ncclSum, count, "ncclBroadcast")) return ncclInvalidArgument;
  return issue("ncclBroadcast", comm, stream, [=](InFlight* f) {
    void* out = device(recv, count, type, "ncclBroadcast's output");
    if (comm->rank == root && send != recv)
      std::memmove(out, device(send, count, type, "ncclBroadcast's input"), count * type_bytes(type));
    MPI_Ibcast(out, static_cast<int>(count), mpi_type(type), root, comm->comm, &f->request);
  });
}
ncclResult_t ncclReduce(const void* send, void* recv, std::size_t count, ncclDataType_t type, ncclRedOp_t op, int root,
                        ncclComm_t comm, cudaStream_t stream) {
  if (!emulated(type, op, count, "ncclReduce")) return ncclInvalidArgument;
  return issue("ncclReduce", comm, stream, [=](InFlight* f) {
    const void* in = device(send, count, type, "ncclReduce's input");
    void* out = comm->rank == root ? device(recv, count, type, "ncclReduce's output") : nullptr;
    if (comm->rank == root && in == out) in = MPI_IN_PLACE;
    MPI_Ireduce(in, out, static_cast<int>(count), mpi_type(type), mpi_op(type, op), root, comm->comm, &f->request);
  });
}
ncclResult_t ncclSend(const void* send, std::size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  if (!emulated(type, ncclSum, count, "ncclSend")) return ncclInvalidArgument;
  return issue("ncclSend", comm, stream, [=](InFlight* f) {
    // Synchronous mode: complete only when the peer receives, as NCCL's send (an eager MPI send would
    // let an unmatched send pass here that deadlocks on a GPU).
    MPI_Issend(device(send, count, type, "ncclSend's input"), static_cast<int>(count), mpi_type(type), peer, 0,
               comm->comm, &f->request);
  });
}
ncclResult_t ncclRecv(void* recv, std::size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  if (!emulated(type, ncclSum, count, "ncclRecv")) return ncclInvalidArgument;
  return issue("ncclRecv", comm, stream, [=](InFlight* f) {
    MPI_Irecv(device(recv, count, type, "ncclRecv's output"), static_cast<int>(count), mpi_type(type), peer, 0,
              comm->comm, &f->request);
  });
}

}  // extern "C"
