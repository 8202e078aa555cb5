// The host back end's matrix products (core/backend/gemm.hpp): oneDNN matmul primitives, cached per shape,
// or cblas_sgemm.
#include "core/backend/gemm.hpp"

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <tuple>

#ifdef LOOM_HAVE_ONEDNN
#include <oneapi/dnnl/dnnl.hpp>
#endif

extern "C" void openblas_set_num_threads(int) __attribute__((weak));
extern "C" int openblas_get_num_threads(void) __attribute__((weak));
extern "C" char* openblas_get_config(void) __attribute__((weak));
// oneDNN's OpenMP runtime (libgomp, a dependency of libdnnl): weak, so that a build without oneDNN,
// or a oneDNN with another runtime, needs no OpenMP.
extern "C" void omp_set_num_threads(int) __attribute__((weak));
extern "C" int omp_get_max_threads(void) __attribute__((weak));

namespace loom::gemm {
namespace {

std::atomic<Impl> g_choice{Impl::automatic};
std::atomic<int> g_threads{1};  // set_threads

// The distinct kernels used so far, in first-use order; guarded by g_mutex.
std::mutex g_mutex;
std::vector<std::string> g_used;

void note_used(const std::string& name) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (std::find(g_used.begin(), g_used.end(), name) == g_used.end()) g_used.push_back(name);
}

// K == 0: C = beta * C (beta == 0: zeros, C not read). Returns true when nothing is left to do.
bool trivial(int M, int N, int K, float beta, float* C, int ldc) {
  if (M <= 0 || N <= 0) return true;
  if (K > 0) return false;
  for (int r = 0; r < M; ++r) {
    float* c = C + static_cast<std::int64_t>(r) * ldc;
    for (int j = 0; j < N; ++j) c[j] = beta == 0.0f ? 0.0f : beta * c[j];
  }
  return true;
}

void blas_sgemm(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, const float* B, int ldb,
                float beta, float* C, int ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N, K, alpha, A, lda, B,
              ldb, beta, C, ldc);
}

// bf16 through fp32 copies of A and B as stored (rows x cols with leading dimension ld), one sgemm.
void blas_bf16(bool ta, bool tb, int M, int N, int K, float alpha, const bf16* A, int lda, const bf16* B, int ldb,
               float beta, float* C, int ldc) {
  const auto dense = [](const bf16* X, int rows, int cols, int ld) {
    std::vector<float> d(static_cast<std::size_t>(rows) * cols);
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < cols; ++c)
        d[static_cast<std::size_t>(r) * cols + c] = to_float(X[static_cast<std::int64_t>(r) * ld + c]);
    return d;
  };
  const int ar = ta ? K : M, ac = ta ? M : K, br = tb ? N : K, bc = tb ? K : N;
  const std::vector<float> a = dense(A, ar, ac, lda), b = dense(B, br, bc, ldb);
  blas_sgemm(ta, tb, M, N, K, alpha, a.data(), ac, b.data(), bc, beta, C, ldc);
}

#ifdef LOOM_HAVE_ONEDNN

struct Dnnl {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
};
Dnnl& dnnl_state() {
  static Dnnl d;  // created on first use (thread-safe), never in a build or run that takes blas
  return d;
}

// (bf16 operands, ta, tb, M, N, K, lda, ldb, ldc, alpha bits, beta bits)
using Key = std::tuple<bool, bool, bool, int, int, int, int, int, int, std::uint32_t, std::uint32_t>;
struct Entry {
  dnnl::matmul prim;  // empty: oneDNN refused the shape, cblas runs it
  dnnl::memory::desc a, b, c;
  std::string kernel;  // "fp32 gemm:jit"
};
std::map<Key, std::shared_ptr<const Entry>> g_cache;  // guarded by g_mutex
constexpr std::size_t kMaxCached = 4096;

std::uint32_t bits(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

// The primitive for one product, created on first use. Strides carry the transposes and leading
// dimensions: op(A)[m,k] is A[m*lda + k], or A[k*lda + m] when ta.
std::shared_ptr<const Entry> lookup(bool is_bf16, bool ta, bool tb, int M, int N, int K, int lda, int ldb, int ldc,
                                    float alpha, float beta) {
  const Key key{is_bf16, ta, tb, M, N, K, lda, ldb, ldc, bits(alpha), bits(beta)};
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_cache.find(key);
    if (it != g_cache.end()) return it->second;
  }
  using dt = dnnl::memory::data_type;
  using dims = dnnl::memory::dims;
  const dt in = is_bf16 ? dt::bf16 : dt::f32;
  auto made = std::make_shared<Entry>();
  Entry& e = *made;
  e.a = dnnl::memory::desc(dims{M, K}, in, ta ? dims{1, lda} : dims{lda, 1});
  e.b = dnnl::memory::desc(dims{K, N}, in, tb ? dims{1, ldb} : dims{ldb, 1});
  e.c = dnnl::memory::desc(dims{M, N}, dt::f32, dims{ldc, 1});
  const std::string type = is_bf16 ? "bf16 " : "fp32 ";
  try {
    dnnl::primitive_attr attr;
    if (alpha != 1.0f) attr.set_output_scales(0, {alpha});
    if (beta != 0.0f) {
      dnnl::post_ops po;
      po.append_sum(beta);
      attr.set_post_ops(po);
    }
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(e.a, e.b, e.c), attr, dnnl_state().engine);
    e.prim = dnnl::matmul(pd);
    e.kernel = type + pd.impl_info_str();
  } catch (const dnnl::error& err) {
    e.prim = dnnl::matmul();
    // oneDNN 2.6's bf16 matmul needs AVX-512 (avx512_core); say so where that is the reason.
    const bool no_avx512 = !__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw");
    e.kernel = type + "cblas_sgemm (oneDNN refused: " + err.what() +
               (is_bf16 && no_avx512 ? "; its bf16 kernels need AVX-512, which this CPU lacks" : "") + ")";
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_cache.size() >= kMaxCached) g_cache.clear();
  g_cache.emplace(key, made);
  if (std::find(g_used.begin(), g_used.end(), e.kernel) == g_used.end()) g_used.push_back(e.kernel);
  return made;
}

void run(const Entry& e, const void* A, const void* B, float* C) {
  Dnnl& d = dnnl_state();
  dnnl::memory ma(e.a, d.engine, const_cast<void*>(A)), mb(e.b, d.engine, const_cast<void*>(B)), mc(e.c, d.engine, C);
  e.prim.execute(d.stream, {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc}});
  d.stream.wait();
}

const char* runtime_name(unsigned r) {
  switch (r) {
    case DNNL_RUNTIME_OMP:
      return "OpenMP";
    case DNNL_RUNTIME_TBB:
      return "TBB";
    case DNNL_RUNTIME_SEQ:
      return "sequential";
    case DNNL_RUNTIME_THREADPOOL:
      return "threadpool";
    default:
      return "unknown runtime";
  }
}

#endif  // LOOM_HAVE_ONEDNN

std::string blas_name() {
  std::string s =
      openblas_get_config ? std::string(openblas_get_config()) : std::string("CBLAS");  // "OpenBLAS 0.3.21 ..."
  if (openblas_get_num_threads) {
    const int n = openblas_get_num_threads();
    s += " (" + std::to_string(n) + " thread" + (n == 1 ? "" : "s") + ")";
  }
  return s;
}

}  // namespace

Impl parse_impl(const std::string& s) {
  if (s == "auto") return Impl::automatic;
  if (s == "onednn") return Impl::onednn;
  if (s == "blas") return Impl::blas;
  throw std::invalid_argument("unknown gemm implementation '" + s + "' (valid: auto, onednn, blas)");
}

const char* impl_name(Impl i) {
  switch (i) {
    case Impl::automatic:
      return "auto";
    case Impl::onednn:
      return "onednn";
    case Impl::blas:
      return "blas";
  }
  return "?";
}

bool have_onednn() {
#ifdef LOOM_HAVE_ONEDNN
  return true;
#else
  return false;
#endif
}

void set_impl(Impl i) {
  if (i == Impl::onednn && !have_onednn())
    throw std::invalid_argument(
        "gemm implementation 'onednn' is not in this build (built with LOOM_ONEDNN=OFF "
        "or without oneDNN); valid here: auto, blas");
  g_choice.store(i);
}

Impl impl() {
  const Impl i = g_choice.load();
  if (i != Impl::automatic) return i;
  return have_onednn() ? Impl::onednn : Impl::blas;
}

void set_threads(int n) {
  n = std::max(1, n);
  g_threads.store(n);
  if (openblas_set_num_threads) openblas_set_num_threads(n);
  if (omp_set_num_threads) omp_set_num_threads(n);
}

int threads() {
#ifdef LOOM_HAVE_ONEDNN
  if (dnnl::version()->cpu_runtime == DNNL_RUNTIME_OMP) return omp_get_max_threads ? omp_get_max_threads() : 0;
  return 0;
#else
  return 0;
#endif
}

std::vector<std::string> impls_used() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_used;
}

std::string describe() {
  std::string kernels;
  for (const std::string& k : impls_used()) kernels += (kernels.empty() ? "" : ", ") + k;
#ifdef LOOM_HAVE_ONEDNN
  if (impl() == Impl::onednn) {
    const dnnl::version_t* v = dnnl::version();
    const int n = threads();
    std::string s = "oneDNN " + std::to_string(v->major) + "." + std::to_string(v->minor) + "." +
                    std::to_string(v->patch) + " (" + runtime_name(v->cpu_runtime) + ", " + std::to_string(n) +
                    " thread" + (n == 1 ? "" : "s");
    s += kernels.empty() ? ")" : "; " + kernels + ")";
    return s;
  }
#endif
  return blas_name() + (kernels.empty() ? "" : "; " + kernels);
}

static bool blas_for_transposed_a() {
  static const bool yes = !__builtin_cpu_supports("avx512f");
  return yes;
}

void sgemm(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, const float* B, int ldb,
           float beta, float* C, int ldc) {
  if (trivial(M, N, K, beta, C, ldc)) return;
#ifdef LOOM_HAVE_ONEDNN
  // run.gemm = auto: oneDNN, except an fp32 product of a transposed A (the weight gradients,
  // dW += dout^T x) on a CPU without AVX-512, where oneDNN 2.6's kernel runs at 0.8-0.9 of
  // OpenBLAS's rate, and at half where A's rows are 4 KiB apart (dout of a 1024-wide layer;
  // bench/sgemm_peak "fc dW", AMD EPYC AVX2: 31 against 62 GFLOP/s). A rule of the CPU and the
  // shape, not a timing: every rank and every restart picks the same kernels, so results stay
  // bit for bit. One thread only: with more, OpenBLAS's thread pool and oneDNN's OpenMP one spin
  // against each other on the same cores (2 threads, bench model: 1230-1440 tokens/s with the
  // mix against 3620-3840 all on oneDNN).
  if (impl() == Impl::onednn && ta && !tb && g_choice.load() == Impl::automatic && g_threads.load() == 1 &&
      blas_for_transposed_a()) {
    static std::atomic<bool> noted{false};
    if (!noted.exchange(true)) note_used("fp32 cblas_sgemm for transposed A (no AVX-512)");
    blas_sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
  if (impl() == Impl::onednn) {
    const auto e = lookup(false, ta, tb, M, N, K, lda, ldb, ldc, alpha, beta);
    if (e->prim) {
      run(*e, A, B, C);
      return;
    }
  }
#endif
  static std::atomic<bool> noted{false};
  if (impl() == Impl::blas && !noted.exchange(true)) note_used("fp32 cblas_sgemm");
  blas_sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

void gemm_bf16(bool ta, bool tb, int M, int N, int K, float alpha, const bf16* A, int lda, const bf16* B, int ldb,
               float beta, float* C, int ldc) {
  if (trivial(M, N, K, beta, C, ldc)) return;
#ifdef LOOM_HAVE_ONEDNN
  if (impl() == Impl::onednn) {
    const auto e = lookup(true, ta, tb, M, N, K, lda, ldb, ldc, alpha, beta);
    if (e->prim) {
      run(*e, A, B, C);
      return;
    }
  }
#endif
  static std::atomic<bool> noted{false};
  if (impl() == Impl::blas && !noted.exchange(true)) note_used("bf16 cblas_sgemm on fp32 copies");
  blas_bf16(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

}  // namespace loom::gemm
