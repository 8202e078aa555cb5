// Tests generated from the back end's one list of operations (core/backend/backend_ops.hpp): an
// operation added to the list is covered here without a line of this file changing.
#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "core/backend/backend.hpp"
#include "core/backend/forwarding_backend.hpp"

namespace loom {
namespace {

// Calls `op` on `be` with value-initialised arguments (null pointers, zero sizes, empty buffers).
template <class R, class... A>
R call_with_nothing(Backend& be, R (Backend::*op)(A...)) {
  std::tuple<std::decay_t<A>...> args{};
  return std::apply([&](auto&... a) -> R { return (be.*op)(a...); }, args);
}

// How many of an operation's parameters are bare pointers, and how many typed buffers.
template <class R, class... A>
int pointer_params(R (Backend::*)(A...)) {
  return (0 + ... + static_cast<int>(std::is_pointer_v<std::decay_t<A>>));
}
template <class R, class... A>
int buffer_params(R (Backend::*)(A...)) {
  return (0 + ... + static_cast<int>(std::is_same_v<std::decay_t<A>, BufferRef>));
}

// Every operation of the list by name, each with its member pointer (overloads told apart by their
// parameters, as the list declares them).
struct OpCall {
  std::string name;
  std::function<void(Backend&)> call;
  int pointers = 0, buffers = 0;
};
std::vector<OpCall> every_op() {
  std::vector<OpCall> ops;
#define LOOM_TEST_OP(ret, name, params, args)                                                                     \
  ops.push_back({#name,                                                                                           \
                 [](Backend& be) { call_with_nothing(be, static_cast<ret(Backend::*) params>(&Backend::name)); }, \
                 pointer_params(static_cast<ret(Backend::*) params>(&Backend::name)),                             \
                 buffer_params(static_cast<ret(Backend::*) params>(&Backend::name))});
  LOOM_FACE_OPS(LOOM_TEST_OP)
  LOOM_BACKEND_OPS(LOOM_TEST_OP)
  LOOM_BACKEND_DEFAULTED_OPS(LOOM_TEST_OP)
#undef LOOM_TEST_OP
  return ops;
}

// A back end whose every operation records its name and does nothing else (so reads no argument).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
class RecordingBackend final : public Backend {
 public:
  std::string name() const override { return "recording"; }
  std::string description() const override { return "records the operations it is asked for"; }
#define LOOM_RECORD_OP(ret, name, params, args) \
  ret name params override {                    \
    calls.push_back(#name);                     \
    return ret();                               \
  }
  LOOM_FACE_OPS(LOOM_RECORD_OP)
  LOOM_BACKEND_OPS(LOOM_RECORD_OP)
  LOOM_BACKEND_DEFAULTED_OPS(LOOM_RECORD_OP)
#undef LOOM_RECORD_OP
  std::vector<std::string> calls;
};
#pragma GCC diagnostic pop

TEST(BackendOps, AForwardingBackendPassesEachOperationToTheSameOne) {
  auto recording = std::make_unique<RecordingBackend>();
  RecordingBackend* inner = recording.get();
  ForwardingBackend forwarding(std::move(recording));
  for (const OpCall& op : every_op()) {
    inner->calls.clear();
    op.call(forwarding);
    ASSERT_EQ(inner->calls.size(), 1u) << op.name;
    EXPECT_EQ(inner->calls[0], op.name);
  }
}

TEST(BackendOps, TheSizingBackendRefusesEachOperationByName) {
  auto sizing = make_sizing_backend(make_host_backend(1));
  for (const OpCall& op : every_op()) {
    try {
      op.call(*sizing);
      ADD_FAILURE() << "the sizing back end ran " << op.name;
    } catch (const std::logic_error& e) {
      EXPECT_NE(std::string(e.what()).find("ran a kernel (" + op.name + ")"), std::string::npos) << e.what();
    }
  }
}

// Every tensor an operation touches is a typed buffer (its element type and count travel with it,
// and the operation checks both), never a bare pointer.
TEST(BackendOps, NoOperationTakesABarePointer) {
  for (const OpCall& op : every_op()) EXPECT_EQ(op.pointers, 0) << op.name << " takes a bare pointer";
}

// The fenced back end moves each buffer back into the host's address space on its way to the host
// kernels (and refuses a host one): a wrapper that maps buffers sees every buffer argument of every
// operation mapped.
class ShiftingBackend final : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  mutable int mapped = 0;

 protected:
  BufferRef map_buffer(BufferRef b, const char*) const override {
    ++mapped;
    return b;
  }
};

TEST(BackendOps, EveryBufferArgumentIsMapped) {
  ShiftingBackend shifting(std::make_unique<RecordingBackend>());
  int buffers = 0;
  for (const OpCall& op : every_op()) {
    if (op.name == "sq_norm_check") continue;  // a list of buffers: empty when called with nothing
    shifting.mapped = 0;
    op.call(shifting);
    EXPECT_EQ(shifting.mapped, op.buffers) << op.name;
    buffers += op.buffers;
  }
  EXPECT_GT(buffers, 0);
}

}  // namespace
}  // namespace loom
