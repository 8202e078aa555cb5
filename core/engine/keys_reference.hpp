#pragma once
// The deck key reference as Markdown (`loom keys --markdown`, checked in as docs/keys.md): every key of
// `schema` by section, with its type, default, what is allowed and its help. Nothing in it depends on
// the build (no version or path), so the checked-in page can be compared with the command's output.
#include <string>

#include "core/engine/keys.hpp"

namespace loom {

std::string keys_markdown(const DeckSchema& schema);

}  // namespace loom
