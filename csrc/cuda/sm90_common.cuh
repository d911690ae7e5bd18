// What the sm_90a kernels (wgmma) share: shared-memory addressing, cp.async, the wgmma descriptor and fences, the
// m64n64k16 MMA of two shared-memory operands, the quad reductions of an accumulator row and the cu_seqlens_q rule.
// The kernels: latent-attention decode (mla_decode_sm90.cuh) and the query-block attention of 16-bit caches
// (prefill_sm90.cu).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

namespace attnops::sm90 {

// The dynamic shared memory's first 1024-byte boundary (the 128-byte swizzle's operands start on one)
__device__ __forceinline__ uint8_t* aligned_smem(uint8_t* raw) {
  return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool fill) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(fill ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
// generic-proxy writes (cp.async, st.shared) made visible to wgmma's reads (the async proxy)
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// A wgmma shared-memory descriptor: start address, leading and stride byte offsets (16-byte units), 128-byte
// swizzle. K-major operands: stride = 1024 (8 rows of 128 bytes), leading unused (1). N-major V: leading = the
// next 64-column chunk, stride = the next 8 keys.
__device__ __forceinline__ uint64_t descriptor(uint32_t addr, uint32_t leading, uint32_t stride) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(leading >> 4) << 16) |
         (static_cast<uint64_t>(stride >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// waits until at most N committed groups of this warpgroup's wgmmas are in flight
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// keeps the compiler from moving accumulator reads or writes across a wgmma fence or wait
template <int N>
__device__ __forceinline__ void pin(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
__device__ __forceinline__ uint32_t pack_f16(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
// Two values as the 16-bit pair of the MMAs' input type (kHalf: fp16, else bf16)
template <bool kHalf>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
  return kHalf ? pack_f16(lo, hi) : pack_bf16(lo, hi);
}

// Whether entry i (0 .. batch) of cu_seqlens_q breaks its rule (non-decreasing from 0 to num_tokens: docs/design.md,
// "Bad indices"); plain CUDA, any arch
__device__ __forceinline__ bool cu_seqlens_entry_bad(const int* cu_q, int i, int batch, int num_tokens) {
  const int cur = cu_q[i], prev = i > 0 ? cu_q[i - 1] : 0;
  return cur < prev || cur > num_tokens || (i == 0 && cur != 0) || (i == batch && cur != num_tokens);
}

// A value reduced over the four threads of a quad (lanes 4 g .. 4 g + 3: they hold one row of a wgmma accumulator
// between them), the same order in every thread
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// The 32 accumulator registers of an m64n64 wgmma: the operand list, and the operands (d: float[32])
#define ATTNOPS_D32 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, " \
    "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define ATTNOPS_D32_OPERANDS(d) \
    "+f"((d)[0]), "+f"((d)[1]), "+f"((d)[2]), "+f"((d)[3]), "+f"((d)[4]), "+f"((d)[5]), "+f"((d)[6]), \
    "+f"((d)[7]), "+f"((d)[8]), "+f"((d)[9]), "+f"((d)[10]), "+f"((d)[11]), "+f"((d)[12]), "+f"((d)[13]), \
    "+f"((d)[14]), "+f"((d)[15]), "+f"((d)[16]), "+f"((d)[17]), "+f"((d)[18]), "+f"((d)[19]), \
    "+f"((d)[20]), "+f"((d)[21]), "+f"((d)[22]), "+f"((d)[23]), "+f"((d)[24]), "+f"((d)[25]), \
    "+f"((d)[26]), "+f"((d)[27]), "+f"((d)[28]), "+f"((d)[29]), "+f"((d)[30]), "+f"((d)[31])

// S (+)= A B^T: A [64 x 16] and B [64 x 16], both K-major in shared memory (descriptors), bf16 (kHalf: fp16); S
// fp32 [64 x 64]
template <bool kHalf = false>
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  if constexpr (kHalf) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {" ATTNOPS_D32 "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : ATTNOPS_D32_OPERANDS(d)
        : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" ATTNOPS_D32 "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : ATTNOPS_D32_OPERANDS(d)
        : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  }
}

}  // namespace attnops::sm90
