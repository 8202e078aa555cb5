// The checkpoint format (io/checkpoint.hpp) under 1, 2 and 4 ranks: a round trip restores every
// parameter and optimizer tensor bit for bit whichever ranks owned which slices when it was written
// and when it is read (the property that lets a run restart on any layout), and every damaged or
// foreign file is refused on every rank alike, naming the file and what is wrong, the file left as it
// was; `ckpt verify` (one process) names the same damage.
//
// Every rank runs every test and makes the same collective calls; rank 0 alone damages the copies
// (serial HDF5), between barriers.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <mpi.h>
#include <sys/stat.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "core/backend/backend.hpp"
#include "core/base/error.hpp"
#include "core/comm/grid.hpp"
#include "core/model/gpt.hpp"
#include "core/model/optimizer.hpp"
#include "core/test_mpi/ranks.hpp"
#include "io/checkpoint.hpp"

namespace loom {
namespace {

using testing::world_rank;
using testing::world_size;

std::string dir() {
  static const std::string d = [] {
    std::string s = std::string(LOOM_TEST_TMP) + "/checkpoint-np" + std::to_string(world_size());
    if (world_rank() == 0) {
      ::mkdir(LOOM_TEST_TMP, 0755);
      ::mkdir(s.c_str(), 0755);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    return s;
  }();
  return d;
}

GPTConfig small_config() {
  GPTConfig c;
  c.layers = 1;
  c.d_model = 32;
  c.heads = 4;
  c.seq_len = 8;
  c.vocab = 37;
  return c;
}

// Who owns what: every rank its own contiguous part of each tensor (as ZeRO-1 cuts the optimizer
// state), `reversed` taking rank N-1-r's part; or (`whole`) every rank all of each tensor, replica 0
// primary (as plain data parallelism keeps it).
enum class Owning { parts, reversed_parts, whole };

std::vector<OwnedSlice> owning(const GPT& model, Owning how) {
  const int n = world_size();
  const int r = how == Owning::reversed_parts ? n - 1 - world_rank() : world_rank();
  std::vector<OwnedSlice> out;
  for (int i = 0; i < static_cast<int>(model.params().size()); ++i) {
    const std::int64_t numel = model.params()[static_cast<std::size_t>(i)].numel();
    if (how == Owning::whole) {
      out.push_back({i, 0, numel, world_rank() == 0});
      continue;
    }
    const std::int64_t b = numel * r / n, e = numel * (r + 1) / n;
    if (e > b) out.push_back({i, b, e, true});
  }
  return out;
}

// A model and its optimizer on the data-parallel grid of the whole world, the AdamW moments of
// element k of tensor i set to a value of (i, k) that no other element has.
struct TrainedRun {
  std::unique_ptr<Backend> be = make_host_backend(1);
  ProcessGrid grid{MPI_COMM_WORLD, Layout{world_size(), 1, 1}};
  std::unique_ptr<GPT> model;
  std::unique_ptr<AdamW> opt;
  TrainedRun(const GPTConfig& cfg, std::uint64_t seed, Owning how) {
    model = std::make_unique<GPT>(cfg, *be, 2);
    model->init_weights(seed);
    opt = std::make_unique<AdamW>(OptimizerConfig{}, *be, model->params(), owning(*model, how));
  }
  static float moment(int kind, int param, std::int64_t k) {
    return static_cast<float>(kind + 1) * 1e-3f * static_cast<float>(param + 1) + 1e-7f * static_cast<float>(k);
  }
  void set_moments() {
    const auto st = opt->state();
    for (std::size_t s = 0; s < opt->owned().size(); ++s) {
      const OwnedSlice& o = opt->owned()[s];
      for (int kind = 0; kind < 2; ++kind) {
        float* d = st[static_cast<std::size_t>(kind)].data.as<float>() + opt->slice_offset(s);
        for (std::int64_t k = o.begin; k < o.end; ++k) d[k - o.begin] = moment(kind, o.param, k);
      }
    }
  }
  CheckpointState state(std::int64_t step) const {
    CheckpointState s;
    s.step = step;
    s.optimizer_steps = step;
    s.model = model->config();
    s.seed = 11;
    s.loss_scale = 1.0;
    s.deck = "# a deck\n[model]\nlayers = 1\n";
    s.layout = grid.layout();
    return s;
  }
  float* param(int i) { return model->store().param(i).as<float>(); }
};

std::vector<char> bytes_of(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<char>(std::istreambuf_iterator<char>(f), {});
}
void write_bytes(const std::string& path, const std::vector<char>& b) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(b.data(), static_cast<std::streamsize>(b.size()));
}

// A good checkpoint written once per process count (the model of seed 5, moments set, step 6).
const std::string& good_checkpoint() {
  static const std::string path = [] {
    const std::string p = dir() + "/good.h5";
    TrainedRun run(small_config(), 5, Owning::parts);
    run.set_moments();
    save_checkpoint(p, run.grid, *run.model, *run.opt, run.state(6));
    return p;
  }();
  return path;
}

// `damage` (rank 0 only) makes `name` from a copy of the good checkpoint; every rank then loads it and
// must be refused with a message naming the file and matching `what`; the damaged file is unchanged
// by the attempt, and `ckpt verify` lists a problem matching `verify_what` (when given).
void expect_refused(const std::string& name, const std::function<void(const std::string&)>& damage,
                    const std::string& what, const std::string& verify_what = "",
                    const std::function<void(GPTConfig&)>& deck_model = nullptr) {
  const std::string good = good_checkpoint();
  const std::string path = dir() + "/" + name;
  if (world_rank() == 0) {
    write_bytes(path, bytes_of(good));
    damage(path);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  const std::vector<char> before = bytes_of(path);
  GPTConfig cfg = small_config();
  if (deck_model) deck_model(cfg);
  TrainedRun run(cfg, 9, Owning::whole);
  std::string message;
  try {
    load_checkpoint(path, run.grid, *run.model, *run.opt);
  } catch (const InputError& e) {
    message = e.what();
  }
  EXPECT_NE(message, "") << name << ": loaded without complaint";
  EXPECT_NE(message.find("'" + path + "'"), std::string::npos)
      << name << ": the message does not name the file: " << message;
  EXPECT_NE(message.find(what), std::string::npos) << name << ": expected \"" << what << "\" in: " << message;
  EXPECT_TRUE(bytes_of(path) == before) << name << ": reading it changed the file";
  if (!verify_what.empty() && world_rank() == 0) {
    const CheckpointVerdict v = verify_checkpoint(path);
    std::string all;
    for (const auto& p : v.problems) all += p + "\n";
    EXPECT_NE(all.find(verify_what), std::string::npos)
        << name << ": ckpt verify should say \"" << verify_what << "\"; it says:\n"
        << all;
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// Serial HDF5 on rank 0, for the damage.
struct H5 {
  hid_t f;
  explicit H5(const std::string& path) : f(H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT)) {
    EXPECT_GE(f, 0) << path;
  }
  ~H5() { H5Fclose(f); }
  void set_i64(const char* attr, std::int64_t v) {
    H5Adelete(f, attr);
    const hid_t s = H5Screate(H5S_SCALAR);
    const hid_t a = H5Acreate2(f, attr, H5T_NATIVE_INT64, s, H5P_DEFAULT, H5P_DEFAULT);
    H5Awrite(a, H5T_NATIVE_INT64, &v);
    H5Aclose(a);
    H5Sclose(s);
  }
  void set_f64(const char* attr, double v) {
    H5Adelete(f, attr);
    const hid_t s = H5Screate(H5S_SCALAR);
    const hid_t a = H5Acreate2(f, attr, H5T_NATIVE_DOUBLE, s, H5P_DEFAULT, H5P_DEFAULT);
    H5Awrite(a, H5T_NATIVE_DOUBLE, &v);
    H5Aclose(a);
    H5Sclose(s);
  }
  // An attribute holding 100 integers where loom writes one.
  void set_array(hid_t on, const char* attr) {
    H5Adelete(on, attr);
    std::vector<std::int64_t> v(100, 7);
    const hsize_t n = v.size();
    const hid_t s = H5Screate_simple(1, &n, nullptr);
    const hid_t a = H5Acreate2(on, attr, H5T_NATIVE_INT64, s, H5P_DEFAULT, H5P_DEFAULT);
    H5Awrite(a, H5T_NATIVE_INT64, v.data());
    H5Aclose(a);
    H5Sclose(s);
  }
  haddr_t offset(const char* dataset) {
    const hid_t d = H5Dopen2(f, dataset, H5P_DEFAULT);
    const haddr_t at = H5Dget_offset(d);
    H5Dclose(d);
    return at;
  }
};

TEST(Checkpoint, RoundTripIsBitwiseWhoeverOwnsWhat) {
  // Written with each rank owning its part, read with every rank owning all (replica 0 primary) and
  // with the parts reversed among the ranks: parameters and moments come back bit for bit.
  const std::string path = good_checkpoint();
  TrainedRun wrote(small_config(), 5, Owning::parts);
  wrote.set_moments();
  for (Owning how : {Owning::whole, Owning::reversed_parts, Owning::parts}) {
    TrainedRun read(small_config(), 9, how);  // other weights: the load must replace every value
    const CheckpointState st = load_checkpoint(path, read.grid, *read.model, *read.opt);
    EXPECT_EQ(st.step, 6);
    EXPECT_EQ(st.optimizer_steps, 6);
    EXPECT_EQ(read.opt->steps_taken(), 6);
    EXPECT_EQ(st.seed, 11u);
    EXPECT_EQ(st.layout.dp, world_size());
    EXPECT_EQ(st.deck, "# a deck\n[model]\nlayers = 1\n");
    for (int i = 0; i < static_cast<int>(read.model->params().size()); ++i) {
      const std::int64_t n = read.model->params()[static_cast<std::size_t>(i)].numel();
      EXPECT_EQ(std::memcmp(read.param(i), wrote.param(i), static_cast<std::size_t>(n) * sizeof(float)), 0)
          << read.model->params()[static_cast<std::size_t>(i)].name << " differs after the round trip";
    }
    const auto state = read.opt->state();
    int wrong = 0;
    for (std::size_t s = 0; s < read.opt->owned().size(); ++s) {
      const OwnedSlice& o = read.opt->owned()[s];
      for (int kind = 0; kind < 2; ++kind) {
        const float* d = state[static_cast<std::size_t>(kind)].data.as<float>() + read.opt->slice_offset(s);
        for (std::int64_t k = o.begin; k < o.end; ++k) wrong += d[k - o.begin] != TrainedRun::moment(kind, o.param, k);
      }
    }
    EXPECT_EQ(wrong, 0) << "AdamW moments not restored, owning " << static_cast<int>(how);
  }
}

TEST(Checkpoint, WriteIntoAMissingDirectoryFailsOnEveryRankAndLeavesNothing) {
  TrainedRun run(small_config(), 5, Owning::parts);
  const std::string path = dir() + "/no/such/dir/ckpt.h5";
  std::string message;
  try {
    save_checkpoint(path, run.grid, *run.model, *run.opt, run.state(1));
  } catch (const InputError& e) {
    message = e.what();
  }
  EXPECT_NE(message.find(path + ".tmp"), std::string::npos) << message;
  EXPECT_NE(message.find("cannot be created"), std::string::npos) << message;
  struct stat sb;
  EXPECT_NE(::stat(path.c_str(), &sb), 0);
}

TEST(Checkpoint, RefusesATruncatedFile) {
  expect_refused(
      "truncated.h5",
      [](const std::string& p) {
        std::vector<char> b = bytes_of(p);
        b.resize(b.size() / 2);
        write_bytes(p, b);
      },
      "truncated or corrupt", "truncated or corrupt");
}

TEST(Checkpoint, RefusesAFileThatIsNotHdf5) {
  expect_refused(
      "text.h5", [](const std::string& p) { write_bytes(p, std::vector<char>(4096, 'x')); }, "is not a readable HDF5");
}

TEST(Checkpoint, RefusesAnotherFormatVersion) {
  expect_refused(
      "version.h5", [](const std::string& p) { H5(p).set_i64("format_version", 99); },
      "is format version 99; this loom reads version 1", "format version 99");
}

TEST(Checkpoint, RefusesAnHdf5FileThatIsNotLooms) {
  expect_refused(
      "foreign.h5", [](const std::string& p) { H5Adelete(H5(p).f, "format_version"); },
      "has no format_version attribute: not a loom checkpoint");
}

TEST(Checkpoint, RefusesAnotherModel) {
  expect_refused(
      "model.h5", [](const std::string&) {},
      "holds another model: model.d_model = 32 in the checkpoint, 64 in this deck", "",
      [](GPTConfig& c) { c.d_model = 64; });
}

TEST(Checkpoint, RefusesAMissingTensor) {
  expect_refused(
      "missing.h5", [](const std::string& p) { H5Ldelete(H5(p).f, "/optimizer/v/blocks.0.ln2.bias", H5P_DEFAULT); },
      "has no readable tensor /optimizer/v/blocks.0.ln2.bias", "has no tensor /optimizer/v/blocks.0.ln2.bias");
}

TEST(Checkpoint, RefusesATensorOfAnotherShape) {
  expect_refused(
      "shape.h5",
      [](const std::string& p) {
        H5 h(p);
        H5Ldelete(h.f, "/params/wpe.weight", H5P_DEFAULT);
        const hsize_t dims[2] = {3, 32};
        const hid_t s = H5Screate_simple(2, dims, nullptr);
        const hid_t d =
            H5Dcreate2(h.f, "/params/wpe.weight", H5T_NATIVE_FLOAT, s, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
        std::vector<float> zeros(96, 0.0f);
        H5Dwrite(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, zeros.data());
        h.set_array(d, "checksum");
        H5Dclose(d);
        H5Sclose(s);
      },
      "tensor /params/wpe.weight has shape [3, 32], but the deck's model needs [8, 32]");
}

TEST(Checkpoint, RefusesDamagedTensorBytes) {
  expect_refused(
      "corrupt.h5",
      [](const std::string& p) {
        haddr_t at;
        {
          H5 h(p);
          at = h.offset("/params/blocks.0.mlp.fc.weight");
        }
        ASSERT_NE(at, HADDR_UNDEF);
        std::vector<char> b = bytes_of(p);
        for (std::size_t k = 0; k < 256; ++k) b[static_cast<std::size_t>(at) + 1000 + k] = 0x5a;
        write_bytes(p, b);
      },
      "tensor /params/blocks.0.mlp.fc.weight does not match its checksum: the file is corrupt",
      "tensor /params/blocks.0.mlp.fc.weight does not match its checksum");
}

TEST(Checkpoint, RefusesAChecksumThatIsNotOneInteger) {
  expect_refused(
      "checksum.h5",
      [](const std::string& p) {
        H5 h(p);
        const hid_t d = H5Dopen2(h.f, "/params/wte.weight", H5P_DEFAULT);
        h.set_array(d, "checksum");
        H5Dclose(d);
      },
      "tensor /params/wte.weight has no readable checksum attribute (one integer)",
      "tensor /params/wte.weight has no readable checksum attribute");
}

TEST(Checkpoint, RefusesAStepThatIsNotOneInteger) {
  expect_refused(
      "step_array.h5",
      [](const std::string& p) {
        H5 h(p);
        h.set_array(h.f, "step");
      },
      "has no readable attribute step: corrupt", "has no readable attribute step: corrupt");
}

TEST(Checkpoint, RefusesStepsThatDoNotAddUp) {
  expect_refused(
      "steps.h5", [](const std::string& p) { H5(p).set_i64("optimizer_steps", 4); },
      "step must be optimizer_steps + skipped_steps");
}

TEST(Checkpoint, RefusesANonFiniteLossScale) {
  expect_refused(
      "scale.h5", [](const std::string& p) { H5(p).set_f64("loss_scale", std::nan("")); },
      "records loss_scale = nan: corrupt", "records loss_scale = nan: corrupt");
}

TEST(Checkpoint, RefusesAModelOfNoHeads) {
  expect_refused(
      "heads0.h5", [](const std::string& p) { H5(p).set_i64("model_heads", 0); }, "records model.heads = 0: corrupt",
      "records model.heads = 0: corrupt");
}

TEST(Checkpoint, VerifyNamesATensorLinkedFromAnotherFile) {
  // loom never writes a link; read through, it would pass another checkpoint's values off as this one's.
  if (world_rank() == 0) {
    const std::string path = dir() + "/linked.h5";
    write_bytes(path, bytes_of(good_checkpoint()));
    {
      H5 h(path);
      H5Ldelete(h.f, "/params/wpe.weight", H5P_DEFAULT);
      H5Lcreate_external(good_checkpoint().c_str(), "/params/wpe.weight", h.f, "/params/wpe.weight", H5P_DEFAULT,
                         H5P_DEFAULT);
    }
    std::string all;
    for (const auto& p : verify_checkpoint(path).problems) all += p + "\n";
    EXPECT_NE(all.find("tensor /params/wpe.weight is a link"), std::string::npos) << all;
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST(Checkpoint, RefusesValuesOfADivergedRun) {
  // Written as they were (the checksum matches): a run that had diverged, not a damaged file.
  const std::string path = dir() + "/diverged.h5";
  {
    TrainedRun run(small_config(), 5, Owning::parts);
    run.param(3)[0] = std::numeric_limits<float>::quiet_NaN();
    save_checkpoint(path, run.grid, *run.model, *run.opt, run.state(2));
  }
  TrainedRun run(small_config(), 9, Owning::whole);
  std::string message;
  try {
    load_checkpoint(path, run.grid, *run.model, *run.opt);
  } catch (const InputError& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("holds non-finite values (nan or inf): the run that wrote it had diverged"), std::string::npos)
      << message;
  if (world_rank() == 0) {
    std::string all;
    for (const auto& p : verify_checkpoint(path).problems) all += p + "\n";
    EXPECT_NE(all.find("non-finite value"), std::string::npos) << all;
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST(Checkpoint, VerifyFindsTheGoodFileIntactAndAFifoNotAFile) {
  if (world_rank() == 0) {
    const CheckpointVerdict v = verify_checkpoint(good_checkpoint());
    EXPECT_TRUE(v.problems.empty()) << v.problems.front();
    EXPECT_EQ(v.step, 6);
    EXPECT_GT(v.tensors, 0);
    const std::string fifo = dir() + "/fifo.h5";
    std::remove(fifo.c_str());
    ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
    std::string all;
    for (const auto& p : verify_checkpoint(fifo).problems) all += p + "\n";
    EXPECT_NE(all.find("is not a regular file (a FIFO"), std::string::npos) << all;
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

}  // namespace
}  // namespace loom
