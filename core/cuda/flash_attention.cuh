#pragma once
// Fused causal attention (flash-style, as FlashAttention-2): per (sequence, head) the scores
// S = q k^T / sqrt(hs) are made tile by tile in shared memory and never written to device memory;
// forward keeps a running row maximum and sum (the online softmax) and saves one number per row,
// lse = max + log(sum); backward recomputes each tile's probabilities from lse.
//
// Precision: q, k, v, the probabilities, dout and the score gradients are rounded to bf16 as each
// tile is loaded or made (the operands of the tensor-core products, as PyTorch's bf16
// scaled_dot_product_attention and llm.c's cuDNN attention take them); the products accumulate in
// fp32; the softmax, lse, the rescaling and every output are fp32.
//
// Layout as the unfused kernels (core/backend/kernels.hpp attention_forward/_backward): qkv [B,T,3C] with
// head h's q, k, v in columns h*hs, C + h*hs, 2C + h*hs; out [B,T,C]; lse and dsum [B,NH,T].
//
// Work split: a block of 4 warps takes 64 query rows (forward, dq) or 64 key rows (dk, dv) of one
// (sequence, head), each warp 16 of them; the other side is walked in tiles of 64. The backward is
// two kernels, one over key tiles (dk, dv) and one over query tiles (dq), each recomputing the
// probabilities, so no two blocks add into one element: no atomics, and a run repeats bit for bit.
//
// The source compiles for the GPU (nvcc) and for the host against core/cuda/emu/ (the unit tests
// run these very kernels on the CPU); device facilities through core/cuda/device_portable.hpp.
#include <cstddef>
#include <cstdint>

#include "core/cuda/device_portable.hpp"
#include "core/backend/kernel_math.hpp"

namespace loom::cuda::flash {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kRows = 16 * kWarps;  // rows of the block's own side (queries, or keys for dk/dv)
constexpr int kCols = 64;           // rows of each tile of the other side
static_assert(kRows == kCols, "the causal tile bounds below assume square tiles");
constexpr float kNoScore = -1e30f;  // a masked score: exp_k(kNoScore - m) is exp(-87), but masked entries are set 0

// Head sizes the kernels are built for (multiples of the 16-wide wmma tile).
LOOM_HD constexpr bool head_size_supported(int hs) { return math::flash_head_size_supported(hs); }

// Shared memory, carved by the function that sizes it (a null base only counts). Row strides are
// padded (bf16 by 8 elements, fp32 by 4) so rows start on different banks while every 16-row,
// 16-column wmma tile stays 32-byte aligned; each array starts on 128 bytes.
template <int HS>
struct Strides {
  static constexpr int h = HS + 8;     // bf16 [64, HS] tiles: q, k, v, dout
  static constexpr int f = HS + 4;     // fp32 [64, HS] accumulators: out, dq, dk, dv
  static constexpr int s = kCols + 4;  // fp32 [64, 64] scores and their gradients
  static constexpr int p = kCols + 8;  // bf16 [64, 64] probabilities and score gradients
};

struct Carve {
  unsigned char* base;
  std::size_t bytes = 0;
  template <class T>
  LOOM_HD T* take(std::size_t n) {
    T* at = base ? reinterpret_cast<T*>(base + bytes) : nullptr;
    bytes += (n * sizeof(T) + 127) / 128 * 128;
    return at;
  }
};

template <int HS>
struct ForwardSmem {
  dev::bf16_t *q, *k, *v, *p;
  float *o, *s, *m, *l;
  std::size_t bytes;
  LOOM_HD explicit ForwardSmem(unsigned char* base) {
    using S = Strides<HS>;
    Carve c{base};
    q = c.take<dev::bf16_t>(kRows * S::h);  // [64, HS] this block's queries
    k = c.take<dev::bf16_t>(kCols * S::h);  // [64, HS] the tile's keys
    v = c.take<dev::bf16_t>(kCols * S::h);  // [64, HS] the tile's values
    p = c.take<dev::bf16_t>(kRows * S::p);  // [64, 64] probabilities (relative to the running max)
    o = c.take<float>(kRows * S::f);        // [64, HS] output accumulators
    s = c.take<float>(kRows * S::s);        // [64, 64] scores
    m = c.take<float>(kRows);               // [64] running max of the scaled scores
    l = c.take<float>(kRows);               // [64] running sum of exp(score - max)
    bytes = c.bytes;
  }
};

// The backward kernels' tiles: `mine` are the block's own 64 rows (keys for dk/dv, queries for
// dq), `other` the walked side. dk/dv: a = k, b = v, c = q, d = dout. dq: a = q, b = dout, c = k, d = v.
// Their accumulators (dk and dv, or dq) stay in each warp's registers (RowsAcc) for the whole
// walk; at the end each warp stages its rows in `stage`, the scores' and their gradients' space
// (s and dp, adjacent), to write the rows inside T.
template <int HS>
struct BackwardSmem {
  dev::bf16_t *a, *b, *c, *d, *p;
  float *s, *dp, *lse, *dsum, *stage;
  std::size_t bytes;
  LOOM_HD explicit BackwardSmem(unsigned char* base) {
    using S = Strides<HS>;
    Carve c_{base};
    a = c_.take<dev::bf16_t>(kRows * S::h);
    b = c_.take<dev::bf16_t>(kRows * S::h);
    c = c_.take<dev::bf16_t>(kCols * S::h);
    d = c_.take<dev::bf16_t>(kCols * S::h);
    p = c_.take<dev::bf16_t>(kRows * S::p);  // [64, 64] probabilities, then score gradients (bf16)
    s = c_.take<float>(kRows * S::s);        // [64, 64] scores, then score gradients (fp32)
    dp = c_.take<float>(kRows * S::s);       // [64, 64] probability gradients
    stage = s;                               // [64, HS] (row stride S::f) at the end, over s and dp
    static_assert(kRows * S::f <= 2 * kRows * S::s, "the staged rows fit in s and dp");
    static_assert(kRows * S::s * sizeof(float) % 128 == 0, "dp starts where s ends (Carve rounds to 128 bytes)");
    lse = c_.take<float>(kCols > kRows ? kCols : kRows);   // [64] the query rows' lse
    dsum = c_.take<float>(kCols > kRows ? kCols : kRows);  // [64] the query rows' sum(dout * out)
    bytes = c_.bytes;
  }
};

template <int HS>
LOOM_HD inline std::size_t forward_smem_bytes() {
  return ForwardSmem<HS>(nullptr).bytes;
}
template <int HS>
LOOM_HD inline std::size_t backward_smem_bytes() {
  return BackwardSmem<HS>(nullptr).bytes;
}

// The per-element passes between the products: lane `lane` of a warp takes row lane_row(lane) of
// the warp's 16 and, step by step, the columns lane_column gives (math::flash_lane_column: the two
// lanes of a row split its columns, and the warp's 32 lanes touch 32 banks of every padded array,
// fp32 rows of n + 4 floats and bf16 rows of n + 8; FlashAttentionEmu.PerElementPassesAreFreeOfBankConflicts).
LOOM_HD constexpr int lane_row(int lane) { return lane / 2; }
LOOM_HD constexpr int lane_column(int lane, int step, int n) { return math::flash_lane_column(lane, step, n); }

// One (sequence, head)'s slices: q, k, v rows t at q + t * ld (ld = 3C), dout's at dout + t * C.
struct HeadSlices {
  const float *q, *k, *v, *dout;
  std::int64_t ld;
};
LOOM_HD inline HeadSlices head_slices(const float* qkv, const float* dout, int T, int C, int NH, int bh, int hs) {
  const int b = bh / NH, h = bh % NH;
  const std::int64_t ld = 3 * static_cast<std::int64_t>(C);
  const float* q = qkv + static_cast<std::int64_t>(b) * T * ld + static_cast<std::int64_t>(h) * hs;
  const float* g = dout ? dout + static_cast<std::int64_t>(b) * T * C + static_cast<std::int64_t>(h) * hs : nullptr;
  return HeadSlices{q, q + C, q + 2 * static_cast<std::int64_t>(C), g, ld};
}

// A tile to fill: rows [row0, row0 + 64) of a [T, HS] slice of qkv or dout (row stride ld floats)
// into the bf16 tile; rows past T are zeros.
struct TileLoad {
  dev::bf16_t* tile;
  const float* src;
  std::int64_t ld;
};

// Fills the tiles, all the block's threads taking part. Each thread issues a batch of loads (16
// floats of every tile) before it converts and stores any: one load after another, each waiting
// for the last, left the kernels waiting on device memory most of their time (on an H200, 1084 ms
// of attention in 10 steps of bench/gpu.deck; 351 ms with this). Where every source is 16-byte
// aligned (rows of qkv and dout are, when the buffers are: hs and C are multiples of 16), the loads
// are 4 floats and the stores 4 bf16 at a time, a quarter of the instructions; elsewhere one float
// at a time, with the same results.

template <int HS, int N>
LOOM_DEVICE bool loads_aligned(const TileLoad (&loads)[N]) {
  bool aligned = true;
  for (int n = 0; n < N; ++n)
    aligned = aligned && reinterpret_cast<std::uintptr_t>(loads[n].src) % 16 == 0 && loads[n].ld % 4 == 0;
  return aligned;
}

template <int HS, int N>
LOOM_DEVICE void load_tiles(const TileLoad (&loads)[N], int row0, int T) {
  const int tid = dev::thread_x();
  if (loads_aligned<HS>(loads)) {                          // the same answer in every thread
    constexpr int kQuads = HS / 4;                         // float4 per row
    constexpr int kPerThread = kCols * kQuads / kThreads;  // of each tile
    constexpr int kBatch = kPerThread < 4 ? kPerThread : 4;
    static_assert(kCols * kQuads % kThreads == 0 && kPerThread % kBatch == 0, "whole batches of every tile");
    for (int first = 0; first < kPerThread; first += kBatch) {
      dev::float4 staged[N][kBatch];
      LOOM_UNROLL(4)
      for (int n = 0; n < N; ++n) {
        LOOM_UNROLL(4)
        for (int j = 0; j < kBatch; ++j) {
          const int i = tid + (first + j) * kThreads, t = row0 + i / kQuads;
          staged[n][j] =
              t < T ? dev::load_float4(loads[n].src + static_cast<std::int64_t>(t) * loads[n].ld + 4 * (i % kQuads))
                    : dev::make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
      }
      LOOM_UNROLL(4)
      for (int n = 0; n < N; ++n) {
        LOOM_UNROLL(4)
        for (int j = 0; j < kBatch; ++j) {
          const int i = tid + (first + j) * kThreads;
          dev::store_bf16x4(loads[n].tile + (i / kQuads) * Strides<HS>::h + 4 * (i % kQuads), staged[n][j]);
        }
      }
    }
    return;
  }
  constexpr int kPerThread = kCols * HS / kThreads;  // of each tile
  constexpr int kBatch = kPerThread < 16 ? kPerThread : 16;
  static_assert(kCols * HS % kThreads == 0 && kPerThread % kBatch == 0, "whole batches of every tile");
  for (int first = 0; first < kPerThread; first += kBatch) {
    float staged[N][kBatch];
    LOOM_UNROLL(4)
    for (int n = 0; n < N; ++n) {
      LOOM_UNROLL(16)
      for (int j = 0; j < kBatch; ++j) {
        const int i = tid + (first + j) * kThreads, t = row0 + i / HS;
        staged[n][j] = t < T ? loads[n].src[static_cast<std::int64_t>(t) * loads[n].ld + i % HS] : 0.0f;
      }
    }
    LOOM_UNROLL(4)
    for (int n = 0; n < N; ++n) {
      LOOM_UNROLL(16)
      for (int j = 0; j < kBatch; ++j) {
        const int i = tid + (first + j) * kThreads;
        loads[n].tile[(i / HS) * Strides<HS>::h + i % HS] = dev::to_bf16(staged[n][j]);
      }
    }
  }
}

// The products, each a warp's, on bf16 tiles with fp32 accumulation (wmma).
// The bf16 tensor-core products exist from sm_80 on. Compiled for an older architecture (a
// CMAKE_CUDA_ARCHITECTURES below 80) they trap; the back end refuses flash attention there
// (flash_attention_built_arch, kernels.cuh) before any kernel is launched.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define LOOM_FLASH_MMA 0
#else
#define LOOM_FLASH_MMA 1
#endif

// A warp's 16 rows of a [rows, HS] bf16 tile as the left operand of its products, in registers:
// HS / 16 wmma tiles, loaded once for as long as the rows stay (the block's own queries, keys, ...).
template <int HS>
struct RowsOperand {
#if LOOM_FLASH_MMA
  dev::wmma::fragment<dev::wmma::matrix_a, 16, 16, 16, dev::bf16_t, dev::wmma::row_major> tile[HS / 16];
#endif
};

// The warp's rows [16, HS] of a bf16 tile (row stride Strides::h) into registers.
template <int HS>
LOOM_DEVICE void load_rows(RowsOperand<HS>& rows, const dev::bf16_t* rows16) {
#if !LOOM_FLASH_MMA
  (void)rows, (void)rows16;
  __trap();
#else
  for (int kk = 0; kk < HS / 16; ++kk) dev::wmma::load_matrix_sync(rows.tile[kk], rows16 + kk * 16, Strides<HS>::h);
#endif
}

// [16, 64] = rows [16, HS] x others^T (others: [64, HS], row stride Strides::h), into out (row stride ldout).
template <int HS>
LOOM_DEVICE void product_nt(float* out, int ldout, const RowsOperand<HS>& rows, const dev::bf16_t* others) {
#if !LOOM_FLASH_MMA
  (void)out, (void)ldout, (void)rows, (void)others;
  __trap();
#else
  namespace wmma = dev::wmma;
  constexpr int ld = Strides<HS>::h;
  for (int n = 0; n < kCols / 16; ++n) {
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 0.0f);
    for (int kk = 0; kk < HS / 16; ++kk) {
      wmma::fragment<wmma::matrix_b, 16, 16, 16, dev::bf16_t, wmma::col_major> fb;  // others^T
      wmma::load_matrix_sync(fb, others + n * 16 * ld + kk * 16, ld);
      wmma::mma_sync(acc, rows.tile[kk], fb, acc);
    }
    wmma::store_matrix_sync(out + n * 16, acc, ldout, wmma::mem_row_major);
  }
#endif
}

// A warp's 16 rows of an [rows, HS] fp32 accumulator, in registers: HS / 16 wmma tiles.
template <int HS>
struct RowsAcc {
#if LOOM_FLASH_MMA
  dev::wmma::fragment<dev::wmma::accumulator, 16, 16, 16, float> tile[HS / 16];
#endif
};

template <int HS>
LOOM_DEVICE void zero(RowsAcc<HS>& acc) {
#if !LOOM_FLASH_MMA
  (void)acc;
  __trap();
#else
  for (auto& t : acc.tile) dev::wmma::fill_fragment(t, 0.0f);
#endif
}

// acc [16, HS] += p16 [16, 64] (bf16, row stride Strides::p) x others [64, HS]: each of p16's four
// 16-column tiles loaded once, every accumulator tile adding them in the same order.
template <int HS>
LOOM_DEVICE void product_nn_acc(RowsAcc<HS>& acc, const dev::bf16_t* p16, const dev::bf16_t* others) {
#if !LOOM_FLASH_MMA
  (void)acc, (void)p16, (void)others;
  __trap();
#else
  namespace wmma = dev::wmma;
  using S = Strides<HS>;
  for (int kk = 0; kk < kCols / 16; ++kk) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, dev::bf16_t, wmma::row_major> fa;
    wmma::load_matrix_sync(fa, p16 + kk * 16, S::p);
    for (int n = 0; n < HS / 16; ++n) {
      wmma::fragment<wmma::matrix_b, 16, 16, 16, dev::bf16_t, wmma::row_major> fb;
      wmma::load_matrix_sync(fb, others + kk * 16 * S::h + n * 16, S::h);
      wmma::mma_sync(acc.tile[n], fa, fb, acc.tile[n]);
    }
  }
#endif
}

// The same on an accumulator kept in shared memory (acc16: [16, HS] fp32, row stride Strides::f),
// as the forward's is, which rescales its rows between tiles.
template <int HS>
LOOM_DEVICE void product_nn_add(float* acc16, const dev::bf16_t* p16, const dev::bf16_t* others) {
#if !LOOM_FLASH_MMA
  (void)acc16, (void)p16, (void)others;
  __trap();
#else
  namespace wmma = dev::wmma;
  using S = Strides<HS>;
  RowsAcc<HS> acc;
  for (int n = 0; n < HS / 16; ++n) wmma::load_matrix_sync(acc.tile[n], acc16 + n * 16, S::f, wmma::mem_row_major);
  product_nn_acc<HS>(acc, p16, others);
  for (int n = 0; n < HS / 16; ++n) wmma::store_matrix_sync(acc16 + n * 16, acc.tile[n], S::f, wmma::mem_row_major);
#endif
}

// The warp's rows [row0, row0 + 16) of the block, times `scale`, through the warp's part of
// `stage` (row stride Strides::f) to dst rows row0 + t0 ... (row stride ld), those inside T.
template <int HS>
LOOM_DEVICE void write_rows(float* dst, std::int64_t ld, int t0, int T, int row0, float* stage, RowsAcc<HS>& acc,
                            float scale) {
#if !LOOM_FLASH_MMA
  (void)dst, (void)ld, (void)t0, (void)T, (void)row0, (void)stage, (void)acc, (void)scale;
  __trap();
#else
  using S = Strides<HS>;
  float* mine = stage + row0 * S::f;
  for (int n = 0; n < HS / 16; ++n) {
    for (int i = 0; i < acc.tile[n].num_elements; ++i) acc.tile[n].x[i] *= scale;
    dev::wmma::store_matrix_sync(mine + n * 16, acc.tile[n], S::f, dev::wmma::mem_row_major);
  }
  dev::sync_warp();  // the warp's rows are staged
  for (int i = dev::thread_x() % 32; i < 16 * HS; i += 32) {
    const int rr = i / HS, d = i % HS, t = t0 + row0 + rr;
    if (t < T) dst[static_cast<std::int64_t>(t) * ld + d] = mine[rr * S::f + d];
  }
  dev::sync_warp();  // every lane is done reading the staged rows
#endif
}

// The query tile of a forward or dq block: the last first. Blocks start roughly in the order of
// their index, and a causal query tile's work grows with its index (it walks every key tile up to
// its own): the longest start first, so the short ones fill the end rather than one long one
// running alone. (dk/dv's heaviest key tile is already the first.) The grid's y must be exactly
// ceil(T/64), as tile_grid (flash_attention.cu) makes it: a larger one would skip the first tiles.
LOOM_DEVICE int last_tile_first() { return dev::grid_y() - 1 - dev::block_y(); }

// ---------------------------------------------------------------------------------------------
// Forward. Grid (B*NH, ceil(T/64)) (heads on x, whose limit is 2^31 - 1), 128 threads, forward_smem_bytes<HS>() of
// dynamic shared memory.

// out: fp32, or bf16/fp16 (OutT: the output projection's operand) rounded once on store.
template <int HS, class OutT = float>
LOOM_KERNEL void attention_forward_kernel(OutT* out, float* lse,  // [B,T,C], [B,NH,T]
                                          const float* qkv,       // [B,T,3C]
                                          int T, int C, int NH, float scale) {
  using S = Strides<HS>;
  ForwardSmem<HS> sm(dev::shared_memory<unsigned char>());
  const int tid = dev::thread_x(), warp = tid / 32, lane = tid % 32;
  const int q0 = last_tile_first() * kRows, bh = dev::block_x(), b = bh / NH, h = bh % NH;
  const HeadSlices x = head_slices(qkv, nullptr, T, C, NH, bh, HS);

  load_tiles<HS>({TileLoad{sm.q, x.q, x.ld}}, q0, T);
  for (int i = tid; i < kRows * S::f; i += kThreads) sm.o[i] = 0.0f;
  for (int r = tid; r < kRows; r += kThreads) sm.m[r] = kNoScore, sm.l[r] = 0.0f;
  dev::sync_block();
  RowsOperand<HS> q_rows;  // the warp's 16 queries, for every key tile
  load_rows<HS>(q_rows, sm.q + warp * 16 * S::h);

  // Two lanes per row, each with half of the tile's columns and half of the head's (lane_column).
  const int r = warp * 16 + lane_row(lane), t = q0 + r;
  const int last_q = (q0 + kRows < T ? q0 + kRows : T) - 1;
  for (int k0 = 0; k0 <= last_q; k0 += kCols) {  // causal: no key tile past the block's last query
    dev::sync_block();                           // the previous tile's products are done with k and v
    load_tiles<HS>({TileLoad{sm.k, x.k, x.ld}, TileLoad{sm.v, x.v, x.ld}}, k0, T);
    dev::sync_block();
    product_nt<HS>(sm.s + warp * 16 * S::s, S::s, q_rows, sm.k);  // scores of the warp's rows
    dev::sync_warp();
    float* srow = sm.s + r * S::s;
    float mx = kNoScore;
    for (int step = 0; step < kCols / 2; ++step) {
      const int c = lane_column(lane, step, kCols);
      const int key = k0 + c;
      const float x = key <= t && key < T ? srow[c] * scale : kNoScore;
      srow[c] = x;
      mx = x > mx ? x : mx;
    }
    const float other = dev::shfl_xor(mx, 1);
    mx = other > mx ? other : mx;
    const float m_old = sm.m[r];
    const float m_new = m_old > mx ? m_old : mx;
    float sum = 0.0f;
    dev::bf16_t* prow = sm.p + r * S::p;
    for (int step = 0; step < kCols / 2; ++step) {
      const int c = lane_column(lane, step, kCols);
      const int key = k0 + c;
      const float pr = key <= t && key < T ? math::exp_k(srow[c] - m_new) : 0.0f;
      prow[c] = dev::to_bf16(pr);
      sum += pr;
    }
    sum += dev::shfl_xor(sum, 1);
    const float alpha = math::exp_k(m_old - m_new);  // rescales what earlier tiles accumulated
    for (int step = 0; step < HS / 2; ++step) sm.o[r * S::f + lane_column(lane, step, HS)] *= alpha;
    dev::sync_warp();  // the warp's probabilities and rescaled outputs are in; both lanes have read m[r], l[r]
    if (lane % 2 == 0) sm.m[r] = m_new, sm.l[r] = sm.l[r] * alpha + sum;  // read again after the next sync_block
    product_nn_add<HS>(sm.o + warp * 16 * S::f, sm.p + warp * 16 * S::p, sm.v);
  }
  dev::sync_block();
  OutT* out_b = out + static_cast<std::int64_t>(b) * T * C + h * HS;
  for (int i = tid; i < kRows * HS; i += kThreads) {
    const int rr = i / HS, d = i % HS, tt = q0 + rr;
    if (tt < T) dev::store_as(out_b + static_cast<std::int64_t>(tt) * C + d, sm.o[rr * S::f + d] / sm.l[rr]);
  }
  for (int rr = tid; rr < kRows; rr += kThreads)
    if (q0 + rr < T) lse[static_cast<std::int64_t>(bh) * T + q0 + rr] = sm.m[rr] + logf(sm.l[rr]);
}

// ---------------------------------------------------------------------------------------------
// Backward, step 1: dsum[b,h,t] = sum over the head's columns of dout * out (fp32), one warp per row.
// Grid: rows_per_warp_geometry(B*NH*T) (kernels.cuh), any multiple of 32 threads.

template <class OutT>
LOOM_KERNEL void attention_backward_dsum_kernel(float* dsum,                         // [B,NH,T]
                                                const float* dout, const OutT* out,  // [B,T,C], [B,T,C]
                                                int B, int T, int C, int NH, int hs) {
  const std::int64_t rows = static_cast<std::int64_t>(B) * NH * T;
  const int lane = dev::thread_x() % 32, warps_per_block = dev::block_dim_x() / 32;
  const std::int64_t stride = static_cast<std::int64_t>(warps_per_block) * dev::grid_x();
  for (std::int64_t row = static_cast<std::int64_t>(dev::block_x()) * warps_per_block + dev::thread_x() / 32;
       row < rows; row += stride) {
    const std::int64_t t = row % T, bh = row / T, b = bh / NH, h = bh % NH;
    const std::int64_t at = (b * T + t) * C + h * hs;
    float acc = 0.0f;
    for (int d = lane; d < hs; d += 32) acc += dout[at + d] * dev::as_float(out[at + d]);
    for (int m = 16; m > 0; m /= 2) acc += dev::shfl_xor(acc, m);
    if (lane == 0) dsum[row] = acc;
  }
}

// ---------------------------------------------------------------------------------------------
// Backward, step 2: dk and dv. Grid (B*NH, ceil(T/64)): a block owns 64 keys and walks the query
// tiles from its first key on (causal); backward_smem_bytes<HS>() of dynamic shared memory.

template <int HS>
LOOM_KERNEL void attention_backward_kv_kernel(float* dqkv,                          // [B,T,3C]: k, v columns (=)
                                              const float* dout, const float* qkv,  // [B,T,C], [B,T,3C]
                                              const float* lse, const float* dsum,  // [B,NH,T], [B,NH,T]
                                              int T, int C, int NH, float scale) {
  using S = Strides<HS>;
  BackwardSmem<HS> sm(dev::shared_memory<unsigned char>());  // a = k, b = v, c = q, d = dout
  const int tid = dev::thread_x(), warp = tid / 32, lane = tid % 32;
  const int k0 = dev::block_y() * kRows, bh = dev::block_x();
  const HeadSlices x = head_slices(qkv, dout, T, C, NH, bh, HS);
  const float* lse_bh = lse + static_cast<std::int64_t>(bh) * T;
  const float* dsum_bh = dsum + static_cast<std::int64_t>(bh) * T;

  load_tiles<HS>({TileLoad{sm.a, x.k, x.ld}, TileLoad{sm.b, x.v, x.ld}}, k0, T);
  RowsAcc<HS> dk, dv;  // the warp's 16 keys' gradients
  zero(dk);
  zero(dv);

  const int r = warp * 16 + lane_row(lane), key = k0 + r;
  float* srow = sm.s + r * S::s;
  const float* dprow = sm.dp + r * S::s;
  dev::bf16_t* prow = sm.p + r * S::p;
  for (int q0 = k0; q0 < T; q0 += kCols) {  // causal: no query before the block's first key
    dev::sync_block();                      // the previous tile's products are done with q and dout
    load_tiles<HS>({TileLoad{sm.c, x.q, x.ld}, TileLoad{sm.d, x.dout, C}}, q0, T);
    for (int i = tid; i < kCols; i += kThreads) {
      const bool in = q0 + i < T;
      sm.lse[i] = in ? lse_bh[q0 + i] : 0.0f;
      sm.dsum[i] = in ? dsum_bh[q0 + i] : 0.0f;
    }
    dev::sync_block();
    {  // the warp's keys and values, loaded each tile: kept, they would cost this kernel registers it has not
      RowsOperand<HS> rows;
      load_rows<HS>(rows, sm.a + warp * 16 * S::h);
      product_nt<HS>(sm.s + warp * 16 * S::s, S::s, rows, sm.c);  // scores^T = k q^T
      load_rows<HS>(rows, sm.b + warp * 16 * S::h);
      product_nt<HS>(sm.dp + warp * 16 * S::s, S::s, rows, sm.d);  // dprobs^T = v dout^T
    }
    dev::sync_warp();
    for (int step = 0; step < kCols / 2; ++step) {
      const int c = lane_column(lane, step, kCols);
      const int t = q0 + c;
      const bool on = key <= t && t < T && key < T;
      const float pr = on ? math::exp_k(srow[c] * scale - sm.lse[c]) : 0.0f;
      prow[c] = dev::to_bf16(pr);
      srow[c] = on ? math::softmax_backward(pr, dprow[c], sm.dsum[c]) : 0.0f;  // dscores^T
    }
    dev::sync_warp();
    product_nn_acc<HS>(dv, sm.p + warp * 16 * S::p, sm.d);  // dv += probs^T dout
    dev::sync_warp();                                       // every lane is done reading the probabilities
    for (int step = 0; step < kCols / 2; ++step) {
      const int c = lane_column(lane, step, kCols);
      prow[c] = dev::to_bf16(srow[c]);
    }
    dev::sync_warp();
    product_nn_acc<HS>(dk, sm.p + warp * 16 * S::p, sm.c);  // dk += dscores^T q
  }
  dev::sync_block();  // every warp is done with s and dp, where the rows are staged
  write_rows<HS>(dqkv + (x.k - qkv), x.ld, k0, T, warp * 16, sm.stage, dk, scale);  // the same offsets in dqkv
  write_rows<HS>(dqkv + (x.v - qkv), x.ld, k0, T, warp * 16, sm.stage, dv, 1.0f);
}

// ---------------------------------------------------------------------------------------------
// Backward, step 3: dq. Grid (B*NH, ceil(T/64)): a block owns 64 queries and walks the key tiles
// up to its last query; backward_smem_bytes<HS>() of dynamic shared memory.

template <int HS>
LOOM_KERNEL void attention_backward_q_kernel(float* dqkv,                          // [B,T,3C]: q columns (=)
                                             const float* dout, const float* qkv,  // [B,T,C], [B,T,3C]
                                             const float* lse, const float* dsum,  // [B,NH,T], [B,NH,T]
                                             int T, int C, int NH, float scale) {
  using S = Strides<HS>;
  BackwardSmem<HS> sm(dev::shared_memory<unsigned char>());  // a = q, b = dout, c = k, d = v
  const int tid = dev::thread_x(), warp = tid / 32, lane = tid % 32;
  const int q0 = last_tile_first() * kRows, bh = dev::block_x();
  const HeadSlices x = head_slices(qkv, dout, T, C, NH, bh, HS);

  load_tiles<HS>({TileLoad{sm.a, x.q, x.ld}, TileLoad{sm.b, x.dout, C}}, q0, T);
  for (int i = tid; i < kRows; i += kThreads) {
    const bool in = q0 + i < T;
    sm.lse[i] = in ? lse[static_cast<std::int64_t>(bh) * T + q0 + i] : 0.0f;
    sm.dsum[i] = in ? dsum[static_cast<std::int64_t>(bh) * T + q0 + i] : 0.0f;
  }
  dev::sync_block();
  RowsOperand<HS> q_rows, dout_rows;  // the warp's 16 queries and their output gradients, for every key tile
  load_rows<HS>(q_rows, sm.a + warp * 16 * S::h);
  load_rows<HS>(dout_rows, sm.b + warp * 16 * S::h);
  RowsAcc<HS> dq;  // the warp's 16 queries' gradients
  zero(dq);

  const int r = warp * 16 + lane_row(lane), t = q0 + r;
  float* srow = sm.s + r * S::s;
  const float* dprow = sm.dp + r * S::s;
  dev::bf16_t* prow = sm.p + r * S::p;
  const int last_q = (q0 + kRows < T ? q0 + kRows : T) - 1;
  for (int k0 = 0; k0 <= last_q; k0 += kCols) {
    dev::sync_block();  // the previous tile's products are done with k and v
    load_tiles<HS>({TileLoad{sm.c, x.k, x.ld}, TileLoad{sm.d, x.v, x.ld}}, k0, T);
    dev::sync_block();
    product_nt<HS>(sm.s + warp * 16 * S::s, S::s, q_rows, sm.c);      // scores = q k^T
    product_nt<HS>(sm.dp + warp * 16 * S::s, S::s, dout_rows, sm.d);  // dprobs = dout v^T
    dev::sync_warp();
    for (int step = 0; step < kCols / 2; ++step) {
      const int c = lane_column(lane, step, kCols);
      const int key = k0 + c;
      const bool on = key <= t && key < T && t < T;
      const float pr = on ? math::exp_k(srow[c] * scale - sm.lse[r]) : 0.0f;
      prow[c] = dev::to_bf16(on ? math::softmax_backward(pr, dprow[c], sm.dsum[r]) : 0.0f);
    }
    dev::sync_warp();
    product_nn_acc<HS>(dq, sm.p + warp * 16 * S::p, sm.c);  // dq += dscores k
  }
  dev::sync_block();  // every warp is done with s and dp, where the rows are staged
  write_rows<HS>(dqkv + (x.q - qkv), x.ld, q0, T, warp * 16, sm.stage, dq, scale);  // the same offset in dqkv
}

}  // namespace loom::cuda::flash
