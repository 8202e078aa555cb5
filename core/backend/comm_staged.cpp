// The communicator of a device back end without NCCL (or whose ranks share a GPU, which NCCL
// refuses): device buffers travel through host copies and the MPI communicator it wraps; host
// buffers (the scalars) go to that communicator unchanged. See core/comm/comm.hpp, make_staged_communicator.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/backend/backend.hpp"
#include "core/comm/comm.hpp"

namespace loom {
namespace {

bool within(const BufferRef& inner, const BufferRef& outer) {
  const auto* i = static_cast<const char*>(inner.data);
  const auto* o = static_cast<const char*>(outer.data);
  return inner.count > 0 && i >= o && i + inner.bytes() <= o + outer.bytes();
}

class StagedCommunicator;

// One staged operation: the host copies it runs on, and what goes back to the device when it completes.
class StagedRequest final : public CommRequest {
 public:
  StagedRequest(StagedCommunicator* c, CommRequestPtr inner, std::vector<std::pair<BufferRef, void*>> back,
                std::vector<std::byte> host)
      : comm_(c), host_(std::move(host)), inner_(std::move(inner)), back_(std::move(back)) {}
  bool test() override;
  void wait() override;

 private:
  void finish();
  StagedCommunicator* comm_;
  // The copies (one block; aliased buffers share it). Declared before inner_, so destroyed after it:
  // a request dropped unfinished completes its MPI operation (the MPI requests' destructors do) while
  // the memory it moves is still there.
  std::vector<std::byte> host_;
  CommRequestPtr inner_;
  std::vector<std::pair<BufferRef, void*>> back_;  // device buffer <- its host copy, on completion
  bool done_ = false;
};

class StagedCommunicator final : public Communicator {
 public:
  StagedCommunicator(std::unique_ptr<Communicator> inner, Backend& backend)
      : inner_(std::move(inner)), backend_(backend) {}
  const std::string& name() const override { return inner_->name(); }
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  void progress() override {
    inner_->progress();
    refresh();
  }
  void barrier() override {
    inner_->barrier();
    refresh();
  }
  // Its collectives are the MPI communicator's, on host copies: the same ring scratch.
  void reserve_scratch(const std::map<std::size_t, int>& buffers_per_class) override {
    inner_->reserve_scratch(buffers_per_class);
  }
  ScratchUse scratch_use() const override { return inner_->scratch_use(); }
  // Adds what the MPI communicator counted since the last look.
  void refresh() { add_counts_since(inner_->stats(), seen_); }
  Backend& backend() { return backend_; }

 protected:
  CommRequestPtr start_all_reduce(BufferRef data, ReduceOp op) override {
    Staging s(*this, data, BufferRef(), true);
    return s.done(inner_->all_reduce_async(s.host(data), op), {data});
  }
  CommRequestPtr start_reduce_scatter(BufferRef send, BufferRef recv, const std::vector<std::int64_t>& counts,
                                      ReduceOp op) override {
    Staging s(*this, send, recv, true);
    return s.done(inner_->reduce_scatter_async(s.host(send), s.host(recv), counts, op), {recv});
  }
  CommRequestPtr start_all_gather(BufferRef send, BufferRef recv, const std::vector<std::int64_t>& counts) override {
    Staging s(*this, send, recv, true);
    return s.done(inner_->all_gather_async(s.host(send), s.host(recv), counts), {recv});
  }
  CommRequestPtr start_broadcast(BufferRef data, int root) override {
    Staging s(*this, data, BufferRef(), inner_->rank() == root);
    return s.done(inner_->broadcast_async(s.host(data), root), {data});
  }
  CommRequestPtr start_send(BufferRef data, int peer, int tag) override {
    Staging s(*this, data, BufferRef(), true);
    return s.done(inner_->send_async(s.host(data), peer, tag), {});
  }
  CommRequestPtr start_recv(BufferRef data, int peer, int tag) override {
    Staging s(*this, data, BufferRef(), false);
    return s.done(inner_->recv_async(s.host(data), peer, tag), {data});
  }

 private:
  // The host copies of one operation's device buffers: `a` (the input, copied in when `fill`) and
  // `b` in one block, or one inside the other's copy when one lies inside the other (the in-place
  // reduce-scatter and all-gather). Host buffers are used as they are.
  class Staging {
   public:
    Staging(StagedCommunicator& c, BufferRef a, BufferRef b, bool fill) : c_(c) {
      const bool a_dev = a.space == MemSpace::device && a.count > 0;
      const bool b_dev = b.space == MemSpace::device && b.count > 0;
      if (a_dev && b_dev && within(b, a)) {
        outer_ = a;
      } else if (a_dev && b_dev && within(a, b)) {
        outer_ = b;  // a is a block of b: b's other blocks round-trip unchanged
      } else {
        if (a_dev) place(a);
        if (b_dev) place(b);
      }
      if (outer_.count > 0) place(outer_);
      host_.resize(size_);
      if (fill) {
        if (outer_.count > 0)
          copy_in(outer_);
        else if (a_dev)
          copy_in(a);
      }
    }
    // The host copy of `x` (x itself when it is host memory).
    BufferRef host(const BufferRef& x) const {
      if (x.space != MemSpace::device || x.count == 0)
        return x.space == MemSpace::device ? BufferRef(nullptr, x.type, 0) : x;
      const BufferRef& base = outer_.count > 0 ? outer_ : x;
      const std::size_t at = offset(base) + static_cast<std::size_t>(static_cast<const char*>(x.data) -
                                                                     static_cast<const char*>(base.data));
      return BufferRef(const_cast<std::byte*>(host_.data()) + at, x.type, x.count, MemSpace::host);
    }
    CommRequestPtr done(CommRequestPtr inner, std::vector<BufferRef> outputs) {
      std::vector<std::pair<BufferRef, void*>> back;
      for (const BufferRef& o : outputs)
        if (o.space == MemSpace::device && o.count > 0) back.push_back({o, host(o).data});
      return std::make_unique<StagedRequest>(&c_, std::move(inner), std::move(back), std::move(host_));
    }

   private:
    void place(const BufferRef& x) {
      at_.push_back({x.data, size_});
      size_ += (x.bytes() + 63) / 64 * 64;
    }
    std::size_t offset(const BufferRef& x) const {
      for (const auto& [p, at] : at_)
        if (p == x.data) return at;
      return 0;
    }
    void copy_in(const BufferRef& x) { c_.backend().copy_to_host(host(x).data, x); }
    StagedCommunicator& c_;
    BufferRef outer_;
    std::vector<std::pair<const void*, std::size_t>> at_;
    std::size_t size_ = 0;
    std::vector<std::byte> host_;
  };

  std::unique_ptr<Communicator> inner_;
  Backend& backend_;
  CommStats seen_;
};

bool StagedRequest::test() {
  if (done_) return true;
  const bool complete = inner_->test();
  comm_->refresh();
  if (complete) finish();
  return complete;
}

void StagedRequest::wait() {
  if (done_) return;
  inner_->wait();
  comm_->refresh();
  finish();
}

void StagedRequest::finish() {
  for (const auto& [device, host] : back_) comm_->backend().copy_from_host(device, host);
  done_ = true;
}

}  // namespace

std::unique_ptr<Communicator> make_staged_communicator(std::unique_ptr<Communicator> inner, Backend& backend) {
  return std::make_unique<StagedCommunicator>(std::move(inner), backend);
}

std::unique_ptr<Communicator> Backend::make_communicator(MPI_Comm comm, const std::string& name) {
  std::unique_ptr<Communicator> mpi = make_mpi_communicator(comm, name);
  if (space() == MemSpace::host) return mpi;
  return make_staged_communicator(std::move(mpi), *this);
}

}  // namespace loom
