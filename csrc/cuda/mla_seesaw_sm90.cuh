// Latent attention (MLA) decode for sm_90a, the "seesaw" schedule: the `cuda` backend's latent-attention kernel
// with ATTNOPS_CUDA_MLA_VARIANT=seesaw (off unless asked for: not yet measured). mla_decode_sm90.cuh's kernel has
// warpgroup 0 compute a tile's scores and softmax while warpgroup 1 waits and the tensor cores idle through the
// softmax (docs/bench.md: its chain without copies is 2.15 us a tile where the MMAs need 1.2). Here a step takes
// two tiles, and each warpgroup computes the scores and the softmax of one of them, so that one warpgroup's MMAs
// run while the other's softmax does (the schedule FlashMLA's authors describe, written anew here):
//
//   warpgroup 0 (O[:, :256])                        warpgroup 1 (O[:, 256:])
//   S0 = Q K0^T                                     S1 = Q K1^T
//   m0 = max(m, rowmax S0), to warpgroup 1   ---->  m1 = max(m0, rowmax S1)
//   P0 = exp2(S0 - m0); O_L = O_L c0 + P0 V0_L      P1 = exp2(S1 - m1), c1 = exp2(m0 - m1), to warpgroup 0
//   P0 *= c1, to warpgroup 1                 <----  O_R = O_R c0 c1 + P1 V1_R
//   O_L = O_L c1 + P1 V1_L                   ---->  O_R += P0 V0_R
//
// (c0 = exp2(m - m0): the factor of the step's first tile). The sums follow the same factors in each warpgroup and
// are added at the end. Exchanges go through shared memory behind named barriers (bar.arrive by the producer,
// bar.sync by the consumer), P as the A operand of the other warpgroup's P V.
//
// Copies: every tile by the tensor memory accelerator (one thread's boxes; the cache's tensor map as in the TMA
// path), each of the two tile slots in two groups of column chunks on their own mbarriers, each group copied again
// as soon as its last reader is done: a slot's own group (the rotary chunk 8 and the 256 columns its scores'
// warpgroup multiplies by P) right after that warpgroup's P V, the other group after the other warpgroup's. The
// scores read the own group first. Rows past the sequence's end are zeroed after they land (they may hold
// anything, NaN included, and P V must not meet them); pages past it are read as zeros (coordinates off the map).
//
// Shared memory: Q's first 512 values (q_pe's 64 sit in registers, the A operand of the rotary chunk's MMAs: a
// block holds two tiles and both P's only so), two tile slots, P0 and P1, row values, four mbarriers.
// Bf16 caches, pages of 8 rows or more; splits, merge, bad indices and outputs as mla_decode_sm90.cuh.
#pragma once
#include "mla_decode_sm90.cuh"

namespace attnops::mla_sm90 {

constexpr int kQNopeBytes = (kR / 64) * kChunkBytes;
constexpr int kSeesawSmemBytes = kQNopeBytes + 2 * kTileBytes + 2 * kPBytes + 6 * kRows * 4 + 4 * 8 + 1024;
static_assert(kSeesawSmemBytes <= 227 * 1024, "one block must fit an sm_90 SM's 227 KB of shared memory");
constexpr int kBarM0 = 1, kBarS1 = 2, kBarP0 = 3, kBarOwn = 4;  // named barriers (0 is __syncthreads')

__device__ __forceinline__ void named_arrive(int id) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "n"(kThreads) : "memory");
}
__device__ __forceinline__ void named_sync(int id, int threads = kThreads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// S (+)= A B^T: A [64 x 16] bf16 in registers (as wgmma_m64n256k16_rs's), B [64 x 16] K-major in shared memory
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b,
                                                   int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
      "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
      "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
      :
      "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
      "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
      "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
      "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}

// Slot s (0: even tiles, whose scores warpgroup 0 computes; 1: odd tiles, warpgroup 1's) holds its tile in two
// groups of column chunks: group 0, chunks 4 s .. 4 s + 3 and the rotary chunk 8 (read by warpgroup s alone);
// group 1, chunks 4 (1 - s) .. 4 (1 - s) + 3 (read by warpgroup s's scores and by the other warpgroup's P V)
__device__ __forceinline__ int group_chunks(int slot, int group) { return 4 * (slot ^ group); }

// One group of the tile of keys [start, start + 64) into slot `dst` by the tensor memory accelerator, awaited on
// `bar` (tma_chunks: a box past `end` reads page -1, zeros, and no table entry past the sequence's)
__device__ __forceinline__ bool tma_group(const Args& a, const int* table_row, int start, int end, uint32_t dst,
                                          uint32_t bar, int slot, int group) {
  return tma_chunks(a, table_row, start, end, dst, bar, group_chunks(slot, group), 4, group == 0);
}

// S = Q K^T of the tile in `tile` (slot s): the own group first (the rotary chunk from q_pe's registers, then the
// four chunks), then, once it has landed, the other group. Rows past `visible` (< 64: the split's last tile) are
// zeroed first in the 8 value chunks, by this warpgroup (their scores are masked whatever the rows hold).
__device__ __forceinline__ void tile_scores(float (&s)[32], uint32_t s_q, uint32_t tile, const uint32_t (&q_pe)[4][4],
                                            int slot, uint32_t bar0, uint32_t bar1, uint32_t& phases, int visible,
                                            uint8_t* tile_bytes, int wg_tid) {
  const uint32_t own = 2 * slot, other = 2 * slot + 1;
  mbarrier_wait(bar0, (phases >> own) & 1);
  phases ^= 1u << own;
  if (visible < kKeys) {  // (both groups in place, then the value chunks' rows past the end zeroed: P V's)
    mbarrier_wait(bar1, (phases >> other) & 1);
    zero_rows_past(tile_bytes, visible, wg_tid);
    fence_proxy_async();
    named_sync(kBarOwn + slot, 128);
  }
#pragma unroll
  for (int z = 0; z < 32; ++z) s[z] = 0.0f;
  pin(s);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
    wgmma_m64n64k16_rs(s, q_pe[kk], descriptor(tile + 8 * kChunkBytes + kk * 32, 16, 1024), 1);
  const int first = group_chunks(slot, 0);
#pragma unroll
  for (int c = 0; c < 4; ++c) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const uint32_t offset = (first + c) * kChunkBytes + kk * 32;
      wgmma_m64n64k16_ss(s, descriptor(s_q + offset, 16, 1024), descriptor(tile + offset, 16, 1024), 1);
    }
  }
  if (visible == kKeys) mbarrier_wait(bar1, (phases >> other) & 1);
  phases ^= 1u << other;
  const int second = group_chunks(slot, 1);
#pragma unroll
  for (int c = 0; c < 4; ++c) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const uint32_t offset = (second + c) * kChunkBytes + kk * 32;
      wgmma_m64n64k16_ss(s, descriptor(s_q + offset, 16, 1024), descriptor(tile + offset, 16, 1024), 1);
    }
  }
  wgmma_commit();
  wgmma_wait_all();
  pin(s);
}

// P = exp2(S - base) in place (fp32), its bf16 A fragments, and this thread's row sums
__device__ __forceinline__ void exponentiate(float (&s)[32], float base0, float base1, uint32_t (&p_frag)[4][4],
                                             float& sum0, float& sum1) {
  sum0 = sum1 = 0.0f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    s[4 * j] = exp2f(s[4 * j] - base0);
    s[4 * j + 1] = exp2f(s[4 * j + 1] - base0);
    s[4 * j + 2] = exp2f(s[4 * j + 2] - base1);
    s[4 * j + 3] = exp2f(s[4 * j + 3] - base1);
    sum0 += s[4 * j] + s[4 * j + 1];
    sum1 += s[4 * j + 2] + s[4 * j + 3];
    p_frag[j >> 1][(j & 1) * 2] = pack_bf16(s[4 * j], s[4 * j + 1]);
    p_frag[j >> 1][(j & 1) * 2 + 1] = pack_bf16(s[4 * j + 2], s[4 * j + 3]);
  }
}

// P (fp32 in registers, times `scale0` for row0 and `scale1` for row1) into shared memory as bf16 [64 x 64]
// K-major in the 128-byte swizzle: the A operand of the other warpgroup's P V
__device__ __forceinline__ void store_p(uint8_t* p_bytes, const float (&s)[32], float scale0, float scale1, int row0,
                                        int row1, int t4) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    *reinterpret_cast<uint32_t*>(p_bytes + row0 * 128 + ((j ^ (row0 & 7)) << 4) + t4 * 4) =
        pack_bf16(s[4 * j] * scale0, s[4 * j + 1] * scale0);
    *reinterpret_cast<uint32_t*>(p_bytes + row1 * 128 + ((j ^ (row1 & 7)) << 4) + t4 * 4) =
        pack_bf16(s[4 * j + 2] * scale1, s[4 * j + 3] * scale1);
  }
}

__device__ __forceinline__ float exp2_from(float m_old, float base) { return exp2f(m_old - base); }

template <int kUnused = 0>  // (a template: compiled where the host instantiates it)
__global__ void __launch_bounds__(kThreads, 1) mla_seesaw_kernel(const __grid_constant__ Args a) {
#if defined(ATTNOPS_MLA_SM90A)
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = aligned_smem(smem_raw);
  const uint32_t s_q = smem_u32(smem);
  const uint32_t s_slots = s_q + kQNopeBytes;  // slot s at s_slots + s * kTileBytes
  uint8_t* p0_bytes = smem + kQNopeBytes + 2 * kTileBytes;
  uint8_t* p1_bytes = p0_bytes + kPBytes;
  const uint32_t s_p0 = smem_u32(p0_bytes), s_p1 = smem_u32(p1_bytes);
  float* s_m0 = reinterpret_cast<float*>(p1_bytes + kPBytes);  // warpgroup 0 -> 1: the max after the even tile,
  float* s_c0 = s_m0 + kRows;                                  // and its factor c0
  float* s_m1 = s_c0 + kRows;                                  // warpgroup 1 -> 0: the max after the odd tile,
  float* s_c1 = s_m1 + kRows;                                  // and its factor c1
  float* s_l0 = s_c1 + kRows;                                  // the end: each warpgroup's sums
  float* s_l1 = s_l0 + kRows;
  const uint32_t s_bar = smem_u32(s_l1 + kRows);  // slot s, group g: s_bar + 8 (2 s + g)

  const int tid = threadIdx.x, warp = (tid >> 5) & 3, lane = tid & 31;
  const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);  // (warp-uniform for the compiler: mla_decode_sm90.cuh)
  const int wg_tid = tid & 127;
  const int g = lane >> 2, t4 = lane & 3;
  const int row0 = warp * 16 + g, row1 = row0 + 8;
  const BlockKeys keys = block_keys(a, tid);
  if (empty_split(a, keys, tid)) return;
  const int token = keys.token, head_block = keys.head_block;
  const int lo = keys.lo, hi = keys.hi, tiles = keys.tiles;
  const int* table_row = keys.table_row;
  const float qk_scale_log2 = a.qk_scale_log2;

  {  // Q's first 512 values into shared memory; q_pe's 64 into registers (the rotary MMAs' A fragments)
    const int row = tid >> 2, head = head_block * kRows + row;
    const bool valid = head < a.num_heads;
    const __nv_bfloat16* nope = a.q_nope + token * a.q_nope_token + (valid ? head : 0) * a.q_nope_head;
#pragma unroll
    for (int j = 0; j < kR / 8 / 4; ++j) {
      const int piece = (tid & 3) + 4 * j;
      cp_async_16(s_q + swizzled(row, piece), nope + piece * 8, valid);
    }
    cp_async_commit();
  }
  uint32_t q_pe[4][4];
  {
    const int head0 = head_block * kRows + row0, head1 = head_block * kRows + row1;
    const __nv_bfloat16* pe0 = a.q_pe + token * a.q_pe_token + head0 * a.q_pe_head;
    const __nv_bfloat16* pe1 = a.q_pe + token * a.q_pe_token + head1 * a.q_pe_head;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int col = 16 * kk + 8 * half + 2 * t4;
        q_pe[kk][2 * half] = head0 < a.num_heads ? *reinterpret_cast<const uint32_t*>(pe0 + col) : 0u;
        q_pe[kk][2 * half + 1] = head1 < a.num_heads ? *reinterpret_cast<const uint32_t*>(pe1 + col) : 0u;
      }
    }
  }
  if (tid == 0) {
#pragma unroll
    for (int b = 0; b < 4; ++b) mbarrier_init(s_bar + 8 * b);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  bool saw_bad = false;
  if (tid == 0) {  // the first two tiles, both groups
    for (int t = 0; t < 2 && t < tiles; ++t)
      for (int group = 0; group < 2; ++group)
        saw_bad |= tma_group(a, table_row, lo + t * kKeys, hi, s_slots + t * kTileBytes, s_bar + 8 * (2 * t + group),
                             t, group);
  }
  cp_async_wait<0>();
  fence_proxy_async();
  __syncthreads();  // Q in place

  float o[128];  // warpgroup wg's columns [256 wg, 256 wg + 256) of rows row0, row1
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.0f;
  float m0 = -INFINITY, m1 = -INFINITY;  // the running maxima of rows row0, row1 (both warpgroups keep them)
  float l0 = 0.0f, l1 = 0.0f;            // this thread's part of the rows' sums, in this warpgroup's factors
  uint32_t phases = 0;                   // bit 2 s + g: the parity slot s's group g completes next
  const uint32_t slot0 = s_slots, slot1 = s_slots + kTileBytes;
  const auto bar = [&](int slot, int group) { return s_bar + 8 * (2 * slot + group); };

  for (int pair = 0; 2 * pair < tiles; ++pair) {
    const int start0 = lo + 2 * pair * kKeys, start1 = start0 + kKeys;
    const bool has1 = start1 < hi;  // (uniform)
    float s[32];
    uint32_t p_frag[4][4];
    if (wg == 0) {
      tile_scores(s, s_q, slot0, q_pe, 0, bar(0, 0), bar(0, 1), phases, min(hi - start0, kKeys), smem + kQNopeBytes,
                  wg_tid);
      float max0, max1;
      masked_max(s, start0, hi, t4, qk_scale_log2, max0, max1);
      const float new0 = fmaxf(m0, max0), new1 = fmaxf(m1, max1);
      const float base0 = new0 == -INFINITY ? 0.0f : new0, base1 = new1 == -INFINITY ? 0.0f : new1;
      const float c0_0 = exp2_from(m0, base0), c0_1 = exp2_from(m1, base1);
      m0 = new0;
      m1 = new1;
      if (t4 == 0) {
        s_m0[row0] = new0;
        s_m0[row1] = new1;
        s_c0[row0] = c0_0;
        s_c0[row1] = c0_1;
      }
      named_arrive(kBarM0);
      float sum0, sum1;
      exponentiate(s, base0, base1, p_frag, sum0, sum1);
      l0 = l0 * c0_0 + sum0;
      l1 = l1 * c0_1 + sum1;
      scale_rows(o, c0_0, c0_1);
      pin(o);
      wgmma_fence();
      pv_rs(o, p_frag, slot0);  // O_L += P0 V0_L
      wgmma_commit();
      named_sync(kBarS1);  // c1 and P1 from warpgroup 1
      const float c1_0 = s_c1[row0], c1_1 = s_c1[row1];
      m0 = s_m1[row0];
      m1 = s_m1[row1];
      wgmma_wait_all();
      pin(o);
      store_p(p0_bytes, s, c1_0, c1_1, row0, row1, t4);  // P0 c1: warpgroup 1's A operand
      fence_proxy_async();
      named_arrive(kBarP0);
      // slot 0's own group read for the last time: the next even tile's
      if (wg_tid == 0 && start0 + 2 * kKeys < hi)
        saw_bad |= tma_group(a, table_row, start0 + 2 * kKeys, hi, slot0, bar(0, 0), 0, 0);
      l0 *= c1_0;
      l1 *= c1_1;
      scale_rows(o, c1_0, c1_1);
      if (has1) {
        pin(o);
        wgmma_fence();
        pv_ss(o, s_p1, slot1);  // O_L += P1 V1_L
        wgmma_commit();
        wgmma_wait_all();
        pin(o);
        // slot 1's group 1 read for the last time: the next odd tile's
        if (wg_tid == 0 && start1 + 2 * kKeys < hi)
          saw_bad |= tma_group(a, table_row, start1 + 2 * kKeys, hi, slot1, bar(1, 1), 1, 1);
      }
    } else {
      if (has1)
        tile_scores(s, s_q, slot1, q_pe, 1, bar(1, 0), bar(1, 1), phases, min(hi - start1, kKeys),
                    smem + kQNopeBytes + kTileBytes, wg_tid);
      named_sync(kBarM0);  // m0 and c0 from warpgroup 0
      const float n0_0 = s_m0[row0], n0_1 = s_m0[row1], c0_0 = s_c0[row0], c0_1 = s_c0[row1];
      float new0 = n0_0, new1 = n0_1, c1_0 = 1.0f, c1_1 = 1.0f, sum0 = 0.0f, sum1 = 0.0f;
      if (has1) {
        float max0, max1;
        masked_max(s, start1, hi, t4, qk_scale_log2, max0, max1);
        new0 = fmaxf(n0_0, max0);
        new1 = fmaxf(n0_1, max1);
        const float base0 = new0 == -INFINITY ? 0.0f : new0, base1 = new1 == -INFINITY ? 0.0f : new1;
        c1_0 = exp2_from(n0_0, base0);
        c1_1 = exp2_from(n0_1, base1);
        exponentiate(s, base0, base1, p_frag, sum0, sum1);
        store_p(p1_bytes, s, 1.0f, 1.0f, row0, row1, t4);  // P1: warpgroup 0's A operand
        fence_proxy_async();
      }
      if (t4 == 0) {
        s_m1[row0] = new0;
        s_m1[row1] = new1;
        s_c1[row0] = c1_0;
        s_c1[row1] = c1_1;
      }
      named_arrive(kBarS1);
      m0 = new0;
      m1 = new1;
      l0 = l0 * c0_0 * c1_0 + sum0;
      l1 = l1 * c0_1 * c1_1 + sum1;
      scale_rows(o, c0_0 * c1_0, c0_1 * c1_1);
      pin(o);
      wgmma_fence();
      if (has1) pv_rs(o, p_frag, slot1 + 4 * kChunkBytes);  // O_R += P1 V1_R
      wgmma_commit();
      named_sync(kBarP0);  // P0 c1 from warpgroup 0 (which is done with slot 0's own group)
      mbarrier_wait(bar(0, 1), (phases >> 1) & 1);  // (slot 0's group 1: warpgroup 0 saw it land; so does this one)
      phases ^= 1u << 1;
      pv_ss(o, s_p0, slot0 + 4 * kChunkBytes);  // O_R += P0 V0_R
      wgmma_commit();
      wgmma_wait<1>();  // P1 V1_R done: slot 1's own group read for the last time, the next odd tile's
      if (wg_tid == 0 && has1 && start1 + 2 * kKeys < hi)
        saw_bad |= tma_group(a, table_row, start1 + 2 * kKeys, hi, slot1, bar(1, 0), 1, 0);
      wgmma_wait_all();
      pin(o);
      // slot 0's group 1 read for the last time: the next even tile's
      if (wg_tid == 0 && start0 + 2 * kKeys < hi)
        saw_bad |= tma_group(a, table_row, start0 + 2 * kKeys, hi, slot0, bar(0, 1), 0, 1);
    }
  }

  const bool poisoned = __syncthreads_or(saw_bad) != 0;  // a visible key of this split in a bad page
  if (poisoned && tid == 0) atomicMin(a.errors + kErrBlockTable, sequence_of(a, token));
  const int bad_from = nan_from(a, keys, poisoned, tid, nullptr);  // (one token a block: no scratch needed)
#pragma unroll
  for (int mask = 1; mask <= 2; mask <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, mask);
    l1 += __shfl_xor_sync(0xffffffffu, l1, mask);
  }
  float* s_l_mine = wg == 0 ? s_l0 : s_l1;
  if (t4 == 0) {
    s_l_mine[row0] = l0;
    s_l_mine[row1] = l1;
    if (wg == 0) {
      s_m0[row0] = m0;
      s_m0[row1] = m1;
    }
  }
  __syncthreads();
  if (tid < kRows) s_l0[tid] += s_l1[tid];
  __syncthreads();
  store_rows(a, o, wg, t4, row0, row1, keys, s_m0, s_l0, bad_from, 1.0f);
#endif
}

// The kernel (a name for its instantiation: any file that includes this compiles it)
inline void (*seesaw_kernel())(Args) { return mla_seesaw_kernel<0>; }

}  // namespace attnops::mla_sm90
