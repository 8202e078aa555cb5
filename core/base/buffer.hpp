#pragma once
// TypedBuffer: a labelled buffer that files its bytes in the memory ledger for as long as it lives.
// Every tensor loom allocates is one (or a slice of one).
#include <Kokkos_Core.hpp>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>

#include "core/base/dtype.hpp"
#include "core/base/ledger.hpp"

namespace loom {

using HostSpace = Kokkos::HostSpace;

// TypedBuffer: an owning buffer of any element type in either memory space, filed in the ledger
// for as long as it lives. Back ends allocate them (Backend::allocate); everything else passes its
// BufferRef around. Host memory is a zero-initialised Kokkos View (aligned to at least 8 bytes);
// device memory comes from the back end with the function that frees it.
class TypedBuffer {
 public:
  TypedBuffer() = default;
  // Host memory: `count` zeroed elements of `type`.
  TypedBuffer(const std::string& label, DType type, std::int64_t count, Mem category)
      : host_(label, (static_cast<std::size_t>(count) * dtype_size(type) + 7) / 8),
        ref_(host_.data(), type, count, MemSpace::host),
        category_(category) {
    Ledger::global().allocate(category_, ref_.bytes());
  }
  // Memory the caller allocated (a device back end): `release` frees it when this buffer goes.
  TypedBuffer(BufferRef adopted, Mem category, std::function<void(void*)> release)
      : ref_(adopted), category_(category), release_(std::move(release)) {
    Ledger::global().allocate(category_, ref_.bytes());
  }
  ~TypedBuffer() { free(); }
  TypedBuffer(const TypedBuffer&) = delete;
  TypedBuffer& operator=(const TypedBuffer&) = delete;
  TypedBuffer(TypedBuffer&& o) noexcept { *this = std::move(o); }
  TypedBuffer& operator=(TypedBuffer&& o) noexcept {
    if (this != &o) {
      free();
      host_ = std::move(o.host_);
      ref_ = o.ref_;
      category_ = o.category_;
      release_ = std::move(o.release_);
      o.host_ = {};
      o.ref_ = {};
      o.release_ = nullptr;
    }
    return *this;
  }
  const BufferRef& ref() const { return ref_; }
  template <class T>
  T* data() const {
    return ref_.as<T>();
  }
  DType type() const { return ref_.type; }
  std::int64_t count() const { return ref_.count; }
  std::size_t bytes() const { return ref_.bytes(); }
  MemSpace space() const { return ref_.space; }
  Mem category() const { return category_; }
  bool empty() const { return ref_.count == 0; }
  void free() {
    if (ref_.data != nullptr && ref_.count > 0) Ledger::global().release(category_, ref_.bytes());
    if (release_ && ref_.data) release_(ref_.data);
    release_ = nullptr;
    host_ = {};
    ref_ = {};
  }

 private:
  Kokkos::View<std::uint64_t*, HostSpace> host_;
  BufferRef ref_;
  Mem category_ = Mem::workspace;
  std::function<void(void*)> release_;
};

}  // namespace loom
