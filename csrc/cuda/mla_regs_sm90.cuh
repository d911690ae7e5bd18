// Latent attention (MLA) decode for sm_90a on an fp8 e4m3 cache at most 16 heads, the keys as the MMAs' M and the
// cache's bytes widened in registers: the `cuda` backend's latent-attention kernel with
// ATTNOPS_CUDA_MLA_VARIANT=regs (off unless asked for: this form not yet measured on the H200).
//
// Why: the keys form (mla_keys_sm90.cuh) widens a tile's fp8 bytes in shared memory to the bf16 tile its MMAs read,
// so a tile costs shared memory 36 KB read, 72 KB written and 136 KB read again by the MMAs, and its slot holds
// the bf16 tile until P V is done: one tile in flight a warpgroup. Its fp8 decode is no faster than bf16
// (docs/bench.md). Here the MMAs take the keys (and values) from registers (wgmma's A operand), each thread
// widening the bytes it loads, so shared memory holds only the fp8 bytes, read once for the scores and once for
// P V (68 KB a tile), and a warpgroup keeps two tiles in flight.
//   S^T [64 keys x 16] = K [64 x 576] Q^T        (m64n16k16 x 36, K from registers, Q in shared memory)
//   O^T [512 x 16]    += V^T [512 x 64] P^T      (m64n16k16 x 8 row blocks x 4, V^T from registers)
// MMAs in f16: every e4m3 value is an f16 value (cvt.rn.f16x2.e4m3x2, exact, NaN kept), Q is scaled by a power of
// two into f16's range (its largest finite magnitude to [2^14, 2^15): no overflow, and a value loses bits only
// where it is below 2^-31 of the largest), the scale undone on the scores; P in f16 (finer than bf16 in [0, 1]).
//
// The products' inner dimensions are permuted where that lets a thread load 16 contiguous bytes and use all of
// them (a sum does not depend on the order of its terms):
// - S: thread (warp w, lane 4 g + t4) holds keys 16 w + g and + 8; for k-step s of column chunk c its A fragment's
//   columns 2 t4 + h and 2 t4 + 8 + h are the row's values 64 c + 16 t4 + 4 s + h and + 2 + h, so one 16-byte
//   load of a row's chunk serves its four k-steps. Q is staged in shared memory in the same order (stage_q).
// - P V: the M rows (values) are permuted so that thread (w, g) holds the 16 values 16 (8 w + g) .. + 15 of each
//   key (row block b's rows g and g + 8 are values 16 (8 w + g) + 2 b and + 1): one 16-byte load a key; its four
//   keys of a k-step (16 s + 2 t4 + {0, 1, 8, 9}) paired by byte permutes into A's key pairs.
// The tile's fp8 bytes land by the tensor memory accelerator in [9 chunks][64 rows][64 bytes] with the 64-byte
// swizzle (row r's 16-byte piece u at u ^ ((r >> 1) & 3)): with it, and the two row parities of a quarter-warp
// reading their keys in opposite orders, every 16-byte load of the scores and of P V meets 8 bank groups.
//
// A block: one token, one split of its keys, 384 threads = two warpgroups that take the split's tiles in turn
// (warpgroup w the tiles w, w + 2, ...), each with its own two stages, running maxima, sums and O^T, merged at the
// end as in the keys form (finish_keys_block), and a producer warpgroup (its registers given to the other two by
// setmaxnreg) whose first warp reads each tile's pages from the block table, prefetches the tile to L2 and, once
// the warpgroup has loaded the bytes of the stage's tile before (the stage's empty barrier), copies it in (its full
// barrier). So no table read and no copy's issue sits on the warpgroups' chain (their MMAs wait for all four of
// their warps). The scores' 36 MMAs go to four accumulators (k-step s % 4), summed after: four chains
// of 9, not one of 36. Rows past the sequence's end: their scores masked, their values zeroed in registers. Pages of
// 8 rows or more; splits, merge, bad indices and outputs as mla_decode_sm90.cuh.
#pragma once
#include "mla_keys_sm90.cuh"

namespace attnops::mla_sm90 {

constexpr int kRegsTileBytes = kChunks * kFp8ChunkBytes;  // a tile's fp8 bytes (36 KB)
constexpr int kRegsStages = 2;                            // stages a warpgroup
constexpr int kRegsThreads = kThreads + 128;              // the two warpgroups and the producer's
// setmaxnreg's counts a thread. A warp's setmaxnreg.inc takes registers only from those the block's other warps gave
// back by setmaxnreg.dec, and waits until enough are there: the block holds what it was launched with (kRegsThreads
// x the registers ptxas gives each thread under __launch_bounds__(kRegsThreads, 1): 65536 / 384 rounded down to 8,
// 168), so asking for more than that leaves a warpgroup waiting forever (48 and 232 asked for 65536).
// The producer's path needs about 48 (at 40 ptxas spills), and the computing warpgroups' fits 216 without a spill.
constexpr int kLaunchRegisters = 65536 / kRegsThreads / 8 * 8;
constexpr int kProducerRegisters = 56, kConsumerRegisters = 216;
static_assert(128 * kProducerRegisters + 2 * 128 * kConsumerRegisters <= kRegsThreads * kLaunchRegisters,
              "setmaxnreg may hand out only the registers the block was launched with");
constexpr int kScoreChains = 4;                           // accumulators of the scores
constexpr int kRegsSmemBytes = kQBytes + 2 * kRegsStages * kRegsTileBytes + 2 * kPtBytes +
                               2 * 4 * kNarrowHeads * 4 + kNarrowHeads * 4 + 2 * 2 * kRegsStages * 8 + 1024;
static_assert(kRegsSmemBytes <= 227 * 1024, "one block must fit an sm_90 SM's 227 KB of shared memory");
static_assert(kKeysOBytes <= 2 * kRegsStages * kRegsTileBytes, "the hand-over uses the stages' memory");
constexpr int kQShiftTop = 15;  // Q's largest finite magnitude scaled below 2^15 (f16's largest is 65504)

// D (+)= A B: A [64 x 16] f16 from registers (each warp's 16 rows as mma.m16n8k16's A fragments), B [16 x 16] f16
// K-major in shared memory; D fp32 [64 x 16]
__device__ __forceinline__ void wgmma_m64n16k16_rs_f16(float (&d)[8], const uint32_t (&a)[4], uint64_t desc_b,
                                                       int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, "
      "p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}

// Two e4m3 values (the low and high byte of `pair`'s low 16 bits) as an f16 pair (low, high), exactly
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t pair) {
  uint32_t out;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(out) : "h"(static_cast<uint16_t>(pair & 0xffff)));
  return out;
}

__device__ __forceinline__ uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t selector) {
  uint32_t out;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(out) : "r"(x), "r"(y), "r"(selector));
  return out;
}

__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}
__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}
__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// Byte offset of 16-byte piece `piece` (0 .. 3) of row `row` in a 64-byte-swizzled chunk of a staged tile
__device__ __forceinline__ uint32_t swizzled64(int row, int piece) {
  return row * 64 + ((piece ^ ((row >> 1) & 3)) << 4);
}

// Q [16 x 576] into shared memory as f16, K-major in 64-value column chunks (128-byte swizzle), column j of k-step
// s of chunk c holding value 64 c + 16 t4 + 4 s + 2 hi + h (j = 2 t4 + h + 8 hi: the keys' fragments' order),
// scaled by 2^shift (returned) so that its largest finite magnitude lies in [2^14, 2^15) (shift 0 where Q holds
// nothing else but zeros). Rows past num_heads are zeros. The two warpgroups' threads (kThreads); a __syncthreads
// inside (the producer's warpgroup meets it in its own path).
// Item (head, c, s) of a thread: the 16 values of a k-step, read as four runs of 4 (8 bytes each), kept in registers
// between the block's maximum and the stores.
constexpr int kQItems = kNarrowHeads * kChunks * 4;
constexpr int kQItemsAThread = (kQItems + kThreads - 1) / kThreads;
__device__ __forceinline__ int stage_q(const Args& a, int token, uint8_t* q_smem, float* scratch, int tid) {
  uint2 runs[kQItemsAThread][4];
  float amax = 0.0f;
#pragma unroll
  for (int n = 0; n < kQItemsAThread; ++n) {
    const int item = tid + n * kThreads;
    const int head = item / (kChunks * 4), c = (item / 4) % kChunks, s = item % 4;
    const bool valid = item < kQItems && head < a.num_heads;
    const int row = valid ? head : 0;  // (no address past the heads, even one not read)
#pragma unroll
    for (int t4 = 0; t4 < 4; ++t4) {
      const int column = 64 * c + 16 * t4 + 4 * s;  // (4 values: 8 bytes, aligned)
      const __nv_bfloat16* src = column < kR ? a.q_nope + token * a.q_nope_token + row * a.q_nope_head + column
                                             : a.q_pe + token * a.q_pe_token + row * a.q_pe_head + (column - kR);
      runs[n][t4] = valid ? *reinterpret_cast<const uint2*>(src) : make_uint2(0, 0);
      const uint32_t halves[2] = {runs[n][t4].x, runs[n][t4].y};
#pragma unroll
      for (int w = 0; w < 2; ++w) {
        const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&halves[w]));
        if (fabsf(f.x) < INFINITY) amax = fmaxf(amax, fabsf(f.x));  // (NaN and Inf pass unscaled)
        if (fabsf(f.y) < INFINITY) amax = fmaxf(amax, fabsf(f.y));
      }
    }
  }
#pragma unroll
  for (int mask = 16; mask >= 1; mask >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, mask));
  if ((tid & 31) == 0) scratch[tid >> 5] = amax;
  __syncthreads();
  amax = scratch[0];
#pragma unroll
  for (int w = 1; w < kThreads / 32; ++w) amax = fmaxf(amax, scratch[w]);
  int exponent = 0;
  if (amax > 0.0f) frexpf(amax, &exponent);  // amax in [2^(exponent - 1), 2^exponent)
  const int shift = amax > 0.0f ? kQShiftTop - exponent : 0;
#pragma unroll
  for (int n = 0; n < kQItemsAThread; ++n) {
    const int item = tid + n * kThreads;
    if (item >= kQItems) continue;
    const int head = item / (kChunks * 4), c = (item / 4) % kChunks, s = item % 4;
    // run t4's values (16 t4 + 4 s + {0, 1, 2, 3}) are columns 2 t4, 2 t4 + 1, 2 t4 + 8, 2 t4 + 9 of the k-step
    uint16_t column[16];
#pragma unroll
    for (int t4 = 0; t4 < 4; ++t4) {
      const uint32_t halves[2] = {runs[n][t4].x, runs[n][t4].y};
#pragma unroll
      for (int w = 0; w < 2; ++w) {
        const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&halves[w]));
        const __half2 h = __floats2half2_rn(ldexpf(f.x, shift), ldexpf(f.y, shift));
        const uint32_t bits = *reinterpret_cast<const uint32_t*>(&h);
        column[2 * t4 + 8 * w] = static_cast<uint16_t>(bits & 0xffff);
        column[2 * t4 + 8 * w + 1] = static_cast<uint16_t>(bits >> 16);
      }
    }
    // the k-step's 16 columns: 16-byte pieces 2 s and 2 s + 1 of the head's line in chunk c
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      uint32_t packed[4];
#pragma unroll
      for (int k = 0; k < 4; ++k)
        packed[k] = column[8 * half + 2 * k] | (static_cast<uint32_t>(column[8 * half + 2 * k + 1]) << 16);
      const int piece = 2 * s + half;
      *reinterpret_cast<uint4*>(q_smem + c * kQChunkBytes + head * 128 + ((piece ^ (head & 7)) << 4)) =
          make_uint4(packed[0], packed[1], packed[2], packed[3]);
    }
  }
  return shift;
}

template <int kCount>
__device__ __forceinline__ void pin_words(uint32_t (&r)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// The producer warp: tiles [first, end) of the split, in order, each into its warpgroup's stage: its pages read
// and, where the stage holds an earlier tile, the tile prefetched to L2 and the stage's empty barrier awaited (the
// warpgroup has loaded that tile's bytes), then copied in (its full barrier) by lane 0. The whole warp runs the loop
// (one control flow); returns whether a visible key's page is outside the cache.
__device__ __forceinline__ bool produce_tiles(const Args& a, const int* table_row, int lo, int hi, int first, int end,
                                              uint32_t s_stages, uint32_t full_bars, uint32_t empty_bars, int lane) {
  bool bad = false;
  for (int i = first; i < end; ++i) {
    const int w = i & 1, k = i >> 1, index = kRegsStages * w + k % kRegsStages;
    const int start = lo + i * kKeys;
    int pages[kMaxBoxes];
    box_pages(a, table_row, start, hi, min(a.page_size, kKeys), pages, bad);
    if (k >= kRegsStages) {
      if (lane == 0) tma_prefetch(a, pages, start);
      mbarrier_wait(empty_bars + 8 * index, (k / kRegsStages - 1) & 1);
    }
    if (lane == 0) tma_fp8_boxes(a, pages, start, s_stages + index * kRegsTileBytes, full_bars + 8 * index);
  }
  return bad;
}

__global__ void __launch_bounds__(kRegsThreads, 1) mla_regs_kernel(const __grid_constant__ Args a) {
#if defined(ATTNOPS_MLA_SM90A)
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = aligned_smem(smem_raw);
  const uint32_t s_q = smem_u32(smem);
  const uint32_t s_stages = s_q + kQBytes;  // warpgroup w's stage k at s_stages + (kRegsStages w + k) * tile bytes
  uint8_t* pt_bytes = smem + kQBytes + 2 * kRegsStages * kRegsTileBytes;  // warpgroup w's P at + w * kPtBytes
  // [warpgroup][warp][head]: the warps' maxima of a tile; at the end the warps' sums
  float* s_colmax = reinterpret_cast<float*>(pt_bytes + 2 * kPtBytes);
  // warpgroup w's stage k: its full barrier at + 8 (kRegsStages w + k), its empty barrier 2 kRegsStages later
  const uint32_t full_bars = smem_u32(wg1_maxima(s_colmax) + kNarrowHeads);
  const uint32_t empty_bars = full_bars + 8 * 2 * kRegsStages;

  const int tid = threadIdx.x, lane = tid & 31;
  const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);  // 2: the producer's (warp-uniform: see mla_decode_kernel)
  const int warp = (tid >> 5) & 3, wg_tid = tid & 127;
  const int g = lane >> 2, t4 = lane & 3;
  const BlockKeys keys = block_keys(a, tid);
  if (empty_split(a, keys, tid)) return;
  const int token = keys.token, lo = keys.lo, hi = keys.hi, tiles = keys.tiles;

  if (tid == 0) {
#pragma unroll
    for (int b = 0; b < 4 * kRegsStages; ++b) mbarrier_init(full_bars + 8 * b);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (wg == 2) {  // the producer: the first tiles (one a stage) before Q is staged, the rest after; then it leaves
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegisters));
    const int first_tiles = min(tiles, 2 * kRegsStages);
    bool bad = false;
    if (warp == 0)
      bad = produce_tiles(a, keys.table_row, lo, hi, 0, first_tiles, s_stages, full_bars, empty_bars, lane);
    __syncthreads();  // (stage_q's)
    __syncthreads();  // (Q in place)
    if (warp == 0)
      bad |= produce_tiles(a, keys.table_row, lo, hi, first_tiles, tiles, s_stages, full_bars, empty_bars, lane);
    __syncthreads_or(bad);  // (finish_keys_block's two barriers)
    __syncthreads();
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegisters));
  const int shift = stage_q(a, token, smem, s_colmax, tid);
  fence_proxy_async();
  __syncthreads();  // (Q in place; the scratch of its maximum read by every thread before the maxima reuse it)
  const float kv_scale = *a.kv_scale;
  const float qk_scale_log2 = ldexpf(a.qk_scale_log2 * kv_scale, -shift);
  float o[8][8];  // O^T row block b: o[b][4 j + c] as column_of's layout, rows as the P V permutation says
#pragma unroll
  for (int b = 0; b < 8; ++b)
#pragma unroll
    for (int z = 0; z < 8; ++z) o[b][z] = 0.0f;
  float m[4], l[4];  // this thread's four heads: running maximum (base 2; the warpgroup's), this thread's sums
#pragma unroll
  for (int q = 0; q < 4; ++q) m[q] = -INFINITY, l[q] = 0.0f;
  // P V's loads: this thread's 16 values (chunk and piece of each key's row), and its keys' order (see above)
  const int value_chunk = 2 * warp + (g >> 2), value_piece = g & 3;
  const int parity = g & 1;
  const uint32_t lo_selector = parity ? 0x1504u : 0x5140u, hi_selector = parity ? 0x3726u : 0x7362u;
  const uint32_t s_pt = smem_u32(pt_bytes + (wg & 1) * kPtBytes);
  uint8_t* my_pt = pt_bytes + (wg & 1) * kPtBytes;
  float* my_colmax = s_colmax + (wg & 1) * 4 * kNarrowHeads;

  for (int k = 0, i = wg; i < tiles; ++k, i += 2) {
    const int start = lo + i * kKeys;
    const int visible = min(hi - start, kKeys);
    const int index = kRegsStages * wg + k % kRegsStages;
    const uint32_t stage = s_stages + index * kRegsTileBytes;
    mbarrier_wait(full_bars + 8 * index, (k / kRegsStages) & 1);
    // S^T = K Q^T: chunk c's 16 bytes of rows 16 warp + g and + 8, widened to four k-steps' A fragments; k-step st
    // of each chunk into accumulator st
    const int row0 = 16 * warp + g, row1 = row0 + 8;
    float chains[kScoreChains][8];
#pragma unroll
    for (int n = 0; n < kScoreChains; ++n)
#pragma unroll
      for (int z = 0; z < 8; ++z) chains[n][z] = 0.0f;
    uint32_t frag[2][16];
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const uint4 x = lds128(stage + c * kFp8ChunkBytes + swizzled64(row0, t4));
      const uint4 y = lds128(stage + c * kFp8ChunkBytes + swizzled64(row1, t4));
      if (c >= 2) {
        wgmma_wait<1>();  // (chunk c - 2's MMAs done: their fragments free)
        pin_words(frag[c & 1]);
      }
#pragma unroll
      for (int st = 0; st < 4; ++st) {
        frag[c & 1][4 * st + 0] = e4m3x2_to_f16x2(word(x, st));
        frag[c & 1][4 * st + 1] = e4m3x2_to_f16x2(word(y, st));
        frag[c & 1][4 * st + 2] = e4m3x2_to_f16x2(word(x, st) >> 16);
        frag[c & 1][4 * st + 3] = e4m3x2_to_f16x2(word(y, st) >> 16);
      }
#pragma unroll
      for (int n = 0; n < kScoreChains; ++n) pin(chains[n]);
      wgmma_fence();
#pragma unroll
      for (int st = 0; st < 4; ++st) {
        const uint32_t(&a4)[4] = *reinterpret_cast<const uint32_t(*)[4]>(&frag[c & 1][4 * st]);
        wgmma_m64n16k16_rs_f16(chains[st % kScoreChains], a4,
                               descriptor(s_q + c * kQChunkBytes + st * 32, 16, 1024), c > 0);
      }
      wgmma_commit();
    }
    wgmma_wait_all();
#pragma unroll
    for (int n = 0; n < kScoreChains; ++n) pin(chains[n]);
    pin_words(frag[0]);
    pin_words(frag[1]);
    float s[8];
#pragma unroll
    for (int z = 0; z < 8; ++z) {
      s[z] = chains[0][z];
#pragma unroll
      for (int n = 1; n < kScoreChains; ++n) s[z] += chains[n][z];
    }
    keys_softmax<__half>(s, start, hi, qk_scale_log2, m, l, o, my_colmax, my_pt, wg);
    fence_proxy_async();
    warpgroup_sync(wg);  // P in place (and every read of the maxima done)
    // O^T += V^T P^T, k-step st: keys 16 st + 2 t4 + {0, 1, 8, 9}, read in the order {0, 1, 8, 9} ^ parity, so that
    // a quarter-warp's two row parities meet different bank groups
    uint32_t vfrag[2][8][4];
#pragma unroll
    for (int st = 0; st < kKeys / 16; ++st) {
      uint4 v[4];
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        const int key = 16 * st + 2 * t4 + ((n & 1) ^ parity) + 8 * (n >> 1);
        v[n] = lds128(stage + value_chunk * kFp8ChunkBytes + swizzled64(key, value_piece));
        if (visible < kKeys && key >= visible) v[n] = make_uint4(0, 0, 0, 0);  // (may hold anything, NaN too)
      }
      if (st == kKeys / 16 - 1) {
        warpgroup_sync(wg);  // every thread's loads of the stage done: the producer may copy its next tile in
        if (wg_tid == 0) mbarrier_arrive(empty_bars + 8 * index);
      }
      if (st >= 2) {
        wgmma_wait<1>();
#pragma unroll
        for (int b = 0; b < 8; ++b) pin_words(vfrag[st & 1][b]);
      }
      // words u of keys (A, B) = (2 t4, 2 t4 + 1) (and + 8, + 9): [B1 A1 B0 A0] and [B3 A3 B2 A2], whose 16-bit
      // halves widen to (A, B) pairs of values 4 u .. 4 u + 3: row blocks 2 u (rows g, g + 8) and 2 u + 1
#pragma unroll
      for (int u = 0; u < 4; ++u) {
#pragma unroll
        for (int pair = 0; pair < 2; ++pair) {
          const uint32_t w01 = byte_perm(word(v[2 * pair], u), word(v[2 * pair + 1], u), lo_selector);
          const uint32_t w23 = byte_perm(word(v[2 * pair], u), word(v[2 * pair + 1], u), hi_selector);
          vfrag[st & 1][2 * u][2 * pair] = e4m3x2_to_f16x2(w01);
          vfrag[st & 1][2 * u][2 * pair + 1] = e4m3x2_to_f16x2(w01 >> 16);
          vfrag[st & 1][2 * u + 1][2 * pair] = e4m3x2_to_f16x2(w23);
          vfrag[st & 1][2 * u + 1][2 * pair + 1] = e4m3x2_to_f16x2(w23 >> 16);
        }
      }
#pragma unroll
      for (int b = 0; b < 8; ++b) pin(o[b]);
      wgmma_fence();
#pragma unroll
      for (int b = 0; b < 8; ++b) {
        // (A's registers: a0 rows g keys 2 t4, a1 rows g + 8, a2 rows g keys 2 t4 + 8, a3 rows g + 8)
        const uint32_t a4[4] = {vfrag[st & 1][b][0], vfrag[st & 1][b][1], vfrag[st & 1][b][2], vfrag[st & 1][b][3]};
        wgmma_m64n16k16_rs_f16(o[b], a4, descriptor(s_pt + st * 32, 16, 1024), 1);
      }
      wgmma_commit();
    }
    wgmma_wait_all();
#pragma unroll
    for (int b = 0; b < 8; ++b) pin(o[b]);
  }

  // (both warpgroups' loops done, the stages free; the producer's bad pages come through its own call)
  finish_keys_block(a, keys, wg, false, kv_scale, o, m, l, s_colmax, reinterpret_cast<float*>(smem + kQBytes),
                    [&](int b, int z) { return 16 * (8 * warp + g) + 2 * b + ((z >> 1) & 1); });
#endif
}

inline void (*regs_kernel())(Args) { return mla_regs_kernel; }

}  // namespace attnops::mla_sm90
