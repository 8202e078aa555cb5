#pragma once
// A back end that wraps another and passes every operation on (the fenced and the sizing back ends):
// each operation of core/backend/backend_ops.hpp (both lists) is generated here, so a wrapper overrides only what
// differs. Before an operation it calls before_op(name); on the way, each typed buffer goes through
// map_buffer (identity here). The operations take no bare pointers (core/test/test_backend_ops.cpp
// checks), so every tensor an operation touches passes map_buffer. The communicator
// is Backend's own choice for this back end's space(), not the wrapped one's.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/backend/backend.hpp"

namespace loom {

class ForwardingBackend : public Backend {
  // Each argument on its way to the wrapped back end (defined first: the operations below use them).
  BufferRef map(BufferRef b, const char* op) const { return map_buffer(b, op); }
  std::vector<BufferRef> map(const std::vector<BufferRef>& v, const char* op) const {
    std::vector<BufferRef> out;
    out.reserve(v.size());
    for (const BufferRef& b : v) out.push_back(map_buffer(b, op));
    return out;
  }
  std::vector<AdamWSlice> map(const std::vector<AdamWSlice>& v, const char* op) const {
    std::vector<AdamWSlice> out = v;
    for (AdamWSlice& s : out)
      for (BufferRef* b : {&s.params, &s.m, &s.v, &s.grads}) *b = map_buffer(*b, op);
    return out;
  }
  template <class T>
  T map(T x, const char*) const {
    return x;
  }
  template <class F, class... A>
  auto pass(const char* op, F f, const A&... a) {
    return f(map(a, op)...);
  }

 public:
  explicit ForwardingBackend(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {}

  std::string name() const override { return inner_->name(); }
  std::string description() const override { return inner_->description(); }
  MemSpace space() const override { return inner_->space(); }
  void set_precision(const Precision& p) override {
    inner_->set_precision(p);
    precision_ = p;
  }
  void release_scratch() override { inner_->release_scratch(); }
  TypedBuffer allocate(const std::string& label, DType type, std::int64_t count, Mem category) override {
    return inner_->allocate(label, type, count, category);
  }
  void copy_from_host(BufferRef buffer, const void* src) override {
    inner_->copy_from_host(map_buffer(buffer, "copy_from_host"), src);
  }
  void copy_to_host(void* dst, BufferRef buffer) override {
    inner_->copy_to_host(dst, map_buffer(buffer, "copy_to_host"));
  }
  void synchronize() override { inner_->synchronize(); }
  void plan_workspace(StepPlan& plan, const std::vector<MatmulCall>& calls,
                      const AttentionShape& attention) const override {
    inner_->plan_workspace(plan, calls, attention);
  }
  bool ring_scratch_pools() const override { return inner_->ring_scratch_pools(); }
  std::string flash_attention_refusal(int hs) const override { return inner_->flash_attention_refusal(hs); }
  std::string cudnn_attention_refusal(int T, int hs) const override { return inner_->cudnn_attention_refusal(T, hs); }
  std::string ring_attention_refusal() const override { return inner_->ring_attention_refusal(); }
  std::string expert_rows_refusal() const override { return inner_->expert_rows_refusal(); }
  std::int64_t topk_scratch_bytes(std::int64_t n) const override { return inner_->topk_scratch_bytes(n); }

#define LOOM_FORWARD_OP(ret, name, params, args)                                           \
  ret name params override {                                                               \
    before_op(#name);                                                                      \
    return pass(                                                                           \
        #name, [this](auto... a) -> ret { return inner_->name(a...); }, LOOM_EXPAND args); \
  }
  LOOM_FACE_OPS(LOOM_FORWARD_OP)
  LOOM_BACKEND_OPS(LOOM_FORWARD_OP)
  LOOM_BACKEND_DEFAULTED_OPS(LOOM_FORWARD_OP)
#undef LOOM_FORWARD_OP

 protected:
  Backend& inner() const { return *inner_; }
  // Called first by every operation of the list, with its name.
  virtual void before_op(const char* /*op*/) {}
  // What a typed buffer argument of operation `op` becomes for the wrapped back end.
  virtual BufferRef map_buffer(BufferRef b, const char* /*op*/) const { return b; }

 private:
  std::unique_ptr<Backend> inner_;
};

}  // namespace loom
