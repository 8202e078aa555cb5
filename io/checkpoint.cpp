#include "io/checkpoint.hpp"

#include <hdf5.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "core/backend/backend.hpp"
#include "core/base/error.hpp"
#include "core/comm/fault.hpp"
#include "core/base/rng.hpp"

namespace loom {
namespace {

// HDF5 prints its own error stack by default; loom reports errors itself, naming the file.
struct QuietHdf5 {
  QuietHdf5() { init_hdf5(); }
};

struct Handle {  // closes an HDF5 id with the matching function; movable, not copyable
  hid_t id;
  herr_t (*close)(hid_t);
  Handle(hid_t i, herr_t (*c)(hid_t)) : id(i), close(c) {}
  Handle(Handle&& o) noexcept : id(o.id), close(o.close) { o.id = -1; }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  ~Handle() {
    if (id >= 0) close(id);
  }
};

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw InputError("checkpoint " + quote_path(path) + ": " + what);
}

std::string shape_text(const std::vector<hsize_t>& d) {
  std::string s = "[";
  for (std::size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}
std::string shape_text(const std::vector<std::int64_t>& d) {
  return shape_text(std::vector<hsize_t>(d.begin(), d.end()));
}

// Selects in `space` (the full logical tensor) the elements this rank's shard of `p` holds, in the
// Selects in the file space the elements `shard` describes (its boxes, OR'ed in file order) and
// returns the matching memory space; with `take` false nothing (a rank still joins every
// collective transfer).
Handle transfer_spaces(hid_t fspace, const ShardDesc* shard, bool take) {
  hsize_t local = take ? static_cast<hsize_t>(shard->numel()) : 0;
  Handle mspace{H5Screate_simple(1, &local, nullptr), H5Sclose};
  if (!take || local == 0) {
    H5Sselect_none(fspace);
    H5Sselect_none(mspace.id);
    return mspace;
  }
  if (shard->whole()) {
    H5Sselect_all(fspace);
    return mspace;
  }
  bool first = true;
  for (const ShardDesc::Box& b : shard->boxes()) {
    std::vector<hsize_t> start(b.start.begin(), b.start.end()), count(b.count.begin(), b.count.end());
    H5Sselect_hyperslab(fspace, first ? H5S_SELECT_SET : H5S_SELECT_OR, start.data(), nullptr, count.data(), nullptr);
    first = false;
  }
  return mspace;
}

template <class T>
void write_attr(hid_t obj, const char* name, hid_t type, const T& value) {
  Handle space{H5Screate(H5S_SCALAR), H5Sclose};
  Handle a{H5Acreate2(obj, name, type, space.id, H5P_DEFAULT, H5P_DEFAULT), H5Aclose};
  H5Awrite(a.id, type, &value);
}
void write_attr_string(hid_t obj, const char* name, const std::string& value) {
  Handle type{H5Tcopy(H5T_C_S1), H5Tclose};
  H5Tset_size(type.id, value.size() + 1);
  H5Tset_strpad(type.id, H5T_STR_NULLTERM);
  Handle space{H5Screate(H5S_SCALAR), H5Sclose};
  Handle a{H5Acreate2(obj, name, type.id, space.id, H5P_DEFAULT, H5P_DEFAULT), H5Aclose};
  H5Awrite(a.id, type.id, value.c_str());
}

// An attribute that holds one value of one of the type classes asked for, opened; else an invalid
// handle. Anything else (an array, a string where a number belongs) is unreadable, never read into a
// buffer of one value: a damaged or hand-edited file must not overrun it.
Handle open_single_attr(hid_t obj, const char* name, std::initializer_list<H5T_class_t> classes) {
  if (H5Aexists(obj, name) <= 0) return Handle{-1, H5Aclose};
  Handle a{H5Aopen(obj, name, H5P_DEFAULT), H5Aclose};
  if (a.id < 0) return a;
  Handle space{H5Aget_space(a.id), H5Sclose};
  Handle type{H5Aget_type(a.id), H5Tclose};
  const H5T_class_t cls = H5Tget_class(type.id);
  if (space.id < 0 || H5Sget_simple_extent_npoints(space.id) != 1 ||
      std::find(classes.begin(), classes.end(), cls) == classes.end())
    return Handle{-1, H5Aclose};
  return a;
}
bool read_attr_i64(hid_t obj, const char* name, std::int64_t& out) {
  Handle a = open_single_attr(obj, name, {H5T_INTEGER});
  return a.id >= 0 && H5Aread(a.id, H5T_NATIVE_INT64, &out) >= 0;
}
bool read_attr_f64(hid_t obj, const char* name, double& out) {
  Handle a = open_single_attr(obj, name, {H5T_FLOAT, H5T_INTEGER});
  return a.id >= 0 && H5Aread(a.id, H5T_NATIVE_DOUBLE, &out) >= 0;
}
// A string attribute of fixed length, as loom writes them, or of variable length, as h5py writes a
// Python str (a deck attribute edited there); read in the attribute's own character set (HDF5 does
// not convert between ASCII and UTF-8), the bytes as they are.
bool read_attr_string(hid_t obj, const char* name, std::string& out) {
  Handle a = open_single_attr(obj, name, {H5T_STRING});
  if (a.id < 0) return false;
  Handle type{H5Aget_type(a.id), H5Tclose};
  Handle mem{H5Tcopy(H5T_C_S1), H5Tclose};
  H5Tset_cset(mem.id, H5Tget_cset(type.id));
  if (H5Tis_variable_str(type.id) > 0) {
    H5Tset_size(mem.id, H5T_VARIABLE);
    char* text = nullptr;
    if (H5Aread(a.id, mem.id, &text) < 0) return false;
    const bool read = text != nullptr;  // a null string: nothing stored
    if (read) out.assign(text);
    H5free_memory(text);
    return read;
  }
  const std::size_t n = H5Tget_size(type.id);
  std::vector<char> buf(n + 1, 0);
  H5Tset_size(mem.id, n + 1);  // room for the terminator: a null-padded string of n characters keeps all n
  if (H5Aread(a.id, mem.id, buf.data()) < 0) return false;
  out.assign(buf.data());
  return true;
}

// The model.* keys a checkpoint records as attributes ("model_layers", ...): a checkpoint continues
// only a model of the same shape.
struct ModelKey {
  const char* key;
  const char* attr;
  int GPTConfig::*field;
};
const ModelKey kModelKeys[] = {{"model.layers", "model_layers", &GPTConfig::layers},
                               {"model.d_model", "model_d_model", &GPTConfig::d_model},
                               {"model.heads", "model_heads", &GPTConfig::heads},
                               {"model.seq_len", "model_seq_len", &GPTConfig::seq_len},
                               {"model.vocab", "model_vocab", &GPTConfig::vocab}};

// "key = value" of a resolved deck's text, by section.key ('#' starts a comment; decks hold no '#').
}  // namespace

namespace {
// The model shape a checkpoint records: its model_* attributes, or (files written before them) its deck.
GPTConfig recorded_model(hid_t file, const std::string& path, const std::string& deck) {
  const auto recorded = resolved_deck_values(deck);
  GPTConfig cfg;
  for (const ModelKey& k : kModelKeys) {
    std::int64_t v = -1;
    if (!read_attr_i64(file, k.attr, v)) {
      const auto it = recorded.find(k.key);
      if (it == recorded.end())
        fail(path, std::string("records no ") + k.key + " (neither attribute " + k.attr + " nor its deck): corrupt");
      v = std::atoll(it->second.c_str());
    }
    // A damaged attribute: named before anything is built from it (an int holds every real size).
    if (v < 1 || v > std::numeric_limits<int>::max())
      fail(path, std::string("records ") + k.key + " = " + std::to_string(v) + ": corrupt (a model's sizes are 1 to " +
                     std::to_string(std::numeric_limits<int>::max()) + ")");
    cfg.*k.field = static_cast<int>(v);
  }
  const double L = cfg.layers, C = cfg.d_model, params = L * 12.0 * C * C + (double(cfg.vocab) + cfg.seq_len) * C;
  if (cfg.layers > 100000 || params > 1e13)
    fail(path, "records a model of " + std::to_string(cfg.layers) + " layers and about " + std::to_string(params) +
                   " parameters: corrupt (beyond any model loom builds)");
  // The attention kind is no tensor's shape, but the model's arithmetic: a flash or cudnn run is
  // sampled as it was trained (decks from before the key are unfused; a checkpoint records auto as the
  // kind it resolved to).
  cfg.read_architecture(recorded);  // model.arch and Llama's keys (absent before them: gpt2)
  const auto attention = recorded.find("model.attention");
  const std::string kind = attention == recorded.end() ? "unfused" : attention->second;
  if (kind != "unfused" && kind != "flash" && kind != "cudnn")
    fail(path, "records model.attention = " + kind + " (a checkpoint holds unfused, flash or cudnn)");
  cfg.set_attention(kind);
  return cfg;
}
}  // namespace

std::map<std::string, std::string> resolved_deck_values(const std::string& text) {
  std::map<std::string, std::string> values;
  std::istringstream in(text);
  std::string line, section;
  auto trim = [](std::string s) {
    s.erase(0, s.find_first_not_of(" \t\r"));
    s.erase(s.find_last_not_of(" \t\r") + 1);
    return s;
  };
  while (std::getline(in, line)) {
    line = trim(line.substr(0, line.find('#')));
    if (line.empty()) continue;
    if (line.front() == '[' && line.back() == ']') {
      section = line.substr(1, line.size() - 2);
      continue;
    }
    const auto eq = line.find('=');
    if (eq != std::string::npos) values[section + "." + trim(line.substr(0, eq))] = trim(line.substr(eq + 1));
  }
  return values;
}

namespace {

// A layout-independent checksum of a logical tensor: the sum over its elements of a hash of
// (index in the full tensor, value bits). Each element is counted by its one primary owner, so the
// partial sums of any layout add up (MPI_SUM over the world) to the same number.
// The part of it for `count` consecutive elements `x` starting at index `global` of the full tensor.
std::uint64_t checksum_run(std::int64_t global, const float* x, std::int64_t count) {
  const std::uint64_t g0 = static_cast<std::uint64_t>(global);
  std::uint64_t part = 0;
  for (std::int64_t c = 0; c < count; ++c) {
    std::uint32_t bits;
    std::memcpy(&bits, x + c, sizeof bits);
    part += rng::mix64((g0 + static_cast<std::uint64_t>(c)) * 0x9e3779b97f4a7c15ULL ^ bits);
  }
  return part;
}

std::uint64_t checksum(const ShardDesc* shard, const float* data, bool owner) {
  std::uint64_t sum = 0;
  if (owner && shard)
    shard->for_each_run([&](std::int64_t local, std::int64_t global, std::int64_t count) {
      sum += checksum_run(global, data + local, count);
    });
  MPI_Allreduce(MPI_IN_PLACE, &sum, 1, MPI_UINT64_T, MPI_SUM, MPI_COMM_WORLD);
  return sum;
}

// Whether every link of an absolute path exists (H5Lexists needs each parent to exist).
bool path_exists(hid_t file, const std::string& path) {
  for (std::size_t at = path.find('/', 1);; at = path.find('/', at + 1)) {
    const std::string prefix = at == std::string::npos ? path : path.substr(0, at);
    if (H5Lexists(file, prefix.c_str(), H5P_DEFAULT) <= 0) return false;
    if (at == std::string::npos) return true;
  }
}

// Everything a checkpoint holds as tensors, in file order: the parameters (through the store),
// each kind of optimizer state, then what the run's other roles contribute. Ownership comes from
// the store's owned slices (primary), never from a rank number.
std::vector<CheckpointTensor> checkpoint_tensors(GPT& model, Optimizer& optimizer,
                                                 const std::vector<CheckpointContributor*>& parts) {
  std::vector<CheckpointTensor> out;
  const auto& owned = optimizer.owned();
  auto slice_of = [&](int param) -> int {  // this rank's owned slice of a tensor (one at most), or -1
    for (std::size_t k = 0; k < owned.size(); ++k)
      if (owned[k].param == param) return static_cast<int>(k);
    return -1;
  };
  const auto shape_only = [](const ParamInfo& whole) {
    ShardDesc d = ShardDesc::make(whole.shape(), TpSplit::none, 1, 0);
    return d;
  };
  for (const ParamInfo& whole : model.all_params()) {
    CheckpointTensor t;
    t.path = "/params/" + whole.name;
    const int i = model.param_index(whole.name);
    const int k = i >= 0 ? slice_of(i) : -1;
    if (i < 0) {
      t.shard = shape_only(whole);
    } else if (!model.store().param(i).empty()) {  // held whole (replicas read all of it)
      const ParamInfo& p = model.params()[static_cast<std::size_t>(i)];
      t.shard = p.shard;
      t.data = model.store().param(i);
      t.holds = true;
      if (k >= 0 && owned[static_cast<std::size_t>(k)].primary) {
        t.primary_begin = owned[static_cast<std::size_t>(k)].begin;
        t.primary_end = owned[static_cast<std::size_t>(k)].end;
      }
    } else {  // only the owned slice is held (ZeRO-3), as for the optimizer state below
      const ParamInfo& p = model.params()[static_cast<std::size_t>(i)];
      if (k < 0) {
        t.shard = p.shard.cut(0, 0);
      } else {
        const OwnedSlice& o = owned[static_cast<std::size_t>(k)];
        t.shard = p.shard.cut(o.begin, o.end);
        t.data = model.store().owned_param(o);
        t.holds = true;
        if (o.primary) t.primary_end = o.size();
      }
    }
    out.push_back(std::move(t));
  }
  for (const Optimizer::StateTensor& st : optimizer.state())
    for (const ParamInfo& whole : model.all_params()) {
      CheckpointTensor t;
      t.path = "/optimizer/" + st.kind + "/" + whole.name;
      const int i = model.param_index(whole.name);
      const int k = i >= 0 ? slice_of(i) : -1;
      if (k < 0) {
        t.shard = i >= 0 ? model.params()[static_cast<std::size_t>(i)].shard.cut(0, 0) : shape_only(whole);
      } else {
        const OwnedSlice& o = owned[static_cast<std::size_t>(k)];
        t.shard = model.params()[static_cast<std::size_t>(i)].shard.cut(o.begin, o.end);
        t.data = st.data.slice(optimizer.slice_offset(static_cast<std::size_t>(k)), o.size());
        t.holds = true;
        if (o.primary) t.primary_end = o.size();
      }
      out.push_back(std::move(t));
    }
  for (CheckpointContributor* c : parts)
    for (CheckpointTensor& t : c->checkpoint_tensors()) out.push_back(std::move(t));
  return out;
}

std::map<std::string, double> contributed_attributes(const std::vector<CheckpointContributor*>& parts) {
  std::map<std::string, double> all;
  for (const CheckpointContributor* c : parts)
    for (const auto& kv : c->checkpoint_attributes()) all[kv.first] = kv.second;
  return all;
}

bool g_file_left_open = false;

}  // namespace

bool checkpoint_file_left_open() { return g_file_left_open; }

void init_hdf5() {
  // Before the library starts: no atexit clean-up, which would try to close a file a failed write
  // left open and crash when a rank is taken down by MPI_Abort (the MPI_Finalize hook stays).
  static const bool once = [] {
    H5dont_atexit();
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
    return true;
  }();
  (void)once;
}

CheckpointImage checkpoint_image(GPT& model, Optimizer& optimizer, const std::vector<CheckpointContributor*>& parts) {
  CheckpointImage image;
  image.tensors = checkpoint_tensors(model, optimizer, parts);
  image.attributes = contributed_attributes(parts);
  image.model = model.config();
  image.n_params = static_cast<int>(model.all_params().size());
  image.backend = &model.backend();
  return image;
}

CheckpointImage checkpoint_snapshot(GPT& model, Optimizer& optimizer,
                                    const std::vector<CheckpointContributor*>& parts) {
  CheckpointImage image = checkpoint_image(model, optimizer, parts);
  image.copies.reserve(image.tensors.size());
  for (CheckpointTensor& t : image.tensors) {
    const bool owner = t.holds && t.primary_end > t.primary_begin;
    if (!owner) {
      t.data = BufferRef();
      continue;
    }
    // Only the elements this rank writes: [primary_begin, primary_end), at their own offsets.
    std::vector<float>& copy = image.copies.emplace_back(static_cast<std::size_t>(t.primary_end));
    const std::int64_t n = t.primary_end - t.primary_begin;
    image.backend->copy_to_host(copy.data() + t.primary_begin, t.data.slice(t.primary_begin, n));
    t.data = BufferRef(copy.data(), t.primary_end);
  }
  image.backend = nullptr;  // everything is on the host now
  return image;
}

std::string write_checkpoint_image(const std::string& path, MPI_Comm comm, const CheckpointImage& image,
                                   const CheckpointState& state) {
  static QuietHdf5 quiet;
  int ranks = 1, rank = 0;
  MPI_Comm_size(comm, &ranks);
  MPI_Comm_rank(comm, &rank);
  const std::string tmp = path + ".tmp";
  Handle fapl{H5Pcreate(H5P_FILE_ACCESS), H5Pclose};
  H5Pset_fapl_mpio(fapl.id, comm, MPI_INFO_NULL);
  Handle file{H5Fcreate(tmp.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl.id), H5Fclose};
  if (file.id < 0) fail(tmp, "cannot be created (check checkpoint.dir)");
  // Each owner writes its own hyperslab independently (datasets are still created collectively):
  // collective transfers cost a round of collectives per dataset, which on ranks sharing cores took
  // 4 s for a 0.4 MB file at 4 ranks on 2 cores, against 0.6 s independently.
  Handle dxpl{H5Pcreate(H5P_DATASET_XFER), H5Pclose};
  H5Pset_dxpl_mpio(dxpl.id, H5FD_MPIO_INDEPENDENT);
  Handle lcpl{H5Pcreate(H5P_LINK_CREATE), H5Pclose};
  H5Pset_create_intermediate_group(lcpl.id, 1);

  // Attributes: every rank writes the same values (HDF5 requires attribute writes to be collective).
  write_attr(file.id, "format_version", H5T_NATIVE_INT64, kCheckpointFormatVersion);
  write_attr(file.id, "step", H5T_NATIVE_INT64, state.step);
  write_attr(file.id, "optimizer_steps", H5T_NATIVE_INT64, state.optimizer_steps);
  const std::int64_t seed = static_cast<std::int64_t>(state.seed);
  write_attr(file.id, "seed", H5T_NATIVE_INT64, seed);
  const std::int64_t data_step = state.data_step >= 0 ? state.data_step : state.step;
  write_attr(file.id, "data_next_step", H5T_NATIVE_INT64, data_step);
  // A loss scaler's own value (a contributed `loss_scale`) takes the core attribute's place.
  const std::map<std::string, double>& contributed = image.attributes;
  const auto scaler = contributed.find("loss_scale");
  write_attr(file.id, "loss_scale", H5T_NATIVE_DOUBLE, scaler == contributed.end() ? state.loss_scale : scaler->second);
  const std::int64_t dp = state.layout.dp, tp = state.layout.tp, pp = state.layout.pp;
  write_attr(file.id, "layout_dp", H5T_NATIVE_INT64, dp);
  write_attr(file.id, "layout_tp", H5T_NATIVE_INT64, tp);
  write_attr(file.id, "layout_pp", H5T_NATIVE_INT64, pp);
  write_attr(file.id, "layout_cp", H5T_NATIVE_INT64, static_cast<std::int64_t>(state.layout.cp));
  write_attr_string(file.id, "generator",
                    "counter-based (seed, name, index) for weights; (seed, split, step, row) for data");
  write_attr_string(file.id, "deck", state.deck);
  write_attr(file.id, "skipped_steps", H5T_NATIVE_INT64, state.skipped_steps);
  for (const ModelKey& k : kModelKeys) {
    const std::int64_t v = image.model.*k.field;
    write_attr(file.id, k.attr, H5T_NATIVE_INT64, v);
  }
  for (const auto& [name, value] : contributed)
    if (name != "loss_scale") write_attr(file.id, name.c_str(), H5T_NATIVE_DOUBLE, value);

  // Each element is written by its primary owner (the store decides: by default data-parallel
  // replica 0, and for a tensor replicated over the tp group tp rank 0). Everyone else selects
  // nothing (the transfers are independent; the creations and attributes collective).
  const std::vector<CheckpointTensor>& tensors = image.tensors;
  const int n_params = image.n_params;
  int written = 0;
  // A failed write (no space, quota, file size limit) is noted and the rank goes on joining every
  // collective call, so that all ranks can close the file and agree on the failure afterwards.
  std::string failure;
  // With several ranks, a rank whose write failed has left HDF5's collective calls early and the others
  // wait for it inside them: nothing collective can follow, so it takes the job down, naming the file
  // and the reason (the .tmp is left; the earlier checkpoints and `latest` are untouched).
  auto note_failure = [&](const std::string& what) {
    if (!failure.empty()) return;
    failure = "checkpoint '" + tmp + "': " + what + " (" + std::strerror(errno ? errno : EIO) + ")";
    if (ranks > 1) abort_job(failure + "; the earlier checkpoints and `latest` are unchanged", 1);
  };
  for (const CheckpointTensor& t : tensors) {
    // Every rank creates every dataset of the whole model (creation is collective); the owners write.
    std::vector<hsize_t> dims(t.shard.shape.begin(), t.shard.shape.end());
    Handle fspace{H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), H5Sclose};
    Handle ds{H5Dcreate2(file.id, t.path.c_str(), H5T_NATIVE_FLOAT, fspace.id, lcpl.id, H5P_DEFAULT, H5P_DEFAULT),
              H5Dclose};
    errno = 0;
    if (ds.id < 0) note_failure("cannot create dataset " + t.path);
    const bool owner = t.holds && t.primary_end > t.primary_begin;
    const ShardDesc mine = owner ? t.shard.cut(t.primary_begin, t.primary_end) : t.shard;
    // A device tensor is written from a host copy of the part this rank writes.
    std::vector<float> staged;
    const float* data = owner ? t.data.as<float>() + t.primary_begin : nullptr;
    if (data && t.data.space != MemSpace::host) {
      staged.resize(static_cast<std::size_t>(t.primary_end - t.primary_begin));
      image.backend->copy_to_host(staged.data(),
                                  BufferRef(const_cast<float*>(data), t.primary_end - t.primary_begin, t.data.space));
      data = staged.data();
    }
    const Handle mspace = transfer_spaces(fspace.id, &mine, owner);
    errno = 0;
    float none = 0;
    if (ds.id >= 0 && H5Dwrite(ds.id, H5T_NATIVE_FLOAT, mspace.id, fspace.id, dxpl.id, data ? data : &none) < 0)
      note_failure("cannot write dataset " + t.path);
    const std::int64_t sum = static_cast<std::int64_t>(checksum(&mine, data, owner));
    if (ds.id >= 0) write_attr(ds.id, "checksum", H5T_NATIVE_INT64, sum);
    // Regression cases kill a rank here, half-way through the file, to prove that the previous
    // checkpoint and `latest` survive.
    if (++written == n_params && inject_fault("checkpoint", state.step))
      abort_job("injected fault while writing checkpoint " + tmp + " (LOOM_INJECT_FAULT)", 1);
  }
  errno = 0;
  // MPI_File_sync: on disk before the file gets its final name.
  if (H5Fflush(file.id, H5F_SCOPE_GLOBAL) < 0) note_failure("cannot flush the file");
  errno = 0;
  if (H5Fclose(file.id) < 0) {
    note_failure("cannot close the file");
    g_file_left_open = true;
  }
  file.id = -1;
  // Every rank's data is in the file before it gets its name, and every rank knows whether it is.
  errno = 0;
  if (failure.empty() && rank == 0 && std::rename(tmp.c_str(), path.c_str()) != 0)
    note_failure("cannot rename it to " + path);
  // HDF5 keeps a file it could not close in its tables and closes it again when MPI finalizes, which
  // crashes inside HDF5: every rank then leaves without finalizing (exit_without_finalize()).
  int left_open = g_file_left_open ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &left_open, 1, MPI_INT, MPI_MAX, comm);
  g_file_left_open = left_open != 0;
  return failure;
}

namespace {
std::string unwritten(const std::string& path) {
  return "checkpoint '" + path + ".tmp' was not written, and the earlier checkpoints and `latest` are unchanged";
}
}  // namespace

void save_checkpoint(const std::string& path, ProcessGrid& grid, GPT& model, Optimizer& optimizer,
                     const CheckpointState& state, const std::vector<CheckpointContributor*>& parts) {
  const std::string failure =
      write_checkpoint_image(path, MPI_COMM_WORLD, checkpoint_image(model, optimizer, parts), state);
  agree_on_failure(
      grid.world(), failure, [&] { std::remove((path + ".tmp").c_str()); }, unwritten(path));
}

std::string agree_over(MPI_Comm comm, const std::string& local_failure, const std::string& consequence) {
  int ranks = 1, rank = 0;
  MPI_Comm_size(comm, &ranks);
  MPI_Comm_rank(comm, &rank);
  int first = local_failure.empty() ? ranks : rank, count = local_failure.empty() ? 0 : 1;
  MPI_Allreduce(MPI_IN_PLACE, &first, 1, MPI_INT, MPI_MIN, comm);
  MPI_Allreduce(MPI_IN_PLACE, &count, 1, MPI_INT, MPI_SUM, comm);
  if (count == 0) return "";
  if (!local_failure.empty()) write_stderr(rank_error_text(rank, local_failure));
  return consequence + ": it failed on " + std::to_string(count) + " of " + std::to_string(ranks) +
         " rank(s), first on rank " + std::to_string(first);
}

std::string write_checkpoint_agreed(const std::string& path, MPI_Comm comm, const CheckpointImage& image,
                                    const CheckpointState& state) {
  const std::string agreed = agree_over(comm, write_checkpoint_image(path, comm, image, state), unwritten(path));
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  if (!agreed.empty() && rank == 0) std::remove((path + ".tmp").c_str());
  return agreed;
}

std::string model_mismatches(const GPTConfig& in_checkpoint, const GPTConfig& deck) {
  std::string mismatches;
  for (const ModelKey& k : kModelKeys) {
    const int v = in_checkpoint.*k.field, here = deck.*k.field;
    if (v != here)
      mismatches += std::string(mismatches.empty() ? "" : "; ") + k.key + " = " + std::to_string(v) +
                    " in the checkpoint, " + std::to_string(here) + " in this deck";
  }
  const auto ours = deck.architecture_values();
  for (const auto& [key, value] : in_checkpoint.architecture_values())
    if (ours.at(key) != value)
      mismatches += std::string(mismatches.empty() ? "" : "; ") + key + " = " + value + " in the checkpoint, " +
                    ours.at(key) + " in this deck";
  return mismatches;
}

// A checkpoint file HDF5 can read, else an error saying what the path is instead.
static void require_hdf5(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    fail(path,
         "is a directory, not a checkpoint file: name a ckpt-*.h5 file in it, or set checkpoint.dir to it and "
         "checkpoint.resume = latest");
  // Opening a FIFO would wait for a writer: only regular files (symbolic links to them) are read.
  if (std::filesystem::exists(path, ec) && !std::filesystem::is_regular_file(path, ec))
    fail(path, "is not a regular file (a FIFO, socket or device): not a checkpoint");
  if (H5Fis_hdf5(path.c_str()) > 0) return;
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) fail(path, "cannot be read (no such file, or no permission)");
  std::fclose(f);
  if (const std::string named = latest_pointer_target(path); !named.empty()) {
    const std::filesystem::path p(path);
    const std::string dir = p.parent_path().empty() ? "." : p.parent_path().string();
    fail(path, "is the pointer to the newest checkpoint (it names " + named +
                   "), not a checkpoint: give "
                   "checkpoint.resume = latest with checkpoint.dir = " +
                   dir + ", or the file it names, " + (p.parent_path() / named).string());
  }
  fail(path, "is not a readable HDF5 file (truncated or corrupt)");
}

std::string latest_pointer_target(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::path(path).filename() != "latest" || !std::filesystem::is_regular_file(path, ec)) return "";
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return "";
  char head[256] = {0};
  const std::size_t n = std::fread(head, 1, sizeof head - 1, f);
  std::fclose(f);
  std::string named(head, n);
  while (!named.empty() && (named.back() == '\n' || named.back() == '\r')) named.pop_back();
  const bool is_name = named.rfind("ckpt-", 0) == 0 && named.size() > 8 &&
                       named.compare(named.size() - 3, 3, ".h5") == 0 && named.find('/') == std::string::npos;
  return is_name ? named : "";
}

namespace {
// A checkpoint's attributes, checked for what any reader needs: a loom checkpoint of this format
// version, every piece of metadata, the model shape, and steps that add up.
CheckpointState read_state(hid_t file, const std::string& path) {
  CheckpointState st;
  std::int64_t version = 0;
  if (!read_attr_i64(file, "format_version", version))
    fail(path, "has no format_version attribute: not a loom checkpoint");
  if (version != kCheckpointFormatVersion)
    fail(path, "is format version " + std::to_string(version) + "; this loom reads version " +
                   std::to_string(kCheckpointFormatVersion));
  std::int64_t seed = 0, dp = 1, tp = 1, pp = 1;
  const auto need = [&](bool found, const char* name) {
    if (!found) fail(path, std::string("has no readable attribute ") + name + ": corrupt");
  };
  need(read_attr_i64(file, "step", st.step), "step");
  need(read_attr_i64(file, "optimizer_steps", st.optimizer_steps), "optimizer_steps");
  need(read_attr_i64(file, "seed", seed), "seed");
  need(read_attr_f64(file, "loss_scale", st.loss_scale), "loss_scale");
  need(read_attr_string(file, "deck", st.deck), "deck");
  need(read_attr_i64(file, "layout_dp", dp), "layout_dp");
  need(read_attr_i64(file, "layout_tp", tp), "layout_tp");
  need(read_attr_i64(file, "layout_pp", pp), "layout_pp");
  if (dp < 1 || tp < 1 || pp < 1 || dp > 1000000 || tp > 1000000 || pp > 1000000)
    fail(path, "records the layout dp " + std::to_string(dp) + " x tp " + std::to_string(tp) + " x pp " +
                   std::to_string(pp) + ": corrupt (each at least 1)");
  if (!std::isfinite(st.loss_scale) || st.loss_scale <= 0)
    fail(path,
         "records loss_scale = " + std::to_string(st.loss_scale) + ": corrupt (a loss scale is positive and finite)");
  st.seed = static_cast<std::uint64_t>(seed);
  st.layout.dp = static_cast<int>(dp);
  st.layout.tp = static_cast<int>(tp);
  st.layout.pp = static_cast<int>(pp);
  std::int64_t cp = 1;  // written since context parallelism; before it, 1
  if (read_attr_i64(file, "layout_cp", cp) && (cp < 1 || cp > 1000000))
    fail(path, "records the layout cp " + std::to_string(cp) + ": corrupt (at least 1)");
  st.layout.cp = static_cast<int>(cp);
  if (!read_attr_i64(file, "skipped_steps", st.skipped_steps)) st.skipped_steps = 0;  // written before skipping existed
  st.model = recorded_model(file, path, st.deck);
  if (st.model.d_model % st.model.heads != 0)
    fail(path, "records model.d_model = " + std::to_string(st.model.d_model) +
                   " and model.heads = " + std::to_string(st.model.heads) + ", which does not divide it: corrupt");
  if (st.step < 0 || st.optimizer_steps < 0 || st.skipped_steps < 0 || st.step != st.optimizer_steps + st.skipped_steps)
    fail(path, "has step = " + std::to_string(st.step) + ", optimizer_steps = " + std::to_string(st.optimizer_steps) +
                   " and skipped_steps = " + std::to_string(st.skipped_steps) +
                   ": step must be optimizer_steps + skipped_steps, none negative (corrupt)");
  if (!read_attr_i64(file, "data_next_step", st.data_step)) st.data_step = st.step;
  if (st.data_step < st.step)
    fail(path, "has data_next_step = " + std::to_string(st.data_step) + " below step = " + std::to_string(st.step) +
                   ": corrupt (a run only ever skips batches forward)");
  return st;
}
}  // namespace

CheckpointState load_checkpoint(const std::string& path, ProcessGrid& grid, GPT& model, Optimizer& optimizer,
                                const std::vector<CheckpointContributor*>& parts) {
  static QuietHdf5 quiet;
  require_hdf5(path);
  Handle fapl{H5Pcreate(H5P_FILE_ACCESS), H5Pclose};
  H5Pset_fapl_mpio(fapl.id, MPI_COMM_WORLD, MPI_INFO_NULL);
  Handle file{H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl.id), H5Fclose};
  if (file.id < 0) fail(path, "cannot be opened as HDF5 (truncated or corrupt)");

  // The whole model shape, before any tensor: a checkpoint of fewer layers or other heads would
  // otherwise load the tensors it shares with the deck's model and silently train another model.
  CheckpointState st = read_state(file.id, path);
  const std::string mismatches = model_mismatches(st.model, model.config());
  if (!mismatches.empty())
    fail(path, "holds another model: " + mismatches + " (a checkpoint continues only the model it holds)");

  Handle dxpl{H5Pcreate(H5P_DATASET_XFER), H5Pclose};
  H5Pset_dxpl_mpio(dxpl.id, H5FD_MPIO_INDEPENDENT);  // each rank reads its own part, as save writes it
  (void)grid;
  for (const CheckpointTensor& t : checkpoint_tensors(model, optimizer, parts)) {
    const std::string& name = t.path;
    if (H5Lexists(file.id, "/params", H5P_DEFAULT) <= 0 || !path_exists(file.id, name)) {
      if (!t.required) continue;  // state this run adds (the same answer on every rank: the same file)
      fail(path, "has no readable tensor " + name + " (corrupt, or a checkpoint of another model)");
    }
    Handle ds{H5Dopen2(file.id, name.c_str(), H5P_DEFAULT), H5Dclose};
    if (ds.id < 0) fail(path, "cannot open tensor " + name + " (corrupt)");
    Handle fspace{H5Dget_space(ds.id), H5Sclose};
    std::vector<hsize_t> dims(H5Sget_simple_extent_ndims(fspace.id));
    H5Sget_simple_extent_dims(fspace.id, dims.data(), nullptr);
    if (dims != std::vector<hsize_t>(t.shard.shape.begin(), t.shard.shape.end()))
      fail(path, "tensor " + name + " has shape " + shape_text(dims) + ", but the deck's model needs " +
                     shape_text(t.shard.shape) + " (model.* keys differ from the run that wrote it)");
    // Every rank that holds elements of the tensor reads them (replicas and the last stage's shadow
    // of wte too); the others join the collective read with nothing selected.
    const Handle mspace = transfer_spaces(fspace.id, &t.shard, t.holds);
    float none = 0;
    // A device tensor is read into a host copy, checked there, and copied over once it passes.
    const bool on_device = t.holds && t.data.space != MemSpace::host;
    std::vector<float> staged(on_device ? static_cast<std::size_t>(t.shard.numel()) : 0);
    float* data = !t.holds ? &none : on_device ? staged.data() : t.data.as<float>();
    if (H5Dread(ds.id, H5T_NATIVE_FLOAT, mspace.id, fspace.id, dxpl.id, data) < 0)
      fail(path, "cannot read tensor " + name + " (truncated or corrupt)");
    // The checksum (of the values' bits) first: bytes damaged into a NaN are corruption. Then
    // finiteness: values written as they were, non-finite, are a run that had diverged. Every rank
    // learns of a non-finite value any rank read, so all refuse alike.
    std::int64_t want = 0;
    if (!read_attr_i64(ds.id, "checksum", want))
      fail(path, "tensor " + name + " has no readable checksum attribute (one integer): corrupt");
    const bool owner = t.holds && t.primary_end > t.primary_begin;
    const ShardDesc mine = owner ? t.shard.cut(t.primary_begin, t.primary_end) : t.shard;
    const auto got = static_cast<std::int64_t>(checksum(&mine, owner ? data + t.primary_begin : nullptr, owner));
    if (got != want) fail(path, "tensor " + name + " does not match its checksum: the file is corrupt");
    int nonfinite = 0;
    for (std::int64_t i = 0; t.holds && i < t.shard.numel() && !nonfinite; ++i) nonfinite = !std::isfinite(data[i]);
    MPI_Allreduce(MPI_IN_PLACE, &nonfinite, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (nonfinite)
      fail(path, "tensor " + name +
                     " holds non-finite values (nan or inf): the run that wrote it had diverged; "
                     "resume from an earlier checkpoint");
    if (on_device) model.backend().copy_from_host(BufferRef(t.data.as<float>(), t.shard.numel(), t.data.space), data);
  }
  for (CheckpointContributor* c : parts) {
    std::map<std::string, double> found;
    for (const auto& kv : c->checkpoint_attributes()) {
      double v = 0;
      if (read_attr_f64(file.id, kv.first.c_str(), v)) found[kv.first] = v;
    }
    c->restore_attributes(found);
  }
  optimizer.set_steps_taken(st.optimizer_steps);
  model.store().params_written();  // 16-bit compute copies are rebuilt from the loaded masters
  return st;
}

CheckpointState checkpoint_header(const std::string& path) {
  static QuietHdf5 quiet;
  require_hdf5(path);
  Handle file{H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose};
  if (file.id < 0) fail(path, "cannot be opened as HDF5 (truncated or corrupt)");
  CheckpointState st;
  std::int64_t version = 0;
  if (!read_attr_i64(file.id, "format_version", version))
    fail(path, "has no format_version attribute: not a loom checkpoint");
  if (!read_attr_i64(file.id, "step", st.step) || !read_attr_string(file.id, "deck", st.deck))
    fail(path, "is missing metadata (step or deck): corrupt");
  st.model = recorded_model(file.id, path, st.deck);
  return st;
}

std::string checkpoint_info(const std::string& path) {
  static QuietHdf5 quiet;
  require_hdf5(path);
  Handle file{H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose};
  if (file.id < 0) fail(path, "cannot be opened as HDF5 (truncated or corrupt)");
  std::ostringstream out;
  std::int64_t v = 0;
  std::string deck;
  out << "checkpoint " << path << "\n";
  for (const char* key : {"format_version", "step", "optimizer_steps", "skipped_steps", "seed", "data_next_step",
                          "model_layers", "model_d_model", "model_heads", "model_seq_len", "model_vocab"})
    if (read_attr_i64(file.id, key, v)) out << "  " << key << ": " << v << "\n";
  std::int64_t dp = 0, tp = 0, pp = 0;
  if (read_attr_i64(file.id, "layout_dp", dp) && read_attr_i64(file.id, "layout_tp", tp) &&
      read_attr_i64(file.id, "layout_pp", pp))
    out << "  layout: dp " << dp
        << (read_attr_i64(file.id, "layout_cp", v) && v > 1 ? " x cp " + std::to_string(v) : "") << " x tp " << tp
        << " x pp " << pp << "\n";
  double scale = 0;
  if (read_attr_f64(file.id, "loss_scale", scale)) out << "  loss_scale: " << scale << "\n";
  out << "  tensors:\n";
  struct Visit {
    std::ostringstream* out;
  } visit{&out};
  H5Ovisit(
      file.id, H5_INDEX_NAME, H5_ITER_INC,
      [](hid_t root, const char* name, const H5O_info_t* info, void* data) -> herr_t {
        if (info->type != H5O_TYPE_DATASET) return 0;
        auto& o = *static_cast<Visit*>(data)->out;
        Handle ds{H5Dopen2(root, name, H5P_DEFAULT), H5Dclose};
        Handle space{H5Dget_space(ds.id), H5Sclose};
        std::vector<hsize_t> dims(H5Sget_simple_extent_ndims(space.id));
        H5Sget_simple_extent_dims(space.id, dims.data(), nullptr);
        Handle type{H5Dget_type(ds.id), H5Tclose};
        const char* dtype = H5Tequal(type.id, H5T_NATIVE_FLOAT) > 0    ? "float32"
                            : H5Tequal(type.id, H5T_NATIVE_DOUBLE) > 0 ? "float64"
                                                                       : "other";
        o << "    /" << name << "  " << shape_text(dims) << "  " << dtype << "\n";
        return 0;
      },
      &visit);
  if (read_attr_string(file.id, "deck", deck)) out << "  deck:\n" << deck;
  return out.str();
}

CheckpointVerdict verify_checkpoint(const std::string& path) {
  static QuietHdf5 quiet;
  CheckpointVerdict v;
  try {
    require_hdf5(path);
    Handle file{H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose};
    if (file.id < 0)
      fail(path, "cannot be opened as HDF5 (truncated or corrupt, or locked: open for writing elsewhere)");
    const CheckpointState st = read_state(file.id, path);
    v.step = st.step;
    v.layout = st.layout;

    // Every tensor a resume needs: the recorded model's parameters and AdamW's state, whole, as
    // load_checkpoint lists them (built on the sizing back end: nothing is allocated).
    std::unique_ptr<Backend> be = make_sizing_backend(make_host_backend(1));
    GPT model(st.model, *be, 1);
    AdamW optimizer(OptimizerConfig{}, *be, model.params(), model.store().owned());
    for (const CheckpointTensor& t : checkpoint_tensors(model, optimizer, {})) {
      if (!path_exists(file.id, t.path)) {
        v.problems.push_back("has no tensor " + t.path + " (the model it records needs it)");
        continue;
      }
      H5L_info_t link{};
      if (H5Lget_info(file.id, t.path.c_str(), &link, H5P_DEFAULT) < 0 || link.type != H5L_TYPE_HARD) {
        v.problems.push_back("tensor " + t.path +
                             " is a link (soft, or into another file), not data of its own: "
                             "not as loom writes it");
        continue;
      }
      Handle ds{H5Dopen2(file.id, t.path.c_str(), H5P_DEFAULT), H5Dclose};
      if (ds.id < 0) {
        v.problems.push_back("cannot open tensor " + t.path + " (corrupt)");
        continue;
      }
      Handle space{H5Dget_space(ds.id), H5Sclose};
      std::vector<hsize_t> dims(static_cast<std::size_t>(std::max(0, H5Sget_simple_extent_ndims(space.id))));
      H5Sget_simple_extent_dims(space.id, dims.data(), nullptr);
      if (dims != std::vector<hsize_t>(t.shard.shape.begin(), t.shard.shape.end()))
        v.problems.push_back("tensor " + t.path + " has shape " + shape_text(dims) +
                             ", but the model it records needs " + shape_text(t.shard.shape));
    }

    // Every dataset in the file (the plugins' state too), read whole in blocks of rows: its values
    // against the checksum its writers recorded, then finiteness, as load_checkpoint checks them.
    std::vector<std::string> names;
    const herr_t visited = H5Ovisit(
        file.id, H5_INDEX_NAME, H5_ITER_INC,
        [](hid_t, const char* name, const H5O_info_t* info, void* out) -> herr_t {
          if (info->type == H5O_TYPE_DATASET)
            static_cast<std::vector<std::string>*>(out)->push_back("/" + std::string(name));
          return 0;
        },
        &names);
    if (visited < 0)
      v.problems.push_back("cannot list its datasets (a damaged group): those after " +
                           (names.empty() ? std::string("the first") : names.back()) + " are not checked");
    std::vector<float> block;
    for (const std::string& name : names) {
      Handle ds{H5Dopen2(file.id, name.c_str(), H5P_DEFAULT), H5Dclose};
      if (ds.id < 0) {
        v.problems.push_back("cannot open tensor " + name + " (corrupt)");
        continue;
      }
      std::int64_t want = 0;
      if (!read_attr_i64(ds.id, "checksum", want)) {
        v.problems.push_back("tensor " + name +
                             " has no readable checksum attribute (one integer): corrupt, or not loom's");
        continue;
      }
      Handle type{H5Dget_type(ds.id), H5Tclose};
      if (H5Tget_class(type.id) != H5T_FLOAT || H5Tget_size(type.id) != sizeof(float))
        v.problems.push_back("tensor " + name + " is not stored as float32, as loom writes it (corrupt, or rewritten)");
      Handle fspace{H5Dget_space(ds.id), H5Sclose};
      const int rank = std::max(0, H5Sget_simple_extent_ndims(fspace.id));
      std::vector<hsize_t> dims(static_cast<std::size_t>(rank));
      H5Sget_simple_extent_dims(fspace.id, dims.data(), nullptr);
      const hsize_t rows = rank ? dims[0] : 1;
      hsize_t row = 1;
      for (int d = 1; d < rank; ++d) row *= dims[static_cast<std::size_t>(d)];
      // Pieces of about 2^20 elements: blocks of whole rows, or a long row of a matrix in parts (a
      // compression residual's row is a whole tensor).
      const hsize_t piece = hsize_t{1} << 20;
      const hsize_t per_block = std::max<hsize_t>(1, piece / std::max<hsize_t>(row, 1));
      const hsize_t cols_per_piece = rank == 2 && row > piece ? piece : row;
      std::uint64_t got = 0;
      std::int64_t nonfinite = 0;
      bool readable = true;
      for (hsize_t r0 = 0; r0 < rows && readable; r0 += cols_per_piece < row ? 1 : per_block)
        for (hsize_t c0 = 0; c0 < std::max<hsize_t>(row, 1) && readable; c0 += cols_per_piece) {
          const hsize_t n = cols_per_piece < row ? 1 : std::min(per_block, rows - r0);
          const hsize_t m = std::min(cols_per_piece, row - c0);
          std::vector<hsize_t> start(static_cast<std::size_t>(rank), 0), count(dims);
          if (rank) {
            start[0] = r0;
            count[0] = n;
            if (rank == 2) {
              start[1] = c0;
              count[1] = m;
            }
            H5Sselect_hyperslab(fspace.id, H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr);
          }
          const hsize_t elems = n * m;
          block.resize(static_cast<std::size_t>(elems));
          Handle mspace{H5Screate_simple(1, &elems, nullptr), H5Sclose};
          readable = H5Dread(ds.id, H5T_NATIVE_FLOAT, mspace.id, fspace.id, H5P_DEFAULT, block.data()) >= 0;
          if (!readable) break;
          got += checksum_run(static_cast<std::int64_t>(r0 * row + c0), block.data(), static_cast<std::int64_t>(elems));
          for (float x : block) nonfinite += !std::isfinite(x);
          if (row == 0) break;
        }
      ++v.tensors;
      v.bytes += static_cast<std::int64_t>(rows * row * sizeof(float));
      if (!readable)
        v.problems.push_back("cannot read tensor " + name + " (truncated or corrupt)");
      else if (static_cast<std::int64_t>(got) != want)
        v.problems.push_back("tensor " + name + " does not match its checksum: the file is corrupt");
      else if (nonfinite)
        v.problems.push_back("tensor " + name + " holds " + std::to_string(nonfinite) +
                             (nonfinite == 1 ? " non-finite value" : " non-finite values") +
                             " (nan or inf): the run that wrote it had diverged");
    }
  } catch (const InputError& e) {
    v.problems.push_back(e.what());
  } catch (const std::exception& e) {  // anything else a damaged file leads to: said, and the next file read
    v.problems.push_back(std::string("cannot be checked: ") + e.what());
  }
  // A tensor both lists name (a required one that cannot be opened) is said once.
  std::vector<std::string> once;
  for (std::string& p : v.problems)
    if (std::find(once.begin(), once.end(), p) == once.end()) once.push_back(std::move(p));
  v.problems = std::move(once);
  return v;
}

}  // namespace loom
