// The CPU cache write: key/value [T, Hkv, D] go to slot slot_mapping[t] = page * page_size + offset of k_cache /
// v_cache, converted to the cache's format on the way (fp8: divided by the per-tensor or per-head scale and
// saturated at the format's max, as attnops/formats.py's quantize_fp8 does). Slot -1 (padding) is skipped; a slot
// below -1 or past the cache is a bad index: that token writes nothing (recorded in attnops.errors' buffer when
// given), the others are written.
//
// Memory-bound and simple: tokens in parallel, one scalar conversion per element (c10's conversions round to
// nearest even, exactly as Tensor.to() does, so the result is bit-identical to the reference backend's).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
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

template <typename Src>
void write_cache_from(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache,
                      const at::Tensor& v_cache, const int64_t* slots, int64_t slot_stride,
                      const std::vector<float>& k_scale, const std::vector<float>& v_scale) {
  switch (k_cache.scalar_type()) {
    case at::kFloat: return write_cache<Src, float>(key, value, k_cache, v_cache, slots, slot_stride, k_scale, v_scale);
    case at::kBFloat16:
      return write_cache<Src, c10::BFloat16>(key, value, k_cache, v_cache, slots, slot_stride, k_scale, v_scale);
    case at::kHalf:
      return write_cache<Src, c10::Half>(key, value, k_cache, v_cache, slots, slot_stride, k_scale, v_scale);
    case at::kFloat8_e4m3fn:
      return write_cache<Src, c10::Float8_e4m3fn>(key, value, k_cache, v_cache, slots, slot_stride, k_scale, v_scale);
    case at::kFloat8_e5m2:
      return write_cache<Src, c10::Float8_e5m2>(key, value, k_cache, v_cache, slots, slot_stride, k_scale, v_scale);
    default: TORCH_CHECK(false, "attnops.reshape_and_cache: unsupported cache dtype ", k_cache.scalar_type());
  }
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
  // slots are read from host memory: the first bad one is recorded here (write_cache skips them all)
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  const int64_t slot_stride = slot_mapping.stride(0), num_slots = k_cache.size(0) * k_cache.size(1);
  check_errors(op, errors);
  for (int64_t t = 0; t < key.size(0); ++t) {
    const int64_t slot = slots[t * slot_stride];
    if (slot < -1 || slot >= num_slots) {
      if (errors.has_value()) {
        int32_t* entry = errors->data_ptr<int32_t>() + kErrSlotMapping;
        *entry = std::min<int32_t>(*entry, static_cast<int32_t>(t));
      }
      break;
    }
  }
  switch (key.scalar_type()) {
    case at::kFloat:
      return write_cache_from<float>(key, value, k_cache, v_cache, slots, slot_stride, k_scales, v_scales);
    case at::kBFloat16:
      return write_cache_from<c10::BFloat16>(key, value, k_cache, v_cache, slots, slot_stride, k_scales, v_scales);
    default: return write_cache_from<c10::Half>(key, value, k_cache, v_cache, slots, slot_stride, k_scales, v_scales);
  }
}

namespace {

// The internal op the Python CPU backend calls (attnops/backends/cpu.py) after attnops/checks.py validated it.
void cpu_reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                           const at::Tensor& slot_mapping, const std::optional<at::Tensor>& k_scale,
                           const std::optional<at::Tensor>& v_scale, const std::optional<at::Tensor>& errors) {
  reshape_and_cache_cpu(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, errors);
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
#endif  // ATTNOPS_STANDALONE

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnops, m) {
  m.def(
      "cpu_reshape_and_cache(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
      "Tensor? k_scale, Tensor? v_scale, Tensor(c!)? errors=None) -> ()");
}

TORCH_LIBRARY_IMPL(attnops, CPU, m) {
  m.impl("cpu_reshape_and_cache", &cpu_reshape_and_cache);
#ifdef ATTNOPS_STANDALONE
  m.impl("reshape_and_cache", &reshape_and_cache);
#endif
}

}  // namespace attnops::cpu
