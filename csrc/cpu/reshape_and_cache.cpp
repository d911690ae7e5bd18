// The CPU cache write: key/value [T, Hkv, D] go to slot slot_mapping[t] = page * page_size + offset of k_cache /
// v_cache, converted to the cache's format on the way (fp8: divided by the per-tensor or per-head scale and
// saturated at the format's max, as attnops/formats.py's quantize_fp8 does). Slot -1 (padding) is skipped; a slot
// below -1 or past the cache is a bad index: that token writes nothing (recorded in attnops.errors' buffer when
// given), the others are written.
//
// Memory-bound and simple: tokens in parallel, one scalar conversion per element (c10's conversions round to
// nearest even, exactly as Tensor.to() does, so the result is bit-identical to the reference backend's).
//
// The latent cache write (mla_cache_write) is here too, with the same conversions and slot rules: row
// slot_mapping[i] of kv_cache [num_pages, page_size, R + P] = [kv_c[i], k_pe[i]].
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "host_utils.h"

namespace attnops::cpu {

namespace {

template <typename Dst>
struct Store {
  // plain formats: the value as the cache's dtype
  static Dst convert(float x, float /*scale*/) { return static_cast<Dst>(x); }
};

template <typename F8>
struct StoreFp8 {
  // x / scale, clamped to the format's finite range (NaN stays NaN), rounded to the nearest fp8 value
  static F8 convert(float x, float scale) {
    const float limit = static_cast<float>(std::numeric_limits<F8>::max());
    float y = x / scale;
    if (!std::isnan(y)) y = std::min(std::max(y, -limit), limit);
    return static_cast<F8>(y);
  }
};
template <>
struct Store<c10::Float8_e4m3fn> : StoreFp8<c10::Float8_e4m3fn> {};
template <>
struct Store<c10::Float8_e5m2> : StoreFp8<c10::Float8_e5m2> {};

template <typename Src, typename Dst>
void write_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const int64_t* slots, int64_t slot_stride, const std::vector<float>& k_scale,
                 const std::vector<float>& v_scale) {
  const int64_t num_tokens = key.size(0), num_heads = key.size(1), head_dim = key.size(2);
  const int64_t page_size = k_cache.size(1), num_slots = k_cache.size(0) * page_size;
  const Src* key_data = key.const_data_ptr<Src>();
  const Src* value_data = value.const_data_ptr<Src>();
  Dst* k_data = static_cast<Dst*>(k_cache.data_ptr());
  Dst* v_data = static_cast<Dst*>(v_cache.data_ptr());
  const int64_t grain = std::max<int64_t>(1, 16384 / (num_heads * head_dim));  // a few hundred KB per task
  at::parallel_for(0, num_tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t * slot_stride];
      if (slot < 0 || slot >= num_slots) continue;  // padding, or a bad index (recorded by the caller)
      const int64_t page = slot / page_size, offset = slot % page_size;
      for (int64_t h = 0; h < num_heads; ++h) {
        const Src* ks = key_data + t * key.stride(0) + h * key.stride(1);
        const Src* vs = value_data + t * value.stride(0) + h * value.stride(1);
        const int64_t dst = page * k_cache.stride(0) + offset * k_cache.stride(1) + h * k_cache.stride(2);
        for (int64_t d = 0; d < head_dim; ++d) {
          k_data[dst + d] = Store<Dst>::convert(static_cast<float>(ks[d * key.stride(2)]), k_scale[h]);
          v_data[dst + d] = Store<Dst>::convert(static_cast<float>(vs[d * value.stride(2)]), v_scale[h]);
        }
      }
    }
  });
}

// Calls f(Src{}, Dst{}) with the C++ types of the source values (float32, bfloat16, float16: checked by the caller)
// and of the cache.
template <typename F>
void with_types(const char* op, at::ScalarType src, at::ScalarType dst, const F& f) {
  auto to = [&](auto source) {
    switch (dst) {
      case at::kFloat: return f(source, float{});
      case at::kBFloat16: return f(source, c10::BFloat16{});
      case at::kHalf: return f(source, c10::Half{});
      case at::kFloat8_e4m3fn: return f(source, c10::Float8_e4m3fn{});
      case at::kFloat8_e5m2: return f(source, c10::Float8_e5m2{});
      default: TORCH_CHECK(false, "attnops.", op, ": unsupported cache dtype ", dst);
    }
  };
  switch (src) {
    case at::kFloat: return to(float{});
    case at::kBFloat16: return to(c10::BFloat16{});
    default: return to(c10::Half{});
  }
}

// Slots are read from host memory: the first bad one (below -1, or past the cache's num_slots) is recorded in
// attnops.errors' buffer when given; the writes skip them all.
void record_bad_slot(const char* op, const int64_t* slots, int64_t slot_stride, int64_t num_tokens, int64_t num_slots,
                     const std::optional<at::Tensor>& errors) {
  check_errors(op, errors);
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slots[t * slot_stride];
    if (slot < -1 || slot >= num_slots) {
      if (errors.has_value()) {
        int32_t* entry = errors->data_ptr<int32_t>() + kErrSlotMapping;
        *entry = std::min<int32_t>(*entry, static_cast<int32_t>(t));
      }
      return;
    }
  }
}

// The latent rows: kv_c [N, R] and k_pe [N, P] (any strides) side by side in row slots[i] of kv_cache.
template <typename Src, typename Dst>
void write_latent(const at::Tensor& kv_c, const at::Tensor& k_pe, const at::Tensor& kv_cache, const int64_t* slots,
                  int64_t slot_stride, float scale) {
  const int64_t num_tokens = kv_c.size(0), latent_dim = kv_c.size(1), rope_dim = k_pe.size(1);
  const int64_t page_size = kv_cache.size(1), num_slots = kv_cache.size(0) * page_size;
  const Src* c_data = kv_c.const_data_ptr<Src>();
  const Src* pe_data = k_pe.const_data_ptr<Src>();
  Dst* cache = static_cast<Dst*>(kv_cache.data_ptr());
  const int64_t grain = std::max<int64_t>(1, 16384 / (latent_dim + rope_dim));
  at::parallel_for(0, num_tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t * slot_stride];
      if (slot < 0 || slot >= num_slots) continue;  // padding, or a bad index (recorded by the caller)
      Dst* row = cache + (slot / page_size) * kv_cache.stride(0) + (slot % page_size) * kv_cache.stride(1);
      const Src* c = c_data + t * kv_c.stride(0);
      const Src* pe = pe_data + t * k_pe.stride(0);
      for (int64_t d = 0; d < latent_dim; ++d)
        row[d] = Store<Dst>::convert(static_cast<float>(c[d * kv_c.stride(1)]), scale);
      for (int64_t d = 0; d < rope_dim; ++d)
        row[latent_dim + d] = Store<Dst>::convert(static_cast<float>(pe[d * k_pe.stride(1)]), scale);
    }
  });
}

// The latent rows in DeepSeek's fp8 layout ("fp8_ds_mla", a uint8 cache [.., R + 4 R/128 + 2 P]), exactly as
// attnops/formats.py's quantize_latent_fp8 writes them: each 128 values over their scale max(amax, 1e-4) / 448
// (a NaN among them: the NaN 0x7FC00000 as scale) as e4m3, saturated, a NaN as 0x7F; the scales as float32; k_pe
// as bf16.
template <typename Src>
void write_latent_fp8(const at::Tensor& kv_c, const at::Tensor& k_pe, const at::Tensor& kv_cache,
                      const int64_t* slots, int64_t slot_stride) {
  const int64_t num_tokens = kv_c.size(0), latent_dim = kv_c.size(1), rope_dim = k_pe.size(1);
  const int64_t page_size = kv_cache.size(1), num_slots = kv_cache.size(0) * page_size;
  const Src* c_data = kv_c.const_data_ptr<Src>();
  const Src* pe_data = k_pe.const_data_ptr<Src>();
  uint8_t* cache = kv_cache.data_ptr<uint8_t>();
  at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t * slot_stride];
      if (slot < 0 || slot >= num_slots) continue;  // padding, or a bad index (recorded by the caller)
      uint8_t* row = cache + (slot / page_size) * kv_cache.stride(0) + (slot % page_size) * kv_cache.stride(1);
      const Src* c = c_data + t * kv_c.stride(0);
      for (int64_t t0 = 0; t0 < latent_dim; t0 += 128) {
        float amax = 0.f;
        for (int64_t d = t0; d < t0 + 128; ++d) {
          const float x = std::fabs(static_cast<float>(c[d * kv_c.stride(1)]));
          amax = std::isnan(x) ? x : std::max(amax, x);  // (a NaN stays: std::max(NaN, x) is NaN)
        }
        const float scale =
            std::isnan(amax) ? std::numeric_limits<float>::quiet_NaN() : std::max(amax, 1e-4f) / 448.f;
        std::memcpy(row + latent_dim + t0 / 32, &scale, sizeof(float));
        for (int64_t d = t0; d < t0 + 128; ++d) {
          const c10::Float8_e4m3fn y = Store<c10::Float8_e4m3fn>::convert(static_cast<float>(c[d * kv_c.stride(1)]),
                                                                          scale);
          row[d] = (y.x & 0x7F) == 0x7F ? 0x7F : y.x;  // (one NaN: 0x7F, whatever its sign)
        }
      }
      uint8_t* rope = row + latent_dim + latent_dim / 32;
      const Src* pe = pe_data + t * k_pe.stride(0);
      for (int64_t d = 0; d < rope_dim; ++d) {
        const c10::BFloat16 y(static_cast<float>(pe[d * k_pe.stride(1)]));
        std::memcpy(rope + 2 * d, &y, 2);
      }
    }
  });
}

}  // namespace

void reshape_and_cache_cpu(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& slot_mapping,
                           const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                           const std::optional<at::Tensor>& errors) {
  const char* op = "reshape_and_cache";
  check_caches(op, k_cache, v_cache);
  ATTNOPS_ARG_CHECK(op,
                    key.device().is_cpu() && value.device().is_cpu() && key.dim() == 3 &&
                        key.sizes() == value.sizes() && key.scalar_type() == value.scalar_type(),
                    "key and value must be CPU tensors [num_tokens, num_kv_heads, head_dim] of one shape and dtype");
  ATTNOPS_ARG_CHECK(op, is_plain(key.scalar_type()), "key must be float32, bfloat16 or float16 (got ",
                    key.scalar_type(), ")");
  ATTNOPS_ARG_CHECK(op, key.size(1) == k_cache.size(2) && key.size(2) == k_cache.size(3),
                    "key's [num_kv_heads, head_dim] ", key.sizes().slice(1), " != the cache's ",
                    k_cache.sizes().slice(2));
  ATTNOPS_ARG_CHECK(op,
                    slot_mapping.device().is_cpu() && slot_mapping.scalar_type() == at::kLong &&
                        slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0),
                    "slot_mapping must be int64 [num_tokens] on the CPU");
  const bool fp8 = is_fp8(k_cache.scalar_type());
  const std::vector<float> k_scales = unpack_scale(op, "k_scale", k_scale, fp8, k_cache.size(2));
  const std::vector<float> v_scales = unpack_scale(op, "v_scale", v_scale, fp8, k_cache.size(2));
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  const int64_t slot_stride = slot_mapping.stride(0), num_slots = k_cache.size(0) * k_cache.size(1);
  record_bad_slot(op, slots, slot_stride, key.size(0), num_slots, errors);
  with_types(op, key.scalar_type(), k_cache.scalar_type(), [&](auto src, auto dst) {
    write_cache<decltype(src), decltype(dst)>(key, value, k_cache, v_cache, slots, slot_stride, k_scales, v_scales);
  });
}

// The latent cache write: kv_c [N, R] and k_pe [N, P] (float32, bfloat16 or float16, one dtype) into row
// slot_mapping[i] of kv_cache [num_pages, page_size, R + P] (last dim contiguous), converted to the cache's dtype
// (fp8: divided by the per-tensor kv_scale and saturated). Slot -1 is skipped; a bad slot writes nothing and is
// recorded.
void mla_cache_write_cpu(const at::Tensor& kv_c, const at::Tensor& k_pe, const at::Tensor& kv_cache,
                         const at::Tensor& slot_mapping, const std::optional<at::Tensor>& kv_scale,
                         const std::optional<at::Tensor>& errors) {
  const char* op = "mla_cache_write";
  ATTNOPS_ARG_CHECK(op,
                    kv_c.device().is_cpu() && k_pe.device().is_cpu() && kv_c.dim() == 2 && k_pe.dim() == 2 &&
                        k_pe.size(0) == kv_c.size(0) && k_pe.scalar_type() == kv_c.scalar_type(),
                    "kv_c [N, R] and k_pe [N, P] must be CPU tensors of one dtype and N");
  ATTNOPS_ARG_CHECK(op, is_plain(kv_c.scalar_type()), "kv_c must be float32, bfloat16 or float16 (got ",
                    kv_c.scalar_type(), ")");
  // a uint8 cache holds DeepSeek's fp8 layout ("fp8_ds_mla"): R e4m3 bytes, R/128 float32 scales, P bf16 values
  const bool latent_fp8 = kv_cache.scalar_type() == at::kByte;
  const int64_t latent_dim = kv_c.size(1), rope_dim = k_pe.size(1);
  ATTNOPS_ARG_CHECK(op,
                    kv_cache.device().is_cpu() && kv_cache.dim() == 3 &&
                        kv_cache.size(2) ==
                            (latent_fp8 ? latent_dim + latent_dim / 32 + 2 * rope_dim : latent_dim + rope_dim) &&
                        kv_cache.stride(2) == 1 && (!latent_fp8 || latent_dim % 128 == 0),
                    "kv_cache must be a CPU tensor [num_pages, page_size, R + P] (uint8: [.., .., R + 4 R/128 + 2 P] "
                    "with R a multiple of 128), contiguous in its last dimension (got ", kv_cache.sizes(), ")");
  ATTNOPS_ARG_CHECK(op, is_plain(kv_cache.scalar_type()) || is_fp8(kv_cache.scalar_type()) || latent_fp8,
                    "kv_cache must be float32, bfloat16, float16, fp8 or uint8 (got ", kv_cache.scalar_type(), ")");
  ATTNOPS_ARG_CHECK(op,
                    slot_mapping.device().is_cpu() && slot_mapping.scalar_type() == at::kLong &&
                        slot_mapping.dim() == 1 && slot_mapping.size(0) == kv_c.size(0),
                    "slot_mapping must be int64 [N] on the CPU");
  const float scale = unpack_scale(op, "kv_scale", kv_scale, is_fp8(kv_cache.scalar_type()), 1)[0];
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  const int64_t slot_stride = slot_mapping.stride(0), num_slots = kv_cache.size(0) * kv_cache.size(1);
  record_bad_slot(op, slots, slot_stride, kv_c.size(0), num_slots, errors);
  if (latent_fp8) {
    with_types(op, kv_c.scalar_type(), at::kFloat, [&](auto src, auto /*dst*/) {
      write_latent_fp8<decltype(src)>(kv_c, k_pe, kv_cache, slots, slot_stride);
    });
    return;
  }
  with_types(op, kv_c.scalar_type(), kv_cache.scalar_type(), [&](auto src, auto dst) {
    write_latent<decltype(src), decltype(dst)>(kv_c, k_pe, kv_cache, slots, slot_stride, scale);
  });
}

namespace {

// The internal op the Python CPU backend calls (attnops/backends/cpu.py) after attnops/checks.py validated it.
void cpu_reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                           const at::Tensor& slot_mapping, const std::optional<at::Tensor>& k_scale,
                           const std::optional<at::Tensor>& v_scale, const std::optional<at::Tensor>& errors) {
  reshape_and_cache_cpu(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, errors);
}

void cpu_mla_cache_write(const at::Tensor& kv_c, const at::Tensor& k_pe, at::Tensor& kv_cache,
                         const at::Tensor& slot_mapping, const std::optional<at::Tensor>& kv_scale,
                         const std::optional<at::Tensor>& errors) {
  mla_cache_write_cpu(kv_c, k_pe, kv_cache, slot_mapping, kv_scale, errors);
}

#ifdef ATTNOPS_STANDALONE
// The public op, for the C++-only build (CMake); the Python package implements it in attnops/ops.py.
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                       const at::Tensor& slot_mapping, c10::string_view kv_format,
                       const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                       const std::optional<at::Tensor>& k_block_scale, const std::optional<at::Tensor>& v_block_scale) {
  check_kv_format("reshape_and_cache", kv_format, k_cache.scalar_type());
  ATTNOPS_ARG_CHECK("reshape_and_cache", !k_block_scale.has_value() && !v_block_scale.has_value(),
                    "k_block_scale/v_block_scale are for 4-bit caches, which the C++ CPU kernels do not serve");
  reshape_and_cache_cpu(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, std::nullopt);
}

void mla_cache_write(const at::Tensor& kv_c, const at::Tensor& k_pe, at::Tensor& kv_cache,
                     const at::Tensor& slot_mapping, c10::string_view kv_format,
                     const std::optional<at::Tensor>& kv_scale) {
  const std::string fmt(kv_format);
  ATTNOPS_ARG_CHECK("mla_cache_write",
                    fmt == "fp8_e4m3"     ? kv_cache.scalar_type() == at::kFloat8_e4m3fn
                    : fmt == "fp8_ds_mla" ? kv_cache.scalar_type() == at::kByte
                                          : fmt == "auto" && kv_cache.scalar_type() == kv_c.scalar_type(),
                    "kv_format must be 'auto' (a cache of kv_c's dtype), 'fp8_e4m3' (a float8_e4m3fn cache) or "
                    "'fp8_ds_mla' (a uint8 one); got '", fmt, "' with a ", kv_cache.scalar_type(), " cache");
  mla_cache_write_cpu(kv_c, k_pe, kv_cache, slot_mapping, kv_scale, std::nullopt);
}
#endif  // ATTNOPS_STANDALONE

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnops, m) {
  m.def(
      "cpu_reshape_and_cache(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
      "Tensor? k_scale, Tensor? v_scale, Tensor(c!)? errors=None) -> ()");
  m.def(
      "cpu_mla_cache_write(Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache, Tensor slot_mapping, Tensor? kv_scale, "
      "Tensor(b!)? errors=None) -> ()");
}

TORCH_LIBRARY_IMPL(attnops, CPU, m) {
  m.impl("cpu_reshape_and_cache", &cpu_reshape_and_cache);
  m.impl("cpu_mla_cache_write", &cpu_mla_cache_write);
#ifdef ATTNOPS_STANDALONE
  m.impl("reshape_and_cache", &reshape_and_cache);
  m.impl("mla_cache_write", &mla_cache_write);
#endif
}

}  // namespace attnops::cpu
