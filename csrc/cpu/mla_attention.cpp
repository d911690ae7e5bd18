// The CPU latent-attention (MLA) kernel, host side. Absorbed MLA is multi-query attention with one KV head whose K
// row is the whole latent row [c (R values), r (P values)] and whose V row is its first R values, with the query in
// two parts [q_nope, q_pe]: so it unpacks into paged attention's parameters (one KV head, all H query heads its
// group, v_cache = k_cache, value_dim = R, q_pe read after q_nope's R values) and runs paged attention's work items,
// threads and inner loops (run_attention, attention_kernels.h). Each latent row is loaded once per tile for all its
// query rows (the tokens of a block x every head), and the bad-index, NaN, sink, tree-mask and LSE rules are
// paged_attention's, as docs/design.md says they are for mla_attention.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#ifdef ATTNOPS_STANDALONE
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#endif

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "cpu_kernels.h"
#include "host_utils.h"

namespace attnops::cpu {

// Runs the kernel; `out` is [T, H, R] of q_nope's dtype, `lse` (when given) float32 [T, H]. Checks shapes and
// dtypes; the indices are read and checked by run_attention (see host_utils.h).
void mla_attention_cpu(const at::Tensor& q_nope, const at::Tensor& q_pe, const at::Tensor& kv_cache,
                       const at::Tensor& block_table, const at::Tensor& seq_lens,
                       const std::optional<at::Tensor>& cu_seqlens_q, double scale,
                       const std::optional<at::Tensor>& kv_scale, const std::optional<at::Tensor>& sinks,
                       const std::optional<at::Tensor>& tree_mask, const at::Tensor& out,
                       const std::optional<at::Tensor>& errors, const std::optional<at::Tensor>& lse,
                       bool batch_invariant = false) {
  const char* op = "mla_attention";
  ATTNOPS_ARG_CHECK(op, q_nope.device().is_cpu() && q_nope.dim() == 3 && q_nope.stride(2) == 1,
                    "q_nope must be a CPU tensor [num_tokens, num_heads, R], contiguous in its last dimension");
  ATTNOPS_ARG_CHECK(op, is_plain(q_nope.scalar_type()), "q_nope must be float32, bfloat16 or float16 (got ",
                    q_nope.scalar_type(), ")");
  ATTNOPS_ARG_CHECK(op,
                    q_pe.device().is_cpu() && q_pe.dim() == 3 && q_pe.stride(2) == 1 &&
                        q_pe.scalar_type() == q_nope.scalar_type() && q_pe.size(0) == q_nope.size(0) &&
                        q_pe.size(1) == q_nope.size(1),
                    "q_pe must be a CPU tensor [num_tokens, num_heads, P] of q_nope's dtype, contiguous in its last "
                    "dimension");
  const int64_t num_tokens = q_nope.size(0), num_heads = q_nope.size(1);
  const int64_t latent_dim = q_nope.size(2), rope_dim = q_pe.size(2);
  // the inner loops take rows in whole vectors (16 floats) and values in pairs of them
  ATTNOPS_ARG_CHECK(op, latent_dim % 64 == 0 && latent_dim >= 64 && latent_dim <= kMaxValueDim,
                    "R must be a multiple of 64 from 64 to ", kMaxValueDim, " (got ", latent_dim, ")");
  ATTNOPS_ARG_CHECK(op, rope_dim % 16 == 0 && rope_dim >= 16 && rope_dim <= kMaxHeadDim - kMaxValueDim,
                    "P must be a multiple of 16 from 16 to ", kMaxHeadDim - kMaxValueDim, " (got ", rope_dim, ")");
  ATTNOPS_ARG_CHECK(op, num_heads >= 1, "num_heads must be at least 1");
  ATTNOPS_ARG_CHECK(op,
                    out.device().is_cpu() && out.sizes() == q_nope.sizes() &&
                        out.scalar_type() == q_nope.scalar_type(),
                    "out must be a CPU tensor of q_nope's shape and dtype");
  // a uint8 cache holds DeepSeek's fp8 layout ("fp8_ds_mla"): R e4m3 bytes, R/128 float32 scales, P bf16 values
  const bool latent_fp8 = kv_cache.scalar_type() == at::kByte;
  const int64_t row_size = latent_fp8 ? latent_dim + latent_dim / 32 + 2 * rope_dim : latent_dim + rope_dim;
  ATTNOPS_ARG_CHECK(op, kv_cache.dim() == 3 && kv_cache.size(2) == row_size, "kv_cache must be [num_pages, page_size, ",
                    latent_fp8 ? "R + 4 R/128 + 2 P] = [.., .., " : "R + P] = [.., .., ", row_size, "] (got ",
                    kv_cache.sizes(), ")");
  ATTNOPS_ARG_CHECK(op, kv_cache.stride(2) == 1, "kv_cache must be contiguous in its last dimension");
  ATTNOPS_ARG_CHECK(op, !latent_fp8 || latent_dim % 128 == 0,
                    "a uint8 cache (DeepSeek's fp8 layout) takes R a multiple of 128 (got ", latent_dim, ")");
  // as paged attention's caches: one KV head, the row as both K and V
  const at::Tensor rows = kv_cache.unsqueeze(2);
  const int page_shift = check_caches(op, rows, rows, /*fp4_ok=*/latent_fp8);
  check_rows(op, num_tokens, num_heads, block_table, seq_lens, cu_seqlens_q, sinks, tree_mask, lse);
  ATTNOPS_ARG_CHECK(op, scale > 0, "need scale > 0");
  const bool fp8 = is_fp8(kv_cache.scalar_type());
  const std::vector<float> kv_scales = unpack_scale(op, "kv_scale", kv_scale, fp8, 1);

  AttentionParams p{};
  p.q = q_nope.const_data_ptr();
  p.q_stride_token = q_nope.stride(0);
  p.q_stride_head = q_nope.stride(1);
  p.q_pe = q_pe.const_data_ptr();
  p.q_pe_stride_token = q_pe.stride(0);
  p.q_pe_stride_head = q_pe.stride(1);
  p.q_nope_dim = latent_dim;
  p.out = out.data_ptr();
  p.out_stride_token = out.stride(0);
  p.out_stride_head = out.stride(1);
  p.out_stride_dim = out.stride(2);
  p.q_dtype = dtype_of(q_nope.scalar_type());
  p.lse = lse.has_value() ? lse->data_ptr<float>() : nullptr;
  p.lse_stride_token = lse.has_value() ? lse->stride(0) : 0;
  p.lse_stride_head = lse.has_value() ? lse->stride(1) : 0;
  p.k_cache = kv_cache.const_data_ptr();
  p.v_cache = kv_cache.const_data_ptr();
  p.cache_stride_page = kv_cache.stride(0);
  p.cache_stride_slot = kv_cache.stride(1);
  p.cache_stride_head = 0;  // the one KV head
  p.kv_dtype = latent_fp8 ? DType::LatentFp8 : dtype_of(kv_cache.scalar_type());
  p.fp8_lut = fp8 || latent_fp8 ? fp8_table_for(latent_fp8 ? at::kFloat8_e4m3fn : kv_cache.scalar_type()) : nullptr;
  p.block_table = block_table.const_data_ptr<int32_t>();
  p.bt_stride_seq = block_table.stride(0);
  p.bt_stride_page = block_table.stride(1);
  p.page_shift = page_shift;
  p.num_pages = kv_cache.size(0);
  p.num_q_heads = num_heads;
  p.num_kv_heads = 1;
  p.group = num_heads;
  p.head_dim = latent_dim + rope_dim;
  p.value_dim = latent_dim;
  p.scale = static_cast<float>(scale);
  p.soft_cap = 0.f;
  p.window_left = -1;
  // the per-tensor scale dequantizes K (folded into q) and V (into the output's norm) alike
  p.k_scale = kv_scales.data();
  p.v_scale = kv_scales.data();
  p.sinks = sinks.has_value() ? sinks->const_data_ptr<float>() : nullptr;
  p.tree_mask = tree_mask.has_value() ? tree_mask->const_data_ptr<bool>() : nullptr;
  p.tree_mask_stride = tree_mask.has_value() ? tree_mask->stride(0) : 0;
  p.tree_mask_cols = tree_mask.has_value() ? tree_mask->size(1) : 0;
  p.batch_invariant = batch_invariant;
  run_attention(p, num_tokens, block_table, seq_lens, cu_seqlens_q, out, errors, lse);
}

namespace {

// The internal op the Python CPU backend calls (attnops/backends/cpu.py), after attnops/checks_mla.py validated
// everything: kv_format is implied by the cache dtype.
void cpu_mla_attention(const at::Tensor& q_nope, const at::Tensor& q_pe, const at::Tensor& kv_cache,
                       const at::Tensor& block_table, const at::Tensor& seq_lens,
                       const std::optional<at::Tensor>& cu_seqlens_q, double scale,
                       const std::optional<at::Tensor>& kv_scale, const std::optional<at::Tensor>& sinks,
                       const std::optional<at::Tensor>& tree_mask, at::Tensor& out,
                       const std::optional<at::Tensor>& errors, const std::optional<at::Tensor>& lse,
                       bool batch_invariant) {
  check_errors("mla_attention", errors);
  mla_attention_cpu(q_nope, q_pe, kv_cache, block_table, seq_lens, cu_seqlens_q, scale, kv_scale, sinks, tree_mask,
                    out, errors, lse, batch_invariant);
}

#ifdef ATTNOPS_STANDALONE
// kv_format of the public op (C++-only build): "auto" (the cache has q's dtype), "fp8_e4m3" (a float8_e4m3fn
// cache) or "fp8_ds_mla" (a uint8 one); the checks of attnops/checks_mla.py that the kernel's own do not make.
void check_mla_kv_format(c10::string_view kv_format, const at::Tensor& q_nope, const at::Tensor& kv_cache,
                         const std::optional<at::Tensor>& topk_indices) {
  ATTNOPS_ARG_CHECK("mla_attention", !topk_indices.has_value(),
                    "topk_indices (the sparse form) is served by the Python package, not the C++-only build");
  const std::string fmt(kv_format);
  if (fmt == "fp8_ds_mla") {
    ATTNOPS_ARG_CHECK("mla_attention", kv_cache.scalar_type() == at::kByte,
                      "kv_cache of kv_format 'fp8_ds_mla' must be uint8 (got ", kv_cache.scalar_type(), ")");
    return;
  }
  if (fmt == "fp8_e4m3") {
    ATTNOPS_ARG_CHECK("mla_attention", kv_cache.scalar_type() == at::kFloat8_e4m3fn,
                      "kv_cache of kv_format 'fp8_e4m3' must be float8_e4m3fn (got ", kv_cache.scalar_type(), ")");
    return;
  }
  ATTNOPS_ARG_CHECK("mla_attention", fmt == "auto",
                    "kv_format must be 'auto', 'fp8_e4m3' or 'fp8_ds_mla' (got '", fmt, "')");
  ATTNOPS_ARG_CHECK("mla_attention", kv_cache.scalar_type() == q_nope.scalar_type(),
                    "kv_cache must have q_nope's dtype for kv_format 'auto' (got ", kv_cache.scalar_type(), ")");
}

// The public ops, for the C++-only build (CMake): in the Python package, attnops/ops.py implements them.
void mla_attention_out(const at::Tensor& q_nope, const at::Tensor& q_pe, const at::Tensor& kv_cache,
                       const at::Tensor& block_table, const at::Tensor& seq_lens,
                       const std::optional<at::Tensor>& cu_seqlens_q, double scale, c10::string_view kv_format,
                       const std::optional<at::Tensor>& kv_scale, const std::optional<at::Tensor>& sinks,
                       const std::optional<at::Tensor>& tree_mask, const std::optional<at::Tensor>& topk_indices,
                       at::Tensor& out) {
  check_mla_kv_format(kv_format, q_nope, kv_cache, topk_indices);
  mla_attention_cpu(q_nope, q_pe, kv_cache, block_table, seq_lens, cu_seqlens_q, scale, kv_scale, sinks, tree_mask,
                    out, std::nullopt, std::nullopt);
}

void mla_attention_with_lse_out(const at::Tensor& q_nope, const at::Tensor& q_pe, const at::Tensor& kv_cache,
                                const at::Tensor& block_table, const at::Tensor& seq_lens,
                                const std::optional<at::Tensor>& cu_seqlens_q, double scale,
                                c10::string_view kv_format, const std::optional<at::Tensor>& kv_scale,
                                const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& tree_mask,
                                const std::optional<at::Tensor>& topk_indices, at::Tensor& out, at::Tensor& lse) {
  check_mla_kv_format(kv_format, q_nope, kv_cache, topk_indices);
  mla_attention_cpu(q_nope, q_pe, kv_cache, block_table, seq_lens, cu_seqlens_q, scale, kv_scale, sinks, tree_mask,
                    out, std::nullopt, lse);
}

at::Tensor mla_attention(const at::Tensor& q_nope, const at::Tensor& q_pe, const at::Tensor& kv_cache,
                         const at::Tensor& block_table, const at::Tensor& seq_lens,
                         const std::optional<at::Tensor>& cu_seqlens_q, double scale, c10::string_view kv_format,
                         const std::optional<at::Tensor>& kv_scale, const std::optional<at::Tensor>& sinks,
                         const std::optional<at::Tensor>& tree_mask, const std::optional<at::Tensor>& topk_indices) {
  at::Tensor out = at::empty_like(q_nope);
  mla_attention_out(q_nope, q_pe, kv_cache, block_table, seq_lens, cu_seqlens_q, scale, kv_format, kv_scale, sinks,
                    tree_mask, topk_indices, out);
  return out;
}

std::tuple<at::Tensor, at::Tensor> mla_attention_with_lse(
    const at::Tensor& q_nope, const at::Tensor& q_pe, const at::Tensor& kv_cache, const at::Tensor& block_table,
    const at::Tensor& seq_lens, const std::optional<at::Tensor>& cu_seqlens_q, double scale,
    c10::string_view kv_format, const std::optional<at::Tensor>& kv_scale, const std::optional<at::Tensor>& sinks,
    const std::optional<at::Tensor>& tree_mask, const std::optional<at::Tensor>& topk_indices) {
  at::Tensor out = at::empty_like(q_nope);
  at::Tensor lse = at::empty({q_nope.size(0), q_nope.size(1)}, q_nope.options().dtype(at::kFloat));
  mla_attention_with_lse_out(q_nope, q_pe, kv_cache, block_table, seq_lens, cu_seqlens_q, scale, kv_format, kv_scale,
                             sinks, tree_mask, topk_indices, out, lse);
  return {out, lse};
}
#endif  // ATTNOPS_STANDALONE

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnops, m) {
  m.def(
      "cpu_mla_attention(Tensor q_nope, Tensor q_pe, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
      "Tensor? cu_seqlens_q, float scale, Tensor? kv_scale, Tensor? sinks, Tensor? tree_mask, Tensor(a!) out, "
      "Tensor(b!)? errors=None, Tensor(c!)? lse=None, bool batch_invariant=False) -> ()");
}

TORCH_LIBRARY_IMPL(attnops, CPU, m) {
  m.impl("cpu_mla_attention", &cpu_mla_attention);
#ifdef ATTNOPS_STANDALONE
  m.impl("mla_attention", &mla_attention);
  m.impl("mla_attention.out", &mla_attention_out);
  m.impl("mla_attention_with_lse", &mla_attention_with_lse);
  m.impl("mla_attention_with_lse.out", &mla_attention_with_lse_out);
#endif
}

}  // namespace attnops::cpu
