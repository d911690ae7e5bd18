// Host side of the sm_90a latent-attention decode (mla_decode_sm90.cuh has the kernel and says how it works):
// torch.ops.attnops.mla_decode_sm90, called by the `cuda` backend (attnops/backends/cuda_mla.py), which validates
// the call and plans the splits.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <algorithm>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cudaTypedefs.h>
#include <torch/library.h>

#include "mla_keys_sm90.cuh"
#include "mla_regs_sm90.cuh"

namespace attnops::mla_sm90 {

// 1 where the kernel this device runs is the sm_90a code (built with TORCH_CUDA_ARCH_LIST holding 9.0a; setup.py
// asks for it on an sm_90 GPU), else 0: the backend declines then. Safe inside a capture.
int64_t mla_sm90a_built(int64_t device) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  cudaFuncAttributes attributes{};
  if (cudaFuncGetAttributes(&attributes, sm90a_marker) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return attributes.sharedSizeBytes >= kMarkerInts * sizeof(int) ? 1 : 0;
}

// The cache as the TMA forms' tensor map: [num_pages][page_size][row] with the cache's strides (row: 576 values, or
// DeepSeek's fp8 layout's 656 bytes), boxes of {64 values, min(page_size, 64) rows, 1 page}, coordinates outside it
// as zeros: bf16 landing in the 128-byte swizzle (the wgmma layout), fp8 bytes unswizzled (the keys form widens them
// in shared memory) or in the 64-byte swizzle (the regs form's loads)
static void encode_kv_map(CUtensorMap* map, const at::Tensor& kv_cache, bool fp8, bool swizzle64, int64_t row) {
  using Encode = PFN_cuTensorMapEncodeTiled_v12000;
  static const Encode encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      fn = nullptr;
    }
    return reinterpret_cast<Encode>(fn);
  }();
  TORCH_CHECK(encode != nullptr, "mla_decode_sm90: the CUDA driver has no cuTensorMapEncodeTiled");
  const int64_t page_size = kv_cache.size(1), element = kv_cache.element_size();
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(row), static_cast<cuuint64_t>(page_size),
                              static_cast<cuuint64_t>(kv_cache.size(0))};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(kv_cache.stride(1) * element),
                                 static_cast<cuuint64_t>(kv_cache.stride(0) * element)};
  const cuuint32_t box[3] = {64, static_cast<cuuint32_t>(std::min<int64_t>(page_size, kKeys)), 1};
  const cuuint32_t unit[3] = {1, 1, 1};
  const CUresult done = encode(map, fp8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3,
                               kv_cache.data_ptr(), dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                               !fp8        ? CU_TENSOR_MAP_SWIZZLE_128B
                               : swizzle64 ? CU_TENSOR_MAP_SWIZZLE_64B
                                           : CU_TENSOR_MAP_SWIZZLE_NONE,
                               CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(done == CUDA_SUCCESS, "mla_decode_sm90: cuTensorMapEncodeTiled failed (", static_cast<int>(done), ")");
}

// q_nope [T, H, 512] and q_pe [T, H, 64] bf16 with unit inner stride and 16-byte aligned rows; kv_cache
// [num_pages, page_size, 576] bf16 or float8_e4m3fn (with kv_scale, float32 of one element), or uint8 [num_pages,
// page_size, 656] in DeepSeek's fp8 layout (kv_format "fp8_ds_mla"; the cp.async and keys forms), the same; out
// [T, H, 512] bf16 (unit inner stride, value pairs aligned), lse float32 [T, H] contiguous or none; with
// splits > 1, part_out float32 [T, H, splits, 512] and part_lse [T, H, splits] are the splits' partials, merged
// into out and lse (sinks, float32 [H], need splits > 1); cu_seqlens_q int32 [B + 1] (several query tokens a
// sequence) or none (decode: B == T); tokens_per_block: with cu_seqlens_q and at most 32 heads, the query tokens
// of a sequence a block takes as its rows (tokens_per_block x H <= 64: Args.group), else 1; merge: the splits'
// merge kernel, 0 mla_merge_kernel, 1 mla_merge_warps_kernel. Validated by the backend.
void mla_decode_sm90(const at::Tensor& q_nope, const at::Tensor& q_pe, const at::Tensor& kv_cache,
                     const std::optional<at::Tensor>& kv_scale, const at::Tensor& block_table,
                     const at::Tensor& seq_lens, const std::optional<at::Tensor>& sinks,
                     const at::Tensor& out, const std::optional<at::Tensor>& lse, const at::Tensor& part_out,
                     const at::Tensor& part_lse, const at::Tensor& errors, double scale, int64_t splits,
                     int64_t chunk, int64_t stages, int64_t variant,
                     const std::optional<at::Tensor>& cu_seqlens_q, int64_t tokens_per_block, int64_t merge) {
  const int64_t T = q_nope.size(0), H = q_nope.size(1);
  TORCH_CHECK(q_nope.size(2) == kR && q_pe.size(2) == kP, "mla_decode_sm90: latent 512 and rotary 64 only");
  TORCH_CHECK(splits >= 1 && chunk % kKeys == 0 && chunk > 0, "mla_decode_sm90: chunk a multiple of 64");
  TORCH_CHECK(cu_seqlens_q ? cu_seqlens_q->size(0) == seq_lens.size(0) + 1 : seq_lens.size(0) == T,
              "mla_decode_sm90: one query token a sequence, or cu_seqlens_q of the sequences + 1 entries");
  TORCH_CHECK(!sinks || splits > 1, "mla_decode_sm90: sinks are added by the merge (splits > 1)");
  TORCH_CHECK(tokens_per_block == 1 || (tokens_per_block > 1 && cu_seqlens_q && tokens_per_block * H <= kRows &&
                                        variant <= 1),
              "mla_decode_sm90: several query tokens a block need cu_seqlens_q, at most 64 rows (tokens x heads) "
              "and the cp.async or tma form");
  if (T == 0) return;
  TORCH_CHECK(seq_lens.size(0) > 0, "mla_decode_sm90: at least one sequence");
  c10::cuda::CUDAGuard guard(q_nope.device());
  Args a{};
  a.q_nope = reinterpret_cast<const __nv_bfloat16*>(q_nope.data_ptr());
  a.q_pe = reinterpret_cast<const __nv_bfloat16*>(q_pe.data_ptr());
  const bool e4m3 = kv_cache.scalar_type() == at::kFloat8_e4m3fn, ds = kv_cache.scalar_type() == at::kByte;
  const bool fp8 = e4m3 || ds;
  TORCH_CHECK(fp8 || kv_cache.scalar_type() == at::kBFloat16,
              "mla_decode_sm90: a bf16, float8_e4m3fn or uint8 (DeepSeek's fp8 layout) cache");
  TORCH_CHECK(kv_cache.size(2) == (ds ? kDsRowBytes : kD), "mla_decode_sm90: rows of 576 values, or 656 bytes in "
              "DeepSeek's fp8 layout");
  TORCH_CHECK(e4m3 == kv_scale.has_value(), "mla_decode_sm90: kv_scale with an fp8 e4m3 cache, and only then");
  a.kv = reinterpret_cast<const uint8_t*>(kv_cache.data_ptr());
  a.kv_scale = e4m3 ? kv_scale->data_ptr<float>() : nullptr;
  a.block_table = block_table.data_ptr<int>();
  a.seq_lens = seq_lens.data_ptr<int>();
  a.cu_q = cu_seqlens_q ? cu_seqlens_q->data_ptr<int>() : nullptr;
  at::Tensor token_rows;  // verify: [2, T] each token's sequence and the rows after it (mla_rows_kernel)
  if (cu_seqlens_q) {
    token_rows = at::empty({2, T}, seq_lens.options());
    a.token_seq = token_rows.data_ptr<int>();
    a.token_later = a.token_seq + T;
  }
  a.num_tokens = static_cast<int>(T);
  a.batch = static_cast<int>(seq_lens.size(0));
  a.group = static_cast<int>(tokens_per_block);
  a.out = reinterpret_cast<__nv_bfloat16*>(out.data_ptr());
  a.lse = lse ? lse->data_ptr<float>() : nullptr;  // (with splits, the merge writes it)
  a.part_out = splits > 1 ? part_out.data_ptr<float>() : nullptr;
  a.part_lse = splits > 1 ? part_lse.data_ptr<float>() : nullptr;
  a.errors = errors.data_ptr<int>();
  a.q_nope_token = q_nope.stride(0), a.q_nope_head = q_nope.stride(1);
  a.q_pe_token = q_pe.stride(0), a.q_pe_head = q_pe.stride(1);
  a.kv_page = kv_cache.stride(0) * kv_cache.element_size();
  a.kv_token = kv_cache.stride(1) * kv_cache.element_size();
  a.out_token = out.stride(0), a.out_head = out.stride(1);
  a.table_stride = static_cast<int>(block_table.stride(0));
  a.num_pages = static_cast<int>(kv_cache.size(0));
  a.page_size = static_cast<int>(kv_cache.size(1));
  a.capacity = static_cast<int>(block_table.size(1) * kv_cache.size(1));
  a.num_heads = static_cast<int>(H);
  a.head_blocks = static_cast<int>((H + kRows - 1) / kRows);
  a.chunk = static_cast<int>(chunk);
  a.splits = static_cast<int>(splits);
  a.qk_scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  TORCH_CHECK(stages >= kAllStages && stages <= kLoadsOnly, "mla_decode_sm90: stages 0, 1 or 2");
  a.stages = static_cast<int>(stages);
  // variant 0: tiles by cp.async; 1: whole tiles by the TMA; 2: the keys as the MMAs' M, at most 16 heads
  // (mla_keys_sm90.cuh); 3: the keys as the MMAs' M, fp8 widened in registers, at most 16 heads (mla_regs_sm90.cuh)
  TORCH_CHECK(variant >= 0 && variant <= 3, "mla_decode_sm90: variant 0 to 3");
  TORCH_CHECK(variant < 2 || stages == kAllStages, "mla_decode_sm90: the forms after tma run all their stages");
  TORCH_CHECK(variant < 2 || H <= kNarrowHeads, "mla_decode_sm90: the keys and regs forms take at most 16 heads");
  TORCH_CHECK(variant != 3 || e4m3, "mla_decode_sm90: the regs form reads fp8 e4m3 caches");
  TORCH_CHECK(!ds || variant == 0 || variant == 2,
              "mla_decode_sm90: DeepSeek's fp8 layout is read by the cp.async and keys forms only");
  if (variant) {  // (pages of 8 rows or more, each a power of two; rows and pages 16-byte aligned: the backend's)
    TORCH_CHECK((!fp8 || variant >= 2) && a.page_size >= 8 && (a.page_size & (a.page_size - 1)) == 0,
                "mla_decode_sm90: the TMA copies read bf16 caches (fp8 too in the keys and regs forms) with pages of "
                "8 rows or more");
    encode_kv_map(&a.kv_map, kv_cache, fp8, variant == 3, ds ? kDsRowBytes : kD);
  }
  void (*kernel)(Args) = decode_kernel(fp8, variant == 1, tokens_per_block > 1, ds);  // (variants 0 and 1)
  int smem_bytes = kSmemBytes;
  if (variant == 2) kernel = keys_kernel(fp8, ds), smem_bytes = ds ? kKeysDsSmemBytes : kKeysSmemBytes;
  if (variant == 3) kernel = regs_kernel(), smem_bytes = kRegsSmemBytes;
  // (a function attribute, not a stream operation: allowed inside a capture)
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  const dim3 grid(static_cast<unsigned>(T * a.head_blocks), static_cast<unsigned>(splits));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (cu_seqlens_q) {
    mla_rows_kernel<<<1, 1024, 0, stream>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  kernel<<<grid, variant == 3 ? kRegsThreads : kThreads, smem_bytes, stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  TORCH_CHECK(merge == 0 || merge == 1, "mla_decode_sm90: merge 0 (a thread a column) or 1 (warps over the splits)");
  if (splits > 1) {
    const dim3 rows(static_cast<unsigned>(T), static_cast<unsigned>(H));
    (merge ? mla_merge_warps_kernel : mla_merge_kernel)<<<rows, kR / 4, 0, stream>>>(
        a, sinks ? sinks->data_ptr<float>() : nullptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace attnops::mla_sm90

TORCH_LIBRARY_FRAGMENT(attnops, m) {
  // internal: the `cuda` backend's latent-attention decode (attnops/backends/cuda_mla.py)
  m.def(
      "mla_decode_sm90(Tensor q_nope, Tensor q_pe, Tensor kv_cache, Tensor? kv_scale, Tensor block_table, "
      "Tensor seq_lens, Tensor? sinks, Tensor(a!) out, Tensor(b!)? lse, Tensor(c!) part_out, Tensor(d!) part_lse, "
      "Tensor(e!) errors, float scale, int splits, int chunk, int stages=0, int variant=0, "
      "Tensor? cu_seqlens_q=None, int tokens_per_block=1, int merge=0) -> ()");
  m.def("mla_sm90a_built(int device) -> int", &attnops::mla_sm90::mla_sm90a_built);
}

TORCH_LIBRARY_IMPL(attnops, CUDA, m) { m.impl("mla_decode_sm90", &attnops::mla_sm90::mla_decode_sm90); }
