// Helpers shared by the host sides of the CPU ops (paged_attention.cpp, mla_attention.cpp, reshape_and_cache.cpp):
// cheap argument checks, fp8 tables, scale unpacking, kv_format names, and the attention runner.
//
// The Python package validates every argument (attnops/checks.py) before it calls the C++ ops, so the checks here
// are the cheap ones that keep a direct C++ caller from reading or writing out of bounds: shapes, dtypes, strides,
// and the O(batch) / O(pages) index checks that the CPU can afford (the data is in host memory; nothing syncs).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/string_view.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cpu_kernels.h"

namespace attnops::cpu {

// TORCH_CHECK_VALUE: a ValueError in Python, as the contract says for bad input
#define ATTNOPS_ARG_CHECK(op, cond, ...) TORCH_CHECK_VALUE(cond, "attnops.", op, ": ", __VA_ARGS__)

// Entries of attnops.errors' buffer (int32, one per index argument: the lowest position seen bad); the ops' own
// arguments come first, and the buffer may hold more after them (those of the layers above the ops)
constexpr int64_t kErrBlockTable = 0, kErrSeqLens = 1, kErrCuSeqlensQ = 2, kErrSlotMapping = 3, kNumErrors = 4;

inline void check_errors(const char* op, const std::optional<at::Tensor>& errors) {
  if (!errors.has_value()) return;
  ATTNOPS_ARG_CHECK(op,
                    errors->device().is_cpu() && errors->scalar_type() == at::kInt && errors->dim() == 1 &&
                        errors->size(0) >= kNumErrors && errors->is_contiguous(),
                    "errors must be attnops.errors' int32 [", kNumErrors, " or more] CPU buffer");
}

inline bool is_fp8(at::ScalarType t) { return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2; }

inline bool is_plain(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

inline DType dtype_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::Float;
    case at::kBFloat16: return DType::BFloat16;
    case at::kHalf: return DType::Half;
    default: return DType::Fp8;
  }
}

// value of each fp8 byte, before the scale: an fp8 cache is read with one table lookup per element
template <typename F8>
const float* fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[i] = static_cast<float>(F8(static_cast<uint8_t>(i), F8::from_bits()));
    return t;
  }();
  return table.data();
}

inline const float* fp8_table_for(at::ScalarType t) {
  return t == at::kFloat8_e4m3fn ? fp8_table<c10::Float8_e4m3fn>() : fp8_table<c10::Float8_e5m2>();
}

// k_cache / v_cache: [num_pages, page_size, Hkv, D], same shape, strides and dtype, last dim contiguous,
// page_size a power of two up to 256 (fp4_ok: also 4-bit caches, uint8 [.., D/2]). Returns log2(page_size).
inline int check_caches(const char* op, const at::Tensor& k_cache, const at::Tensor& v_cache, bool fp4_ok = false) {
  ATTNOPS_ARG_CHECK(op, k_cache.device().is_cpu() && v_cache.device().is_cpu(), "the CPU kernels need CPU caches");
  ATTNOPS_ARG_CHECK(op, k_cache.dim() == 4, "k_cache must be [num_pages, page_size, num_kv_heads, head_dim] (got ",
                    k_cache.sizes(), ")");
  ATTNOPS_ARG_CHECK(op,
                    k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides() &&
                        k_cache.scalar_type() == v_cache.scalar_type(),
                    "k_cache and v_cache must have the same shape, strides and dtype");
  ATTNOPS_ARG_CHECK(op,
                    is_plain(k_cache.scalar_type()) || is_fp8(k_cache.scalar_type()) ||
                        (fp4_ok && k_cache.scalar_type() == at::kByte),
                    "the CPU kernels read float32, bfloat16, float16, float8_e4m3fn and float8_e5m2 caches",
                    fp4_ok ? " and 4-bit ones (uint8)" : "", " (got ", k_cache.scalar_type(), ")");
  ATTNOPS_ARG_CHECK(op, k_cache.stride(3) == 1, "k_cache must be contiguous in its last dimension");
  const int64_t page_size = k_cache.size(1);
  ATTNOPS_ARG_CHECK(op, page_size >= 1 && page_size <= 256 && (page_size & (page_size - 1)) == 0,
                    "page_size must be a power of two from 1 to 256 (got ", page_size, ")");
  int shift = 0;
  while ((int64_t{1} << shift) < page_size) ++shift;
  return shift;
}

// fp8 caches need a float32 scale per tensor (one element) or per KV head ([Hkv]); other caches take none.
// Returns the per-head values ([Hkv], ones when there is no scale).
inline std::vector<float> unpack_scale(const char* op, const char* name, const std::optional<at::Tensor>& scale,
                                       bool fp8, int64_t num_kv_heads) {
  std::vector<float> values(num_kv_heads, 1.f);
  if (!fp8) {
    ATTNOPS_ARG_CHECK(op, !scale.has_value(), name, " is only for fp8 caches");
    return values;
  }
  ATTNOPS_ARG_CHECK(op, scale.has_value(), "an fp8 cache needs ", name, " (float32, one element or [num_kv_heads])");
  const at::Tensor& s = *scale;
  ATTNOPS_ARG_CHECK(op, s.device().is_cpu() && s.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor");
  const bool per_tensor = s.numel() == 1 && s.dim() <= 1;
  ATTNOPS_ARG_CHECK(op, per_tensor || (s.dim() == 1 && s.size(0) == num_kv_heads), name,
                    " must be 0-d, [1] or [num_kv_heads=", num_kv_heads, "] (got ", s.sizes(), ")");
  const float* data = s.const_data_ptr<float>();
  for (int64_t h = 0; h < num_kv_heads; ++h) values[h] = per_tensor ? data[0] : data[h * s.stride(0)];
  return values;
}

// 4-bit caches' block scales (k_scale / v_scale of nvfp4 and mxfp4): [num_pages, page_size, Hkv, D / block], equal
// shapes, strides and dtype, last dim contiguous; float8_e4m3fn scales are nvfp4's (a block of 16 values), uint8
// (e8m0) mxfp4's (32). Returns the block.
inline int64_t check_block_scales(const char* op, const std::optional<at::Tensor>& k_scale,
                                  const std::optional<at::Tensor>& v_scale, const at::Tensor& k_cache,
                                  int64_t head_dim) {
  ATTNOPS_ARG_CHECK(op, k_scale.has_value() && v_scale.has_value(),
                    "a 4-bit cache needs k_scale and v_scale: its block scales");
  const at::Tensor& k = *k_scale;
  const at::Tensor& v = *v_scale;
  const bool nvfp4 = k.scalar_type() == at::kFloat8_e4m3fn;
  ATTNOPS_ARG_CHECK(op, nvfp4 || k.scalar_type() == at::kByte,
                    "a 4-bit cache's block scales must be float8_e4m3fn (nvfp4) or uint8 (mxfp4, e8m0)");
  const int64_t block = nvfp4 ? 16 : 32;
  ATTNOPS_ARG_CHECK(op,
                    k.device().is_cpu() && k.dim() == 4 && k.size(0) == k_cache.size(0) &&
                        k.size(1) == k_cache.size(1) && k.size(2) == k_cache.size(2) && head_dim % block == 0 &&
                        k.size(3) == head_dim / block && k.stride(3) == 1,
                    "k_scale must be the cache's block scales, [num_pages, page_size, num_kv_heads, head_dim / ",
                    block, "] on the CPU, contiguous in its last dimension (got ", k.sizes(), ")");
  ATTNOPS_ARG_CHECK(op,
                    v.sizes() == k.sizes() && v.strides() == k.strides() && v.scalar_type() == k.scalar_type() &&
                        v.device().is_cpu(),
                    "k_scale and v_scale must have the same shape, strides and dtype");
  return block;
}

// kv_format of the public ops (C++-only build): "auto" or the name of the cache's dtype; "nvfp4" / "mxfp4" for a
// uint8 cache of 4-bit values (its block scales say which: check_block_scales).
inline void check_kv_format(const char* op, c10::string_view kv_format, at::ScalarType cache_dtype) {
  const std::string fmt(kv_format);
  if (fmt == "nvfp4" || fmt == "mxfp4") {
    ATTNOPS_ARG_CHECK(op, cache_dtype == at::kByte, "kv_format '", fmt, "' needs uint8 caches (got ", cache_dtype,
                      ")");
    return;
  }
  ATTNOPS_ARG_CHECK(op, cache_dtype != at::kByte, "a uint8 cache is kv_format 'nvfp4' or 'mxfp4'");
  if (fmt == "auto") return;
  const char* expected = cache_dtype == at::kFloat           ? "fp32"
                         : cache_dtype == at::kBFloat16      ? "bf16"
                         : cache_dtype == at::kHalf          ? "fp16"
                         : cache_dtype == at::kFloat8_e4m3fn ? "fp8_e4m3"
                         : cache_dtype == at::kFloat8_e5m2   ? "fp8_e5m2"
                                                             : "?";
  ATTNOPS_ARG_CHECK(op, fmt == expected, "kv_format '", fmt, "' does not match the cache dtype ", cache_dtype,
                    " (expected 'auto' or '", expected, "')");
}

// The arguments that say which query rows are whose and what each sees, as paged_attention and mla_attention take
// them: block_table int32 [B, max_pages], seq_lens int32 [B], cu_seqlens_q int32 [B+1] (None: decode, one row a
// sequence), sinks float32 [num_q_heads], tree_mask bool [num_tokens, Q], lse float32 [num_tokens, num_q_heads].
inline void check_rows(const char* op, int64_t num_tokens, int64_t num_q_heads, const at::Tensor& block_table,
                       const at::Tensor& seq_lens, const std::optional<at::Tensor>& cu_seqlens_q,
                       const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& tree_mask,
                       const std::optional<at::Tensor>& lse) {
  if (lse.has_value()) {
    ATTNOPS_ARG_CHECK(op,
                      lse->device().is_cpu() && lse->scalar_type() == at::kFloat && lse->dim() == 2 &&
                          lse->size(0) == num_tokens && lse->size(1) == num_q_heads,
                      "lse must be a float32 CPU tensor [num_tokens, num_q_heads]");
  }
  ATTNOPS_ARG_CHECK(op,
                    block_table.device().is_cpu() && block_table.scalar_type() == at::kInt && block_table.dim() == 2,
                    "block_table must be int32 [B, max_pages] on the CPU");
  const int64_t batch = block_table.size(0);
  ATTNOPS_ARG_CHECK(op,
                    seq_lens.device().is_cpu() && seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 &&
                        seq_lens.size(0) == batch,
                    "seq_lens must be int32 [B] on the CPU, with B == block_table.shape[0]");
  const bool decode = !cu_seqlens_q.has_value();
  if (decode) {
    ATTNOPS_ARG_CHECK(op, num_tokens == batch, "decode (cu_seqlens_q=None) needs one query row per sequence");
  } else {
    ATTNOPS_ARG_CHECK(op,
                      cu_seqlens_q->device().is_cpu() && cu_seqlens_q->scalar_type() == at::kInt &&
                          cu_seqlens_q->dim() == 1 && cu_seqlens_q->size(0) == batch + 1,
                      "cu_seqlens_q must be int32 [B+1] on the CPU");
  }
  if (sinks.has_value()) {
    ATTNOPS_ARG_CHECK(op,
                      sinks->device().is_cpu() && sinks->scalar_type() == at::kFloat && sinks->dim() == 1 &&
                          sinks->size(0) == num_q_heads && sinks->stride(0) == 1,
                      "sinks must be a contiguous float32 CPU tensor [num_q_heads]");
  }
  if (tree_mask.has_value()) {
    ATTNOPS_ARG_CHECK(op, !decode, "tree_mask needs cu_seqlens_q (decode has one query row per sequence)");
    ATTNOPS_ARG_CHECK(op,
                      tree_mask->device().is_cpu() && tree_mask->scalar_type() == at::kBool &&
                          tree_mask->dim() == 2 && tree_mask->size(0) == num_tokens && tree_mask->size(1) >= 1 &&
                          tree_mask->stride(1) == 1,
                      "tree_mask must be a bool CPU tensor [num_tokens, Q], contiguous in its last dimension");
  }
}

// Runs attention as `p` describes it (every field set but max_tile_rows) over the sequences of block_table,
// seq_lens and cu_seqlens_q (None: decode), which the caller checked for shape and dtype (paged_attention.cpp): cuts
// the work into tiles and key splits, runs them on at::parallel_for's threads, merges the splits. The lengths,
// offsets and page indices are read here, from host memory: bad ones give docs/design.md's "Bad indices" results
// in out/lse and are recorded in `errors` when given.
void run_attention(AttentionParams& p, int64_t num_tokens, const at::Tensor& block_table, const at::Tensor& seq_lens,
                   const std::optional<at::Tensor>& cu_seqlens_q, const at::Tensor& out,
                   const std::optional<at::Tensor>& errors, const std::optional<at::Tensor>& lse);

}  // namespace attnops::cpu
