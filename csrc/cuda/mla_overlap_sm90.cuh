// Latent attention (MLA) decode for sm_90a, the "overlap" form: the `cuda` backend's latent-attention kernel with
// ATTNOPS_CUDA_MLA_VARIANT=overlap (off unless asked for: not yet measured). mla_decode_sm90.cuh's TMA form runs a
// tile as Q K^T (warpgroup 0), the softmax (warpgroup 0, tensor cores idle), P V (both): its chain of work without
// copies is about 2.2 us a tile where the MMAs need 1.2 (docs/bench.md). Here warpgroup 0 issues the next tile's
// Q K^T before this tile's softmax, so that the tensor cores compute the next scores while its threads compute
// this tile's P:
//
//   warpgroup 0: wait S(i); issue S(i+1) = Q K(i+1)^T; softmax of S(i) -> P(i); | O_L += P(i) V(i)
//   warpgroup 1:                                                               | O_R += P(i) V(i)
//
// Warpgroup 0 holds two score tiles (S(i), S(i+1)) beside its half of O. Tiles are copied by the tensor memory
// accelerator two stages deep: tile i + 2 into tile i's stage once both warpgroups' P V of it is done, which is
// just before warpgroup 0 needs it (for S(i + 2)), so its pages are read and the tile prefetched to L2 at the
// start of tile i; rows past the sequence's end are zeroed after they land (they may hold anything, NaN included,
// and P V must not meet them). Bf16 caches, pages of 8 rows or more; splits, merge, bad indices and outputs as
// mla_decode_sm90.cuh.
#pragma once
#include "mla_decode_sm90.cuh"

namespace attnops::mla_sm90 {

constexpr int kBarScores = 1;  // a named barrier of warpgroup 0 (0 is __syncthreads')

// Warpgroup 0: the tile's value rows past `visible` zeroed (the split's last tile), then S = Q K^T issued
// (committed, not awaited)
__device__ __forceinline__ void zero_and_issue_scores(float (&s)[32], uint32_t s_q, uint32_t tile,
                                                      uint8_t* tile_bytes, int visible, int wg_tid) {
  if (visible < kKeys) {
    zero_rows_past(tile_bytes, visible, wg_tid);
    fence_proxy_async();
    asm volatile("bar.sync %0, 128;\n" ::"n"(kBarScores) : "memory");
  }
  issue_scores(s, s_q, tile);
}

template <int kUnused>
__global__ void __launch_bounds__(kThreads, 1) mla_overlap_kernel(const __grid_constant__ Args a) {
#if defined(ATTNOPS_MLA_SM90A)
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = aligned_smem(smem_raw);
  const uint32_t s_q = smem_u32(smem);
  const uint32_t s_k = s_q + kTileBytes;  // two stages of kTileBytes
  const uint32_t s_p = s_q + 3 * kTileBytes;
  uint8_t* p_bytes = smem + 3 * kTileBytes;
  float* s_alpha = reinterpret_cast<float*>(p_bytes + kPBytes);
  float* s_m = s_alpha + kRows;
  float* s_l = s_m + kRows;
  const uint32_t s_bar = smem_u32(s_l + kRows);  // stage s's mbarrier at + 8 s

  const int tid = threadIdx.x, warp = (tid >> 5) & 3, lane = tid & 31;
  const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);  // (warp-uniform to the compiler: see mla_decode_kernel)
  const int g = lane >> 2, t4 = lane & 3;
  const int row0 = warp * 16 + g, row1 = row0 + 8;
  const BlockKeys keys = block_keys(a, tid);
  if (empty_split(a, keys, tid)) return;
  const int lo = keys.lo, hi = keys.hi, tiles = keys.tiles;
  const int* table_row = keys.table_row;
  const float qk_scale_log2 = a.qk_scale_log2;
  constexpr int kIssuer = kThreads - 1;  // (warpgroup 1's: it waits least)

  if (tid == kIssuer) {
    mbarrier_init(s_bar);
    mbarrier_init(s_bar + 8);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  bool saw_bad = false;
  if (tid == kIssuer) {  // tiles 0 and 1, then Q
    for (int t = 0; t < 2 && t < tiles; ++t)
      saw_bad |= tma_chunks(a, table_row, lo + t * kKeys, hi, s_k + t * kTileBytes, s_bar + 8 * t, 0, kChunks - 1,
                            true);
  }
  load_q(a, s_q, keys, tid);  // (Q after the first tiles' copies)
  cp_async_commit();
  cp_async_wait<0>();
  fence_proxy_async();
  __syncthreads();

  float o[128];  // warpgroup wg's columns [256 wg, 256 wg + 256) of rows row0, row1
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.0f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;  // warpgroup 0: running max, this thread's sums
  uint32_t phases = 0;  // bit s: the parity stage s's mbarrier completes next
  const auto await_tile = [&](int i) {
    mbarrier_wait(s_bar + (i & 1) * 8, (phases >> (i & 1)) & 1);
    phases ^= 1u << (i & 1);
  };
  float s_even[32], s_odd[32];  // warpgroup 0: the scores of even and odd tiles
  if (wg == 0 && tiles > 0) {
    await_tile(0);
    zero_and_issue_scores(s_even, s_q, s_k, smem + kTileBytes, min(hi - lo, kKeys), tid & 127);
  }

  // one tile: i's scores in `cur` (issued), i + 1's issued into `next`
  const auto step = [&](int i, float (&cur)[32], float (&next)[32]) {
    const int start = lo + i * kKeys;
    const uint32_t tile = s_k + (i & 1) * kTileBytes;
    uint32_t p_frag[4][4];
    float alpha0, alpha1;
    int next_pages[kMaxBoxes];  // (the issuer's: tile i + 2's, read now, copied once tile i is done)
    if (tid == kIssuer && i + 2 < tiles) {
      box_pages(a, table_row, start + 2 * kKeys, hi, min(a.page_size, kKeys), next_pages, saw_bad);
      tma_prefetch(a, next_pages, start + 2 * kKeys);
    }
    if (wg == 0) {
      wgmma_wait<0>();  // S(i)
      pin(cur);
      if (i + 1 < tiles) {
        await_tile(i + 1);
        zero_and_issue_scores(next, s_q, s_k + ((i + 1) & 1) * kTileBytes,
                              smem + kTileBytes + ((i + 1) & 1) * kTileBytes, min(hi - start - kKeys, kKeys),
                              tid & 127);
      }
      softmax_tile(cur, start, hi, hi, t4, row0, row1, qk_scale_log2, m0, m1, l0, l1, p_frag, p_bytes, s_alpha, alpha0,
                   alpha1);
    } else {
      await_tile(i);  // (its P V reads the tile)
    }
    __syncthreads();  // P and the factors in shared memory; the tile's value rows zeroed where past the end
    if (wg == 0) {
      // S(i + 1) done (computed beside the softmax): O's rescale below must not meet a wgmma in flight (ptxas
      // serialises every wgmma of a stage whose accumulators other instructions write)
      wgmma_wait<0>();
      pin(next);
    } else {
      alpha0 = s_alpha[row0];
      alpha1 = s_alpha[row1];
    }
    scale_rows(o, alpha0, alpha1);
    pin(o);
    wgmma_fence();
    const uint32_t v_cols = tile + wg * 4 * kChunkBytes;
    if (wg == 0) {
      pv_rs(o, p_frag, v_cols);
    } else {
      pv_ss(o, s_p, v_cols);
    }
    wgmma_commit();
    wgmma_wait<0>();
    pin(o);
    __syncthreads();  // both P V of the tile done: its stage and P free
    if (tid == kIssuer && i + 2 < tiles) tma_boxes(a, next_pages, start + 2 * kKeys, tile, s_bar + (i & 1) * 8, 0,
                                                   kChunks - 1, true);
  };
  for (int i = 0; i < tiles; i += 2) {
    step(i, s_even, s_odd);
    if (i + 1 < tiles) step(i + 1, s_odd, s_even);
  }

  finish_rows(a, o, saw_bad, keys, tid, wg, t4, row0, row1, m0, m1, l0, l1, s_m, s_l, 1.0f);
#endif
}

inline void (*overlap_kernel())(Args) { return mla_overlap_kernel<0>; }

}  // namespace attnops::mla_sm90
