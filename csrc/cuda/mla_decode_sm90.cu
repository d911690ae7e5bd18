// Host side of the sm_90a latent-attention decode (mla_decode_sm90.cuh has the kernel and says how it works):
// torch.ops.attnops.mla_decode_sm90, called by the `cuda` backend (attnops/backends/cuda_mla.py), which validates
// the call and plans the splits.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "mla_decode_sm90.cuh"

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

// q_nope [T, H, 512] and q_pe [T, H, 64] bf16 with unit inner stride and 16-byte aligned rows; kv_cache
// [num_pages, page_size, 576] bf16 or float8_e4m3fn (with kv_scale, float32 of one element), the same; out
// [T, H, 512] bf16 (unit inner stride, value pairs aligned), lse float32 [T, H] contiguous or none; with
// splits > 1, part_out float32 [T, H, splits, 512] and part_lse [T, H, splits] are the splits' partials, merged
// into out and lse (sinks, float32 [H], need splits > 1). Validated by the backend.
void mla_decode_sm90(const at::Tensor& q_nope, const at::Tensor& q_pe, const at::Tensor& kv_cache,
                     const std::optional<at::Tensor>& kv_scale, const at::Tensor& block_table,
                     const at::Tensor& seq_lens, const std::optional<at::Tensor>& sinks,
                     const at::Tensor& out, const std::optional<at::Tensor>& lse, const at::Tensor& part_out,
                     const at::Tensor& part_lse, const at::Tensor& errors, double scale, int64_t splits,
                     int64_t chunk, int64_t stages) {
  const int64_t T = q_nope.size(0), H = q_nope.size(1);
  TORCH_CHECK(q_nope.size(2) == kR && q_pe.size(2) == kP, "mla_decode_sm90: latent 512 and rotary 64 only");
  TORCH_CHECK(splits >= 1 && chunk % kKeys == 0 && chunk > 0, "mla_decode_sm90: chunk a multiple of 64");
  TORCH_CHECK(seq_lens.size(0) == T, "mla_decode_sm90: decode only (one query token a sequence)");
  TORCH_CHECK(!sinks || splits > 1, "mla_decode_sm90: sinks are added by the merge (splits > 1)");
  if (T == 0) return;
  c10::cuda::CUDAGuard guard(q_nope.device());
  Args a{};
  a.q_nope = reinterpret_cast<const __nv_bfloat16*>(q_nope.data_ptr());
  a.q_pe = reinterpret_cast<const __nv_bfloat16*>(q_pe.data_ptr());
  const bool fp8 = kv_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(fp8 == kv_scale.has_value(), "mla_decode_sm90: kv_scale with an fp8 e4m3 cache, and only then");
  a.kv = reinterpret_cast<const uint8_t*>(kv_cache.data_ptr());
  a.kv_scale = fp8 ? kv_scale->data_ptr<float>() : nullptr;
  a.block_table = block_table.data_ptr<int>();
  a.seq_lens = seq_lens.data_ptr<int>();
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
  auto kernel = decode_kernel(fp8);
  // (a function attribute, not a stream operation: allowed inside a capture)
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  const dim3 grid(static_cast<unsigned>(T * a.head_blocks), static_cast<unsigned>(splits));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (splits > 1) {
    mla_merge_kernel<<<dim3(static_cast<unsigned>(T), static_cast<unsigned>(H)), kR / 4, 0, stream>>>(
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
      "Tensor(e!) errors, float scale, int splits, int chunk, int stages=0) -> ()");
  m.def("mla_sm90a_built(int device) -> int", &attnops::mla_sm90::mla_sm90a_built);
}

TORCH_LIBRARY_IMPL(attnops, CUDA, m) { m.impl("mla_decode_sm90", &attnops::mla_sm90::mla_decode_sm90); }
