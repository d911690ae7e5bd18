// Paged attention over a 4-bit KV cache (nvfp4, mxfp4) for decode and short query blocks (verify), in CUDA C++
// with the register layout chosen by hand: the `cuda` backend (attnops/backends/cuda.py) calls it through
// torch.ops.attnops.fp4_paged_attention_cuda. Triton's operand layouts for 4-bit values cost its loop nearly twice
// the instructions a key that this one takes (docs/bench.md has both counts and what they mean for time).
//
// Layout, per warp and 32 keys (4 warps a 128-key tile, each with its own softmax state, merged through shared
// memory at the end). The operands are swapped: S^T = K Q^T and O^T = V^T P^T by mma.m16n8k16 (fp16 in, fp32
// out), keys (QK) and output dims (PV) as M, the query rows (token, head) as N in blocks of 8 (kHB blocks).
// - K: head dims are QK's reduction axis, so their order inside the mma is free: lane (r = lane / 4, c = lane % 4)
//   loads D / 8 contiguous bytes of key 16 mb + r (+ 8) and decodes them into exactly its A fragments.
// - e2m1 -> fp16 through e4m3: the nibble's magnitude bits moved to an e4m3 byte's bits 4..2 and its sign to bit 7
//   is the e4m3 of value x 2^-6, exactly; shifts and lop3s make 8 such bytes of a word and cvt.rn.f16x2.e4m3x2
//   turns two into a half2; one packed multiply by the block scale follows. Every product is exact in fp16; the
//   2^6 goes into the score scale (K) and the output (V).
// - V: keys are PV's reduction axis; the output dims are permuted instead, so lane r loads D / 16 contiguous bytes
//   of each of its keys, and a byte permute puts two keys' nibbles of the same dims into one word for the decode.
//   P^T reaches PV's B operand by movmatrix.trans from S^T's accumulators.
// - mxfp4: block scales are powers of two of any exponent, beyond fp16's range: each key's largest block exponent
//   goes outside the mma (K: a power of two on the key's scores; V: added to the log2 weights of P V, which keep a
//   running max of their own, m_v: o = acc 2^(m_v - m) / l), the rest (2^(e - e_max) <= 1) into the values.
//
// Windows and soft cap as the other backends (a row at position p sees keys p - window_left .. p).
//
// Bad indices (docs/design.md): a sequence length outside [0, capacity] makes its rows NaN and reads nothing; a
// page index outside the cache is never read (clamped into it) and makes NaN the rows that see one of its keys;
// cu_seqlens_q that does not run non-decreasing from 0 to T makes every row NaN. Each is recorded in the error
// buffer (attnops/errors.py) with atomic min.
//
// ATTNOPS_CUDA_BOUNDS=0 builds the kernel without those checks, only to measure what they cost
// (benchmarks/cuda_bounds_ab.sh): such a build reads whatever a bad index names. Never ship it.
#ifndef ATTNOPS_CUDA_BOUNDS
#define ATTNOPS_CUDA_BOUNDS 1
#endif
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace attnops::fp4_cuda {

constexpr int kWarps = 4;
constexpr int kKeysPerWarp = 32;
constexpr int kTile = kWarps * kKeysPerWarp;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kFold = 64.0f;  // decoded values are value x 2^-6
// attnops/errors.py ARGUMENTS
constexpr int kErrBlockTable = 0, kErrSeqLens = 1, kErrCuSeqlensQ = 2;
constexpr bool kBounds = ATTNOPS_CUDA_BOUNDS != 0;

struct Args {
  const void* q;              // [T, Hq, D], bf16 or fp16 (q_bf16), strides q_token, q_head (elements), inner 1
  const uint8_t* k_cache;     // packed e2m1, [pages, page_size, Hkv, D / 2] by the byte strides below
  const uint8_t* v_cache;
  const uint8_t* k_scale;     // block scales (e4m3 or e8m0 bytes), [pages, page_size, Hkv, D / block]
  const uint8_t* v_scale;
  const int* block_table;     // [B, table_stride]
  const int* seq_lens;        // [B], the query tokens included
  const int* cu_seqlens_q;    // [B + 1], or null: decode (token b is sequence b's one query)
  void* out;                  // [T, Hq, D] in q's dtype, strides out_token, out_head (elements)
  float* lse;                 // [T, Hq] contiguous (natural log), or null
  float* part_out;            // [T, Hq, splits, D], normalized, with several splits (merge_kernel)
  float* part_lse;            // [T, Hq, splits], log2 units
  int* errors;                // the device's error buffer
  int batch, num_tokens, chunk, splits;  // chunk: keys a split, a multiple of kTile
  int num_q_heads, num_kv_heads, page_shift, table_stride, num_pages, capacity;
  long long q_token, q_head, out_token, out_head;
  long long cache_page_stride, cache_token_stride, cache_head_stride;  // bytes
  long long scale_page_stride, scale_token_stride, scale_head_stride;  // bytes
  float sm_scale;
  float soft_cap;             // 0: none
  int window_left;            // -1: none (a row at position p sees keys p - window_left .. p)
  bool q_bf16;
  bool skip_empty;            // a split with no key of its sequence only marks its partials empty (split_is_empty)
};

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 890
#define ATTNOPS_FP4_CUDA_ARCH_OK 1
#else
#define ATTNOPS_FP4_CUDA_ARCH_OK 0  // cvt.rn.f16x2.e4m3x2 is sm_89+; the host refuses older GPUs before launching
#endif

// Two e4m3 bytes (low byte first) -> half2.
__device__ __forceinline__ uint32_t e4m3x2_to_half2(uint16_t two) {
  uint32_t out = 0;
#if ATTNOPS_FP4_CUDA_ARCH_OK
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(out) : "h"(two));
#endif
  return out;
}

// A word's four e4m3 bytes -> two half2: (byte 0, byte 1) and (byte 2, byte 3). (The word is split inside the
// asm: the conversion then reads its high half in place, where a shift by 16 would come first in C++.)
__device__ __forceinline__ void e4m3x4_to_half2x2(uint32_t bytes, uint32_t& lo, uint32_t& hi) {
#if ATTNOPS_FP4_CUDA_ARCH_OK
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n cvt.rn.f16x2.e4m3x2 %1, h;\n}"
      : "=r"(lo), "=r"(hi)
      : "r"(bytes));
#else
  lo = hi = 0;
#endif
}

// e2m1 -> e4m3 by moving bits (value x 2^-6, exactly: 0.5 lands on the subnormal 2^-7). Nibbles 0, 2, 4, 6 of `w`
// (bits 8k) -> `even`'s bytes, nibbles 1, 3, 5, 7 (bits 8k + 4) -> `odd`'s.
__device__ __forceinline__ void e2m1x8_to_e4m3(uint32_t w, uint32_t& even, uint32_t& odd) {
  even = ((w & 0x07070707u) << 2) | ((w & 0x08080808u) << 4);
  odd = ((w >> 2) & 0x1C1C1C1Cu) | (w & 0x80808080u);
}

// K: one word's 8 nibbles (dims +0..+7) -> 4 half2 of value x 2^-6: (+0, +2), (+4, +6), (+1, +3), (+5, +7).
__device__ __forceinline__ void e2m1x8_to_half2x4(uint32_t w, uint32_t (&p)[4]) {
  uint32_t even, odd;
  e2m1x8_to_e4m3(w, even, odd);
  e4m3x4_to_half2x2(even, p[0], p[1]);
  e4m3x4_to_half2x2(odd, p[2], p[3]);
}

// V: two keys' words of the same 8 dims -> 8 half2 (key a, key b), [i] = dim +i, value x 2^-6. The keys' bytes
// are interleaved first, (a k, b k, a k+1, b k+1): each byte holds dims 2k, 2k + 1 of one key, so the decode's even
// and odd words come out as (a, b) pairs of dims 2k and 2k + 2 (even) and 2k + 1 and 2k + 3 (odd).
__device__ __forceinline__ void e2m1x8_pair_keys(uint32_t wa, uint32_t wb, uint32_t (&p)[8]) {
  uint32_t e, o;
  e2m1x8_to_e4m3(__byte_perm(wa, wb, 0x5140), e, o);  // dims 0..3
  e4m3x4_to_half2x2(e, p[0], p[2]);
  e4m3x4_to_half2x2(o, p[1], p[3]);
  e2m1x8_to_e4m3(__byte_perm(wa, wb, 0x7362), e, o);  // dims 4..7
  e4m3x4_to_half2x2(e, p[4], p[6]);
  e4m3x4_to_half2x2(o, p[5], p[7]);
}

// 2^x with results below 2^-126 flushed to 0: exp2f's range check (a compare and two predicated multiplies around
// each MUFU.EX2, for denormal results) buys nothing in a softmax whose weights become fp16 (smallest 2^-24).
// -inf gives 0 and NaN NaN, as exp2f.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t hmul2_u32(uint32_t a, uint32_t b) {
  __half2 r = __hmul2(*reinterpret_cast<__half2*>(&a), *reinterpret_cast<__half2*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}

// An 8x8 matrix of 16-bit values in the mma fragment layout (lane (g, c): row g, columns 2c, 2c + 1) transposed.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y = x;
#if ATTNOPS_FP4_CUDA_ARCH_OK
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
#endif
  return y;
}

__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if ATTNOPS_FP4_CUDA_ARCH_OK
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// The head dim a Q/K fragment element stands for: k-step s, quad lane c, element e of (kk = 2c, 2c + 1, 2c + 8,
// 2c + 9). K's lane decodes word t = s / 2 of its D / 8 bytes (dims D / 4 c + 8t + 0..7) into the half2 pairs
// (+0, +2), (+4, +6), (+1, +3), (+5, +7); k-step 2t takes pairs 0 and 2, 2t + 1 pairs 1 and 3.
template <int D>
__device__ __forceinline__ int qk_dim(int s, int c, int e) {
  const int offsets[4] = {0, 2, 1, 3};
  return D / 4 * c + 8 * (s >> 1) + 4 * (s & 1) + offsets[e];
}

// One warp's copy of one tile (its 32 keys). K and V are copied alike: lane (r, c) copies D / 8 bytes of key
// 8 nb + r (bytes D / 8 c ..; D = 256: two copies of 16), so one page lookup serves both; K lands lane-minor, which
// is what its lane reads back, V at v_slot, which makes conflict-free the V reads of D / 16 bytes of keys 2c (+1)
// by lanes r. A key's scale row (D / 16 bytes, mxfp4 D / 32) is one copy, by lane (key - base); mxfp4's 2-byte rows
// at D = 64 are under cp.async's 4-byte minimum: a plain load into a register one step ahead, stored before the
// step that reads it (kScaleInRegister).
template <int D, bool kMx>
struct alignas(16) WarpStage {
  static_assert(D == 64 || D == 128 || D == 256, "head dims 64, 128 and 256");
  using Chunk = std::conditional_t<D == 64, uint2, uint4>;
  static constexpr int kParts = D == 256 ? 2 : 1;       // copies of a key's D / 8 bytes
  static constexpr int kScaleBytes = kMx ? D / 32 : D / 16;  // a key's scale row
  static constexpr bool kScaleInRegister = kScaleBytes < 4;
  static constexpr int kScaleWords = kScaleInRegister ? 1 : kScaleBytes / 4;  // (a 2-byte row: the low half)
  Chunk k[4][kParts][32];  // [row block nb][part][lane]: key 8 nb + r, dims D / 4 c ..
  Chunk v[4][kParts][32];  // [row block nb][part][v_slot(r, c) ^ part]: the same bytes of V
  uint32_t ks[32][kScaleWords];  // [key - base]: the scale rows
  uint32_t vs[32][kScaleWords];
};
// Where lane (r, c)'s V copy of key 8 nb + r goes in row block nb: key pairs (2i, 2i + 1) share 128 bytes (D = 128),
// their 8 chunks XOR 2i; the 16 lanes of a V read (4 even or odd keys 2c + b, chunks r / 2) then meet 8 banks each.
__device__ __forceinline__ int v_slot(int key, int c) {
  return 8 * (key / 2) + ((4 * (key % 2) + c) ^ (2 * (key / 2)));
}
// The merge of a pass's 4 warp states (in the stages' memory): each warp's running max, sum, P V max (mxfp4) and
// O^T per query row, the first bad page each warp found, which rows are NaN.
template <int D>
struct MergeState {
  float m[kWarps][16], l[kWarps][16], mv[kWarps][16];
  float acc[kWarps][16][D + 4];
  int bad_first[kWarps];
  int row_bad[16];
};
template <int D, bool kMx>
union SharedMemory {
  WarpStage<D, kMx> stages[2][kWarps];
  MergeState<D> merge;
};

// The block's shared memory, as the kernel declares it (dynamic: D = 256 takes more than the 48 KB a static array
// may). The epilogue's steps take it from here rather than as a parameter: their offsets into it then fold into the
// addresses (through a pointer parameter, separate adds remain in the SASS).
template <int D, bool kMx>
__device__ __forceinline__ SharedMemory<D, kMx>& shared_memory() {
  extern __shared__ __align__(16) unsigned char smem_bytes[];
  return *reinterpret_cast<SharedMemory<D, kMx>*>(smem_bytes);
}

template <typename T>
__device__ __forceinline__ void cp_async(T* dst, const void* src, int src_bytes) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8 || sizeof(T) == 16, "cp.async copies 4, 8 or 16 bytes");
  const uint32_t d = (uint32_t)__cvta_generic_to_shared(dst);
  if constexpr (sizeof(T) == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(src_bytes));
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" ::"r"(d), "l"(src), "n"(sizeof(T)),
                 "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

// mxfp4: the largest of a word's 4 exponent bytes; 2^(e - 127) for an e8m0 byte (e = 0 taken as 1: a key whose
// every block is 2^-127 holds values of at most 6 x 2^-127); 2^k for k <= 0 (0 below 2^-126, fp16's range ends first)
__device__ __forceinline__ int byte_max4(uint32_t w) {
  const uint32_t m = __vmaxu2(w & 0x00FF00FFu, (w >> 8) & 0x00FF00FFu);
  return (int)max(m & 0xFFFFu, m >> 16);
}
// mxfp4: the largest exponent byte of a key's scale row (D / 32 bytes)
template <int kWords>
__device__ __forceinline__ int row_max(const uint32_t (&row)[kWords]) {
  int m = byte_max4(row[0]);
#pragma unroll
  for (int i = 1; i < kWords; ++i) m = max(m, byte_max4(row[i]));
  return m;
}
// byte i of a scale row
template <int kWords>
__device__ __forceinline__ int row_byte(const uint32_t (&row)[kWords], int i) {
  return (int)((row[i / 4] >> (8 * (i % 4))) & 0xFF);
}
__device__ __forceinline__ float e8m0_value(int e) { return __int_as_float(max(e, 1) << 23); }
__device__ __forceinline__ float pow2_down(int k) { return k < -126 ? 0.f : __int_as_float((127 + k) << 23); }

__device__ __forceinline__ float load_q(const Args& a, long long index) {
  return a.q_bf16 ? __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(a.q)[index])
                  : __half2float(reinterpret_cast<const __half*>(a.q)[index]);
}
__device__ __forceinline__ void store_out(const Args& a, long long index, float x) {
  if (a.q_bf16)
    reinterpret_cast<__nv_bfloat16*>(a.out)[index] = __float2bfloat16(x);
  else
    reinterpret_cast<__half*>(a.out)[index] = __float2half(x);
}

// cu_seqlens_q runs non-decreasing from 0 to num_tokens (every block checks it: B + 1 loads spread over its threads);
// with `record`, the first entry where it stops is recorded (attnops/errors.py: atomic min over the bad entries)
__device__ __forceinline__ bool cu_seqlens_ok(const Args& a, bool record) {
  int bad = 0;
  for (int i = threadIdx.x; i <= a.batch; i += blockDim.x) {
    const int v = a.cu_seqlens_q[i];
    if (v > a.num_tokens || (i == 0 && v != 0) || (i > 0 && v < a.cu_seqlens_q[i - 1]) ||
        (i == a.batch && v != a.num_tokens)) {
      bad = 1;
      if (record) atomicMin(a.errors + kErrCuSeqlensQ, i);
    }
  }
  return !__syncthreads_or(bad);
}

// ---- the kernel's steps ----
// The compiler simplifies each step on its own before inlining it into the kernel, so how a step's inputs arrive
// shows in the SASS. These forms give the SASS of the kernel written in one piece (cuobjdump, sm_90): scalars in
// small structs by reference (Lane, StepParams, BlockRows, KvCopies' members), shared memory from shared_memory(),
// the PV product inside attend_tile and the key loop in the kernel. Scalars by value, or those two as functions of
// their own, gave other instruction counts and registers.

// This thread's place: its warp, its lane, and the lane's quad row r = lane / 4 and column c = lane % 4 in the mma
// fragments.
struct Lane {
  int warp, lane, r, c;
};

// Every row of the block NaN, where cu_seqlens_q is bad (which rows are whose is undefined): the block writes the
// tokens b, b + B, ... of its heads (for this split) and reads nothing.
template <int D>
__device__ __forceinline__ void write_nan_rows(const Args& a, int kvh, int b, int split, int group) {
  for (int t = b; t < a.num_tokens; t += a.batch)
    for (int idx = threadIdx.x; idx < group * D; idx += blockDim.x) {
      const long long head = (long long)t * a.num_q_heads + kvh * group + idx / D;
      if (a.splits == 1) {
        store_out(a, t * a.out_token + (kvh * group + idx / D) * a.out_head + idx % D, NAN);
        if (a.lse != nullptr && idx % D == 0) a.lse[head] = NAN;
      } else {
        a.part_out[(head * a.splits + split) * D + idx % D] = NAN;
        if (idx % D == 0) a.part_lse[head * a.splits + split] = NAN;
      }
    }
}

// A sequence length outside [0, capacity]: no keys are defined for it
__device__ __forceinline__ bool length_bad(const Args& a, int n) { return kBounds && (n < 0 || n > a.capacity); }

// A byte's address: the page's offset as a 64-bit product (one IMAD.WIDE.U32 with the base), the rest 32-bit
__device__ __forceinline__ const uint8_t* byte_at(const uint8_t* head, int page, int page_stride, int rest) {
  return head + (uint64_t)(uint32_t)page * (uint32_t)page_stride + (uint32_t)rest;
}

// The copies of a pass's tiles from the block's KV head in the paged cache into the warps' stages. The pages of a
// warp's 32 keys at `base` are one a lane (fewer for pages of more than one key), for issue_tile's shuffles:
// load_pages reads the table entries a step ahead; check_pages, when the copies are issued (the load has landed by
// then), clamps them into the cache and flags a bad one (met_bad).
template <int D, int kPageShift, bool kMx>
struct KvCopies {
  using Stage = WarpStage<D, kMx>;
  const int* table;  // the sequence's block table row
  const uint8_t *k_head, *v_head, *ks_head, *vs_head;
  int cache_page, cache_token, scale_page, scale_token;  // byte strides
  int page_shift, page_mask, last_page;
  int kv_hi, lo_seen;  // keys copied: [lo_seen, kv_hi) (others are zero-filled)
  // (kScaleInRegister: the scale rows of the tile issued last, K and V, for the stage the next step reads)
  uint32_t scale_rows_next[2];

  // (the table index of this lane's page; -1: no page for this lane)
  __device__ __forceinline__ int page_entry(const Lane& ln, int base) const {
    return ln.lane <= ((kKeysPerWarp - 1) >> page_shift) && base < kv_hi
               ? min((base >> page_shift) + ln.lane, (kv_hi - 1) >> page_shift)
               : -1;
  }
  __device__ __forceinline__ int load_pages(const Lane& ln, int base) const {
    const int index = page_entry(ln, base);
    return index >= 0 ? table[index] : 0;
  }
  __device__ __forceinline__ int check_pages(int page, bool& met_bad) const {
    if constexpr (!kBounds) return page;
    // one unsigned min clamps a negative index too; a lane with no page has page 0 (bad only in a cache of no
    // pages, which reads no tile)
    const int clamped = (int)min((unsigned)page, (unsigned)last_page);
    met_bad |= clamped != page;
    return clamped;
  }

  // Issues the copies of this lane's bytes of the warp's 32 keys at `base` into stage `st` (cp.async, zero-filled
  // past the split: every address is inside the cache, no branch). A tile whose keys are all in range (kFull)
  // needs no clamp: key base + off sits in page off >> page_shift of the tile's at slot
  // ((base & page_mask) + off) & page_mask. kScaleInRegister: the scale rows go to scale_rows_next (K, V), for the
  // step that reads the stage to store.
  template <bool kFull>
  __device__ __forceinline__ void issue_tile(SharedMemory<D, kMx>& smem, int st, int base, int lane_page,
                                             const Lane& ln) {
    Stage& stage = smem.stages[st][ln.warp];
    const int first_page = base >> page_shift, base_slot = base & page_mask;
    // (a lambda, not a member function: as one, the D = 64 mxfp4 instantiations' SASS assigns the scale rows'
    // registers differently)
    auto locate = [&](int key, int& page, int& slot) {
      if (kFull) {
        const int off = key - base;
        page = __shfl_sync(0xffffffffu, lane_page, off >> page_shift);
        // base is a multiple of 32 (splits are whole tiles): with pages of at most 32 keys known at compile
        // time, a key's slot is a constant of the lane and the copy (its offsets hoist out of the loop)
        slot = kPageShift >= 0 && kPageShift <= 5 ? off & page_mask : (base_slot + off) & page_mask;
      } else {
        const int k = min(key, kv_hi - 1);
        page = __shfl_sync(0xffffffffu, lane_page, ((k >> page_shift) - first_page) & 31);
        slot = k & page_mask;
      }
    };
#pragma unroll
    for (int nb = 0; nb < 4; ++nb) {
      const int key = base + 8 * nb + ln.r;
      int page, slot;
      locate(key, page, slot);
      const int bytes = kFull || (key < kv_hi && key >= lo_seen) ? (int)sizeof(typename Stage::Chunk) : 0;
#pragma unroll
      for (int part = 0; part < Stage::kParts; ++part) {
        const int offset = slot * cache_token + D / 8 * ln.c + 16 * part;
        cp_async(&stage.k[nb][part][ln.lane], byte_at(k_head, page, cache_page, offset), bytes);
        cp_async(&stage.v[nb][part][v_slot(ln.r, ln.c) ^ part], byte_at(v_head, page, cache_page, offset), bytes);
      }
    }
    {  // the scale rows: this lane's key base + lane
      const int key = base + ln.lane;
      int page, slot;
      locate(key, page, slot);
      const bool copied = kFull || (key < kv_hi && key >= lo_seen);
      const uint8_t* ks_at = byte_at(ks_head, page, scale_page, slot * scale_token);
      const uint8_t* vs_at = byte_at(vs_head, page, scale_page, slot * scale_token);
      if constexpr (Stage::kScaleInRegister) {  // (zero where cp.async would zero-fill; nothing waits on the
        uint32_t k_row = 0u, v_row = 0u;       // loads before the next step stores them)
        if (copied) {
          k_row = __ldg(reinterpret_cast<const unsigned short*>(ks_at));
          v_row = __ldg(reinterpret_cast<const unsigned short*>(vs_at));
        }
        scale_rows_next[0] = k_row;
        scale_rows_next[1] = v_row;
      } else {
        const int bytes = copied ? 4 * Stage::kScaleWords : 0;
        cp_async(&stage.ks[ln.lane], ks_at, bytes);
        cp_async(&stage.vs[ln.lane], vs_at, bytes);
      }
    }
  }

  // issue_tile for the keys at `base` from their table entries as loaded (the branch is uniform across the warp)
  __device__ __forceinline__ void issue(SharedMemory<D, kMx>& smem, int st, int base, int raw_page, const Lane& ln,
                                        bool& met_bad) {
    const int lane_page = check_pages(raw_page, met_bad);
    if (base + kKeysPerWarp <= kv_hi)
      issue_tile<true>(smem, st, base, lane_page, ln);
    else
      issue_tile<false>(smem, st, base, lane_page, ln);
  }
};

// What each 32-key step reads besides its tile and the rows' state: the split's end kv_hi and the window's width
// w_eff (its masks), the score scale (log2 units, kFold in it) and the soft cap as 2 / soft_cap and
// soft_cap log2(e) (cap2 0: none).
struct StepParams {
  int kv_hi, w_eff;
  float qk_scale, cap2, cap_l2;
};

// The scores of the warp's 32 keys at `base`, S^T = K Q^T in 2 m-blocks of 16 keys (rows r: key 16 mb + r, r + 8:
// key 16 mb + 8 + r): K's nibbles decoded and scaled per block into the mma's A fragments, the scores in log2
// units, soft-capped, and -inf where the row does not see the key (kFull: every row sees every key).
template <int D, int kHB, bool kMx, bool kFull>
__device__ __forceinline__ void tile_scores(const WarpStage<D, kMx>& stage, int base,
                                            const uint32_t (&qb)[kHB][D / 16][2], const int (&last_key)[kHB][2],
                                            const Lane& ln, const StepParams& p, float (&st)[kHB][2][4]) {
  using Stage = WarpStage<D, kMx>;
  const int &r = ln.r, &c = ln.c;
#pragma unroll
  for (int mb = 0; mb < 2; ++mb) {
    // nvfp4: the lane's blocks (D / 64 c, and + 1 for D = 128) as a half2 of scales. mxfp4: the lane's block
    // D c / 128 (D = 256: and + 1; D = 64: lanes c hold half a block each) relative to the key's largest, and
    // that largest's power of two on the key's scores (kf)
    uint32_t sc_g, sc_h, sc_g2 = 0, sc_h2 = 0;  // (sc_*2: D = 256, the lane's blocks 2 and 3)
    float kf[2] = {p.qk_scale, p.qk_scale};
    if constexpr (kMx) {
      const auto& w_g = stage.ks[16 * mb + r];
      const auto& w_h = stage.ks[16 * mb + 8 + r];
      const int ref_g = row_max(w_g), ref_h = row_max(w_h), blk = D * c / 128;
      sc_g = pack_half2(pow2_down(row_byte(w_g, blk) - ref_g), 0.f);
      sc_h = pack_half2(pow2_down(row_byte(w_h, blk) - ref_h), 0.f);
      if constexpr (D == 256) {  // (words 4..7 of the lane's 8: its second block)
        sc_g2 = pack_half2(pow2_down(row_byte(w_g, blk + 1) - ref_g), 0.f);
        sc_h2 = pack_half2(pow2_down(row_byte(w_h, blk + 1) - ref_h), 0.f);
      }
      kf[0] = p.qk_scale * e8m0_value(ref_g), kf[1] = p.qk_scale * e8m0_value(ref_h);
    } else {
      // (the word of the key's row holding the lane's blocks D / 64 c ..)
      const int kshift = 8 * (D / 64 * c % 4), word = D / 64 * c / 4;
      const uint32_t w_g = stage.ks[16 * mb + r][word], w_h = stage.ks[16 * mb + 8 + r][word];
      sc_g = e4m3x2_to_half2((uint16_t)(w_g >> kshift));
      sc_h = e4m3x2_to_half2((uint16_t)(w_h >> kshift));
      if constexpr (D == 256) {
        sc_g2 = e4m3x2_to_half2((uint16_t)(w_g >> 16));
        sc_h2 = e4m3x2_to_half2((uint16_t)(w_h >> 16));
      }
    }
    uint32_t words_g[D / 32], words_h[D / 32];  // the lane's D / 4 dims, 8 a word
    constexpr int kPartWords = (int)sizeof(typename Stage::Chunk) / 4;
#pragma unroll
    for (int part = 0; part < Stage::kParts; ++part) {
      memcpy(words_g + kPartWords * part, &stage.k[2 * mb][part][ln.lane], sizeof(typename Stage::Chunk));
      memcpy(words_h + kPartWords * part, &stage.k[2 * mb + 1][part][ln.lane], sizeof(typename Stage::Chunk));
    }
    float cf[kHB][4];
#pragma unroll
    for (int hb = 0; hb < kHB; ++hb) cf[hb][0] = cf[hb][1] = cf[hb][2] = cf[hb][3] = 0.f;
#pragma unroll
    for (int t = 0; t < D / 32; ++t) {
      uint32_t pg[4], ph[4];  // qk_dim's pairs of word t of keys r and r + 8 (word t: the lane's block t / 2)
      e2m1x8_to_half2x4(words_g[t], pg);
      e2m1x8_to_half2x4(words_h[t], ph);
      // block t / 2: the low or high half of its pair (mxfp4: the low half, the lane's one block)
      const uint32_t sel = t / 2 % 2 == 0 || kMx ? 0x1010 : 0x3232;
      const uint32_t scl_g = __byte_perm(t / 2 < 2 ? sc_g : sc_g2, 0, sel);
      const uint32_t scl_h = __byte_perm(t / 2 < 2 ? sc_h : sc_h2, 0, sel);
#pragma unroll
      for (int i = 0; i < 4; ++i) pg[i] = hmul2_u32(pg[i], scl_g), ph[i] = hmul2_u32(ph[i], scl_h);
      const uint32_t a_even[4] = {pg[0], ph[0], pg[2], ph[2]};  // k-step 2t
      const uint32_t a_odd[4] = {pg[1], ph[1], pg[3], ph[3]};   // k-step 2t + 1
#pragma unroll
      for (int hb = 0; hb < kHB; ++hb) {
        mma_16816(cf[hb], a_even, qb[hb][2 * t][0], qb[hb][2 * t][1]);
        mma_16816(cf[hb], a_odd, qb[hb][2 * t + 1][0], qb[hb][2 * t + 1][1]);
      }
    }
#pragma unroll
    for (int hb = 0; hb < kHB; ++hb)
#pragma unroll
      for (int e = 0; e < 4; ++e) cf[hb][e] *= kf[e >> 1];
#ifndef ATTNOPS_SASS_NO_SOFT_CAP
    if (p.cap2 > 0.f) {  // (uniform) soft_cap x tanh(s / soft_cap) in log2 units, tanh through exp2 (as in Triton)
#pragma unroll
      for (int hb = 0; hb < kHB; ++hb)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          cf[hb][e] = p.cap_l2 * (1.f - __fdividef(2.f, exp2_ftz(cf[hb][e] * p.cap2) + 1.f));
    }
#endif
#pragma unroll
    for (int hb = 0; hb < kHB; ++hb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key_e = base + 16 * mb + r + 8 * (e >> 1), last = last_key[hb][e & 1];
        st[hb][mb][e] =
            kFull || (key_e < p.kv_hi && key_e <= last && key_e >= last - p.w_eff) ? cf[hb][e] : -INFINITY;
      }
  }
}

// The largest x of the 8 lanes with the same c
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 4));
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 8));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 16));
}

// Online softmax per query row 8 hb + 2c + j, over the keys of the lanes with the same c: the scores st (log2
// units) become the P V weights, the running max and sums move, acc_t is rescaled where a max moved. mxfp4: each
// key's V power of two joins its weight, and the weights keep a running max of their own (mv_t).
template <int D, int kHB, bool kMx>
__device__ __forceinline__ void online_softmax(const WarpStage<D, kMx>& stage, const Lane& ln,
                                               float (&st)[kHB][2][4], float (&acc_t)[kHB][D / 16][4],
                                               float (&m_t)[kHB][2], float (&l_t)[kHB][2], float (&mv_t)[kHB][2]) {
  // mxfp4: the log2 of each S^T row key's V power of two (rows r, r + 8 of m-block mb)
  float ev[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
  (void)ev;
  if constexpr (kMx) {
#pragma unroll
    for (int mb = 0; mb < 2; ++mb)
#pragma unroll
      for (int h = 0; h < 2; ++h) ev[mb][h] = (float)(row_max(stage.vs[16 * mb + 8 * h + ln.r]) - 127);
  }
  float alpha[kHB][2];  // acc's rescale: the P V weights' running max moved (nvfp4: the softmax's)
  bool moved = false;
#pragma unroll
  for (int hb = 0; hb < kHB; ++hb)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float mx =
          quad_max(fmaxf(fmaxf(st[hb][0][j], st[hb][0][j + 2]), fmaxf(st[hb][1][j], st[hb][1][j + 2])));
      const float m_new = fmaxf(m_t[hb][j], mx);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;
      const float alpha_l = exp2_ftz(m_t[hb][j] - m_use);
      float sum = 0.f;
      if constexpr (kMx) {
        const float mvx = quad_max(fmaxf(fmaxf(st[hb][0][j] + ev[0][0], st[hb][0][j + 2] + ev[0][1]),
                                         fmaxf(st[hb][1][j] + ev[1][0], st[hb][1][j + 2] + ev[1][1])));
        const float mv_new = fmaxf(mv_t[hb][j], mvx);
        const float mv_use = mv_new == -INFINITY ? 0.f : mv_new;
        alpha[hb][j] = exp2_ftz(mv_t[hb][j] - mv_use);
#pragma unroll
        for (int mb = 0; mb < 2; ++mb)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            float& x = st[hb][mb][j + 2 * h];
            sum += exp2_ftz(x - m_use);
            x = exp2_ftz(x + ev[mb][h] - mv_use);
          }
        mv_t[hb][j] = mv_new;
      } else {
        alpha[hb][j] = alpha_l;
#pragma unroll
        for (int mb = 0; mb < 2; ++mb) {
          st[hb][mb][j] = exp2_ftz(st[hb][mb][j] - m_use);
          st[hb][mb][j + 2] = exp2_ftz(st[hb][mb][j + 2] - m_use);
          sum += st[hb][mb][j] + st[hb][mb][j + 2];
        }
      }
      moved |= alpha[hb][j] != 1.f;
      l_t[hb][j] = l_t[hb][j] * alpha_l + sum;
      m_t[hb][j] = m_new;
    }
  // (the running max rarely moves after the first tiles: rescale only when it did somewhere in the warp)
  if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
    for (int hb = 0; hb < kHB; ++hb)
#pragma unroll
      for (int mb = 0; mb < D / 16; ++mb)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_t[hb][mb][e] *= alpha[hb][e & 1];
  }
}

// PV k-step ks (16 keys): this lane's V keys 2c, 2c + 1, 2c + 8, 2c + 9 of the 16 (kk = 0..3), as key - base, and
// where its D / 16 bytes of one are (dims D / 8 r ..): half r % 2 of the copy of chunk r / 2 (D = 256: part r % 2)
__device__ __forceinline__ int v_key(int ks, const Lane& ln, int kk) {
  return 16 * ks + 2 * ln.c + (kk & 1) + 8 * (kk >> 1);
}
template <int D, bool kMx>
__device__ __forceinline__ const uint8_t* v_bytes(const WarpStage<D, kMx>& stage, int ks, const Lane& ln, int kk) {
  const int nb = 2 * ks + (kk >> 1), slot = v_slot(2 * ln.c + (kk & 1), ln.r / 2);
  if constexpr (D == 256) return reinterpret_cast<const uint8_t*>(&stage.v[nb][ln.r % 2][slot ^ (ln.r % 2)]);
  return reinterpret_cast<const uint8_t*>(&stage.v[nb][0][slot]) + D / 16 * (ln.r % 2);
}

// One 32-key step of a warp (kFull: every row sees every key): the scores, the online softmax, then O^T += V^T P^T
// in 2 k-steps of 16 keys and D / 16 m-blocks of 16 dims. P^T reaches PV's B operand by movmatrix.trans from S^T's
// accumulators; V's nibbles are decoded two keys at a time. (PV stays in this function: as a function of its own,
// called after the other two, it changes the SASS of several instantiations.)
template <int D, int kHB, bool kMx, bool kFull>
__device__ __forceinline__ void attend_tile(const WarpStage<D, kMx>& stage, int base,
                                            const uint32_t (&qb)[kHB][D / 16][2], const int (&last_key)[kHB][2],
                                            const Lane& ln, const StepParams& p, float (&acc_t)[kHB][D / 16][4],
                                            float (&m_t)[kHB][2], float (&l_t)[kHB][2], float (&mv_t)[kHB][2]) {
  float st[kHB][2][4];
  tile_scores<D, kHB, kMx, kFull>(stage, base, qb, last_key, ln, p, st);
  online_softmax<D, kHB, kMx>(stage, ln, st, acc_t, m_t, l_t, mv_t);
  const int &r = ln.r, &c = ln.c;
#pragma unroll
  for (int ks = 0; ks < 2; ++ks) {
    // P^T's B fragments: the transposes of S^T's 8 x 8 quarters (keys r / r + 8 x rows 2c, 2c + 1)
    uint32_t pb[kHB][2];
#pragma unroll
    for (int hb = 0; hb < kHB; ++hb) {
      pb[hb][0] = movmatrix_trans(pack_half2(st[hb][ks][0], st[hb][ks][1]));  // keys 2c, 2c + 1 of row r
      pb[hb][1] = movmatrix_trans(pack_half2(st[hb][ks][2], st[hb][ks][3]));  // keys 2c + 8, 2c + 9
    }
    // this lane's keys 2c, 2c + 1, 2c + 8, 2c + 9 of the 16, dims D / 8 r .. (block D / 128 r: byte sh of the
    // copied word)
    uint32_t sc01, sc89, sc01_2 = 0, sc89_2 = 0;  // (sc*_2: D = 256, the lane's second block)
    if constexpr (kMx) {  // the lane's block D r / 256 relative to each key's largest (that power is in P)
      float rel[4];
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const auto& w = stage.vs[v_key(ks, ln, kk)];
        rel[kk] = pow2_down(row_byte(w, D * r / 256) - row_max(w));
      }
      sc01 = pack_half2(rel[0], rel[1]), sc89 = pack_half2(rel[2], rel[3]);
      sc01_2 = sc01, sc89_2 = sc89;  // (D = 256: the lane's 32 dims are one block)
    } else {
      const int sh = 8 * (D * r / 128 % 4), word = D * r / 128 / 4;
      const uint32_t s0 = stage.vs[v_key(ks, ln, 0)][word] >> sh, s1 = stage.vs[v_key(ks, ln, 1)][word] >> sh;
      const uint32_t s8 = stage.vs[v_key(ks, ln, 2)][word] >> sh, s9 = stage.vs[v_key(ks, ln, 3)][word] >> sh;
      sc01 = e4m3x2_to_half2((uint16_t)((s0 & 0xFF) | ((s1 & 0xFF) << 8)));
      sc89 = e4m3x2_to_half2((uint16_t)((s8 & 0xFF) | ((s9 & 0xFF) << 8)));
      if constexpr (D == 256) {  // the next byte: block 2r + 1
        sc01_2 = e4m3x2_to_half2((uint16_t)(((s0 >> 8) & 0xFF) | (s1 & 0xFF00)));
        sc89_2 = e4m3x2_to_half2((uint16_t)(((s8 >> 8) & 0xFF) | (s9 & 0xFF00)));
      }
    }
    uint32_t va[D / 64], vb[D / 64], vc[D / 64], vd[D / 64];  // the lane's D / 8 dims of each key, 8 a word
    memcpy(va, v_bytes(stage, ks, ln, 0), sizeof va);
    memcpy(vb, v_bytes(stage, ks, ln, 1), sizeof vb);
    memcpy(vc, v_bytes(stage, ks, ln, 2), sizeof vc);
    memcpy(vd, v_bytes(stage, ks, ln, 3), sizeof vd);
#pragma unroll
    for (int hw = 0; hw < D / 64; ++hw) {
      uint32_t b0[8], b1[8];  // [i]: dim D / 8 r + 8 hw + i of keys (2c, 2c + 1) / (2c + 8, 2c + 9)
      e2m1x8_pair_keys(va[hw], vb[hw], b0);
      e2m1x8_pair_keys(vc[hw], vd[hw], b1);
#pragma unroll
      for (int q = 0; q < 4; ++q) {  // m-block 4 hw + q: rows r / r + 8 are dims D / 8 r + 8 hw + 2q (+1)
        // (words hw of the lane's D / 8 dims: block hw / 2 of its blocks, a second one only at D = 256)
        const uint32_t s01 = hw / 2 == 0 ? sc01 : sc01_2, s89 = hw / 2 == 0 ? sc89 : sc89_2;
        const uint32_t av[4] = {hmul2_u32(b0[2 * q], s01), hmul2_u32(b0[2 * q + 1], s01),
                                hmul2_u32(b1[2 * q], s89), hmul2_u32(b1[2 * q + 1], s89)};
#pragma unroll
        for (int hb = 0; hb < kHB; ++hb) mma_16816(acc_t[hb][4 * hw + q], av, pb[hb][0], pb[hb][1]);
      }
    }
  }
}

// The block's query rows: the tokens t0 .. t0 + q_len of sequence b (seq_len keys), each with the `group` query
// heads of KV head kvh: rows = q_len x group, row n is (token n / group, head n % group of the group).
struct BlockRows {
  int b, kvh, split, t0, q_len, group, rows, seq_len;
};

// Q^T as B fragments of a pass's rows (column n = query row row0 + 8 hb + r: b0 = slots 2c, 2c + 1, b1 = 2c + 8,
// 2c + 9), and the last key each of this lane's C columns (rows row0 + 8 hb + 2c + j) sees.
template <int D, int kHB>
__device__ __forceinline__ void load_q_fragments(const Args& a, const BlockRows& br, int row0, const Lane& ln,
                                                 uint32_t (&qb)[kHB][D / 16][2], int (&last_key)[kHB][2]) {
#pragma unroll
  for (int hb = 0; hb < kHB; ++hb) {
    const int row = row0 + 8 * hb + ln.r;
    const long long q_row = (br.t0 + row / br.group) * a.q_token + (br.kvh * br.group + row % br.group) * a.q_head;
#pragma unroll
    for (int s = 0; s < D / 16; ++s)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float lo = 0.f, hi = 0.f;
        if (row < br.rows) {
          lo = load_q(a, q_row + qk_dim<D>(s, ln.c, 2 * half));
          hi = load_q(a, q_row + qk_dim<D>(s, ln.c, 2 * half + 1));
        }
        qb[hb][s][half] = pack_half2(lo, hi);
      }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int col = row0 + 8 * hb + 2 * ln.c + j;
      // (rows past the last see the keys the last sees: no row of -inf scores; they are not written)
      last_key[hb][j] = br.seq_len - br.q_len + min(col, br.rows - 1) / br.group;
    }
  }
}

// A pass's softmax state before its first key: O^T 0, running max -inf, sums 0
template <int D, int kHB>
__device__ __forceinline__ void reset_state(float (&acc_t)[kHB][D / 16][4], float (&m_t)[kHB][2],
                                            float (&l_t)[kHB][2], float (&mv_t)[kHB][2]) {
#pragma unroll
  for (int hb = 0; hb < kHB; ++hb) {
#pragma unroll
    for (int mb = 0; mb < D / 16; ++mb) acc_t[hb][mb][0] = acc_t[hb][mb][1] = acc_t[hb][mb][2] = acc_t[hb][mb][3] = 0.f;
    m_t[hb][0] = m_t[hb][1] = mv_t[hb][0] = mv_t[hb][1] = -INFINITY;
    l_t[hb][0] = l_t[hb][1] = 0.f;
  }
}

// Each warp's state of the pass into shared memory by query row: running max, sum (over its lanes), P V max and O^T
template <int D, int kHB, bool kMx>
__device__ __forceinline__ void share_warp_state(const Lane& ln, const float (&acc_t)[kHB][D / 16][4],
                                                 const float (&m_t)[kHB][2], const float (&l_t)[kHB][2],
                                                 const float (&mv_t)[kHB][2]) {
  MergeState<D>& sm = shared_memory<D, kMx>().merge;
#pragma unroll
  for (int hb = 0; hb < kHB; ++hb)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      float l = l_t[hb][j];
      l += __shfl_xor_sync(0xffffffffu, l, 4);
      l += __shfl_xor_sync(0xffffffffu, l, 8);
      l += __shfl_xor_sync(0xffffffffu, l, 16);
      if (ln.r == 0) {
        sm.m[ln.warp][8 * hb + 2 * ln.c + j] = m_t[hb][j];
        sm.mv[ln.warp][8 * hb + 2 * ln.c + j] = kMx ? mv_t[hb][j] : m_t[hb][j];
        sm.l[ln.warp][8 * hb + 2 * ln.c + j] = l;
      }
    }
#pragma unroll
  for (int hb = 0; hb < kHB; ++hb)
#pragma unroll
    for (int mb = 0; mb < D / 16; ++mb)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        sm.acc[ln.warp][8 * hb + 2 * ln.c + (e & 1)][D / 8 * ln.r + 2 * mb + (e >> 1)] = acc_t[hb][mb][e];
}

// The first key of a bad page among the pages the pass's copies read that some row sees (a page wholly before
// every row's window is not looked at), INT_MAX if none: a cache of no pages has nothing but; otherwise only a block
// that clamped one (block_met_bad) looks for it (rare), its threads over the table entries in parallel. Synchronizes
// the block.
template <int D, int kPageShift, bool kMx>
__device__ __forceinline__ int first_bad_key(const Args& a, const KvCopies<D, kPageShift, kMx>& kv, int split_hi,
                                             bool block_met_bad, const Lane& ln) {
  MergeState<D>& sm = shared_memory<D, kMx>().merge;
  int block_bad = kBounds && a.num_pages == 0 && kv.lo_seen < split_hi ? kv.lo_seen : INT_MAX;
  if (block_met_bad) {  // (uniform across the block)
    int first = INT_MAX;
    for (int p = (kv.lo_seen >> kv.page_shift) + threadIdx.x; p <= (kv.kv_hi - 1) >> kv.page_shift; p += blockDim.x)
      if ((unsigned)kv.table[p] > (unsigned)kv.last_page) {
        first = p;
        break;
      }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) first = min(first, __shfl_xor_sync(0xffffffffu, first, o));
    if (ln.lane == 0) sm.bad_first[ln.warp] = first;
  }
  __syncthreads();
  if (block_met_bad) {
#pragma unroll
    for (int w = 0; w < kWarps; ++w)
      if (sm.bad_first[w] != INT_MAX) block_bad = min(block_bad, max(sm.bad_first[w] << kv.page_shift, kv.lo_seen));
  }
  return block_bad;
}

// Whether this thread's query row of the pass (row0 + threadIdx.x) sees a key of a bad page, recorded: past
// block_bad (the first such key of the split), within its view (rare: only a block that met a bad page scans its
// table entries, and only with a window)
template <int D, int kPageShift, bool kMx>
__device__ __forceinline__ bool row_sees_bad_page(const Args& a, const KvCopies<D, kPageShift, kMx>& kv,
                                                  const BlockRows& br, int row0, int w_eff, int block_bad) {
  const int last = br.seq_len - br.q_len + (row0 + threadIdx.x) / br.group;
  const int lo = max(block_bad, last - w_eff), hi = min(last, kv.kv_hi - 1);
  bool bad = kBounds && block_bad != INT_MAX && lo <= hi;
  if (bad && a.window_left >= 0 && a.num_pages > 0) {
    bad = false;
    for (int p = lo >> kv.page_shift; p <= hi >> kv.page_shift && !bad; ++p)
      bad = kv.table[p] < 0 || kv.table[p] > kv.last_page;
  }
  if (bad) atomicMin(a.errors + kErrBlockTable, br.b);
  return bad;
}

// The pass's rows, the warps' states merged: normalized, NaN where marked, written to out (and lse) with one split,
// else as this split's partial (normalized output, base-2 LSE) for merge_kernel.
template <int D, bool kMx>
__device__ __forceinline__ void write_pass_rows(const Args& a, const BlockRows& br, int row0, int pass_rows) {
  const MergeState<D>& sm = shared_memory<D, kMx>().merge;
  for (int idx = threadIdx.x; idx < pass_rows * D; idx += blockDim.x) {
    const int n = idx / D, d = idx % D, row = row0 + n;
    float m = -INFINITY;
    for (int w = 0; w < kWarps; ++w) m = fmaxf(m, sm.m[w][n]);
    const float m_use = m == -INFINITY ? 0.f : m;
    float l = 0.f, o = 0.f;
    for (int w = 0; w < kWarps; ++w) {  // (acc is in units of 2^mv: mxfp4's V powers of two are in it)
      l += sm.l[w][n] * exp2f(sm.m[w][n] - m_use);
      o += sm.acc[w][n][d] * exp2f(sm.mv[w][n] - m_use);
    }
    const int token = br.t0 + row / br.group, head = br.kvh * br.group + row % br.group;
    const bool nan_row = sm.row_bad[n];
    // (l is NaN where a score was: NaN in q or a key the row sees reaches the row)
    float value = l == 0.f ? 0.f : o * kFold / l;
    float lse2 = l == 0.f ? -INFINITY : m_use + log2f(l);
    if (nan_row) value = lse2 = NAN;
    const long long row_index = (long long)token * a.num_q_heads + head;
    if (a.splits == 1) {
      store_out(a, token * a.out_token + head * a.out_head + d, value);
      if (a.lse != nullptr && d == 0) a.lse[row_index] = lse2 * kLn2;
    } else {
      a.part_out[(row_index * a.splits + br.split) * D + d] = value;
      if (d == 0) a.part_lse[row_index * a.splits + br.split] = lse2;
    }
  }
}

// With skip_empty and several splits, a split that holds no key of its sequence (the short sequences of a ragged
// batch, whose splits cover the table's capacity) marks its rows' partials empty (base-2 LSE -inf: weight 0, which
// merge_kernel then does not read) and the block leaves, reading and writing nothing else; without it the block
// runs its (empty) key loop and writes zero partials. A bad length takes the full path: its rows are NaN.
__device__ __forceinline__ bool split_is_empty(const Args& a, const BlockRows& br, bool len_bad) {
  if (!a.skip_empty || a.splits == 1 || br.split * a.chunk < br.seq_len || len_bad) return false;
  for (int row = threadIdx.x; row < br.rows; row += blockDim.x) {
    const int token = br.t0 + row / br.group, head = br.kvh * br.group + row % br.group;
    a.part_lse[((long long)token * a.num_q_heads + head) * a.splits + br.split] = -INFINITY;
  }
  return true;
}

// Grid (Hkv, B, splits), 4 warps. Block (kvh, b, split) serves every query row of sequence b and KV head kvh: the
// rows (token i, head h of the group) in passes of 8 kHB, over the split's keys.
// kPageShift: log2 of the page size when known at compile time (address arithmetic folds), -1 to read it from a.
template <int D, int kPageShift, int kHB, bool kMx>
__global__ void __launch_bounds__(kWarps * 32, D == 256 ? 2 : kHB == 1 ? 4 : 3) fp4_attention_kernel(Args a) {
  constexpr int kKSteps = D / 16;  // QK k-steps; PV's m-blocks of output dims
  constexpr int kRows = 8 * kHB;   // query rows a pass
  const int kvh = blockIdx.x, b = blockIdx.y, split = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int r = lane / 4, c = lane % 4;
  const Lane ln{warp, lane, r, c};
  const int group = a.num_q_heads / a.num_kv_heads;
  // (dynamic: D = 256 takes more than the 48 KB a static array may; declared here rather than taken from
  // shared_memory(), which changes the SASS of the mxfp4 kernels' key loop)
  extern __shared__ __align__(16) unsigned char smem_bytes[];
  SharedMemory<D, kMx>& smem = *reinterpret_cast<SharedMemory<D, kMx>*>(smem_bytes);
  using Stage = WarpStage<D, kMx>;

  // ---- the block's rows and keys; bad indices ----
  int t0 = b, q_len = 1;
  if (a.cu_seqlens_q != nullptr) {
    if (kBounds && !cu_seqlens_ok(a, b == 0 && kvh == 0 && split == 0)) {
      write_nan_rows<D>(a, kvh, b, split, group);
      return;
    }
    t0 = a.cu_seqlens_q[b];
    q_len = a.cu_seqlens_q[b + 1] - t0;
  }
  const int rows = q_len * group;
  if (rows == 0) return;  // a sequence with no query rows reads nothing
  const int seq_len_raw = a.seq_lens[b];
  const bool len_bad = length_bad(a, seq_len_raw);
  if (len_bad && kvh == 0 && split == 0 && threadIdx.x == 0) atomicMin(a.errors + kErrSeqLens, b);
  const int seq_len = len_bad ? 0 : seq_len_raw;
  const BlockRows br{b, kvh, split, t0, q_len, group, rows, seq_len};
  if (split_is_empty(a, br, len_bad)) return;
  // this block's keys: split `split` of `chunk` (each pass narrows it to its rows' windows)
  const int split_lo = min(split * a.chunk, seq_len), split_hi = min(split_lo + a.chunk, seq_len);
  // a cache of no pages is read not at all (every page index is bad)
  const int kv_hi = a.num_pages > 0 ? split_hi : split_lo;
  const int w_eff = a.window_left >= 0 ? a.window_left : (1 << 30);  // (no window: wider than any sequence)
  const float cap2 = a.soft_cap > 0.f ? 2.f / a.soft_cap : 0.f, cap_l2 = a.soft_cap * kLog2e;

  const float qk_scale = a.sm_scale * kLog2e * kFold;
  const StepParams step_params{kv_hi, w_eff, qk_scale, cap2, cap_l2};
  const int* table = a.block_table + (long long)b * a.table_stride;
  const uint8_t* k_head = a.k_cache + (long long)kvh * a.cache_head_stride;
  const uint8_t* v_head = a.v_cache + (long long)kvh * a.cache_head_stride;
  const uint8_t* ks_head = a.k_scale + (long long)kvh * a.scale_head_stride;
  const uint8_t* vs_head = a.v_scale + (long long)kvh * a.scale_head_stride;
  const int cache_page = (int)a.cache_page_stride, cache_token = (int)a.cache_token_stride;
  const int scale_page = (int)a.scale_page_stride, scale_token = (int)a.scale_token_stride;
  const int page_shift = kPageShift >= 0 ? kPageShift : a.page_shift;
  const int page_mask = (1 << page_shift) - 1, last_page = a.num_pages - 1;

  for (int row0 = 0; row0 < rows; row0 += kRows) {
    const int pass_rows = min(kRows, rows - row0);
    const int pos_first = seq_len - q_len + row0 / group, pos_last = seq_len - q_len + (row0 + pass_rows - 1) / group;
    // the first key some row of the pass sees, and the keys from full_lo to full_hi that every row sees (a warp's
    // step there masks nothing)
    const int lo_seen = max(split_lo, pos_first - w_eff);
    const int full_lo = pos_last - w_eff, full_hi = min(kv_hi, pos_first + 1);
    // tiles start at a multiple of the tile (a key's slot is then a constant of the lane and the copy)
    const int kv_lo = lo_seen > split_lo ? min(lo_seen & ~(kTile - 1), kv_hi) : split_lo;
    bool met_bad = false;  // this lane clamped a bad page index (a flag in the loop; where, found after it)
    uint32_t qb[kHB][kKSteps][2];
    int last_key[kHB][2];
    load_q_fragments<D, kHB>(a, br, row0, ln, qb, last_key);
    // O^T fragments [row block][m-block]: row r of m-block mb is dim D / 8 r + 2 mb, row r + 8 that + 1; columns
    // 2c, 2c + 1 query rows 8 hb + 2c (+1). Running max and sums per query row 8 hb + 2c + j.
    float acc_t[kHB][kKSteps][4];
    float m_t[kHB][2], l_t[kHB][2];
    float mv_t[kHB][2];  // mxfp4: the running max of the P V product's log2 weights (nvfp4: m_t)
    reset_state<D, kHB>(acc_t, m_t, l_t, mv_t);

    KvCopies<D, kPageShift, kMx> copies{table,      k_head,     v_head,      ks_head,     vs_head,
                                        cache_page, cache_token, scale_page, scale_token, page_shift,
                                        page_mask,  last_page,  kv_hi,       lo_seen,     {0u, 0u}};
    // Two stages: the copies of the next tile fly while this one computes; the pages of the tile after that are
    // loaded one iteration ahead, so that no copy waits on a block-table load. A warp's lanes read bytes other
    // lanes of the warp copied (V, the scale rows): a warp barrier after the wait makes them visible, and one
    // before the copies into a stage keeps them behind every lane's reads of it in the step before.
    const int warp_off = warp * kKeysPerWarp;
    int pages_next = copies.load_pages(ln, kv_lo + warp_off);
    if (kv_lo < kv_hi) copies.issue(smem, 0, kv_lo + warp_off, pages_next, ln, met_bad);
    cp_async_commit();
    pages_next = copies.load_pages(ln, kv_lo + warp_off + kTile);

    for (int tile = kv_lo, it = 0; tile < kv_hi; tile += kTile, ++it) {
      const int base = tile + warp_off;
      __syncwarp();
      if constexpr (Stage::kScaleInRegister) {  // this step's scale rows, loaded while the step before ran
        Stage& stage = smem.stages[it & 1][warp];
        stage.ks[lane][0] = copies.scale_rows_next[0];
        stage.vs[lane][0] = copies.scale_rows_next[1];
      }
      if (tile + kTile < kv_hi) copies.issue(smem, (it + 1) & 1, base + kTile, pages_next, ln, met_bad);
      cp_async_commit();
      pages_next = copies.load_pages(ln, base + 2 * kTile);
      cp_async_wait<1>();
      __syncwarp();
      const Stage& stage = smem.stages[it & 1][warp];
      // one 32-key step; a warp whose keys every row sees masks no score (the branch is uniform across the warp)
      if (base + kKeysPerWarp <= full_hi && base >= full_lo)
        attend_tile<D, kHB, kMx, true>(stage, base, qb, last_key, ln, step_params, acc_t, m_t, l_t, mv_t);
      else
        attend_tile<D, kHB, kMx, false>(stage, base, qb, last_key, ln, step_params, acc_t, m_t, l_t, mv_t);
    }
    cp_async_wait<0>();
    // (the stages' memory is reused below)
    const bool block_met_bad = kBounds && __syncthreads_or(met_bad);
    if constexpr (!kBounds) __syncthreads();

    // ---- merge the 4 warps' states, normalize, write the pass's rows ----
    share_warp_state<D, kHB, kMx>(ln, acc_t, m_t, l_t, mv_t);
    const int block_bad = first_bad_key(a, copies, split_hi, block_met_bad, ln);
    // which rows are NaN: a bad page's key in view, a bad length (read again, not kept live through the key loop: a
    // register there costs the loop instructions)
    if (threadIdx.x < pass_rows)
      smem.merge.row_bad[threadIdx.x] =
          row_sees_bad_page(a, copies, br, row0, w_eff, block_bad) || length_bad(a, a.seq_lens[b]);
    __syncthreads();
    write_pass_rows<D, kMx>(a, br, row0, pass_rows);
    __syncthreads();  // (the next pass's copies reuse the merge's memory)
  }
}

// The splits of each (query token, head) merged by their LSEs (a split with no key has -inf, a NaN row NaN).
// Grid (T, Hq), a thread a dim.
__global__ void merge_kernel(Args a, int D) {
  const int t = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
  const long long row = (long long)t * a.num_q_heads + h;
  const float* lse = a.part_lse + row * a.splits;
  float m = -INFINITY;
  bool nan = false;
  for (int s = 0; s < a.splits; ++s) {
    nan |= isnan(lse[s]);
    m = fmaxf(m, lse[s]);
  }
  float total = 0.f, o = 0.f;
  if (m != -INFINITY && !nan) {
    for (int s = 0; s < a.splits; ++s) {
      const float w = exp2f(lse[s] - m);
      total += w;
      // (with skip_empty an empty split's partial is never written: a weight of 0 reads nothing)
      if (!a.skip_empty || w > 0.f) o += w * a.part_out[(row * a.splits + s) * D + d];
    }
  }
  const float value = nan ? NAN : total > 0.f ? o / total : 0.f;
  store_out(a, t * a.out_token + h * a.out_head + d, value);
  if (a.lse != nullptr && d == 0) a.lse[row] = nan ? NAN : total > 0.f ? (m + log2f(total)) * kLn2 : -INFINITY;
}

template <int D, int kPageShift, int kHB, bool kMx>
void launch_attention(const Args& a, cudaStream_t stream) {
  const dim3 grid(a.num_kv_heads, a.batch, a.splits);
  constexpr size_t kSmem = sizeof(SharedMemory<D, kMx>);
  auto kernel = fp4_attention_kernel<D, kPageShift, kHB, kMx>;
  if constexpr (kSmem > 48 * 1024)  // (a function attribute, not a stream operation: allowed inside a capture)
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kSmem));
  kernel<<<grid, kWarps * 32, kSmem, stream>>>(a);
}

template <int D, bool kMx>
void launch_page(const Args& a, bool wide_rows, cudaStream_t stream) {
  // pages of 16 keys (the common size) fold their address arithmetic at compile time; D = 256 takes rows 8 a pass
  // (its accumulators leave no registers for 16)
  if constexpr (D == 256) {
    a.page_shift == 4 ? launch_attention<D, 4, 1, kMx>(a, stream) : launch_attention<D, -1, 1, kMx>(a, stream);
  } else if (a.page_shift == 4) {
    wide_rows ? launch_attention<D, 4, 2, kMx>(a, stream) : launch_attention<D, 4, 1, kMx>(a, stream);
  } else {
    wide_rows ? launch_attention<D, -1, 2, kMx>(a, stream) : launch_attention<D, -1, 1, kMx>(a, stream);
  }
}

// The compute capability the kernels were built for on this device (0: none): attnops/backends/cuda.py declines
// GPUs below 8.9, and a build without code for them (only PTX of an older arch) would run the arch-guarded empty
// bodies above.
int64_t built_arch(int64_t device) {
  c10::cuda::CUDAGuard guard((c10::DeviceIndex)device);
  cudaFuncAttributes attributes;
  if (cudaFuncGetAttributes(&attributes, fp4_attention_kernel<128, 4, 1, false>) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return attributes.ptxVersion;  // (10 x major + minor of the code's virtual arch)
}

// out [T, Hq, D] (q's dtype), lse (float32 [T, Hq] contiguous) or undefined; the caches and scales as bytes; the
// inputs validated by the op (attnops/checks.py) and the layout by the backend (strides, alignment).
void fp4_paged_attention_cuda(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& k_scale, const at::Tensor& v_scale, const at::Tensor& block_table,
                              const at::Tensor& seq_lens, const std::optional<at::Tensor>& cu_seqlens_q,
                              const at::Tensor& out, const std::optional<at::Tensor>& lse, const at::Tensor& workspace,
                              const at::Tensor& errors, double scale, double soft_cap, int64_t window_left,
                              bool mxfp4, int64_t splits, int64_t chunk, bool skip_empty_splits) {
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t page_size = k_cache.size(1), Hkv = k_cache.size(2), B = seq_lens.size(0);
  TORCH_CHECK(D == 64 || D == 128 || D == 256, "fp4_paged_attention_cuda: head_dim 64, 128 or 256");
  TORCH_CHECK(chunk % kTile == 0 && splits >= 1, "fp4_paged_attention_cuda: chunk must be a multiple of 128");
  if (T == 0 || B == 0) return;
  c10::cuda::CUDAGuard guard(q.device());
  Args a{};
  a.q = q.data_ptr();
  a.q_bf16 = q.scalar_type() == at::kBFloat16;
  a.k_cache = k_cache.data_ptr<uint8_t>();
  a.v_cache = v_cache.data_ptr<uint8_t>();
  a.k_scale = k_scale.data_ptr<uint8_t>();
  a.v_scale = v_scale.data_ptr<uint8_t>();
  a.block_table = block_table.data_ptr<int>();
  a.seq_lens = seq_lens.data_ptr<int>();
  a.cu_seqlens_q = cu_seqlens_q ? cu_seqlens_q->data_ptr<int>() : nullptr;
  a.out = out.data_ptr();
  a.lse = lse ? lse->data_ptr<float>() : nullptr;
  a.errors = errors.data_ptr<int>();
  a.batch = (int)B;
  a.num_tokens = (int)T;
  a.chunk = (int)chunk;
  a.splits = (int)splits;
  a.num_q_heads = (int)Hq;
  a.num_kv_heads = (int)Hkv;
  a.page_shift = 0;
  while ((1 << a.page_shift) < page_size) ++a.page_shift;
  a.table_stride = (int)block_table.stride(0);
  a.num_pages = (int)k_cache.size(0);
  a.capacity = (int)(block_table.size(1) * page_size);
  a.q_token = q.stride(0), a.q_head = q.stride(1);
  a.out_token = out.stride(0), a.out_head = out.stride(1);
  a.cache_page_stride = k_cache.stride(0), a.cache_token_stride = k_cache.stride(1);
  a.cache_head_stride = k_cache.stride(2);
  a.scale_page_stride = k_scale.stride(0), a.scale_token_stride = k_scale.stride(1);
  a.scale_head_stride = k_scale.stride(2);
  a.sm_scale = (float)scale;
  a.soft_cap = (float)soft_cap;
  a.window_left = (int)window_left;
  a.skip_empty = skip_empty_splits;
  if (splits > 1) {
    a.part_out = workspace.data_ptr<float>();
    a.part_lse = a.part_out + T * Hq * splits * D;
  }
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int group = (int)(Hq / Hkv);
  // decode with a group of at most 8: one block of 8 rows; otherwise two (16 rows a pass)
  const bool wide_rows = cu_seqlens_q.has_value() || group > 8;
  if (mxfp4 && D == 256)
    launch_page<256, true>(a, wide_rows, stream);
  else if (mxfp4 && D == 128)
    launch_page<128, true>(a, wide_rows, stream);
  else if (mxfp4)
    launch_page<64, true>(a, wide_rows, stream);
  else if (D == 256)
    launch_page<256, false>(a, wide_rows, stream);
  else if (D == 128)
    launch_page<128, false>(a, wide_rows, stream);
  else
    launch_page<64, false>(a, wide_rows, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (splits > 1) {
    merge_kernel<<<dim3((unsigned)T, (unsigned)Hq), (unsigned)D, 0, stream>>>(a, (int)D);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace attnops::fp4_cuda

TORCH_LIBRARY_FRAGMENT(attnops, m) {
  // internal: the `cuda` backend's kernels (attnops/backends/cuda.py), called from inside paged_attention
  m.def(
      "fp4_paged_attention_cuda(Tensor q, Tensor k_cache, Tensor v_cache, Tensor k_scale, Tensor v_scale, "
      "Tensor block_table, Tensor seq_lens, Tensor? cu_seqlens_q, Tensor(a!) out, Tensor(b!)? lse, "
      "Tensor(c!) workspace, Tensor(d!) errors, float scale, float soft_cap, int window_left, bool mxfp4, int splits, "
      "int chunk, bool skip_empty_splits=False) -> ()");
  m.def("fp4_cuda_built_arch(int device) -> int", &attnops::fp4_cuda::built_arch);
}

TORCH_LIBRARY_IMPL(attnops, CUDA, m) {
  m.impl("fp4_paged_attention_cuda", &attnops::fp4_cuda::fp4_paged_attention_cuda);
}
