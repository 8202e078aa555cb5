// The back end `loom plan` builds a rank's roles on: it allocates nothing and computes nothing. Every
// allocation is filed in the ledger as the real back end would file it, at an address that is never
// dereferenced (device space, so host code that reached into it would be a bug the seams tests
// catch); every kernel throws, so a planner that ran one would say so rather than predict from
// garbage. The workspace of a step's products is the wrapped back end's (plan_workspace), or for a
// cuda run the CUDA back end's (core/backend/workspace_plan.hpp), whose communicators are NCCL's.
#include <stdexcept>

#include "core/backend/device_address.hpp"
#include "core/backend/forwarding_backend.hpp"
#include "core/backend/workspace_plan.hpp"

namespace loom {
namespace {

class SizingBackend final : public ForwardingBackend {
 public:
  SizingBackend(std::unique_ptr<Backend> like, bool cuda) : ForwardingBackend(std::move(like)), cuda_(cuda) {}
  std::string name() const override { return "sizing"; }
  std::string description() const override {
    return "counts allocations for loom plan (" + (cuda_ ? std::string("cuda") : inner().name()) + ")";
  }
  MemSpace space() const override { return MemSpace::device; }
  TypedBuffer allocate(const std::string&, DType type, std::int64_t count, Mem category) override {
    // Distinct, 256-byte aligned, never-mapped addresses (above 2^47, outside the user address space).
    const std::uintptr_t at = next_;
    next_ += (static_cast<std::uintptr_t>(count) * dtype_size(type) + 511) / 256 * 256;
    return TypedBuffer(BufferRef(reinterpret_cast<void*>(at), type, count, MemSpace::device), category, [](void*) {});
  }
  void copy_from_host(BufferRef, const void*) override {}  // initial values: nothing to size
  void copy_to_host(void*, BufferRef) override { before_op("copy_to_host"); }
  void synchronize() override {}
  void release_scratch() override {}
  void plan_workspace(StepPlan& plan, const std::vector<MatmulCall>& calls,
                      const AttentionShape& attention) const override {
    if (cuda_)
      plan.add_scratch(Mem::workspace, cuda_plan::workspace_bytes(precision_.matmul, calls, attention));
    else
      inner().plan_workspace(plan, calls, attention);
  }
  std::int64_t topk_scratch_bytes(std::int64_t n) const override {
    return cuda_ ? cuda_plan::topk_scratch_bytes(n) : inner().topk_scratch_bytes(n);
  }
  bool ring_scratch_pools() const override { return !cuda_ && inner().ring_scratch_pools(); }
  // What the back end it stands for can run.
  std::string flash_attention_refusal(int hs) const override {
    return cuda_ ? flash_head_size_refusal(hs) : inner().flash_attention_refusal(hs);
  }
  // A planned cuda run is assumed to have cuDNN; the shape rules are cuDNN's (cudnn_shape_refusal).
  std::string cudnn_attention_refusal(int T, int hs) const override {
    return cuda_ ? cudnn_shape_refusal(T, hs) : inner().cudnn_attention_refusal(T, hs);
  }
  // A planned cuda run has the CUDA back end's ring attention.
  std::string ring_attention_refusal() const override { return cuda_ ? "" : inner().ring_attention_refusal(); }
  // A planned cuda run has the CUDA back end's expert row kernels.
  std::string expert_rows_refusal() const override { return cuda_ ? "" : inner().expert_rows_refusal(); }

 protected:
  // Every operation of the list (core/backend/backend_ops.hpp) is refused by name.
  void before_op(const char* what) override {
    throw std::logic_error(std::string("loom plan's sizing back end ran a kernel (") + what +
                           "): building a rank's roles must only allocate");
  }

 private:
  bool cuda_;  // plans a cuda run: its workspace, not the wrapped back end's, and NCCL between ranks
  std::uintptr_t next_ = device_address::kSizingBase;
};

}  // namespace

std::unique_ptr<Backend> make_sizing_backend(std::unique_ptr<Backend> like) {
  return std::make_unique<SizingBackend>(std::move(like), false);
}

std::unique_ptr<Backend> make_cuda_sizing_backend() {
  return std::make_unique<SizingBackend>(make_host_backend(1), true);
}

}  // namespace loom
