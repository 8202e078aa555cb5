#pragma once
#include <stdexcept>
#include <string>

namespace loom {
// Input the user can fix (deck, data file, layout): reported without a stack of context and
// exits with status 2 before any training starts.
struct InputError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
}  // namespace loom
