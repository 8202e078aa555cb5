// run.backend = fenced: the host kernels on memory marked device, for checking without a GPU that
// every access to a tensor goes through the back end (DESIGN.md "The GPU path"). Its buffers are
// host memory underneath, but the addresses it hands out are moved by 2^47, out of the process's
// address space: code outside the back end that reads or writes a tensor through a pointer crashes
// (the handler below names the cause), as it would read device memory on a GPU. It refuses every
// typed buffer marked host memory, as the CUDA back end does. Its communicators are the staged
// ones of a device back end without NCCL (Backend::make_communicator). Results are the host back
// end's bit for bit: the kernels are the same.
#include <signal.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/backend/device_address.hpp"
#include "core/backend/forwarding_backend.hpp"

namespace loom {
namespace {

// The addresses the fenced back end hands out: its host memory moved out of the address space.
using device_address::away;
using device_address::back;

// Its communicators are Backend's for a device back end (staged through host copies): a
// ForwardingBackend does not take the wrapped host back end's.
class FencedBackend final : public ForwardingBackend {
 public:
  explicit FencedBackend(int threads) : ForwardingBackend(make_host_backend(threads)) {}
  std::string name() const override { return "fenced"; }
  std::string description() const override {
    return "fenced: the host kernels (" + inner().description() +
           ") on memory marked device, at addresses the host cannot touch";
  }
  MemSpace space() const override { return MemSpace::device; }
  TypedBuffer allocate(const std::string&, DType type, std::int64_t count, Mem category) override {
    // Zeroed host memory underneath, as the host back end's; filed once, under its category, by the
    // device buffer that adopts it.
    const std::size_t bytes = (static_cast<std::size_t>(count) * dtype_size(type) + 63) / 64 * 64;
    void* host = bytes ? std::aligned_alloc(64, bytes) : nullptr;
    if (bytes && !host) throw std::bad_alloc();
    if (host) std::memset(host, 0, bytes);
    return TypedBuffer(BufferRef(away(host), type, count, MemSpace::device), category,
                       [](void* p) { std::free(back(p)); });
  }
  void copy_from_host(BufferRef b, const void* src) override {
    if (b.bytes()) std::memcpy(map_buffer(b, "copy_from_host").data, src, b.bytes());
  }
  void copy_to_host(void* dst, BufferRef b) override {
    if (b.bytes()) std::memcpy(dst, map_buffer(b, "copy_to_host").data, b.bytes());
  }

 protected:
  // Every operation of the list reaches the host kernels with the addresses moved back:
  // a device buffer as the host kernels take it; a host one is refused as the CUDA back end refuses it.
  BufferRef map_buffer(BufferRef b, const char* op) const override {
    if (b.space != MemSpace::device && b.count > 0)
      throw std::invalid_argument(std::string(op) + ": a buffer marked host memory reached a device back end");
    b.space = MemSpace::host;
    b.data = back(b.data);
    return b;
  }
};

void on_segfault(int) {
  static const char msg[] =
      "loom: run.backend = fenced: segmentation fault, most likely a host read or write of a device tensor "
      "(code outside the back end used a tensor's address; use Backend::copy_to_host / copy_from_host or a "
      "back-end operation)\n";
  ssize_t ignored = write(2, msg, sizeof msg - 1);
  (void)ignored;
  signal(SIGSEGV, SIG_DFL);
  raise(SIGSEGV);
}

}  // namespace

std::unique_ptr<Backend> make_fenced_backend(int threads) {
  signal(SIGSEGV, on_segfault);
  return std::make_unique<FencedBackend>(threads);
}

}  // namespace loom
