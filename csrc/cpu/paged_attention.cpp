// The CPU paged-attention kernel, host side: unpacks the arguments, cuts the work into items, runs them on
// at::parallel_for's threads, and registers the op. run_attention (the work items, the threads) also runs latent
// attention (mla_attention.cpp), whose arguments unpack into the same parameters.
//
// Work decomposition. A tile is the query rows of one sequence: a block of its query tokens (one in decode, up to
// kTileRows / group in a prefill) x the query heads of one or more KV heads. Each K/V row read from the cache
// serves all the query heads of its GQA/MQA group and every token of the block, and the rows of a key slot are read
// for all the tile's KV heads together. A tile whose key range is long compared to the whole job (a single long
// sequence, many threads) is split into several items over disjoint key ranges; each writes an unnormalized partial
// result with its row max and sum, and merge() combines them by log-sum-exp. Items are handed out largest first
// from a shared counter, so ragged batches balance across threads.
//
// The inner loops (attention_kernels.h) are compiled for several instruction sets; select_kernels() picks one.
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#ifdef ATTNOPS_STANDALONE
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "cpu_kernels.h"
#include "host_utils.h"

namespace attnops::cpu {

namespace {

constexpr int64_t kTileRows = 16;       // query rows (tokens x group heads) per KV head of a multi-token tile
constexpr int64_t kMaxTileRows = 64;    // rows of a tile over all its KV heads (bounds the per-thread scratch)
constexpr int64_t kMinSplitKeys = 256;  // never split a tile into pieces shorter than this
constexpr int64_t kItemsPerThread = 4;  // split tiles until there are about this many items per thread
// batch-invariant mode: keys a split (a whole number of kKeyChunk), whatever the batch and the threads
constexpr int64_t kInvariantSplitKeys = 1024;

}  // namespace

const KernelTable& select_kernels() {
  static const KernelTable* chosen = [] {
    // ATen's choice honours ATEN_CPU_CAPABILITY, so a user who caps ATen's instruction set caps ours too; each
    // table is also null unless this CPU has the instructions it was compiled for.
    const std::string cap = at::get_cpu_capability();
    if (cap == "AVX512" && kernels_avx512() != nullptr) return kernels_avx512();
    if ((cap == "AVX512" || cap == "AVX2") && kernels_avx2() != nullptr) return kernels_avx2();
    return kernels_default();
  }();
  return *chosen;
}

// Runs the kernel; `out` is [T, Hq, D] of q's dtype, `lse` (when given) float32 [T, Hq]: each row's log-sum-exp. Checks shapes and dtypes (see host_utils.h); the indices it
// reads from host memory give docs/design.md's results for bad values ("Bad indices": NaN rows, nothing read
// outside a tensor) and are recorded in `errors` (attnops.errors' int32 buffer), when given.
void paged_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& block_table, const at::Tensor& seq_lens,
                         const std::optional<at::Tensor>& cu_seqlens_q, double scale, double soft_cap,
                         int64_t window_left, const std::optional<at::Tensor>& k_scale,
                         const std::optional<at::Tensor>& v_scale, const std::optional<at::Tensor>& sinks,
                         const std::optional<at::Tensor>& tree_mask, const at::Tensor& out,
                         const std::optional<at::Tensor>& errors, const std::optional<at::Tensor>& lse,
                         bool batch_invariant = false) {
  const char* op = "paged_attention";
  const int page_shift = check_caches(op, k_cache, v_cache, /*fp4_ok=*/true);
  const bool fp4 = k_cache.scalar_type() == at::kByte;  // nvfp4, mxfp4: two values a byte
  ATTNOPS_ARG_CHECK(op, q.device().is_cpu() && q.dim() == 3 && q.stride(2) == 1,
                    "q must be a CPU tensor [num_tokens, num_q_heads, head_dim], contiguous in its last dimension");
  ATTNOPS_ARG_CHECK(op, is_plain(q.scalar_type()), "q must be float32, bfloat16 or float16 (got ", q.scalar_type(),
                    ")");
  ATTNOPS_ARG_CHECK(op, out.device().is_cpu() && out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(),
                    "out must be a CPU tensor of q's shape and dtype");
  const int64_t num_tokens = q.size(0), num_q_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_pages = k_cache.size(0), num_kv_heads = k_cache.size(2);
  const int64_t cache_head_dim = k_cache.size(3) * (fp4 ? 2 : 1);
  ATTNOPS_ARG_CHECK(op, cache_head_dim == head_dim, "q's head_dim (", head_dim, ") != the cache's (", cache_head_dim,
                    ")");
  ATTNOPS_ARG_CHECK(op, head_dim % 16 == 0 && head_dim >= 16 && head_dim <= kMaxValueDim,
                    "the CPU kernels take head_dim a multiple of 16 from 16 to ", kMaxValueDim, " (got ", head_dim,
                    ")");
  ATTNOPS_ARG_CHECK(op, num_kv_heads > 0 && num_q_heads % num_kv_heads == 0, "num_q_heads (", num_q_heads,
                    ") must be a multiple of num_kv_heads (", num_kv_heads, ")");
  check_rows(op, num_tokens, num_q_heads, block_table, seq_lens, cu_seqlens_q, sinks, tree_mask, lse);
  ATTNOPS_ARG_CHECK(op, scale > 0 && soft_cap >= 0 && window_left >= -1,
                    "need scale > 0, soft_cap >= 0, window_left >= -1");
  const bool fp8 = is_fp8(k_cache.scalar_type());
  const int64_t fp4_block = fp4 ? check_block_scales(op, k_scale, v_scale, k_cache, head_dim) : 0;
  // (a 4-bit cache's k_scale / v_scale are its block scales: no per-tensor or per-head scale)
  const std::vector<float> k_scales = unpack_scale(op, "k_scale", fp4 ? std::nullopt : k_scale, fp8, num_kv_heads);
  const std::vector<float> v_scales = unpack_scale(op, "v_scale", fp4 ? std::nullopt : v_scale, fp8, num_kv_heads);

  AttentionParams p{};
  p.q = q.const_data_ptr();
  p.q_stride_token = q.stride(0);
  p.q_stride_head = q.stride(1);
  p.out = out.data_ptr();
  p.out_stride_token = out.stride(0);
  p.out_stride_head = out.stride(1);
  p.out_stride_dim = out.stride(2);
  p.q_dtype = dtype_of(q.scalar_type());
  p.lse = lse.has_value() ? lse->data_ptr<float>() : nullptr;
  p.lse_stride_token = lse.has_value() ? lse->stride(0) : 0;
  p.lse_stride_head = lse.has_value() ? lse->stride(1) : 0;
  p.k_cache = k_cache.const_data_ptr();
  p.v_cache = v_cache.const_data_ptr();
  p.cache_stride_page = k_cache.stride(0);
  p.cache_stride_slot = k_cache.stride(1);
  p.cache_stride_head = k_cache.stride(2);
  p.kv_dtype = fp4 ? DType::Fp4 : dtype_of(k_cache.scalar_type());
  p.fp8_lut = fp8 ? fp8_table_for(k_cache.scalar_type()) : fp4 ? fp8_table_for(at::kFloat8_e4m3fn) : nullptr;
  if (fp4) {
    p.k_block_scale = static_cast<const uint8_t*>(k_scale->const_data_ptr());
    p.v_block_scale = static_cast<const uint8_t*>(v_scale->const_data_ptr());
    p.scale_stride_page = k_scale->stride(0);
    p.scale_stride_slot = k_scale->stride(1);
    p.scale_stride_head = k_scale->stride(2);
    p.fp4_block = fp4_block;
  }
  p.block_table = block_table.const_data_ptr<int32_t>();
  p.bt_stride_seq = block_table.stride(0);
  p.bt_stride_page = block_table.stride(1);
  p.page_shift = page_shift;
  p.num_pages = num_pages;
  p.num_q_heads = num_q_heads;
  p.num_kv_heads = num_kv_heads;
  p.group = num_q_heads / num_kv_heads;
  p.head_dim = head_dim;
  p.scale = static_cast<float>(scale);
  p.soft_cap = static_cast<float>(soft_cap);
  p.window_left = window_left;
  p.k_scale = k_scales.data();
  p.v_scale = v_scales.data();
  p.sinks = sinks.has_value() ? sinks->const_data_ptr<float>() : nullptr;
  p.tree_mask = tree_mask.has_value() ? tree_mask->const_data_ptr<bool>() : nullptr;
  p.tree_mask_stride = tree_mask.has_value() ? tree_mask->stride(0) : 0;
  p.tree_mask_cols = tree_mask.has_value() ? tree_mask->size(1) : 0;
  p.value_dim = head_dim;
  p.q_pe = nullptr;
  p.q_nope_dim = head_dim;
  p.batch_invariant = batch_invariant;
  run_attention(p, num_tokens, block_table, seq_lens, cu_seqlens_q, out, errors, lse);
}

void run_attention(AttentionParams& p, int64_t num_tokens, const at::Tensor& block_table, const at::Tensor& seq_lens,
                   const std::optional<at::Tensor>& cu_seqlens_q, const at::Tensor& out,
                   const std::optional<at::Tensor>& errors, const std::optional<at::Tensor>& lse) {
  const bool decode = !cu_seqlens_q.has_value();
  const int64_t batch = block_table.size(0), max_pages = block_table.size(1);
  const int64_t page_size = int64_t{1} << p.page_shift, num_kv_heads = p.num_kv_heads;
  const int64_t window_left = p.window_left;

  // Tiles. Lengths and offsets are read from host memory (CPU tensors: no device sync), and checked so that no key
  // or page outside the tensors is ever read.
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  const int32_t* cu = decode ? nullptr : cu_seqlens_q->const_data_ptr<int32_t>();
  const int64_t lens_stride = seq_lens.stride(0), cu_stride = decode ? 0 : cu_seqlens_q->stride(0);
  const int64_t group = p.group;
  const int64_t tokens_per_tile = decode ? 1 : std::max<int64_t>(1, kTileRows / group);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  int32_t* error_entries = errors.has_value() ? errors->data_ptr<int32_t>() : nullptr;
  auto record = [&](int64_t argument, int64_t position) {  // attnops.errors: the lowest position per argument
    if (error_entries != nullptr && position < error_entries[argument])
      error_entries[argument] = static_cast<int32_t>(position);
  };
  if (!decode) {
    // cu_seqlens_q must run non-decreasing from 0 to num_tokens, or which rows are whose is undefined: every row
    // is NaN and nothing is read
    for (int64_t i = 0; i <= batch; ++i) {
      const int64_t start = cu[i * cu_stride];
      if (start > num_tokens || (i == 0 && start != 0) || (i > 0 && start < cu[(i - 1) * cu_stride]) ||
          (i == batch && start != num_tokens)) {
        record(kErrCuSeqlensQ, i);
        out.fill_(nan);
        if (lse.has_value()) lse->fill_(nan);
        return;
      }
    }
  }
  // Blocks of query tokens of one sequence (all KV heads), with the keys they can see.
  std::vector<Tile> blocks;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t kv_len = lens[b * lens_stride];
    const int64_t q_begin = decode ? b : cu[b * cu_stride], q_end = decode ? b + 1 : cu[(b + 1) * cu_stride];
    if (q_begin == q_end) continue;  // no rows: nothing of the sequence is read
    if (kv_len < 0 || kv_len > max_pages * page_size) {  // no defined keys: its rows are NaN
      record(kErrSeqLens, b);
      out.narrow(0, q_begin, q_end - q_begin).fill_(nan);
      if (lse.has_value()) lse->narrow(0, q_begin, q_end - q_begin).fill_(nan);
      continue;
    }
    // Pages outside the cache are masked in the kernel (p.num_pages); recorded here if a row sees one of their
    // keys: the rows see keys from the window start of the first query (its position, kv_len - q_len, may be
    // negative: no key) to kv_len - 1.
    const int64_t seen_from =
        window_left >= 0 ? std::max<int64_t>(0, kv_len - (q_end - q_begin) - window_left) : 0;
    for (int64_t i = 0; i < (kv_len + page_size - 1) >> p.page_shift; ++i) {
      const int64_t page = p.block_table[b * p.bt_stride_seq + i * p.bt_stride_page];
      if ((page < 0 || page >= p.num_pages) && (i + 1) * page_size > seen_from) {
        record(kErrBlockTable, b);
        break;
      }
    }
    for (int64_t t0 = q_begin; t0 < q_end; t0 += tokens_per_tile) {
      const int64_t t1 = std::min(t0 + tokens_per_tile, q_end);
      // the queries are the sequence's last q_len positions; each sees keys at positions <= its own (with a tree
      // mask, any key of the block its mask row names: the whole sequence is in range)
      const int64_t block_start = kv_len - (q_end - q_begin);
      const int64_t first_pos = block_start + (t0 - q_begin);
      const int64_t last_pos = first_pos + (t1 - t0) - 1;
      const int64_t kv_end = std::clamp<int64_t>(p.tree_mask != nullptr ? kv_len : last_pos + 1, 0, kv_len);
      // keys before the window of the block's first token are never read (whole pages of them are skipped)
      const int64_t kv_begin = window_left >= 0 ? std::clamp<int64_t>(first_pos - window_left, 0, kv_end) : 0;
      blocks.push_back({b, 0, num_kv_heads, t0, t1, first_pos, block_start, kv_begin, kv_end});
    }
  }
  if (blocks.empty()) return;

  // KV heads per tile: as many as fit kMaxTileRows rows (a divisor of Hkv: every tile has the same heads), so a
  // chunk's K/V slots are read once for all heads; fewer where that would leave too few work items for the threads
  // (counting the key splits the tiles' lengths allow), except in batch-invariant mode.
  const int64_t num_threads = at::get_num_threads();
  const int64_t rows_per_head = tokens_per_tile * group;
  int64_t pieces = 0;  // work items per KV head that the blocks allow, splits included
  for (const Tile& t : blocks) pieces += std::max<int64_t>(1, (t.kv_end - t.kv_begin) / kMinSplitKeys);
  int64_t heads_per_tile = 1;
  for (int64_t hb = num_kv_heads; hb >= 1; --hb) {
    if (num_kv_heads % hb != 0) continue;
    const bool fits = hb == 1 || hb * rows_per_head <= kMaxTileRows;
    const bool enough_work =
        hb == 1 || p.batch_invariant || (num_kv_heads / hb) * pieces >= kItemsPerThread * num_threads;
    if (fits && enough_work) {
      heads_per_tile = hb;
      break;
    }
  }
  p.max_tile_rows = heads_per_tile * rows_per_head;
  std::vector<Tile> tiles;
  tiles.reserve(blocks.size() * (num_kv_heads / heads_per_tile));
  for (const Tile& block : blocks) {
    for (int64_t h = 0; h < num_kv_heads; h += heads_per_tile) {
      Tile t = block;
      t.kv_head = h;
      t.num_heads = heads_per_tile;
      tiles.push_back(t);
    }
  }

  // Items: split the tiles whose cost is large next to the whole job's, so that every thread gets work.
  auto tile_cost = [&](const Tile& t, int64_t keys) {  // +4 rows a head: loading a K/V row costs about that
    return std::max<int64_t>(keys, 1) * t.num_heads * ((t.q_end - t.q_begin) * group + 4);
  };
  int64_t total_cost = 0;
  for (const Tile& t : tiles) total_cost += tile_cost(t, t.kv_end - t.kv_begin);
  const int64_t target_cost = std::max<int64_t>(1, total_cost / (kItemsPerThread * num_threads));
  std::vector<WorkItem> items;
  std::vector<int64_t> item_cost;
  struct Merge {
    int64_t tile, first_slot, num_slots;
  };
  std::vector<Merge> merges;
  int64_t num_slots = 0;
  for (int64_t i = 0; i < static_cast<int64_t>(tiles.size()); ++i) {
    const Tile& t = tiles[i];
    const int64_t keys = t.kv_end - t.kv_begin;
    int64_t splits = 1;
    if (p.batch_invariant) {
      splits = (keys + kInvariantSplitKeys - 1) / kInvariantSplitKeys;
    } else if (num_threads > 1) {
      splits = std::min((tile_cost(t, keys) + target_cost - 1) / target_cost, keys / kMinSplitKeys);
      splits = std::max<int64_t>(splits, 1);
    }
    if (splits == 1) {
      items.push_back({i, t.kv_begin, t.kv_end, -1});
      item_cost.push_back(tile_cost(t, keys));
      continue;
    }
    // pieces of equal length, in whole chunks of keys (in batch-invariant mode kInvariantSplitKeys, the last shorter)
    const int64_t piece = (keys + splits - 1) / splits;
    const int64_t step =
        p.batch_invariant ? kInvariantSplitKeys : (piece + kKeyChunk - 1) / kKeyChunk * kKeyChunk;
    const int64_t first_slot = num_slots;
    for (int64_t k0 = t.kv_begin; k0 < t.kv_end; k0 += step) {
      const int64_t k1 = std::min(k0 + step, t.kv_end);
      items.push_back({i, k0, k1, num_slots++});
      item_cost.push_back(tile_cost(t, k1 - k0));
    }
    merges.push_back({i, first_slot, num_slots - first_slot});
  }

  std::unique_ptr<float[]> partial_storage;
  Partials partials{nullptr, nullptr, nullptr};
  if (num_slots > 0) {
    const int64_t rows = p.max_tile_rows;
    partial_storage.reset(new float[num_slots * rows * (p.value_dim + 2)]);
    partials.acc = partial_storage.get();
    partials.max = partials.acc + num_slots * rows * p.value_dim;
    partials.sum = partials.max + num_slots * rows;
  }

  // largest first, from a shared counter: a thread that drew short items takes more
  std::vector<int64_t> order(items.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return item_cost[a] > item_cost[b]; });
  const KernelTable& kernels = select_kernels();
  const int64_t num_items = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min(num_threads, num_items);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::unique_ptr<float[]> scratch(new float[scratch_floats(p)]);
    for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) {
      const WorkItem& item = items[order[i]];
      kernels.attend(p, tiles[item.tile], item, partials, scratch.get());
    }
  });
  if (!merges.empty()) {
    at::parallel_for(0, static_cast<int64_t>(merges.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m)
        kernels.merge(p, tiles[merges[m].tile], merges[m].first_slot, merges[m].num_slots, partials);
    });
  }
}

namespace {

// The internal op the Python CPU backend calls (attnops/backends/cpu.py), after attnops/checks.py validated
// everything: scale is resolved, kv_format is implied by the cache dtype.
void cpu_paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& block_table, const at::Tensor& seq_lens,
                         const std::optional<at::Tensor>& cu_seqlens_q, double scale, double soft_cap,
                         int64_t window_left, const std::optional<at::Tensor>& k_scale,
                         const std::optional<at::Tensor>& v_scale, const std::optional<at::Tensor>& sinks,
                         const std::optional<at::Tensor>& tree_mask, at::Tensor& out,
                         const std::optional<at::Tensor>& errors, const std::optional<at::Tensor>& lse,
                         bool batch_invariant) {
  check_errors("paged_attention", errors);
  paged_attention_cpu(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale, soft_cap, window_left, k_scale,
                      v_scale, sinks, tree_mask, out, errors, lse, batch_invariant);
}

#ifdef ATTNOPS_STANDALONE
// The public ops, for the C++-only build (CMake): in the Python package, attnops/ops.py implements them (validation,
// then dispatch among backends), so this build must not register them too.
void paged_attention_out(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& block_table, const at::Tensor& seq_lens,
                         const std::optional<at::Tensor>& cu_seqlens_q, std::optional<double> scale, double soft_cap,
                         int64_t window_left, c10::string_view kv_format, const std::optional<at::Tensor>& k_scale,
                         const std::optional<at::Tensor>& v_scale, const std::optional<at::Tensor>& sinks,
                         const std::optional<at::Tensor>& tree_mask, at::Tensor& out) {
  check_kv_format("paged_attention", kv_format, k_cache.scalar_type());
  const double resolved_scale = scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  paged_attention_cpu(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, resolved_scale, soft_cap, window_left,
                      k_scale, v_scale, sinks, tree_mask, out, std::nullopt, std::nullopt);
}

void paged_attention_with_lse_out(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_table, const at::Tensor& seq_lens,
                                  const std::optional<at::Tensor>& cu_seqlens_q, std::optional<double> scale,
                                  double soft_cap, int64_t window_left, c10::string_view kv_format,
                                  const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                                  const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& tree_mask,
                                  at::Tensor& out, at::Tensor& lse) {
  check_kv_format("paged_attention", kv_format, k_cache.scalar_type());
  const double resolved_scale = scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  paged_attention_cpu(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, resolved_scale, soft_cap, window_left,
                      k_scale, v_scale, sinks, tree_mask, out, std::nullopt, lse);
}

std::tuple<at::Tensor, at::Tensor> paged_attention_with_lse(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_table,
    const at::Tensor& seq_lens, const std::optional<at::Tensor>& cu_seqlens_q, std::optional<double> scale,
    double soft_cap, int64_t window_left, c10::string_view kv_format, const std::optional<at::Tensor>& k_scale,
    const std::optional<at::Tensor>& v_scale, const std::optional<at::Tensor>& sinks,
    const std::optional<at::Tensor>& tree_mask) {
  at::Tensor out = at::empty_like(q);
  at::Tensor lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  paged_attention_with_lse_out(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale, soft_cap, window_left,
                               kv_format, k_scale, v_scale, sinks, tree_mask, out, lse);
  return {out, lse};
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_table, const at::Tensor& seq_lens,
                           const std::optional<at::Tensor>& cu_seqlens_q, std::optional<double> scale, double soft_cap,
                           int64_t window_left, c10::string_view kv_format, const std::optional<at::Tensor>& k_scale,
                           const std::optional<at::Tensor>& v_scale, const std::optional<at::Tensor>& sinks,
                           const std::optional<at::Tensor>& tree_mask) {
  at::Tensor out = at::empty_like(q);
  paged_attention_out(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale, soft_cap, window_left, kv_format,
                      k_scale, v_scale, sinks, tree_mask, out);
  return out;
}
#endif  // ATTNOPS_STANDALONE

}  // namespace

// The instruction set of the inner loops this process runs ("avx512", "avx2" or "default"): for `attnops info`
// and for the tests, which run each copy (ATEN_CPU_CAPABILITY caps the choice).
std::string cpu_kernel_isa() { return select_kernels().isa; }

TORCH_LIBRARY_FRAGMENT(attnops, m) {
  m.def("cpu_kernel_isa() -> str", &cpu_kernel_isa);
  m.def(
      "cpu_paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, "
      "Tensor? cu_seqlens_q, float scale, float soft_cap, int window_left, Tensor? k_scale, Tensor? v_scale, "
      "Tensor? sinks, Tensor? tree_mask, Tensor(a!) out, Tensor(b!)? errors=None, Tensor(c!)? lse=None, "
      "bool batch_invariant=False) -> ()");
}

TORCH_LIBRARY_IMPL(attnops, CPU, m) {
  m.impl("cpu_paged_attention", &cpu_paged_attention);
#ifdef ATTNOPS_STANDALONE
  m.impl("paged_attention", &paged_attention);
  m.impl("paged_attention.out", &paged_attention_out);
  m.impl("paged_attention_with_lse", &paged_attention_with_lse);
  m.impl("paged_attention_with_lse.out", &paged_attention_with_lse_out);
#endif
}

}  // namespace attnops::cpu
