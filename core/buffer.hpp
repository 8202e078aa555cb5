#pragma once
// Buffer<T>: a labelled, zero-initialised Kokkos View that files its bytes in the memory ledger for
// as long as it lives. Every tensor loom allocates is one (or a slice of one).
#include <Kokkos_Core.hpp>
#include <cstddef>
#include <string>
#include <utility>

#include "core/ledger.hpp"

namespace loom {

using HostSpace = Kokkos::HostSpace;
using HostExec = Kokkos::DefaultHostExecutionSpace;

template <class T>
class Buffer {
 public:
  Buffer() = default;
  Buffer(const std::string& label, std::size_t n, Mem category)
      : view_(label, n), category_(category) {
    Ledger::global().allocate(category_, bytes());
  }
  ~Buffer() { free(); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& o) noexcept : view_(std::move(o.view_)), category_(o.category_) { o.view_ = {}; }
  Buffer& operator=(Buffer&& o) noexcept {
    if (this != &o) {
      free();
      view_ = std::move(o.view_);
      category_ = o.category_;
      o.view_ = {};
    }
    return *this;
  }
  T* data() const { return view_.data(); }
  std::size_t size() const { return view_.extent(0); }
  std::size_t bytes() const { return size() * sizeof(T); }
  bool empty() const { return size() == 0; }
  Mem category() const { return category_; }
  T& operator[](std::size_t i) const { return view_(i); }
  const Kokkos::View<T*, HostSpace>& view() const { return view_; }
  void free() {
    if (view_.data() != nullptr && size() > 0) Ledger::global().release(category_, bytes());
    view_ = {};
  }

 private:
  Kokkos::View<T*, HostSpace> view_;
  Mem category_ = Mem::workspace;
};

}  // namespace loom
