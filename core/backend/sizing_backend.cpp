// The back end `loom plan` builds a rank's roles on: it allocates nothing and computes nothing. Every
// allocation is filed in the ledger as the real back end would file it, at an address that is never
// dereferenced (device space, so host code that reached into it would be a bug the seams tests
// catch); every kernel throws, so a planner that ran one would say so rather than predict from
// garbage. The workspace of a step's products is the wrapped back end's (plan_workspace), or for a
// cuda run the CUDA back end's (core/backend/workspace_plan.hpp), whose communicators are NCCL's.
#include <stdexcept>

#include "core/backend/backend.hpp"
#include "core/backend/workspace_plan.hpp"

namespace loom {
namespace {

class SizingBackend final : public Backend {
 public:
  SizingBackend(std::unique_ptr<Backend> like, bool cuda) : like_(std::move(like)), cuda_(cuda) {}
  std::string name() const override { return "sizing"; }
  std::string description() const override {
    return "counts allocations for loom plan (" + (cuda_ ? std::string("cuda") : like_->name()) + ")";
  }
  MemSpace space() const override { return MemSpace::device; }
  void set_precision(const Precision& p) override {
    like_->set_precision(p);
    precision_ = p;
  }
  TypedBuffer allocate(const std::string&, DType type, std::int64_t count, Mem category) override {
    // Distinct, 256-byte aligned, never-mapped addresses (above 2^47, outside the user address space).
    const std::uintptr_t at = next_;
    next_ += (static_cast<std::uintptr_t>(count) * dtype_size(type) + 511) / 256 * 256;
    return TypedBuffer(BufferRef(reinterpret_cast<void*>(at), type, count, MemSpace::device), category, [](void*) {});
  }
  void copy_from_host(BufferRef, const void*) override {}  // initial values: nothing to size
  void copy_to_host(void*, BufferRef) override { no("copy_to_host"); }
  void plan_workspace(StepPlan& plan, const std::vector<MatmulCall>& calls, const AttentionShape& attention) const override {
    if (cuda_)
      plan.add_scratch(Mem::workspace, cuda_plan::workspace_bytes(precision_.matmul, calls, attention));
    else
      like_->plan_workspace(plan, calls, attention);
  }
  std::int64_t topk_scratch_bytes(std::int64_t n) const override {
    return cuda_ ? cuda_plan::topk_scratch_bytes(n) : like_->topk_scratch_bytes(n);
  }
  bool ring_scratch_pools() const override { return !cuda_ && like_->ring_scratch_pools(); }

  void encoder_forward(float*, const std::int32_t*, const float*, const float*, int, int, int, int, int, bool) override {
    no("encoder_forward");
  }
  void encoder_backward(float*, float*, const float*, const std::int32_t*, int, int, int, int, int) override {
    no("encoder_backward");
  }
  void layernorm_forward(float*, float*, float*, const float*, const float*, const float*, int, int) override {
    no("layernorm_forward");
  }
  void layernorm_backward(float*, float*, float*, const float*, const float*, const float*, const float*, const float*,
                          int, int) override {
    no("layernorm_backward");
  }
  void matmul_forward(float*, const float*, const float*, const float*, int, int, int) override { no("matmul_forward"); }
  void bias_add(float*, const float*, int, int) override { no("bias_add"); }
  void bias_backward(float*, const float*, int, int) override { no("bias_backward"); }
  void matmul_backward(float*, float*, float*, const float*, const float*, const float*, int, int, int) override {
    no("matmul_backward");
  }
  void attention_forward(float*, float*, const float*, int, int, int, int) override { no("attention_forward"); }
  void attention_backward(float*, float*, const float*, const float*, const float*, int, int, int, int) override {
    no("attention_backward");
  }
  // What the back end it stands for can run.
  std::string flash_attention_refusal(int hs) const override {
    return cuda_ ? flash_head_size_refusal(hs) : like_->flash_attention_refusal(hs);
  }
  void gelu_forward(float*, const float*, std::int64_t) override { no("gelu_forward"); }
  void gelu_backward(float*, const float*, const float*, std::int64_t) override { no("gelu_backward"); }
  void residual_forward(float*, const float*, const float*, std::int64_t) override { no("residual_forward"); }
  void crossentropy_forward(float*, float*, const float*, const std::int32_t*, int, int) override {
    no("crossentropy_forward");
  }
  void crossentropy_backward(float*, const float*, const std::int32_t*, float, int, int, int) override {
    no("crossentropy_backward");
  }
  void crossentropy_row_max(float*, const float*, int, int) override { no("crossentropy_row_max"); }
  void crossentropy_partial(float*, double*, double*, const float*, const float*, const std::int32_t*, int, int,
                            int) override {
    no("crossentropy_partial");
  }
  void crossentropy_finish(float*, float*, const double*, const float*, const double*, int, int) override {
    no("crossentropy_finish");
  }
  void adamw_update(float*, float*, float*, const float*, std::int64_t, float, float, float, float, float,
                    std::int64_t) override {
    no("adamw_update");
  }
  double sum_squares(const float*, std::int64_t) override { return no("sum_squares"); }
  void scale(float*, float, std::int64_t) override { no("scale"); }
  void fill(float*, float, std::int64_t) override { no("fill"); }
  void copy(float*, const float*, std::int64_t) override { no("copy"); }
  void axpy(float*, float, const float*, std::int64_t) override { no("axpy"); }
  double sum(const float*, std::int64_t) override { return no("sum"); }
  void cast(BufferRef, BufferRef) override { no("cast"); }
  void matmul(BufferRef, BufferRef, BufferRef, int, int, int, bool, bool, float, float) override { no("matmul"); }
  NormCheck sq_norm_check(const std::vector<BufferRef>&) override {
    no("sq_norm_check");
    return {};
  }
  void scale(BufferRef, double) override { no("scale"); }
  void fill(BufferRef, double) override { no("fill"); }
  void int8_absmax(float*, const float*, std::int64_t, std::int64_t) override { no("int8_absmax"); }
  void int8_quantize(std::int8_t*, float*, const float*, std::int64_t, std::int64_t, const float*, int) override {
    no("int8_quantize");
  }
  void int8_dequantize(float*, const std::int8_t*, std::int64_t, std::int64_t, const float*, int) override {
    no("int8_dequantize");
  }
  void topk_select(std::int32_t*, float*, const float*, std::int64_t, std::int64_t) override { no("topk_select"); }
  void topk_scatter_add(float*, const std::int32_t*, const float*, std::int64_t) override { no("topk_scatter_add"); }
  void topk_clear(float*, const std::int32_t*, std::int64_t) override { no("topk_clear"); }

 private:
  [[noreturn]] static double no(const char* what) {
    throw std::logic_error(std::string("loom plan's sizing back end ran a kernel (") + what +
                           "): building a rank's roles must only allocate");
  }
  std::unique_ptr<Backend> like_;
  bool cuda_;  // plans a cuda run: its workspace, not like_'s, and NCCL between ranks
  std::uintptr_t next_ = std::uintptr_t{1} << 48;
};

}  // namespace

std::unique_ptr<Backend> make_sizing_backend(std::unique_ptr<Backend> like) {
  return std::make_unique<SizingBackend>(std::move(like), false);
}

std::unique_ptr<Backend> make_cuda_sizing_backend() {
  return std::make_unique<SizingBackend>(make_host_backend(1), true);
}

}  // namespace loom
