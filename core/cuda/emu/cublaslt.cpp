// The emulated device's cuBLASLt (include/cublasLt.h): D = alpha op(A) op(B) + beta C (+ bias, per
// row of D), column-major, batched with strides, computed on the host's BLAS after each operand is
// read in its type (bf16, fp16, fp32 rounded to TF32 where the compute type says, fp64), queued on
// the stream as the library's kernels are.
#include <cblas.h>
#include <cublasLt.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/cuda/emu/runtime.hpp"
#include "core/base/dtype.hpp"

struct cublasLtContext {
  int alive = 1;
};
struct cublasLtMatmulDescOpaque_t {
  cublasComputeType_t compute;
  cudaDataType scale;
  std::int32_t transa = CUBLAS_OP_N, transb = CUBLAS_OP_N;
  std::uint32_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  const void* bias = nullptr;
  std::int32_t bias_type = -1;  // unset: D's type
};
struct cublasLtMatrixLayoutOpaque_t {
  cudaDataType type;
  std::uint64_t rows, cols;
  std::int64_t ld;
  std::int32_t batch = 1;
  std::int64_t stride = 0;  // elements between the batch's matrices
};
struct cublasLtMatmulPreferenceOpaque_t {
  std::uint64_t workspace = 0;
  std::uint32_t align[4] = {256, 256, 256, 256};  // the library's defaults: A, B, C, D
};

namespace {

using loom::cuda_emu::rt::host_address;

cublasStatus_t refuse(cublasStatus_t s, const std::string& why) {
  std::fprintf(stderr, "loom cuda emulator: cuBLASLt: %s\n", why.c_str());
  return s;
}

std::size_t type_bytes(cudaDataType t) {
  switch (t) {
    case CUDA_R_32F:
      return 4;
    case CUDA_R_64F:
      return 8;
    case CUDA_R_16F:
    case CUDA_R_16BF:
      return 2;
  }
  return 0;
}

// Each attribute's value is of one type, and cuBLASLt takes only that size.
template <class T>
bool take(T& field, const void* buf, std::size_t bytes) {
  if (bytes != sizeof(T) || !buf) return false;
  std::memcpy(&field, buf, sizeof(T));
  return true;
}

// An attribute set, or refused for its size (naming the object and the attribute).
cublasStatus_t taken(bool ok, const char* object, int attr, std::size_t bytes) {
  if (ok) return CUBLAS_STATUS_SUCCESS;
  return refuse(CUBLAS_STATUS_INVALID_VALUE, std::string(object) + " attribute " + std::to_string(attr) + " given " +
                                                 std::to_string(bytes) + " bytes, not its type's");
}

std::uint64_t mix(std::uint64_t h, std::uint64_t v) {  // FNV-1a over v's bytes
  for (int i = 0; i < 8; ++i) h = (h ^ ((v >> (8 * i)) & 0xff)) * 1099511628211ull;
  return h;
}
std::uint64_t fingerprint(const cublasLtMatmulDescOpaque_t& d, const cublasLtMatrixLayoutOpaque_t* const (&l)[4]) {
  std::uint64_t h = 14695981039346656037ull;
  for (std::uint64_t v : {std::uint64_t(d.compute), std::uint64_t(d.scale), std::uint64_t(d.transa),
                          std::uint64_t(d.transb), std::uint64_t(d.epilogue), std::uint64_t(std::int64_t(d.bias_type))})
    h = mix(h, v);
  for (const auto* x : l)
    for (std::uint64_t v : {std::uint64_t(x->type), x->rows, x->cols, std::uint64_t(x->ld), std::uint64_t(x->batch),
                            std::uint64_t(x->stride)})
      h = mix(h, v);
  return h;
}

// The shapes, types and epilogue of a product: "" when cuBLASLt takes it, else why not.
std::string check_product(const cublasLtMatmulDescOpaque_t& d, const cublasLtMatrixLayoutOpaque_t& A,
                          const cublasLtMatrixLayoutOpaque_t& B, const cublasLtMatrixLayoutOpaque_t& C,
                          const cublasLtMatrixLayoutOpaque_t& D) {
  const std::uint64_t m = D.rows, n = D.cols;
  const std::uint64_t am = d.transa == CUBLAS_OP_T ? A.cols : A.rows, ak = d.transa == CUBLAS_OP_T ? A.rows : A.cols;
  const std::uint64_t bk = d.transb == CUBLAS_OP_T ? B.cols : B.rows, bn = d.transb == CUBLAS_OP_T ? B.rows : B.cols;
  auto dims = [](const cublasLtMatrixLayoutOpaque_t& x) {
    return std::to_string(x.rows) + "x" + std::to_string(x.cols);
  };
  if (am != m || bn != n || ak != bk)
    return "op(A) " + std::to_string(am) + "x" + std::to_string(ak) + " times op(B) " + std::to_string(bk) + "x" +
           std::to_string(bn) + " into D " + dims(D);
  if (C.rows != D.rows || C.cols != D.cols || C.type != D.type) return "C " + dims(C) + " is not D's " + dims(D);
  for (const auto* x : {&A, &B, &C, &D}) {
    if (x->ld < std::int64_t(std::max<std::uint64_t>(1, x->rows)))
      return "a leading dimension " + std::to_string(x->ld) + " below its " + std::to_string(x->rows) + " rows";
    if (x->batch != D.batch)
      return "batch counts differ (" + std::to_string(x->batch) + ", D " + std::to_string(D.batch) + ")";
  }
  const bool f32 = A.type == CUDA_R_32F && B.type == CUDA_R_32F && D.type == CUDA_R_32F;
  switch (d.compute) {
    case CUBLAS_COMPUTE_64F:
      if (!(A.type == CUDA_R_64F && B.type == CUDA_R_64F && D.type == CUDA_R_64F && d.scale == CUDA_R_64F))
        return "CUBLAS_COMPUTE_64F takes fp64 operands and scale";
      break;
    case CUBLAS_COMPUTE_32F_FAST_TF32:
      if (!f32 || d.scale != CUDA_R_32F) return "CUBLAS_COMPUTE_32F_FAST_TF32 takes fp32 operands and scale";
      break;
    case CUBLAS_COMPUTE_32F:
      if (d.scale != CUDA_R_32F) return "CUBLAS_COMPUTE_32F takes an fp32 scale";
      if (!(f32 || (A.type == B.type && (A.type == CUDA_R_16BF || A.type == CUDA_R_16F) &&
                    (D.type == A.type || D.type == CUDA_R_32F))))
        return "CUBLAS_COMPUTE_32F takes fp32 operands into fp32, or bf16 (fp16) pairs into bf16 (fp16) or fp32";
      break;
    default:
      return "compute type " + std::to_string(int(d.compute)) + " is not emulated";
  }
  if (d.epilogue != CUBLASLT_EPILOGUE_DEFAULT && d.epilogue != CUBLASLT_EPILOGUE_BIAS)
    return "epilogue " + std::to_string(d.epilogue) + " is not emulated";
  if (d.epilogue == CUBLASLT_EPILOGUE_BIAS && d.bias_type != -1 && d.bias_type != CUDA_R_32F && d.bias_type != D.type)
    return "a bias of type " + std::to_string(d.bias_type) + " into D of type " + std::to_string(int(D.type));
  return "";
}

double element(cudaDataType t, const unsigned char* base, std::int64_t i) {
  switch (t) {
    case CUDA_R_32F:
      return reinterpret_cast<const float*>(base)[i];
    case CUDA_R_64F:
      return reinterpret_cast<const double*>(base)[i];
    case CUDA_R_16BF:
      return loom::to_float(reinterpret_cast<const loom::bf16*>(base)[i]);
    case CUDA_R_16F:
      return loom::to_float(reinterpret_cast<const loom::f16*>(base)[i]);
  }
  return 0;
}
void store(cudaDataType t, unsigned char* base, std::int64_t i, double v) {
  switch (t) {
    case CUDA_R_32F:
      reinterpret_cast<float*>(base)[i] = static_cast<float>(v);
      return;
    case CUDA_R_64F:
      reinterpret_cast<double*>(base)[i] = v;
      return;
    case CUDA_R_16BF:
      reinterpret_cast<loom::bf16*>(base)[i] = loom::to_bf16(static_cast<float>(v));
      return;
    case CUDA_R_16F:
      reinterpret_cast<loom::f16*>(base)[i] = loom::to_f16(static_cast<float>(v));
      return;
  }
}
// fp32 -> TF32 (10 mantissa bits), to nearest, ties away from zero (cvt.rna.tf32.f32; cuBLAS does
// not document which conversion its kernels use, and one that truncates is as likely).
float tf32(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0x1000u) & 0xffffe000u;
  std::memcpy(&x, &u, 4);
  return x;
}

std::uint32_t alignment(std::uintptr_t a) {
  std::uint32_t al = 256;
  while (al > 1 && a % al != 0) al /= 2;
  return al;
}

}  // namespace

std::size_t cublasLtGetVersion() { return 130000; }
cublasStatus_t cublasLtCreate(cublasLtHandle_t* h) {
  *h = new cublasLtContext;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtDestroy(cublasLtHandle_t h) {
  delete h;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* d, cublasComputeType_t compute, cudaDataType_t scale) {
  *d = new cublasLtMatmulDescOpaque_t{compute, scale};
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr,
                                              const void* buf, std::size_t bytes) {
  bool ok = false;
  switch (attr) {
    case CUBLASLT_MATMUL_DESC_TRANSA:
      ok = take(d->transa, buf, bytes);
      break;
    case CUBLASLT_MATMUL_DESC_TRANSB:
      ok = take(d->transb, buf, bytes);
      break;
    case CUBLASLT_MATMUL_DESC_EPILOGUE:
      ok = take(d->epilogue, buf, bytes);
      break;
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER:
      ok = take(d->bias, buf, bytes);
      break;
    case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE:
      ok = take(d->bias_type, buf, bytes);
      break;
  }
  return taken(ok, "matmul descriptor", int(attr), bytes);
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) {
  delete d;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* l, cudaDataType type, std::uint64_t rows,
                                          std::uint64_t cols, std::int64_t ld) {
  *l = new cublasLtMatrixLayoutOpaque_t{type, rows, cols, ld};
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t l, cublasLtMatrixLayoutAttribute_t attr,
                                                const void* buf, std::size_t bytes) {
  bool ok = false;
  switch (attr) {
    case CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT:
      ok = take(l->batch, buf, bytes) && l->batch >= 1;
      break;
    case CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET:
      ok = take(l->stride, buf, bytes);
      break;
  }
  return taken(ok, "matrix layout", int(attr), bytes);
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) {
  delete l;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* p) {
  *p = new cublasLtMatmulPreferenceOpaque_t;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                    cublasLtMatmulPreferenceAttributes_t attr, const void* buf,
                                                    std::size_t bytes) {
  bool ok = false;
  switch (attr) {
    case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES:
      ok = take(p->workspace, buf, bytes);
      break;
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES:
      ok = take(p->align[0], buf, bytes);
      break;
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES:
      ok = take(p->align[1], buf, bytes);
      break;
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES:
      ok = take(p->align[2], buf, bytes);
      break;
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES:
      ok = take(p->align[3], buf, bytes);
      break;
  }
  return taken(ok, "preference", int(attr), bytes);
}
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p) {
  delete p;
  return CUBLAS_STATUS_SUCCESS;
}

// One algorithm, for exactly this product and these alignments: algo.data holds the product's
// fingerprint and the alignments it assumes, which cublasLtMatmul checks.
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t h, cublasLtMatmulDesc_t d, cublasLtMatrixLayout_t a,
                                              cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c,
                                              cublasLtMatrixLayout_t dl, cublasLtMatmulPreference_t p, int requested,
                                              cublasLtMatmulHeuristicResult_t* results, int* returned) {
  *returned = 0;
  if (!h || !d || !a || !b || !c || !dl || !p || requested < 1) return CUBLAS_STATUS_INVALID_VALUE;
  if (const std::string why = check_product(*d, *a, *b, *c, *dl); !why.empty())
    return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "no algorithm: " + why);
  results[0] = cublasLtMatmulHeuristicResult_t{};
  const cublasLtMatrixLayoutOpaque_t* const layouts[4] = {a, b, c, dl};
  results[0].algo.data[0] = 0x6c6f6f6d;  // "loom"
  results[0].algo.data[1] = fingerprint(*d, layouts);
  for (int i = 0; i < 4; ++i) results[0].algo.data[2 + i] = p->align[i];
  results[0].state = CUBLAS_STATUS_SUCCESS;
  *returned = 1;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t d, const void* alpha, const void* A,
                              cublasLtMatrixLayout_t Adesc, const void* B, cublasLtMatrixLayout_t Bdesc,
                              const void* beta, const void* C, cublasLtMatrixLayout_t Cdesc, void* D,
                              cublasLtMatrixLayout_t Ddesc, const cublasLtMatmulAlgo_t* algo, void* workspace,
                              std::size_t workspace_bytes, cudaStream_t stream) {
  if (!h || !d || !Adesc || !Bdesc || !Cdesc || !Ddesc || !alpha || !beta) return CUBLAS_STATUS_INVALID_VALUE;
  if (const std::string why = check_product(*d, *Adesc, *Bdesc, *Cdesc, *Ddesc); !why.empty())
    return refuse(CUBLAS_STATUS_NOT_SUPPORTED, why);
  const cublasLtMatrixLayoutOpaque_t* const layouts[4] = {Adesc, Bdesc, Cdesc, Ddesc};
  if (algo && (algo->data[0] != 0x6c6f6f6d || algo->data[1] != fingerprint(*d, layouts)))
    return refuse(CUBLAS_STATUS_INVALID_VALUE,
                  "an algorithm chosen for another product (its shapes, types, "
                  "operations or epilogue differ)");
  const void* pointers[4] = {A, B, C, D};
  for (int i = 0; i < 4; ++i) {
    const cublasLtMatrixLayoutOpaque_t& l = *layouts[i];
    const std::uint32_t assumed = algo ? static_cast<std::uint32_t>(algo->data[2 + i]) : 256;
    std::uint32_t have = alignment(reinterpret_cast<std::uintptr_t>(pointers[i]));
    if (l.batch > 1) have = std::min(have, alignment(static_cast<std::uintptr_t>(l.stride) * type_bytes(l.type)));
    if (have < assumed)
      return refuse(CUBLAS_STATUS_INVALID_VALUE, std::string("operand ") + "ABCD"[i] + " is " + std::to_string(have) +
                                                     "-byte aligned; its algorithm assumes " + std::to_string(assumed));
  }
  // Every operand inside its allocation: the last element of its last matrix.
  const unsigned char* host[4] = {};
  const unsigned char* bias = nullptr;
  const cudaDataType bias_type = d->bias_type == -1 ? Ddesc->type : cudaDataType(d->bias_type);
  try {
    for (int i = 0; i < 4; ++i) {
      const cublasLtMatrixLayoutOpaque_t& l = *layouts[i];
      const std::int64_t last =
          std::int64_t(l.batch - 1) * l.stride + std::int64_t(l.cols - 1) * l.ld + std::int64_t(l.rows);
      const std::size_t bytes = l.rows && l.cols ? std::size_t(last) * type_bytes(l.type) : 0;
      host[i] = static_cast<const unsigned char*>(
          host_address(pointers[i], bytes, std::string("matmul operand ") + "ABCD"[i]));
    }
    if (d->epilogue == CUBLASLT_EPILOGUE_BIAS) {
      if (!d->bias) return refuse(CUBLAS_STATUS_INVALID_VALUE, "the bias epilogue without a bias pointer");
      bias = static_cast<const unsigned char*>(host_address(d->bias, Ddesc->rows * type_bytes(bias_type), "the bias"));
    }
    if (workspace_bytes > 0) host_address(workspace, workspace_bytes, "the workspace");
  } catch (const std::invalid_argument& e) {
    return refuse(CUBLAS_STATUS_INVALID_VALUE, e.what());
  }
  const bool f64 = d->compute == CUBLAS_COMPUTE_64F;
  const double a = f64 ? *static_cast<const double*>(alpha) : *static_cast<const float*>(alpha);
  const double b = f64 ? *static_cast<const double*>(beta) : *static_cast<const float*>(beta);
  const cublasLtMatmulDescOpaque_t desc = *d;
  const cublasLtMatrixLayoutOpaque_t la = *Adesc, lb = *Bdesc, lc = *Cdesc, ld = *Ddesc;
  unsigned char* out = const_cast<unsigned char*>(host[3]);
  loom::cuda_emu::rt::enqueue(stream, "cublasLtMatmul", [=] {
    const std::int64_t m = std::int64_t(ld.rows), n = std::int64_t(ld.cols);
    const std::int64_t k = std::int64_t(desc.transa == CUBLAS_OP_T ? la.rows : la.cols);
    const bool round_tf32 = desc.compute == CUBLAS_COMPUTE_32F_FAST_TF32;
    std::vector<double> pa(std::size_t(m * k)), pb(std::size_t(k * n)), pd(std::size_t(m * n));  // column-major
    for (std::int32_t batch = 0; batch < ld.batch; ++batch) {
      const auto at = [&](const cublasLtMatrixLayoutOpaque_t& l, const unsigned char* base, bool t, std::int64_t r,
                          std::int64_t c) {
        const std::int64_t i = std::int64_t(batch) * l.stride + (t ? r * l.ld + c : c * l.ld + r);
        const double v = element(l.type, base, i);
        return round_tf32 ? double(tf32(float(v))) : v;
      };
      for (std::int64_t p = 0; p < k; ++p)
        for (std::int64_t i = 0; i < m; ++i)
          pa[std::size_t(p * m + i)] = at(la, host[0], desc.transa == CUBLAS_OP_T, i, p);
      for (std::int64_t j = 0; j < n; ++j)
        for (std::int64_t p = 0; p < k; ++p)
          pb[std::size_t(j * k + p)] = at(lb, host[1], desc.transb == CUBLAS_OP_T, p, j);
      if (f64) {
        cblas_dgemm(CblasColMajor, CblasNoTrans, CblasNoTrans, int(m), int(n), int(k), 1.0, pa.data(), int(m),
                    pb.data(), int(k), 0.0, pd.data(), int(m));
      } else {  // fp32 accumulation, as the device's
        std::vector<float> fa(pa.begin(), pa.end()), fb(pb.begin(), pb.end()), fd(pd.size());
        cblas_sgemm(CblasColMajor, CblasNoTrans, CblasNoTrans, int(m), int(n), int(k), 1.0f, fa.data(), int(m),
                    fb.data(), int(k), 0.0f, fd.data(), int(m));
        for (std::size_t i = 0; i < fd.size(); ++i) pd[i] = fd[i];
      }
      for (std::int64_t j = 0; j < n; ++j)
        for (std::int64_t i = 0; i < m; ++i) {
          double v = a * pd[std::size_t(j * m + i)];
          if (!f64) v = float(v);
          if (b != 0)
            v += b * element(lc.type, host[2], std::int64_t(batch) * lc.stride + j * lc.ld + i);  // beta 0: C unread
          if (!f64) v = float(v);
          if (bias) v = float(v + element(bias_type, bias, i));
          store(ld.type, out, std::int64_t(batch) * ld.stride + j * ld.ld + i, v);
        }
    }
  });
  return CUBLAS_STATUS_SUCCESS;
}
