// Query-block attention over a paged 16-bit KV cache for sm_90a (prefill and extend: several query tokens a
// sequence, causal), in CUDA C++ with Hopper's warpgroup MMA (wgmma): the `cuda` backend's kernel for bf16/fp16
// caches at head dim 128 (attnops/backends/cuda_prefill.py), called through torch.ops.attnops.prefill_sm90.
//
// Why: inside a CUDA graph nobody replans, FlashInfer's planned prefill is passed over and Triton's query tile
// serves it, far below FlashInfer's FA3 path (docs/bench.md); its 128-row tile holds 255 registers and spills. Here
// the tile's accumulators are laid out by hand: each warpgroup owns 64 rows' O [64 x 128] (64 fp32 registers a
// thread) and S [64 x 64] (32), and P goes from registers straight into the P V MMAs.
//
// A block: one KV head, 128 rows = (query token, query head of the group), block_q = 128 / group tokens of one
// sequence (rows past block_q x group are zero queries, never written), every key the rows see, 256 threads = two
// warpgroups of 64 rows each.
// - Shared memory: Q [128 x 128] (two [64 x 128] operands, one a warpgroup) and three stages of a K and a V tile of
//   64 keys [64 x 128] (cp.async: the next two tiles load while this one is used); every operand in wgmma's 128-byte
//   swizzle: 64-value column chunks of [rows x 128 bytes], the 16-byte pieces of row r XORed with r % 8.
// - Each warpgroup: S = Q K^T (m64n64k16 over 128 values, both K-major), the online softmax (base 2) in registers,
//   O = O x alpha + P V (m64n128k16, P from registers, V N-major: the tile as it was copied, no transpose).
// - Causal: row (token t) sees keys [0, pos(t)]; a tile past a warpgroup's first row's end takes the masked softmax,
//   the others do not. Keys at or past the block's last end are never copied (zeros), never seen.
// - One pass over a sequence's keys from its first, no splits: each row's sums run in an order fixed by its own
//   sequence (batch-invariant by construction; not yet tested in that mode, so the backend declines there).
//
// Bad indices (docs/design.md), each recorded in the error buffer (attnops/errors.py) with atomic min: a
// cu_seqlens_q that does not run non-decreasing from 0 to T makes every row NaN and nothing is read; a length
// outside [0, capacity] makes the sequence's rows NaN and reads nothing; a page index outside the cache among the
// pages some row of the block sees is never read and makes NaN the rows that see one of its keys.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <climits>
#include <cstdint>

#include "sm90_common.cuh"

namespace attnops::prefill_sm90 {

using namespace attnops::sm90;

constexpr int kD = 128;                              // head dim
constexpr int kRows = 128;                           // rows a block: two warpgroups of 64
constexpr int kKeys = 64;                            // keys a tile
constexpr int kThreads = 256;
constexpr int kPieces = kD / 8;                      // 16-byte pieces of a row
constexpr int kChunkBytes = 64 * 128;                // one 64-value column chunk of a [64 x 128] operand
constexpr int kOperandBytes = (kD / 64) * kChunkBytes;  // a [64 x 128] operand: a warpgroup's Q, a K or a V tile
constexpr int kStages = 3;  // K/V tile stages: tiles i + 1 and i + 2 load while tile i is used
constexpr int kSmemBytes = 2 * kOperandBytes + kStages * 2 * kOperandBytes + 1024;  // + alignment
static_assert(kSmemBytes <= 227 * 1024, "one block must fit an sm_90 SM's 227 KB of shared memory");
constexpr float kLn2 = 0.6931471805599453f;
constexpr int kErrBlockTable = 0, kErrSeqLens = 1, kErrCuSeqlensQ = 2;  // attnops/errors.py ARGUMENTS

struct Args {
  const uint16_t* q;    // [T, Hq, 128] bf16 or fp16 (the kernel's type), unit inner stride, 16-byte aligned rows
  const uint16_t* k;    // [num_pages, page_size, Hkv, 128], the same type, unit inner stride, 16-byte aligned rows
  const uint16_t* v;
  const int* block_table;
  const int* seq_lens;
  const int* cu_q;      // cu_seqlens_q [batch + 1]
  uint16_t* out;        // [T, Hq, 128], q's type, unit inner stride, 4-byte aligned rows
  float* lse;           // [T, Hq] natural log, contiguous, or null
  int* errors;
  int64_t q_token, q_head, out_token, out_head;        // elements
  int64_t k_page, k_token, k_head, v_page, v_token, v_head;  // elements
  int table_stride, num_pages, page_size, capacity, group, block_q, batch, num_tokens, num_q_heads;
  float qk_scale_log2;  // softmax scale x log2(e), > 0
};

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ATTNOPS_PREFILL_SM90A 1  // wgmma: sm_90a code only (an sm_90 build leaves the kernel empty)
#endif

// Byte offset of 16-byte piece `piece` (0 .. 15) of row `row` (0 .. 63) in a [64 x 128] operand
__device__ __forceinline__ uint32_t swizzled(int row, int piece) {
  return (piece >> 3) * kChunkBytes + row * 128 + (((piece & 7) ^ (row & 7)) << 4);
}

// 2^x, flushing results below 2^-126 to 0 (one MUFU.EX2; exp2f's denormal handling costs more and no weight that
// small changes a sum of at least 1)
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// The 64 accumulator registers of an m64n128 wgmma
#define ATTNOPS_D64 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, " \
    "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, " \
    "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, " \
    "%59, %60, %61, %62, %63"
#define ATTNOPS_D64_OPERANDS(d) ATTNOPS_D32_OPERANDS(d), ATTNOPS_D32_OPERANDS((d) + 32)

// O += P V: P [64 x 16] in registers (each warp's 16 rows as mma.m16n8k16's A fragments), V [16 x 128] N-major in
// shared memory (descriptor); O fp32 [64 x 128]
template <bool kHalf>
__device__ __forceinline__ void wgmma_m64n128k16_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b) {
  if constexpr (kHalf) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {" ATTNOPS_D64 "}, {%64, %65, %66, %67}, %68, "
        "p, 1, 1, 1;\n}\n"
        : ATTNOPS_D64_OPERANDS(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(1));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" ATTNOPS_D64 "}, {%64, %65, %66, %67}, %68, "
        "p, 1, 1, 1;\n}\n"
        : ATTNOPS_D64_OPERANDS(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(1));
  }
}

// The first entry where cu_seqlens_q stops running non-decreasing from 0 to T (batch + 1 if none), by the block's
// threads through one shared int
__device__ __forceinline__ int cu_seqlens_violation(const Args& a, int tid, int* scratch) {
  if (tid == 0) *scratch = a.batch + 1;
  __syncthreads();
  for (int i = tid; i <= a.batch; i += kThreads) {
    if (cu_seqlens_entry_bad(a.cu_q, i, a.batch, a.num_tokens)) atomicMin(scratch, i);
  }
  __syncthreads();
  const int first = *scratch;
  __syncthreads();  // (read by every thread before the scratch is reused)
  return first;
}

// The sequence whose query blocks hold block `pid`: the grid has T / block_q + batch blocks along x, sequence s's
// from cu_q[s] / block_q + s on (an upper bound of the blocks each needs; the extra ones leave)
__device__ __forceinline__ int sequence_of_block(const Args& a, int pid) {
  int lo = 0, hi = a.batch - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (a.cu_q[mid] / a.block_q + mid <= pid) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Loads K and V of keys [start, start + 64) into their tiles (keys at or past `end`, or in a page outside the cache,
// zero-filled and read from nowhere): thread tid takes key tid / 4 (its page: one table entry), pieces tid % 4 + 4 j
__device__ __forceinline__ void load_kv(const Args& a, const int* table_row, int kvh, int start, int end, uint32_t s_k,
                                        uint32_t s_v, int tid) {
  const int row = tid >> 2, key = start + row;
  const int page = key < end ? table_row[key / a.page_size] : -1;
  const bool ok = page >= 0 && page < a.num_pages;
  const int64_t in_page = ok ? key % a.page_size : 0;
  const uint16_t* k = a.k + (ok ? page * a.k_page + in_page * a.k_token + kvh * a.k_head : 0);
  const uint16_t* v = a.v + (ok ? page * a.v_page + in_page * a.v_token + kvh * a.v_head : 0);
#pragma unroll
  for (int j = 0; j < kPieces / 4; ++j) {
    const int piece = (tid & 3) + 4 * j;
    cp_async_16(s_k + swizzled(row, piece), k + (ok ? piece * 8 : 0), ok);
    cp_async_16(s_v + swizzled(row, piece), v + (ok ? piece * 8 : 0), ok);
  }
}

// The online softmax of a warpgroup's tile of scores s (raw q.k; s[4 j + c]: row row0 (c < 2) or row1, key start +
// 8 j + 2 t4 + c % 2), base 2, with the keys at or past each row's end (end0, end1) masked when kMasked: the rows'
// running maxima (m: scaled, base 2) and this thread's sums updated, P as the A fragments of P V, the factors the
// rows' O is rescaled by returned. The scale is > 0, so the raw maximum scaled is the scaled maximum, and the
// exponent is one fused multiply-add.
template <bool kMasked, bool kHalf>
__device__ __forceinline__ void softmax_tile(const float (&s)[32], int start, int end0, int end1, int t4, float scale,
                                             float& m0, float& m1, float& l0, float& l1, uint32_t (&p_frag)[4][4],
                                             float& alpha0, float& alpha1) {
  const auto raw = [&](int j, int c) {
    if constexpr (kMasked)
      return start + 8 * j + 2 * t4 + (c & 1) < (c < 2 ? end0 : end1) ? s[4 * j + c] : -INFINITY;
    return s[4 * j + c];
  };
  float max0 = -INFINITY, max1 = -INFINITY;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    max0 = fmaxf(max0, fmaxf(raw(j, 0), raw(j, 1)));
    max1 = fmaxf(max1, fmaxf(raw(j, 2), raw(j, 3)));
  }
  const float new0 = fmaxf(m0, quad_max(max0) * scale), new1 = fmaxf(m1, quad_max(max1) * scale);
  const float base0 = new0 == -INFINITY ? 0.0f : new0, base1 = new1 == -INFINITY ? 0.0f : new1;
  alpha0 = fast_exp2(m0 - base0);
  alpha1 = fast_exp2(m1 - base1);
  m0 = new0;
  m1 = new1;
  float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float p0 = fast_exp2(fmaf(raw(j, 0), scale, -base0)), p1 = fast_exp2(fmaf(raw(j, 1), scale, -base0));
    const float p2 = fast_exp2(fmaf(raw(j, 2), scale, -base1)), p3 = fast_exp2(fmaf(raw(j, 3), scale, -base1));
    sum0 += p0 + p1;
    sum1 += p2 + p3;
    // the A fragments of 16-key step j / 2 (keys + 0..7: a0 a1; + 8..15: a2 a3)
    p_frag[j >> 1][(j & 1) * 2] = pack_pair<kHalf>(p0, p1);
    p_frag[j >> 1][(j & 1) * 2 + 1] = pack_pair<kHalf>(p2, p3);
  }
  l0 = l0 * alpha0 + sum0;
  l1 = l1 * alpha1 + sum1;
}

// A row of the block (0 .. 127): its query token, head, position and whether it is one
struct Row {
  int64_t token;
  int head, pos;
  bool valid;
};
__device__ __forceinline__ Row row_of(const Args& a, int row, int kvh, int64_t first_token, int first_pos,
                                      int tokens) {
  const int t = row / a.group;
  return {first_token + t, kvh * a.group + row % a.group, first_pos + t, row < a.block_q * a.group && t < tokens};
}

// Q of the block's rows into shared memory (zeros in rows that are no query): thread tid, rows tid / 4 and + 64
// (one a warpgroup), pieces tid % 4 + 4 j
__device__ __forceinline__ void load_q(const Args& a, uint32_t s_q, int kvh, int64_t first_token, int first_pos,
                                       int tokens, int tid) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = (tid >> 2) + 64 * half;
    const Row r = row_of(a, row, kvh, first_token, first_pos, tokens);
    const uint16_t* src = a.q + (r.valid ? r.token * a.q_token + r.head * a.q_head : 0);
#pragma unroll
    for (int j = 0; j < kPieces / 4; ++j) {
      const int piece = (tid & 3) + 4 * j;
      cp_async_16(s_q + half * kOperandBytes + swizzled(row - 64 * half, piece), src + (r.valid ? piece * 8 : 0),
                  r.valid);
    }
  }
}

// A row's end (thread's row of a warpgroup): O [its 128 columns] normalised by the row's sum l (the sums of its
// four threads added) and maximum m, stored in q's type, and the LSE; NaN where `nan_row`
template <bool kHalf>
__device__ __forceinline__ void store_row(const Args& a, const float (&o)[64], int half, const Row& r, float m,
                                          float l, bool nan_row, int t4) {
  l = quad_sum(l);
  if (!r.valid) return;
  const bool has_keys = l > 0.0f;
  const float inv = nan_row ? NAN : (has_keys ? 1.0f / l : 0.0f);
  uint16_t* dst = a.out + r.token * a.out_token + r.head * a.out_head + 2 * t4;
#pragma unroll
  for (int j = 0; j < 16; ++j)
    *reinterpret_cast<uint32_t*>(dst + 8 * j) = pack_pair<kHalf>(o[4 * j + 2 * half] * inv,
                                                                 o[4 * j + 2 * half + 1] * inv);
  if (a.lse != nullptr && t4 == 0)
    a.lse[r.token * a.num_q_heads + r.head] = nan_row ? NAN : (has_keys ? (m + __log2f(l)) * kLn2 : -INFINITY);
}

template <bool kHalf>
__global__ void __launch_bounds__(kThreads, 1) prefill_kernel(const __grid_constant__ Args a) {
#if defined(ATTNOPS_PREFILL_SM90A)
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = aligned_smem(smem_raw);
  const uint32_t s_q = smem_u32(smem);                 // two [64 x 128] operands, one a warpgroup
  const uint32_t s_kv = s_q + 2 * kOperandBytes;       // stage s: K at s_kv + 2 s kOperandBytes, V after it
  __shared__ int scratch;

  const int tid = threadIdx.x, warp = (tid >> 5) & 3, lane = tid & 31;
  // the warpgroup through a shuffle: the compiler then knows it is warp-uniform (mla_decode_sm90.cuh says why)
  const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
  const int g = lane >> 2, t4 = lane & 3;
  // the blocks in reverse: a sequence's last query blocks, which see the most keys, start first and the light
  // ones fill the tail (the grid is T / block_q + batch blocks along x: sequence_of_block)
  const int kvh = blockIdx.y, pid = gridDim.x - 1 - blockIdx.x;

  // --- which sequence and which of its query tokens ---------------------------------------------------------
  const int bad_entry = cu_seqlens_violation(a, tid, &scratch);
  if (bad_entry <= a.batch) {  // every row NaN, this block's by position; nothing read
    if (pid == 0 && kvh == 0 && tid == 0) atomicMin(a.errors + kErrCuSeqlensQ, bad_entry);
    for (int z = tid; z < kRows * kD / 2; z += kThreads) {
      const int row = z / (kD / 2), col = 2 * (z % (kD / 2));
      const int64_t token = static_cast<int64_t>(pid) * a.block_q + row / a.group;
      if (row >= a.block_q * a.group || token >= a.num_tokens) continue;
      const int head = kvh * a.group + row % a.group;
      *reinterpret_cast<uint32_t*>(a.out + token * a.out_token + head * a.out_head + col) =
          pack_pair<kHalf>(NAN, NAN);
      if (a.lse != nullptr && col == 0) a.lse[token * a.num_q_heads + head] = NAN;
    }
    return;
  }
  const int b = sequence_of_block(a, pid);
  const int q_start = a.cu_q[b], q_len = a.cu_q[b + 1] - q_start;
  const int q_block = pid - (q_start / a.block_q + b);
  if (q_block * a.block_q >= q_len) return;
  int seq_len = a.seq_lens[b];
  const bool seq_bad = seq_len < 0 || seq_len > a.capacity;
  if (seq_bad && q_block == 0 && kvh == 0 && tid == 0) atomicMin(a.errors + kErrSeqLens, b);
  if (seq_bad) seq_len = 0;
  const int tokens = min(a.block_q, q_len - q_block * a.block_q);  // query tokens of this block
  const int first_pos = seq_len - q_len + q_block * a.block_q;      // the first one's position (may be negative)
  const int hi = max(first_pos + tokens, 0);                         // keys any row sees: [0, hi)
  const int tiles = (hi + kKeys - 1) / kKeys;
  const int64_t first_token = static_cast<int64_t>(q_start) + q_block * a.block_q;
  const int* table_row = a.block_table + static_cast<int64_t>(b) * a.table_stride;

  // --- the pages the rows see, checked once: the first key of a bad one (rows that see it are NaN) -------------
  if (tid == 0) scratch = INT_MAX;
  __syncthreads();
  for (int p = tid; p * a.page_size < hi; p += kThreads) {
    const int page = table_row[p];
    if (page < 0 || page >= a.num_pages) atomicMin(&scratch, p * a.page_size);
  }
  __syncthreads();
  const int bad_from = scratch;  // INT_MAX: none
  if (bad_from != INT_MAX && tid == 0) atomicMin(a.errors + kErrBlockTable, b);

  // --- the key loop ------------------------------------------------------------------------------------------
  // (stage s: K at s_kv + 2 s kOperandBytes, V after it; tile i in stage i % kStages; one commit group a tile, the
  // first with Q)
  load_q(a, s_q, kvh, first_token, first_pos, tokens, tid);
#pragma unroll
  for (int t = 0; t < kStages - 1; ++t) {
    if (t < tiles) load_kv(a, table_row, kvh, t * kKeys, hi, s_kv + t * 2 * kOperandBytes,
                           s_kv + (2 * t + 1) * kOperandBytes, tid);
    cp_async_commit();
  }

  const int row0 = wg * 64 + warp * 16 + g, row1 = row0 + 8;  // this thread's rows of the block's 128
  const Row r0 = row_of(a, row0, kvh, first_token, first_pos, tokens);
  const Row r1 = row_of(a, row1, kvh, first_token, first_pos, tokens);
  const int end0 = r0.valid ? r0.pos + 1 : hi, end1 = r1.valid ? r1.pos + 1 : hi;  // keys [0, end) each row sees
  // the warpgroup's first row's end: tiles that end by it need no mask for any row of the warpgroup
  const int unmasked_end = first_pos + (wg * 64) / a.group + 1;
  const uint32_t s_q_wg = s_q + wg * kOperandBytes;
  const float scale = a.qk_scale_log2;

  float o[64];  // rows row0, row1 x the 128 columns (o[4 j + c]: row0 for c < 2, column 8 j + 2 t4 + c % 2)
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.0f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;

  int stage = 0, ahead = kStages - 1;  // tile i's stage, and tile i + kStages - 1's
  for (int i = 0; i < tiles; ++i) {
    const int start = i * kKeys;
    const uint32_t s_k = s_kv + stage * 2 * kOperandBytes, s_v = s_k + kOperandBytes;
    cp_async_wait<kStages - 2>();  // (the groups after tile i's may still be in flight)
    fence_proxy_async();
    __syncthreads();  // tile i in place; every use of tile i - 1's stage done
    if (i + kStages - 1 < tiles) {
      const uint32_t next = s_kv + ahead * 2 * kOperandBytes;
      load_kv(a, table_row, kvh, start + (kStages - 1) * kKeys, hi, next, next + kOperandBytes, tid);
    }
    cp_async_commit();
    stage = stage + 1 == kStages ? 0 : stage + 1;
    ahead = ahead + 1 == kStages ? 0 : ahead + 1;

    float s[32];
#pragma unroll
    for (int z = 0; z < 32; ++z) s[z] = 0.0f;
    pin(s);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      const uint32_t offset = (kk >> 2) * kChunkBytes + (kk & 3) * 32;
      wgmma_m64n64k16_ss<kHalf>(s, descriptor(s_q_wg + offset, 16, 1024), descriptor(s_k + offset, 16, 1024),
                                kk > 0);
    }
    wgmma_commit();
    wgmma_wait_all();
    pin(s);

    uint32_t p_frag[4][4];
    float alpha0, alpha1;
    if (start + kKeys > unmasked_end) {
      softmax_tile<true, kHalf>(s, start, end0, end1, t4, scale, m0, m1, l0, l1, p_frag, alpha0, alpha1);
    } else {
      softmax_tile<false, kHalf>(s, start, end0, end1, t4, scale, m0, m1, l0, l1, p_frag, alpha0, alpha1);
    }
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      o[4 * j] *= alpha0;
      o[4 * j + 1] *= alpha0;
      o[4 * j + 2] *= alpha1;
      o[4 * j + 3] *= alpha1;
    }
    pin(o);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk)
      wgmma_m64n128k16_rs<kHalf>(o, p_frag[kk], descriptor(s_v + kk * 2048, kChunkBytes, 1024));
    wgmma_commit();
    wgmma_wait_all();
    pin(o);
  }
  cp_async_wait<0>();

  // --- the rows' end ------------------------------------------------------------------------------------------
  // (a row is NaN where its sequence's length is bad or it sees a key of a bad page: bad_from < its end)
  store_row<kHalf>(a, o, 0, r0, m0, l0, seq_bad || bad_from < end0, t4);
  store_row<kHalf>(a, o, 1, r1, m1, l1, seq_bad || bad_from < end1, t4);
#endif
}

// q [T, Hq, 128] bf16 or fp16 with unit inner stride and 16-byte aligned rows; k_cache, v_cache [num_pages,
// page_size, Hkv, 128] of q's dtype, the same; cu_seqlens_q int32 [B + 1]; out [T, Hq, 128] of q's dtype, unit
// inner stride, 4-byte aligned rows; lse float32 [T, Hq] contiguous or none. Validated by the backend
// (attnops/backends/cuda_prefill.py); these checks only keep a wrong call from reading out of bounds.
void prefill_sm90(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& cu_seqlens_q,
                  const at::Tensor& out, const std::optional<at::Tensor>& lse, const at::Tensor& errors,
                  double scale) {
  const int64_t T = q.size(0), Hq = q.size(1), Hkv = k_cache.size(2), B = seq_lens.size(0);
  const bool half = q.scalar_type() == at::kHalf;
  TORCH_CHECK((half || q.scalar_type() == at::kBFloat16) && k_cache.scalar_type() == q.scalar_type() &&
                  v_cache.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
              "prefill_sm90: q, the caches and out of one dtype, bf16 or fp16");
  TORCH_CHECK(q.dim() == 3 && q.size(2) == kD && k_cache.dim() == 4 && k_cache.size(3) == kD &&
                  v_cache.sizes() == k_cache.sizes() && out.sizes() == q.sizes(),
              "prefill_sm90: head dim 128; caches [num_pages, page_size, Hkv, 128]");
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0 && Hq / Hkv <= kRows, "prefill_sm90: a GQA group of at most 128");
  const auto rows_16 = [](const at::Tensor& t) {
    bool ok = t.stride(-1) == 1 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
    for (int d = 0; d + 1 < t.dim(); ++d) ok = ok && t.stride(d) % 8 == 0;
    return ok;
  };
  TORCH_CHECK(rows_16(q) && rows_16(k_cache) && rows_16(v_cache), "prefill_sm90: rows of q and the caches 16-byte "
              "aligned, unit inner stride");
  TORCH_CHECK(out.stride(-1) == 1 && out.stride(0) % 2 == 0 && out.stride(1) % 2 == 0 &&
                  reinterpret_cast<uintptr_t>(out.data_ptr()) % 4 == 0,
              "prefill_sm90: out with unit inner stride and 4-byte aligned rows");
  TORCH_CHECK(!lse || (lse->is_contiguous() && lse->scalar_type() == at::kFloat && lse->numel() == T * Hq),
              "prefill_sm90: lse float32 [T, Hq] contiguous");
  TORCH_CHECK(cu_seqlens_q.size(0) == B + 1 && B > 0, "prefill_sm90: cu_seqlens_q of the sequences + 1 entries");
  TORCH_CHECK(block_table.stride(1) == 1 && block_table.size(0) >= B, "prefill_sm90: a row of the block table a "
              "sequence, unit inner stride");
  if (T == 0) return;
  c10::cuda::CUDAGuard guard(q.device());
  Args a{};
  a.q = reinterpret_cast<const uint16_t*>(q.data_ptr());
  a.k = reinterpret_cast<const uint16_t*>(k_cache.data_ptr());
  a.v = reinterpret_cast<const uint16_t*>(v_cache.data_ptr());
  a.block_table = block_table.data_ptr<int>();
  a.seq_lens = seq_lens.data_ptr<int>();
  a.cu_q = cu_seqlens_q.data_ptr<int>();
  a.out = reinterpret_cast<uint16_t*>(out.data_ptr());
  a.lse = lse ? lse->data_ptr<float>() : nullptr;
  a.errors = errors.data_ptr<int>();
  a.q_token = q.stride(0), a.q_head = q.stride(1), a.out_token = out.stride(0), a.out_head = out.stride(1);
  a.k_page = k_cache.stride(0), a.k_token = k_cache.stride(1), a.k_head = k_cache.stride(2);
  a.v_page = v_cache.stride(0), a.v_token = v_cache.stride(1), a.v_head = v_cache.stride(2);
  a.table_stride = static_cast<int>(block_table.stride(0));
  a.num_pages = static_cast<int>(k_cache.size(0));
  a.page_size = static_cast<int>(k_cache.size(1));
  a.capacity = static_cast<int>(block_table.size(1) * k_cache.size(1));
  a.group = static_cast<int>(Hq / Hkv);
  a.block_q = kRows / a.group;
  a.batch = static_cast<int>(B);
  a.num_tokens = static_cast<int>(T);
  a.num_q_heads = static_cast<int>(Hq);
  a.qk_scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  void (*kernel)(Args) = half ? prefill_kernel<true> : prefill_kernel<false>;
  // (a function attribute, not a stream operation: allowed inside a capture)
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  const dim3 grid(static_cast<unsigned>(T / a.block_q + B), static_cast<unsigned>(Hkv));
  kernel<<<grid, kThreads, kSmemBytes, c10::cuda::getCurrentCUDAStream()>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace attnops::prefill_sm90

TORCH_LIBRARY_FRAGMENT(attnops, m) {
  // internal: the `cuda` backend's query-block attention over 16-bit caches (attnops/backends/cuda_prefill.py)
  m.def(
      "prefill_sm90(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, "
      "Tensor cu_seqlens_q, Tensor(a!) out, Tensor(b!)? lse, Tensor(c!) errors, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(attnops, CUDA, m) { m.impl("prefill_sm90", &attnops::prefill_sm90::prefill_sm90); }
