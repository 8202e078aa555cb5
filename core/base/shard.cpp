#include "core/base/shard.hpp"

#include <sstream>
#include <stdexcept>

namespace loom {

const char* tp_split_name(TpSplit s) {
  switch (s) {
    case TpSplit::none:
      return "whole";
    case TpSplit::rows:
      return "rows";
    case TpSplit::cols:
      return "cols";
    case TpSplit::qkv_rows:
      return "qkv rows";
  }
  return "?";
}

ShardDesc ShardDesc::make(std::vector<std::int64_t> shape, TpSplit split, int tp, int tp_rank) {
  ShardDesc d;
  d.shape = std::move(shape);
  d.split = tp > 1 ? split : TpSplit::none;
  d.tp = tp;
  d.tp_rank = tp_rank;
  d.tp_shape = d.shape;
  switch (d.split) {
    case TpSplit::none:
      break;
    case TpSplit::rows:
    case TpSplit::qkv_rows:
      d.tp_shape[0] /= tp;
      break;
    case TpSplit::cols:
      d.tp_shape.at(1) /= tp;
      break;
  }
  return d;
}

std::int64_t ShardDesc::full_numel() const {
  std::int64_t n = 1;
  for (auto s : shape) n *= s;
  return n;
}

std::int64_t ShardDesc::tp_numel() const {
  std::int64_t n = 1;
  for (auto s : tp_shape) n *= s;
  return n;
}

ShardDesc ShardDesc::cut(std::int64_t b, std::int64_t e) const {
  if (b < 0 || e < b || e > numel())
    throw std::logic_error("ShardDesc::cut [" + std::to_string(b) + ", " + std::to_string(e) + ") of " +
                           std::to_string(numel()) + " elements");
  ShardDesc d = *this;
  d.begin = begin + b;
  d.end = begin + e;
  return d;
}

namespace {
// Elements per row of the tp piece: each such row is consecutive in the full tensor.
std::int64_t row_length(const ShardDesc& d) {
  if (d.split == TpSplit::none) return d.tp_numel() > 0 ? d.tp_numel() : 1;
  return d.tp_shape.size() > 1 ? d.tp_shape[1] : 1;
}
}  // namespace

std::int64_t ShardDesc::global_index(std::int64_t i) const {
  const std::int64_t j = begin + i;
  if (split == TpSplit::none) return j;
  const std::int64_t rows_l = tp_shape[0], cols_l = tp_shape.size() > 1 ? tp_shape[1] : 1;
  const std::int64_t r = j / cols_l, c = j % cols_l;
  switch (split) {
    case TpSplit::rows:
      return (tp_rank * rows_l + r) * cols_l + c;
    case TpSplit::qkv_rows: {
      const std::int64_t Cl = rows_l / 3, part = r / Cl, within = r % Cl;
      return (part * (Cl * tp) + tp_rank * Cl + within) * cols_l + c;
    }
    case TpSplit::cols:
      return r * (cols_l * tp) + tp_rank * cols_l + c;
    case TpSplit::none:
      break;
  }
  return j;
}

void ShardDesc::for_each_run(const std::function<void(std::int64_t, std::int64_t, std::int64_t)>& fn) const {
  const std::int64_t len = row_length(*this), e = range_end();
  std::int64_t run_local = 0, run_global = 0, run_count = 0;
  for (std::int64_t j = begin; j < e;) {
    const std::int64_t row_end = (j / len + 1) * len;
    const std::int64_t count = (row_end < e ? row_end : e) - j;
    const std::int64_t g = global_index(j - begin);
    if (run_count > 0 && run_global + run_count == g) {
      run_count += count;
    } else {
      if (run_count > 0) fn(run_local, run_global, run_count);
      run_local = j - begin;
      run_global = g;
      run_count = count;
    }
    j += count;
  }
  if (run_count > 0) fn(run_local, run_global, run_count);
}

std::vector<ShardDesc::Box> ShardDesc::boxes() const {
  std::vector<Box> out;
  if (shape.size() == 1) {
    for_each_run([&](std::int64_t, std::int64_t g, std::int64_t n) { out.push_back({{g}, {n}}); });
    return out;
  }
  if (shape.size() != 2) throw std::logic_error("ShardDesc::boxes: tensors of rank 1 or 2 only");
  const std::int64_t K = shape[1];
  auto add = [&](std::int64_t r, std::int64_t c, std::int64_t rows, std::int64_t cols) {
    if (rows <= 0 || cols <= 0) return;
    if (!out.empty()) {
      Box& b = out.back();
      if (b.start[1] == c && b.count[1] == cols && b.start[0] + b.count[0] == r) {
        b.count[0] += rows;
        return;
      }
    }
    out.push_back({{r, c}, {rows, cols}});
  };
  for_each_run([&](std::int64_t, std::int64_t g, std::int64_t n) {
    std::int64_t r = g / K, c = g % K;
    if (c > 0) {  // the partial first row
      const std::int64_t take = n < K - c ? n : K - c;
      add(r, c, 1, take);
      n -= take;
      ++r;
    }
    add(r, 0, n / K, K);          // whole rows
    add(r + n / K, 0, 1, n % K);  // the partial last row
  });
  return out;
}

std::string ShardDesc::describe() const {
  std::ostringstream s;
  s << tp_split_name(split);
  if (split != TpSplit::none) s << " " << tp_rank + 1 << "/" << tp;
  s << " of [";
  for (std::size_t i = 0; i < shape.size(); ++i) s << (i ? "," : "") << shape[i];
  s << "], elements [" << begin << ", " << range_end() << ")";
  return s.str();
}

}  // namespace loom
