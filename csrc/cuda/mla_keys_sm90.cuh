// Latent attention (MLA) decode for sm_90a with the keys as the MMAs' M: the `cuda` backend's latent-attention
// kernel for at most 16 heads: fp8 caches' default with splits of 2048 keys or more (attnops/backends/cuda_mla.py's
// kernel_variant, measured in docs/bench.md), and bf16's with ATTNOPS_CUDA_MLA_VARIANT=keys (slower than tma).
//
// Why: mla_decode_sm90.cuh's kernel puts a token's heads on the M of its MMAs, which is 64 rows whatever the heads,
// so at 16 heads (DeepSeek-V3 over 8 GPUs) three quarters of its MMA work, and of the shared memory the MMAs read,
// is padding, and its chain of work a tile (not the memory) bounds it (docs/bench.md). Here the tile's 64 keys are
// the M and the heads the N (16), both products transposed:
//   S^T [64 keys x 16] = K [64 x 576] Q^T        (m64n16k16 x 36; K and Q K-major in shared memory)
//   O^T [512 x 16]    += V^T [512 x 64] P^T      (m64n16k16 x 8 row blocks x 4; V^T is the tile read M-major)
// so a tile's MMAs read Q (16 rows) lightly besides the tile (as K, then its values as V), and O^T is 64
// registers a thread.
//
// A block: one token, one split of its keys, 256 threads = two warpgroups that take the split's tiles in turn
// (warpgroup w the tiles i = w, w + 2, ...), each in its own slot of shared memory with its own running maxima,
// sums and O^T, so that one warpgroup's softmax runs beside the other's MMAs with no exchange between them until
// the end, where warpgroup 1 hands its state to warpgroup 0 through shared memory and warpgroup 0 merges and
// stores. Every tile is copied by the tensor memory accelerator (one thread of the warpgroup; the cache's tensor map
// as in the TMA path), into the slot as soon as the warpgroup's P V of the slot's last tile is done (its pages read
// and the tile prefetched to L2 before, while the slot's tile is computed); rows past the
// sequence's end are zeroed after they land (they may hold anything, NaN included, and P V must not meet them).
// Softmax: a head's maximum over the tile's 64 keys (rows) is reduced over the warp's lanes and the warpgroup's
// four warps (shared memory, a named barrier); the sums stay a thread's own until the end.
// fp8 e4m3 caches (stored = value / kv_scale): a tile's bytes land in the upper half of its slot (a copy of 64-byte
// boxes, unswizzled) and the warpgroup widens them in place to the bf16 tile, exactly; kv_scale joins the scores'
// scale and the output. So the fp8 form reads half the bytes and keeps the bf16 form's shared memory.
// DeepSeek's fp8 layout (kv_format "fp8_ds_mla", attnops/formats.py: a 656-byte row of the 512 values as e4m3, a
// float32 scale for each 128 of them, the 64 rotary values as bf16; ATTNOPS_CUDA_MLA_DS=1, off until measured): the
// row's bytes land as eleven 64-byte chunks (the last one's 48 bytes past the row, zeros), lower in the slot than
// fp8's nine, and are widened in place the same way, values exactly (not yet times their scale), the rotary values
// copied, the scales kept aside. The scales join the products, not the values: the scores' MMAs go to one
// accumulator for each 128 of the values and one for the rotary part, summed with each key's scales; P is written
// four times, each 128's copy times its keys' scale for that 128, and V^T's row blocks (64 values each) read their
// 128's copy. So the tile's widening stays exact and multiplies nothing.
// Pages of 8 rows or more; splits, merge, bad indices and outputs as mla_decode_sm90.cuh.
#pragma once
#include "mla_decode_sm90.cuh"

namespace attnops::mla_sm90 {

constexpr int kNarrowHeads = 16;                         // the heads a block (the MMAs' N); fewer are zero queries
constexpr int kQChunkBytes = kNarrowHeads * 128;         // one 64-value column chunk of Q [16 x 576]
constexpr int kQBytes = kChunks * kQChunkBytes;
constexpr int kPtBytes = kNarrowHeads * kKeys * 2;       // P [16 heads x 64 keys], K-major (the B operand of P V)
constexpr int kKeysOBytes = kR * kNarrowHeads * 4;       // warpgroup 1's O^T, handed over at the end
static_assert(kKeysOBytes <= 2 * kTileBytes, "the hand-over uses the slots' memory");
constexpr int kKeysSmemBytes = kQBytes + 2 * kTileBytes + 2 * kPtBytes + 2 * 4 * kNarrowHeads * 4 +
                               kNarrowHeads * 4 + 2 * 8 + 1024;
static_assert(kKeysSmemBytes <= 227 * 1024, "one block must fit an sm_90 SM's 227 KB of shared memory");
constexpr int kFp8ChunkBytes = kKeys * 64;              // fp8: one 64-value column chunk of a tile, unswizzled
constexpr int kFp8StageOffset = kTileBytes - kChunks * kFp8ChunkBytes;  // fp8: the staged bytes in a slot
constexpr int kDsChunks = (kDsRowBytes + 63) / 64;        // its staged 64-byte chunks a row (11)
constexpr int kDsStageOffset = kTileBytes - kDsChunks * kFp8ChunkBytes;
static_assert(kDsStageOffset == 28 * 1024, "widen_ds_slot's order of reads and writes assumes the staging at 28 KB");
constexpr int kKeysTailBytes = (2 * 4 * kNarrowHeads + kNarrowHeads) * 4 + 2 * 8;  // maxima, sums, two mbarriers
constexpr int kDsScaleBytes = kKeys * kDsParts * 4;       // a warpgroup's tile's scales [64 keys][4]
constexpr int kKeysDsSmemBytes = kKeysSmemBytes + 2 * (kDsParts - 1) * kPtBytes + 2 * kDsScaleBytes;
static_assert(kKeysDsSmemBytes <= 227 * 1024, "one block must fit an sm_90 SM's 227 KB of shared memory");
static_assert(kKeysTailBytes % 16 == 0, "the scales after the tail are read 16 bytes at a time");
constexpr int kBarWarpgroup = 1;  // named barriers 1 and 2: warpgroup 0's and 1's own (0 is __syncthreads')

__device__ __forceinline__ void warpgroup_sync(int wg) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(kBarWarpgroup + wg) : "memory");
}

// D (+)= A B: A [64 x 16] from shared memory (K-major, or M-major with trans_a), B [16 x 16] K-major in shared
// memory; D fp32 [64 x 16]
template <int kTransA>
__device__ __forceinline__ void wgmma_m64n16k16_ss(float (&d)[8], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, "
      "%11, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(kTransA));
}

// The accumulators' layout (m64n16, this thread: warp `warp` of its warpgroup, lane 4 g + t4): d[4 j + c] is row
// 16 warp + g + 8 (c / 2), column 8 j + 2 t4 + c % 2. Rows are keys (S^T) or latent values (O^T), columns heads;
// a thread's four columns (q = 2 j + c % 2) are the same in both.
__device__ __forceinline__ int column_of(int q, int t4) { return 8 * (q >> 1) + 2 * t4 + (q & 1); }

// fp8: the keys [start, start + 64) copied as bytes to `stage` ([kStaged chunks][64 rows][64 bytes]: 9 for fp8 e4m3,
// kDsChunks for DeepSeek's layout) by the tensor memory accelerator from one thread, awaited on `bar`; boxes of {64
// values, min(page_size, 64) rows} as tma_boxes'
template <int kStaged = kChunks>
__device__ __forceinline__ void tma_fp8_boxes(const Args& a, const int (&pages)[kMaxBoxes], int start, uint32_t stage,
                                              uint32_t bar) {
  mbarrier_expect_bytes(bar, kStaged * kFp8ChunkBytes);
  for_each_box(a, start, [&](int r, int tile_row, int row) {
#pragma unroll
    for (int c = 0; c < kStaged; ++c)
      tma_box(stage + c * kFp8ChunkBytes + tile_row * 64, &a.kv_map, bar, c * 64, row, pages[r]);
  });
}

// A tile's copy into a slot: bf16 swizzled, or fp8 bytes to the slot's upper half (kDs: DeepSeek's layout's, from
// kDsStageOffset)
template <bool kFp8, bool kDs>
__device__ __forceinline__ void copy_tile(const Args& a, const int (&pages)[kMaxBoxes], int start, uint32_t slot,
                                          uint32_t bar) {
  if constexpr (kDs) {
    tma_fp8_boxes<kDsChunks>(a, pages, start, slot + kDsStageOffset, bar);
  } else if constexpr (kFp8) {
    tma_fp8_boxes(a, pages, start, slot + kFp8StageOffset, bar);
  } else {
    tma_boxes(a, pages, start, slot, bar, 0, kChunks - 1, true);
  }
}

// 32 staged e4m3 values (two 16-byte words) as four 16-byte pieces of bf16, to pieces 4 half .. 4 half + 3 of
// column chunk c of the tile's row `row` (swizzled)
__device__ __forceinline__ void store_widened(uint8_t* tile, int row, int c, int half, const uint4 (&v)[2]) {
  const uint32_t words[8] = {v[0].x, v[0].y, v[0].z, v[0].w, v[1].x, v[1].y, v[1].z, v[1].w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    uint32_t out[4];
#pragma unroll
    for (int w = 0; w < 2; ++w) {
      out[2 * w] = e4m3x2_to_bf16x2(static_cast<uint16_t>(words[2 * k + w] & 0xffff));
      out[2 * w + 1] = e4m3x2_to_bf16x2(static_cast<uint16_t>(words[2 * k + w] >> 16));
    }
    *reinterpret_cast<uint4*>(tile + swizzled(row, 8 * c + 4 * half + k)) = make_uint4(out[0], out[1], out[2], out[3]);
  }
}

// fp8: the slot's staged bytes widened in place to its bf16 tile, by the warpgroup (thread t: row t / 2, values
// 32 (t % 2) .. of each chunk). The bf16 chunks 0-3 cover no staged byte, chunk 4 the staging's chunk 0 and chunks
// 5-8 the rest, so: chunks 0-4 read, 0-3 written, a barrier, 4 written; chunks 5-8 read, a barrier, written.
// One chunk's 32 staged bytes of this thread (two 16-byte words, in order). Rows 2 and 3 of every four read their
// second word first: the eight threads of a quarter-warp's load then meet eight different bank groups (rows 64
// bytes apart would otherwise pair up on the same banks)
__device__ __forceinline__ void load_staged(const uint8_t* staged, int row, uint4 (&v)[2]) {
  const int first = (row >> 1) & 1;
  const uint4 a = *reinterpret_cast<const uint4*>(staged + 16 * first);
  const uint4 b = *reinterpret_cast<const uint4*>(staged + 16 * (first ^ 1));
  v[0] = first ? b : a;
  v[1] = first ? a : b;
}

__device__ __forceinline__ void widen_slot(uint8_t* tile, int wg_tid, int wg) {
  const int row = wg_tid >> 1, half = wg_tid & 1;
  const uint8_t* staged = tile + kFp8StageOffset + row * 64 + half * 32;
  uint4 v[5][2];
#pragma unroll
  for (int c = 0; c < 5; ++c) load_staged(staged + c * kFp8ChunkBytes, row, v[c]);
#pragma unroll
  for (int c = 0; c < 4; ++c) store_widened(tile, row, c, half, v[c]);
  warpgroup_sync(wg);
  store_widened(tile, row, 4, half, v[4]);
#pragma unroll
  for (int c = 5; c < kChunks; ++c) load_staged(staged + c * kFp8ChunkBytes, row, v[c - 5]);
  warpgroup_sync(wg);
#pragma unroll
  for (int c = 5; c < kChunks; ++c) store_widened(tile, row, c, half, v[c - 5]);
}

// DeepSeek's layout: the slot's staged chunks (from kDsStageOffset: [11][64 rows][64 bytes]) as its bf16 tile, by
// the warpgroup (thread t: row t / 2, bytes 32 (t % 2) .. of each chunk): chunks 0-7 the e4m3 values widened
// exactly, the rotary values (bytes 528-655 of the row: 16-byte pieces of chunks 8-10) copied to the tile's chunk
// 8, the row's four scales (chunk 8's first 16 bytes) to `scales` [64 rows][4]. bf16 chunk c covers bytes [8c, 8c +
// 8) KB of the slot, staged chunk c' [28 + 4c', 32 + 4c') KB: chunks 0-2 cover no staged byte, 3 and 4 staged 0-2,
// 5-8 staged 3-10. So: staged 0-4 read, chunks 0-2 written, a barrier, 3 and 4 written; staged 5-10 read, a
// barrier, 5-8 written.
__device__ __forceinline__ void widen_ds_slot(uint8_t* tile, int wg_tid, int wg, float* scales) {
  const int row = wg_tid >> 1, half = wg_tid & 1;
  const uint8_t* staged = tile + kDsStageOffset + row * 64 + half * 32;
  uint4 v[6][2];
#pragma unroll
  for (int c = 0; c < 5; ++c) load_staged(staged + c * kFp8ChunkBytes, row, v[c]);
#pragma unroll
  for (int c = 0; c < 3; ++c) store_widened(tile, row, c, half, v[c]);
  warpgroup_sync(wg);
  store_widened(tile, row, 3, half, v[3]);
  store_widened(tile, row, 4, half, v[4]);
#pragma unroll
  for (int c = 5; c < kDsChunks; ++c) load_staged(staged + c * kFp8ChunkBytes, row, v[c - 5]);
  warpgroup_sync(wg);
#pragma unroll
  for (int c = 5; c < 8; ++c) store_widened(tile, row, c, half, v[c - 5]);
  // chunks 8-10's bytes [32 half, 32 half + 32) each, as 16-byte words: word w of chunk 8 + k is the row's bytes
  // 512 + 64 k + 32 half + 16 w, i.e. scales for (k, half, w) = (0, 0, 0), else rotary piece 4 k + 2 half + w - 1
#pragma unroll
  for (int k = 0; k < 3; ++k)
#pragma unroll
    for (int w = 0; w < 2; ++w) {
      const int piece = 4 * k + 2 * half + w - 1;
      if (piece < 0) {
        *reinterpret_cast<uint4*>(scales + row * kDsParts) = v[3 + k][w];
      } else if (piece < 8) {
        *reinterpret_cast<uint4*>(tile + swizzled(row, 8 * 8 + piece)) = v[3 + k][w];
      }
    }
}

// v rounded to nearest in T (bf16 or f16): a function, since torch's extension builds turn off the types'
// implicit conversions
template <class T>
__device__ __forceinline__ T round_to(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 round_to<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half round_to<__half>(float v) { return __float2half_rn(v); }

// A tile's online softmax in the keys forms (thread: warp `warp` of warpgroup wg, lane 4 g + t4; s: its S^T
// accumulators, rows keys start + 16 warp + g and + 8): the scores past `hi` masked, scaled to base 2, the heads'
// maxima over the tile's keys (this thread's two rows, the warp's eight row pairs, the four warps through
// `colmax` [4 warps][16 heads] and a named barrier), then P = exp2(S - base) to shared memory as P [16 heads x 64
// keys] K-major (128-byte swizzle) in T (bf16 or f16), the sums and O^T's rescaling. The caller fences and syncs
// before P V reads P. kParts 4 (DeepSeek's layout): P four times, copy b at pt + b kPtBytes times each key's scale b
// (scale0: this thread's first row's four, scale1: its second's)
template <class T, int kParts = 1>
__device__ __forceinline__ void keys_softmax(float (&s)[8], int start, int hi, float qk_scale_log2, float (&m)[4],
                                             float (&l)[4], float (&o)[8][8], float* colmax, uint8_t* pt, int wg,
                                             const float (&scale0)[kParts] = {}, const float (&scale1)[kParts] = {}) {
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3, g = lane >> 2, t4 = lane & 3;
  const int row0 = 16 * warp + g, row1 = row0 + 8;
  const int key0 = start + row0, key1 = start + row1;
  float tile_max[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int j = q >> 1, c = q & 1;
    s[4 * j + c] = key0 < hi ? s[4 * j + c] * qk_scale_log2 : -INFINITY;
    s[4 * j + 2 + c] = key1 < hi ? s[4 * j + 2 + c] * qk_scale_log2 : -INFINITY;
    float v = fmaxf(s[4 * j + c], s[4 * j + 2 + c]);
#pragma unroll
    for (int mask = 4; mask <= 16; mask <<= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, mask));
    tile_max[q] = v;
  }
  if (g == 0) {
#pragma unroll
    for (int q = 0; q < 4; ++q) colmax[warp * kNarrowHeads + column_of(q, t4)] = tile_max[q];
  }
  warpgroup_sync(wg);
  float alpha[4], base[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int col = column_of(q, t4);
    float v = colmax[col];
#pragma unroll
    for (int w = 1; w < 4; ++w) v = fmaxf(v, colmax[w * kNarrowHeads + col]);
    const float next = fmaxf(m[q], v);
    base[q] = next == -INFINITY ? 0.0f : next;
    alpha[q] = exp2f(m[q] - base[q]);
    m[q] = next;
  }
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int j = q >> 1, c = q & 1, col = column_of(q, t4);
    const float p0 = exp2f(s[4 * j + c] - base[q]), p1 = exp2f(s[4 * j + 2 + c] - base[q]);
    l[q] = l[q] * alpha[q] + p0 + p1;
#pragma unroll
    for (int b = 0; b < kParts; ++b) {
      T* line = reinterpret_cast<T*>(pt + b * kPtBytes + col * 128);
      line[(((row0 >> 3) ^ (col & 7)) << 3) + (row0 & 7)] = round_to<T>(kParts > 1 ? p0 * scale0[b] : p0);
      line[(((row1 >> 3) ^ (col & 7)) << 3) + (row1 & 7)] = round_to<T>(kParts > 1 ? p1 * scale1[b] : p1);
    }
  }
#pragma unroll
  for (int b = 0; b < 8; ++b)
#pragma unroll
    for (int z = 0; z < 8; ++z) o[b][z] *= alpha[2 * (z >> 2) + (z & 1)];
}

// Where warpgroup 1's maxima go at a block's end (kNarrowHeads floats): past the [2 warpgroups][4 warps][heads] of
// `s_colmax`; the kernels put their barriers after them
__device__ __forceinline__ float* wg1_maxima(float* s_colmax) { return s_colmax + 2 * 4 * kNarrowHeads; }

// The end of a keys-form block (its two warpgroups' loops done; every thread of the block calls it, and then
// leaves): the sums over each warpgroup, a bad page recorded, warpgroup 1's maxima, sums and O^T handed to warpgroup
// 0 through shared memory (colmax [2 warpgroups][4 warps][16 heads] floats, then 16 more; `handover`: 128 threads x
// 64 values), which merges the two states, normalises (x kv_scale) and stores: with one split out and the LSE, with
// more the split's partial and base-2 LSE for mla_merge_kernel. o[b][z] is latent value value_of(b, z) of head
// column_of(2 (z / 4) + z % 2, t4). Threads past the two warpgroups (a producer's) meet the two barriers only.
template <class ValueOf>
__device__ __forceinline__ void finish_keys_block(const Args& a, const BlockKeys& keys, int wg, bool saw_bad,
                                                  float kv_scale, float (&o)[8][8], const float (&m)[4], float (&l)[4],
                                                  float* s_colmax, float* handover, ValueOf value_of) {
  const int tid = threadIdx.x, lane = tid & 31, wg_tid = tid & 127;
  const int warp = (tid >> 5) & 3, g = lane >> 2, t4 = lane & 3;
  const int token = keys.token, split = keys.split;
  float* s_m1 = wg1_maxima(s_colmax);
  // the sums over the warpgroup (lanes of a column, then its four warps, below)
#pragma unroll
  for (int q = 0; q < 4; ++q)
#pragma unroll
    for (int mask = 4; mask <= 16; mask <<= 1) l[q] += __shfl_xor_sync(0xffffffffu, l[q], mask);
  const bool poisoned = __syncthreads_or(saw_bad) != 0;
  if (poisoned && tid == 0) atomicMin(a.errors + kErrBlockTable, sequence_of(a, token));
  if (wg < 2 && g == 0) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      s_colmax[(4 * wg + warp) * kNarrowHeads + column_of(q, t4)] = l[q];
      if (wg == 1 && warp == 0) s_m1[column_of(q, t4)] = m[q];
    }
  }
  if (wg == 1) {
#pragma unroll
    for (int b = 0; b < 8; ++b)
#pragma unroll
      for (int z = 0; z < 8; ++z) handover[(8 * b + z) * 128 + wg_tid] = o[b][z];
  }
  __syncthreads();
  if (wg != 0) return;
  // warpgroup 0: the two warpgroups' states merged, normalised, stored (with one split out and the LSE; with more
  // the split's partial and base-2 LSE for mla_merge_kernel)
  const bool nan_rows = keys.len_bad || poisoned;
  float f0[4], f1[4], inv[4], lse2[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int col = column_of(q, t4);
    float l0 = 0.0f, l1 = 0.0f;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      l0 += s_colmax[w * kNarrowHeads + col];
      l1 += s_colmax[(4 + w) * kNarrowHeads + col];
    }
    const float m1 = s_m1[col];
    const float mx = fmaxf(m[q], m1);
    const float base = mx == -INFINITY ? 0.0f : mx;
    f0[q] = exp2f(m[q] - base);
    f1[q] = exp2f(m1 - base);
    const float total = l0 * f0[q] + l1 * f1[q];
    const bool has_keys = total > 0.0f;
    inv[q] = nan_rows ? NAN : (has_keys ? kv_scale / total : 0.0f);
    lse2[q] = nan_rows ? NAN : (has_keys ? base + log2f(total) : -INFINITY);
  }
#pragma unroll
  for (int b = 0; b < 8; ++b) {
#pragma unroll
    for (int z = 0; z < 8; ++z) {
      const int q = 2 * (z >> 2) + (z & 1), head = column_of(q, t4);
      if (head >= a.num_heads) continue;
      const int value = value_of(b, z);
      const float v = (o[b][z] * f0[q] + handover[(8 * b + z) * 128 + wg_tid] * f1[q]) * inv[q];
      if (a.splits == 1) {
        a.out[token * a.out_token + head * a.out_head + value] = __float2bfloat16_rn(v);
      } else {
        const int64_t part = (static_cast<int64_t>(token) * a.num_heads + head) * a.splits + split;
        a.part_out[part * kR + value] = v;
      }
    }
  }
  if (warp == 0 && g == 0) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int head = column_of(q, t4);
      if (head >= a.num_heads) continue;
      if (a.splits == 1) {
        if (a.lse != nullptr) a.lse[static_cast<int64_t>(token) * a.num_heads + head] = lse2[q] * kLn2;
      } else {
        a.part_lse[(static_cast<int64_t>(token) * a.num_heads + head) * a.splits + split] = lse2[q];
      }
    }
  }
}

// kFp8: an fp8 e4m3 cache; kDs (with kFp8): DeepSeek's fp8 layout
template <bool kFp8, bool kDs>
__global__ void __launch_bounds__(kThreads, 1) mla_keys_kernel(const __grid_constant__ Args a) {
#if defined(ATTNOPS_MLA_SM90A)
  static_assert(kFp8 || !kDs, "DeepSeek's layout is staged as fp8 bytes");
  constexpr int kParts = kDs ? kDsParts : 1;  // P's copies (DeepSeek's layout: one for each 128's scales)
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = aligned_smem(smem_raw);
  const uint32_t s_q = smem_u32(smem);
  const uint32_t s_slots = s_q + kQBytes;  // slot w at s_slots + w * kTileBytes
  uint8_t* pt_bytes = smem + kQBytes + 2 * kTileBytes;  // warpgroup w's P at + w * kParts * kPtBytes
  // [warpgroup][warp][head]: the warps' maxima of a tile; at the end the warps' sums
  float* s_colmax = reinterpret_cast<float*>(pt_bytes + 2 * kParts * kPtBytes);
  const uint32_t s_bar = smem_u32(wg1_maxima(s_colmax) + kNarrowHeads);  // warpgroup w's slot: + 8 w
  // DeepSeek's layout: warpgroup w's tile's scales [64 keys][4], after the mbarriers
  float* my_scales = reinterpret_cast<float*>(reinterpret_cast<uint8_t*>(s_colmax) + kKeysTailBytes) +
                     (threadIdx.x >> 7) * kKeys * kDsParts;

  const int tid = threadIdx.x, lane = tid & 31;
  const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);  // (warp-uniform to the compiler: see mla_decode_kernel)
  const int warp = (tid >> 5) & 3, wg_tid = tid & 127;
  const int g = lane >> 2;
  const BlockKeys keys = block_keys(a, tid);
  if (empty_split(a, keys, tid)) return;
  const int token = keys.token, lo = keys.lo, hi = keys.hi, tiles = keys.tiles;
  const int* table_row = keys.table_row;
  const uint32_t slot = s_slots + wg * kTileBytes, bar = s_bar + 8 * wg;
  uint8_t* slot_bytes = smem + kQBytes + wg * kTileBytes;
  const uint32_t s_pt = smem_u32(pt_bytes + wg * kParts * kPtBytes);
  uint8_t* my_pt = pt_bytes + wg * kParts * kPtBytes;
  float* my_colmax = s_colmax + wg * 4 * kNarrowHeads;
  const bool issuer = wg_tid == 0;

  if (tid == 0) {
    mbarrier_init(s_bar);
    mbarrier_init(s_bar + 8);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  bool saw_bad = false;
  if (issuer && wg < tiles) {  // (the first tile of each warpgroup, before Q: both copies in flight at once)
    int pages[kMaxBoxes];
    box_pages(a, table_row, lo + wg * kKeys, hi, min(a.page_size, kKeys), pages, saw_bad);
    copy_tile<kFp8, kDs>(a, pages, lo + wg * kKeys, slot, bar);
  }
  const float kv_scale = kFp8 && !kDs ? *a.kv_scale : 1.0f;
  const float qk_scale_log2 = a.qk_scale_log2 * kv_scale;
  // Q [16 x 576]: q_nope's 512 values then q_pe's 64 a row (zeros past num_heads), K-major in 64-value chunks
  for (int i = tid; i < kNarrowHeads * kPieces; i += kThreads) {
    const int row = i / kPieces, piece = i % kPieces;
    const bool valid = row < a.num_heads;
    const __nv_bfloat16* nope = a.q_nope + token * a.q_nope_token + (valid ? row : 0) * a.q_nope_head;
    const __nv_bfloat16* pe = a.q_pe + token * a.q_pe_token + (valid ? row : 0) * a.q_pe_head;
    const uint32_t dst = s_q + (piece >> 3) * kQChunkBytes + row * 128 + (((piece & 7) ^ (row & 7)) << 4);
    cp_async_16(dst, piece < kR / 8 ? nope + piece * 8 : pe + (piece - kR / 8) * 8, valid);
  }
  cp_async_commit();
  cp_async_wait<0>();
  fence_proxy_async();
  __syncthreads();

  float o[8][8];  // O^T row block b (latent values 64 b ..): o[b][4 j + c] as column_of's layout
#pragma unroll
  for (int b = 0; b < 8; ++b)
#pragma unroll
    for (int z = 0; z < 8; ++z) o[b][z] = 0.0f;
  float m[4], l[4];  // this thread's four heads: running maximum (base 2; the warpgroup's), this thread's sums
#pragma unroll
  for (int q = 0; q < 4; ++q) m[q] = -INFINITY, l[q] = 0.0f;
  uint32_t phase = 0;

  for (int i = wg; i < tiles; i += 2) {
    const int start = lo + i * kKeys;
    const int visible = min(hi - start, kKeys);
    mbarrier_wait(bar, phase);
    phase ^= 1;
    int next_pages[kMaxBoxes];  // (the issuer's: the slot's next tile, copied once this one is done)
    if (issuer && i + 2 < tiles) {
      box_pages(a, table_row, start + 2 * kKeys, hi, min(a.page_size, kKeys), next_pages, saw_bad);
      tma_prefetch<kDs ? kDsChunks : kChunks>(a, next_pages, start + 2 * kKeys);
    }
    if constexpr (kDs) {
      widen_ds_slot(slot_bytes, wg_tid, wg, my_scales);
    } else if constexpr (kFp8) {
      widen_slot(slot_bytes, wg_tid, wg);
    }
    if (visible < kKeys) {  // the value chunks' rows past the end zeroed (their scores are masked below)
      if constexpr (kFp8) warpgroup_sync(wg);  // (every row widened)
      zero_rows_past(slot_bytes, visible, wg_tid);
    }
    if (kFp8 || visible < kKeys) {
      fence_proxy_async();
      warpgroup_sync(wg);
    }
    // S^T = K Q^T (DeepSeek's layout: each 128 of the values into its own accumulator, the rotary part into s)
    float s[8], parts[kDs ? kDsParts : 1][8];
#pragma unroll
    for (int z = 0; z < 8; ++z) {
      s[z] = 0.0f;
#pragma unroll
      for (int b = 0; b < (kDs ? kDsParts : 1); ++b) parts[b][z] = 0.0f;
    }
    pin(s);
    if constexpr (kDs) {
#pragma unroll
      for (int b = 0; b < kDsParts; ++b) pin(parts[b]);
    }
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      const uint32_t k_offset = (kk >> 2) * kChunkBytes + (kk & 3) * 32;
      const uint32_t q_offset = (kk >> 2) * kQChunkBytes + (kk & 3) * 32;
      const uint64_t k_desc = descriptor(slot + k_offset, 16, 1024), q_desc = descriptor(s_q + q_offset, 16, 1024);
      if (kDs && kk < kR / 16) {
        wgmma_m64n16k16_ss<0>(parts[kDs ? kk / 8 : 0], k_desc, q_desc, kk % 8 > 0);
      } else {
        wgmma_m64n16k16_ss<0>(s, k_desc, q_desc, kk > (kDs ? kR / 16 : 0));
      }
    }
    wgmma_commit();
    wgmma_wait_all();
    pin(s);
    if constexpr (kDs) {
      // each key's four scales (0 past the split's end: those rows may hold anything, and P's copies multiply them)
#pragma unroll
      for (int b = 0; b < kDsParts; ++b) pin(parts[b]);
      const int row0 = 16 * warp + g;
      const float4 w0 = *reinterpret_cast<const float4*>(my_scales + row0 * kDsParts);
      const float4 w1 = *reinterpret_cast<const float4*>(my_scales + (row0 + 8) * kDsParts);
      const bool in0 = start + row0 < hi, in1 = start + row0 + 8 < hi;
      const float scale0[kDsParts] = {in0 ? w0.x : 0.0f, in0 ? w0.y : 0.0f, in0 ? w0.z : 0.0f, in0 ? w0.w : 0.0f};
      const float scale1[kDsParts] = {in1 ? w1.x : 0.0f, in1 ? w1.y : 0.0f, in1 ? w1.z : 0.0f, in1 ? w1.w : 0.0f};
#pragma unroll
      for (int z = 0; z < 8; ++z) {  // (z = 4 j + c: row 16 warp + g + 8 (c / 2))
        const float* scale = (z >> 1) & 1 ? scale1 : scale0;
#pragma unroll
        for (int b = 0; b < kDsParts; ++b) s[z] += scale[b] * parts[b][z];
      }
      keys_softmax<__nv_bfloat16, kParts>(s, start, hi, qk_scale_log2, m, l, o, my_colmax, my_pt, wg, scale0, scale1);
    } else {
      keys_softmax<__nv_bfloat16>(s, start, hi, qk_scale_log2, m, l, o, my_colmax, my_pt, wg);
    }
    fence_proxy_async();
    warpgroup_sync(wg);  // P in place (and every read of the maxima done)
    // O^T += V^T P^T: V^T's row block b is the tile's value chunk b read M-major (DeepSeek's layout: with P's copy
    // for its 128, b / 2)
#pragma unroll
    for (int b = 0; b < 8; ++b) pin(o[b]);
    wgmma_fence();
#pragma unroll
    for (int b = 0; b < 8; ++b)
#pragma unroll
      for (int kk = 0; kk < kKeys / 16; ++kk)
        wgmma_m64n16k16_ss<1>(o[b], descriptor(slot + b * kChunkBytes + kk * 2048, kChunkBytes, 1024),
                              descriptor(s_pt + (kDs ? b / 2 : 0) * kPtBytes + kk * 32, 16, 1024), 1);
    wgmma_commit();
    wgmma_wait_all();
#pragma unroll
    for (int b = 0; b < 8; ++b) pin(o[b]);
    warpgroup_sync(wg);  // every warp's P V done: the slot and P free
    if (issuer && i + 2 < tiles) copy_tile<kFp8, kDs>(a, next_pages, start + 2 * kKeys, slot, bar);
  }

  // (also: both warpgroups' loops done, the slots free)
  finish_keys_block(a, keys, wg, saw_bad, kv_scale, o, m, l, s_colmax, reinterpret_cast<float*>(smem + kQBytes),
                    [&](int b, int z) { return 64 * b + 16 * warp + g + 8 * ((z >> 1) & 1); });
#endif
}

inline void (*keys_kernel(bool fp8, bool ds))(Args) {
  return ds ? mla_keys_kernel<true, true> : fp8 ? mla_keys_kernel<true, false> : mla_keys_kernel<false, false>;
}

}  // namespace attnops::mla_sm90
