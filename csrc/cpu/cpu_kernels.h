// The interface between the host side of the CPU attention kernel (paged_attention.cpp: argument unpacking, work
// partitioning, threading; mla_attention.cpp unpacks latent attention's arguments into the same parameters) and
// its inner loops (attention_kernels.h), which are compiled once per instruction set (kernels_default.cpp,
// kernels_avx2.cpp, kernels_avx512.cpp) and picked at run time, the way ATen's own CPU kernels are.
//
// Only plain structs and raw pointers cross this boundary: the per-ISA translation units include as little of
// torch as possible (see kernels_avx512.cpp for why).
#pragma once

#include <cstdint>

namespace attnops::cpu {

// Element types of q, out and the caches. fp8 caches are read through a 256-entry table (Fp8 below); 4-bit caches
// (nvfp4, mxfp4: Fp4) and latent rows in DeepSeek's fp8 layout (LatentFp8: MLA's "fp8_ds_mla", a row of bytes: R
// e4m3 values, a float32 scale a 128 of them, P bf16 values) are dequantized a chunk of rows at a time into scratch
// memory.
enum class DType : int8_t { Float, BFloat16, Half, Fp8, Fp4, LatentFp8 };

struct AttentionParams {
  // q [T, Hq, D] and out [T, Hq, D]: any strides (q's last dim is contiguous; out's need not be).
  const void* q;
  int64_t q_stride_token, q_stride_head;
  void* out;
  int64_t out_stride_token, out_stride_head, out_stride_dim;
  DType q_dtype;  // also out's dtype
  // lse float32 [T, Hq], any strides (null: not asked for): each row's log-sum-exp, the natural log of its softmax
  // denominator (the sink's term included)
  float* lse;
  int64_t lse_stride_token, lse_stride_head;

  // k_cache / v_cache [num_pages, page_size, Hkv, D], equal strides, last dim contiguous. They may be views of
  // one [num_pages, 2, page_size, Hkv, D] tensor, so the page stride is not page_size * Hkv * D.
  const void* k_cache;
  const void* v_cache;
  int64_t cache_stride_page, cache_stride_slot, cache_stride_head;
  DType kv_dtype;
  const float* fp8_lut;  // kv_dtype == Fp8: stored byte -> float value (before the scale); Fp4: e4m3's (nvfp4 scales)
  // kv_dtype == Fp4 (nvfp4, mxfp4): the caches hold uint8 [.., D/2], two e2m1 values a byte (element 2i in the low
  // nibble), and the strides above count bytes; each block of fp4_block values has a scale in k_block_scale /
  // v_block_scale [num_pages, page_size, Hkv, D / fp4_block] (fp4_block 16: float8_e4m3fn, read through fp8_lut;
  // 32: e8m0, 2^(s - 127)), equal strides
  const uint8_t* k_block_scale;
  const uint8_t* v_block_scale;
  int64_t scale_stride_page, scale_stride_slot, scale_stride_head;
  int64_t fp4_block;

  // block_table int32 [B, max_pages] (any strides)
  const int32_t* block_table;
  int64_t bt_stride_seq, bt_stride_page;
  int page_shift;     // log2(page_size): page sizes are powers of two
  int64_t num_pages;  // a page index outside [0, num_pages) is never read: its keys are NaN to the rows seeing them

  int64_t num_q_heads, num_kv_heads, group, head_dim;
  // Latent attention (MLA) is multi-query attention whose K row is the whole latent row [c, r] and whose V row is
  // its first R values, with the query in two tensors. value_dim: the leading values of a V row that are the value
  // (head_dim in paged attention; R in MLA, where v_cache is k_cache). q_pe (null in paged attention) holds each
  // query row's values from q_nope_dim on, q (q_nope) those before; any strides, last dim contiguous.
  int64_t value_dim;
  const void* q_pe;
  int64_t q_pe_stride_token, q_pe_stride_head;
  int64_t q_nope_dim;
  float scale;          // softmax scale (applied to q . k)
  float soft_cap;       // > 0: scores become soft_cap * tanh(score / soft_cap)
  int64_t window_left;  // >= 0: a query sees keys at most window_left positions before it
  // [Hkv] per-head dequantization scales (all equal for a per-tensor scale; all 1 for non-fp8 caches)
  const float* k_scale;
  const float* v_scale;

  // [Hq] a logit per query head that joins every row's softmax denominator (null: none)
  const float* sinks;
  // bool [T, tree_mask_cols] (null: causal): inside its sequence's query block, row t sees block key j iff
  // tree_mask[t * tree_mask_stride + j], for j < tree_mask_cols; keys before the block stay visible
  const bool* tree_mask;
  int64_t tree_mask_stride, tree_mask_cols;

  int64_t max_tile_rows;  // rows (query tokens x heads of a group) of the largest tile: sizes the scratch

  // batch-invariant mode (attnops.batch_invariant): a sequence's keys are split every kInvariantSplitKeys from its
  // own first key and its tiles' heads follow from the head shape only, so that the order of a row's sums does not
  // depend on the other sequences of the call or on the thread count
  bool batch_invariant;
};

// A tile: the query rows of one sequence that are processed together: tokens [q_begin, q_end) x the query heads
// of KV heads [kv_head, kv_head + num_heads) (each KV head's `group` query heads), so that each K/V row is loaded
// once for all the rows of its group, and the K/V rows of a key slot (all the tile's heads) are read together.
struct Tile {
  int64_t seq;
  int64_t kv_head, num_heads;
  int64_t q_begin, q_end;    // rows of q (absolute)
  int64_t first_pos;         // position in the sequence of query row q_begin (queries are the sequence's last ones)
  int64_t block_start;       // position of the sequence's first query (its query block starts there)
  int64_t kv_begin, kv_end;  // keys any row of the tile can see
};

// One unit of parallel work: a tile against the keys [kv_begin, kv_end). A tile whose key range is split (long
// sequences, few tiles) writes unnormalized partial results to `partial_*[slot]`; merge() combines them.
struct WorkItem {
  int64_t tile;
  int64_t kv_begin, kv_end;
  int64_t slot;  // -1: writes the final output directly
};

// Partial results of split tiles: for slot s, row r: acc [slots][max_tile_rows][value_dim], row max m and row sum
// l [slots][max_tile_rows].
struct Partials {
  float* acc;
  float* max;
  float* sum;
};

// Keys processed per step of the online softmax (scores of a chunk are computed, then folded into the running
// max/sum and the accumulators). Chunks ignore page boundaries: each key's row address is looked up, so every page
// size from 1 to 256 takes the same path.
constexpr int64_t kKeyChunk = 32;

// The widest rows the inner loops take: a K row of head_dim values (paged attention's 512; MLA's R + P = 512 + 64)
// and a value of value_dim (paged attention's head_dim; MLA's R = 512).
constexpr int64_t kMaxHeadDim = 576, kMaxValueDim = 512;

// Floats of scratch memory one worker needs: the tile's q rows in fp32 ([rows][head_dim]) and its accumulators
// ([rows][value_dim]), the chunk's scores ([rows][kKeyChunk]), and the running max and sum ([rows] each); for a
// 4-bit, latent fp8 or fp8 cache also a chunk's K and V rows widened ([kKeyChunk][head_dim] each; latent
// attention's V rows are its K rows).
inline int64_t scratch_floats(const AttentionParams& p) {
  return p.max_tile_rows * (p.head_dim + p.value_dim + kKeyChunk + 2) +
         (p.kv_dtype == DType::Fp4 || p.kv_dtype == DType::LatentFp8 || p.kv_dtype == DType::Fp8
              ? 2 * kKeyChunk * p.head_dim
              : 0);
}

// An fp8 tile whose K rows each serve this many query rows (tokens x its group's heads) or more widens a chunk's
// rows once into scratch memory and runs the fp32 loops on them, instead of looking each value up once a row
// (attention_kernels.h, Fp8RowsLoader): the same bits, fewer lookups.
constexpr int64_t kFp8RowsMinShare = 8;

// The inner loops for one instruction set.
struct KernelTable {
  const char* isa;
  // Runs one work item. scratch: scratch_floats(p) floats owned by the calling thread.
  void (*attend)(const AttentionParams& p, const Tile& tile, const WorkItem& item, const Partials& partials,
                 float* scratch);
  // Combines the partial results of `num_slots` slots starting at `first_slot` into the output rows of `tile`.
  void (*merge)(const AttentionParams& p, const Tile& tile, int64_t first_slot, int64_t num_slots,
                const Partials& partials);
};

// Each returns nullptr when its instruction set was not compiled in (non-x86 hosts, other compilers).
const KernelTable* kernels_default();
const KernelTable* kernels_avx2();
const KernelTable* kernels_avx512();

// The table for this CPU: the widest instruction set that both the CPU and ATen's choice
// (ATEN_CPU_CAPABILITY) allow.
const KernelTable& select_kernels();

}  // namespace attnops::cpu
