// Latent attention (MLA) decode for sm_90a, in CUDA C++ with Hopper's warpgroup MMA (wgmma): the `cuda` backend's
// latent-attention kernel (attnops/backends/cuda_mla.py), called through torch.ops.attnops.mla_decode_sm90.
//
// Why not a Triton tile: every query head of a token attends to the same latent rows, so a block takes 64 heads
// as the M dimension of its MMAs and reads each row once for all of them; the 64 x 512 fp32 accumulator then
// needs two warpgroups' registers (128 a thread each), split by output column, with the scores computed once
// (docs/bench.md has the Triton tile's register and spill counts).
//
// A block: one token, 64 of its heads (rows past num_heads are zero queries, never written), one split of its
// keys, 256 threads = two warpgroups.
// - Shared memory: Q [64 x 576] and two stages of 64 latent rows [64 x 576] (cp.async, the next tile loading while
//   this one is used), P [64 x 64] bf16; every operand in wgmma's 128-byte-swizzle layout: 64-value column chunks
//   of [rows x 128 bytes], the 16-byte pieces of row r XORed with r % 8.
// - Warpgroup 0: S = Q K^T (m64n64k16 over 576 values), the online softmax (base 2), P to shared memory and
//   to registers; O[:, 0:256] += P V (P from registers).
// - Warpgroup 1: O[:, 256:512] += P V (P from shared memory), rescaled by warpgroup 0's factors.
// - V is the tile's first 512 values read N-major: the same shared memory as K, no copy.
// - An fp8 e4m3 cache (stored = value / kv_scale) is copied as bytes into two staging stages (where bf16's second
//   tile stage is) and widened to the one bf16 tile before the MMAs, exactly; kv_scale joins the scores' scale and
//   the output.
// - DeepSeek's fp8 layout (kv_format "fp8_ds_mla": 656-byte rows, 512 e4m3 values, a float32 scale a 128 of them,
//   64 bf16 rotary values) the same way through one staging stage (two would not fit beside Q and the tile): a
//   tile's values times their 128's scale rounded once to bf16 (as FlashMLA's), its rotary values copied; the next
//   tile's copy is issued once the stage is widened, not before.
// With one split the block writes out (bf16) and the LSE; with more, its normalised partial (fp32) and base-2 LSE
// for mla_merge_kernel (below), which also adds the sinks.
//
// Bad indices (docs/design.md): a sequence length outside [0, capacity] makes the token's rows NaN and reads
// nothing; a page index outside the cache is never read and makes NaN the rows whose split sees one of its keys.
// Each is recorded in the error buffer (attnops/errors.py) with atomic min.
#pragma once
#include <cuda.h>  // CUtensorMap
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <climits>
#include <cstdint>

#include "sm90_common.cuh"

namespace attnops::mla_sm90 {

using namespace attnops::sm90;  // (sm90_common.cuh: addressing, cp.async, wgmma)

constexpr int kR = 512, kP = 64, kD = kR + kP;  // latent, rotary, row width
constexpr int kRows = 64;                        // heads a block
constexpr int kKeys = 64;                        // keys a tile
constexpr int kThreads = 256;
constexpr int kChunks = kD / 64;                 // 64-value column chunks of a row
constexpr int kPieces = kD / 8;                  // 16-byte pieces of a row
constexpr int kChunkBytes = kKeys * 128;         // one column chunk of a tile (kRows == kKeys)
constexpr int kTileBytes = kChunks * kChunkBytes;
constexpr int kPBytes = kRows * kKeys * 2;
constexpr int kSmemBytes = 3 * kTileBytes + kPBytes + 3 * kRows * 4 + 2 * 8 + 1024;  // + 2 mbarriers, alignment
constexpr int kDsRowBytes = kR + 4 * (kR / 128) + 2 * kP;  // DeepSeek's fp8 layout: a row's bytes (656)
constexpr int kDsParts = kR / 128;                        // its scales a row
constexpr int kMarkerInts = 4;                    // the sm_90a marker's static shared memory (the probe)
static_assert(kSmemBytes <= 227 * 1024, "one block must fit an sm_90 SM's 227 KB of shared memory");
constexpr float kLn2 = 0.6931471805599453f;
constexpr int kErrBlockTable = 0, kErrSeqLens = 1, kErrCuSeqlensQ = 2;  // attnops/errors.py ARGUMENTS

struct Args {
  CUtensorMap kv_map;           // the cache as [num_pages][page_size][576], boxes of 64 values (the TMA forms)
  const __nv_bfloat16* q_nope;  // [T, H, 512], rows 16-byte aligned
  const __nv_bfloat16* q_pe;    // [T, H, 64]
  const uint8_t* kv;            // [num_pages, page_size, 576] bf16, or fp8 e4m3 (stored = value / kv_scale)
  const float* kv_scale;        // fp8: one element
  const int* block_table;
  const int* seq_lens;
  const int* cu_q;         // cu_seqlens_q [batch + 1] (several query tokens a sequence), or null: decode
  int* token_seq;          // with cu_q: [T] each token's sequence (-1: cu_q is bad), by mla_rows_kernel
  int* token_later;        // with cu_q: [T] the rows of its sequence after it
  __nv_bfloat16* out;  // [T, H, 512] (one split)
  float* lse;          // [T, H] natural log, or null
  float* part_out;     // [T, H, splits, 512] (splits > 1)
  float* part_lse;     // [T, H, splits], base 2
  int* errors;
  int64_t q_nope_token, q_nope_head, q_pe_token, q_pe_head, out_token, out_head;
  int64_t kv_page, kv_token;  // bytes
  int table_stride, num_pages, page_size, capacity, num_heads, head_blocks, chunk, splits;
  int num_tokens, batch;  // T, and the sequences (seq_lens' length)
  int group;  // query tokens of a sequence a block takes (verify, at most 32 heads: group x heads <= 64 rows), or 1
  float qk_scale_log2;  // softmax scale x log2(e)
  int stages;           // kAllStages; benchmarks/cuda_mla_stages.py times the kernel with a stage left out
};
// The stages a call runs (benchmarks leave one out to see what a tile's time is made of; the op runs all)
constexpr int kAllStages = 0, kNoLoadsAfterFirst = 1, kLoadsOnly = 2;

// Byte offset of 16-byte piece `piece` (0 .. 71) of row `row` in a [rows x 576] operand: column chunk piece / 8,
// the piece XORed with row % 8 inside its 128-byte line (the 128-byte swizzle)
__device__ __forceinline__ uint32_t swizzled(int row, int piece) {
  return (piece >> 3) * kChunkBytes + row * 128 + (((piece & 7) ^ (row & 7)) << 4);
}

// mbarriers (the TMA path's tiles): a stage's barrier completes a phase when its tile's bytes have all landed
__device__ __forceinline__ void mbarrier_init(uint32_t bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar));
}
__device__ __forceinline__ void mbarrier_expect_bytes(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nwait_%=:\nmbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
// One box of the cache's tensor map ({64 values, rows, 1 page} at value c0, row c1 of page c2) into shared memory
// in the 128-byte swizzle (the wgmma layout: the box's rows land on 128-byte lines of a 1024-byte aligned chunk);
// coordinates outside the map (a bad page index) land as zeros
__device__ __forceinline__ void tma_box(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];\n" ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

// The 128 accumulator registers of an m64n256 wgmma: the operand list, and the operands (d: float[128])
#define ATTNOPS_D128 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, " \
    "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, " \
    "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, " \
    "%59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, " \
    "%78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, " \
    "%97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, " \
    "%113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define ATTNOPS_D128_OPERANDS(d) \
    "+f"((d)[0]), "+f"((d)[1]), "+f"((d)[2]), "+f"((d)[3]), "+f"((d)[4]), "+f"((d)[5]), "+f"((d)[6]), \
    "+f"((d)[7]), "+f"((d)[8]), "+f"((d)[9]), "+f"((d)[10]), "+f"((d)[11]), "+f"((d)[12]), "+f"((d)[13]), \
    "+f"((d)[14]), "+f"((d)[15]), "+f"((d)[16]), "+f"((d)[17]), "+f"((d)[18]), "+f"((d)[19]), \
    "+f"((d)[20]), "+f"((d)[21]), "+f"((d)[22]), "+f"((d)[23]), "+f"((d)[24]), "+f"((d)[25]), \
    "+f"((d)[26]), "+f"((d)[27]), "+f"((d)[28]), "+f"((d)[29]), "+f"((d)[30]), "+f"((d)[31]), \
    "+f"((d)[32]), "+f"((d)[33]), "+f"((d)[34]), "+f"((d)[35]), "+f"((d)[36]), "+f"((d)[37]), \
    "+f"((d)[38]), "+f"((d)[39]), "+f"((d)[40]), "+f"((d)[41]), "+f"((d)[42]), "+f"((d)[43]), \
    "+f"((d)[44]), "+f"((d)[45]), "+f"((d)[46]), "+f"((d)[47]), "+f"((d)[48]), "+f"((d)[49]), \
    "+f"((d)[50]), "+f"((d)[51]), "+f"((d)[52]), "+f"((d)[53]), "+f"((d)[54]), "+f"((d)[55]), \
    "+f"((d)[56]), "+f"((d)[57]), "+f"((d)[58]), "+f"((d)[59]), "+f"((d)[60]), "+f"((d)[61]), \
    "+f"((d)[62]), "+f"((d)[63]), "+f"((d)[64]), "+f"((d)[65]), "+f"((d)[66]), "+f"((d)[67]), \
    "+f"((d)[68]), "+f"((d)[69]), "+f"((d)[70]), "+f"((d)[71]), "+f"((d)[72]), "+f"((d)[73]), \
    "+f"((d)[74]), "+f"((d)[75]), "+f"((d)[76]), "+f"((d)[77]), "+f"((d)[78]), "+f"((d)[79]), \
    "+f"((d)[80]), "+f"((d)[81]), "+f"((d)[82]), "+f"((d)[83]), "+f"((d)[84]), "+f"((d)[85]), \
    "+f"((d)[86]), "+f"((d)[87]), "+f"((d)[88]), "+f"((d)[89]), "+f"((d)[90]), "+f"((d)[91]), \
    "+f"((d)[92]), "+f"((d)[93]), "+f"((d)[94]), "+f"((d)[95]), "+f"((d)[96]), "+f"((d)[97]), \
    "+f"((d)[98]), "+f"((d)[99]), "+f"((d)[100]), "+f"((d)[101]), "+f"((d)[102]), "+f"((d)[103]), \
    "+f"((d)[104]), "+f"((d)[105]), "+f"((d)[106]), "+f"((d)[107]), "+f"((d)[108]), "+f"((d)[109]), \
    "+f"((d)[110]), "+f"((d)[111]), "+f"((d)[112]), "+f"((d)[113]), "+f"((d)[114]), "+f"((d)[115]), \
    "+f"((d)[116]), "+f"((d)[117]), "+f"((d)[118]), "+f"((d)[119]), "+f"((d)[120]), "+f"((d)[121]), \
    "+f"((d)[122]), "+f"((d)[123]), "+f"((d)[124]), "+f"((d)[125]), "+f"((d)[126]), "+f"((d)[127])

// O += P V: P [64 x 16] bf16 in registers (each warp's 16 rows as mma.m16n8k16's A fragments), V [16 x 256] N-major
// in shared memory (descriptor); O fp32 [64 x 256]
__device__ __forceinline__ void wgmma_m64n256k16_rs(float (&d)[128], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" ATTNOPS_D128 "}, {%128, %129, %130, %131}, %132, "
      "p, 1, 1, 1;\n}\n"
      : ATTNOPS_D128_OPERANDS(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(1));
}

// O += P V: P [64 x 16] K-major and V [16 x 256] N-major, both in shared memory; O fp32 [64 x 256]
__device__ __forceinline__ void wgmma_m64n256k16_ss(float (&d)[128], uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" ATTNOPS_D128 "}, %128, %129, p, 1, 1, 0, "
      "1;\n}\n"
      : ATTNOPS_D128_OPERANDS(d)
      : "l"(desc_a), "l"(desc_b), "n"(1));
}

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ATTNOPS_MLA_SM90A 1  // wgmma: sm_90a code only (an sm_90 build leaves the kernel empty; the probe says so)
#endif

// A block's token, head block and split (blockIdx), and its split's keys [lo, hi) of the token's sequence, `tiles`
// of 64 (the last maybe partial). Decode: token b is sequence b's one query row. Several query tokens a sequence
// (verify): mla_rows_kernel has written each token's sequence and how many of the sequence's rows follow it, and
// the token sees the keys up to its own position, like paged attention's rows. With group 1 each such row is its
// own block (a sequence's rows read its keys once each, mostly from L2); with a larger group (at most 32 heads) a
// block takes `tokens` consecutive rows of one sequence, its M rows (token, head) = (row / heads, row % heads), and
// reads their keys once: the block of the group's first token works, the others leave at once (a grid of shapes
// only). A sequence length outside [0, capacity] is recorded and read as no key; a bad cu_seqlens_q (sequence -1)
// too (len_bad: the rows are NaN in the end), each of its tokens a block of its own.
struct BlockKeys {
  int token, head_block, split, lo, hi, tiles;
  int tokens;     // query tokens the block's rows hold (1 but with a group)
  int first_end;  // the first token's keys end (may be negative: a sequence shorter than its rows)
  bool len_bad, idle;
  const int* table_row;  // the sequence's block-table row
};
__device__ __forceinline__ int sequence_of(const Args& a, int token) {
  return a.token_seq != nullptr ? a.token_seq[token] : token;
}
// kPacked (the packed decode kernel's; every other kernel takes one token a block): a.group tokens a block.
template <bool kPacked = false>
__device__ __forceinline__ BlockKeys block_keys(const Args& a, int tid) {
  BlockKeys k;
  k.token = blockIdx.x / a.head_blocks, k.head_block = blockIdx.x % a.head_blocks, k.split = blockIdx.y;
  const int seq = sequence_of(a, k.token);
  const int later_rows = a.token_seq != nullptr ? a.token_later[k.token] : 0;
  k.tokens = 1, k.idle = false;
  if (kPacked && seq >= 0) {
    k.idle = (k.token - a.cu_q[seq]) % a.group != 0;
    k.tokens = min(a.group, later_rows + 1);
  }
  int seq_len = seq < 0 ? 0 : a.seq_lens[seq];
  const bool len_bad = seq_len < 0 || seq_len > a.capacity;
  if (len_bad && !k.idle && k.head_block == 0 && k.split == 0 && tid == 0) atomicMin(a.errors + kErrSeqLens, seq);
  k.len_bad = seq < 0 || len_bad;
  k.first_end = (k.len_bad ? 0 : seq_len) - later_rows;
  k.lo = k.split * a.chunk;
  k.hi = min(k.lo + a.chunk, max(k.first_end + k.tokens - 1, 0));
  k.tiles = k.hi > k.lo ? (k.hi - k.lo + kKeys - 1) / kKeys : 0;
  k.table_row = a.block_table + static_cast<int64_t>(seq < 0 ? 0 : seq) * a.table_stride;
  return k;
}

// Row `row` of a block's 64: its query token, its head, and whether it is one (rows past the heads, or past the
// group's tokens, are zero queries, never written)
struct Row {
  int token, head;
  bool valid;
};
template <bool kPacked = false>
__device__ __forceinline__ Row row_of(const Args& a, const BlockKeys& k, int row) {
  if constexpr (!kPacked) {
    const int head = k.head_block * kRows + row;
    return {k.token, head, head < a.num_heads};
  }
  const int t = row / a.num_heads;
  return {k.token + t, row - t * a.num_heads, t < k.tokens};
}
// The end of the keys row `row` sees in the block's split (its token's own position; with group 1 the split's)
template <bool kPacked = false>
__device__ __forceinline__ int row_end(const Args& a, const BlockKeys& k, int row) {
  return kPacked ? min(k.hi, max(k.first_end + row / a.num_heads, 0)) : k.hi;
}

// A split that starts at or past its sequence's end (the short sequences of a ragged batch, whose splits cover the
// table's capacity): nothing to read, so with several splits the block only marks its partials empty (base-2 LSE
// -inf: the merge skips them) and leaves. With one split, or a bad length, the full path writes the rows. A block
// of a group's later token leaves at once (the group's first writes its rows).
template <bool kPacked = false>
__device__ __forceinline__ bool empty_split(const Args& a, const BlockKeys& k, int tid) {
  if (kPacked && k.idle) return true;
  if (a.splits == 1 || k.tiles > 0 || k.len_bad) return false;
  const Row r = row_of<kPacked>(a, k, tid);
  if (tid < kRows && r.valid)
    a.part_lse[(static_cast<int64_t>(r.token) * a.num_heads + r.head) * a.splits + k.split] = -INFINITY;
  return true;
}

// The page of thread tid's key in the tile of keys [start, start + 64) (0 past `end`): read a tile ahead of its
// copy, so that the copy never waits on the block table
__device__ __forceinline__ int page_of(const Args& a, const int* table_row, int start, int end, int tid) {
  const int key = start + (tid >> 2);
  return key < end ? table_row[key / a.page_size] : 0;
}

// Loads the latent rows of keys [start, start + 64) into `dst` (keys at or past `end` zero-filled, read from
// nowhere): thread tid takes row tid / 4 (its key's page: page_of), pieces tid % 4 + 4 j. bf16: straight into the
// swizzled tile; fp8: into a staging area of plain [64 x 576]-byte rows, for to_bf16_tile. Returns whether its key
// is visible and sits in a page outside the cache (never read).
// kDs: DeepSeek's fp8 layout's rows (kDsRowBytes each) staged the same way.
template <bool kFp8, bool kDs = false>
__device__ __forceinline__ bool load_tile(const Args& a, int page, int start, int end, uint32_t dst, int tid) {
  const int row = tid >> 2;
  const int key = start + row;
  const bool visible = key < end;
  const bool bad = visible && (page < 0 || page >= a.num_pages);
  const bool ok = visible && !bad;
  const uint8_t* src =
      ok ? a.kv + static_cast<int64_t>(page) * a.kv_page + static_cast<int64_t>(key % a.page_size) * a.kv_token : a.kv;
  constexpr int kRowPieces = kDs ? kDsRowBytes / 16 : kFp8 ? kD / 16 : kPieces;
  constexpr int kRowBytes = kDs ? kDsRowBytes : kD;
#pragma unroll
  for (int j = 0; j < (kRowPieces + 3) / 4; ++j) {
    const int piece = (tid & 3) + 4 * j;
    if (kRowPieces % 4 == 0 || piece < kRowPieces)
      cp_async_16(dst + (kFp8 ? row * kRowBytes + piece * 16 : swizzled(row, piece)), src + (ok ? piece * 16 : 0),
                  ok);
  }
  return bad;
}

// The page of each box of a tile's keys [start, start + 64) (boxes of `rows` keys, rows >= 8: at most kMaxBoxes),
// every table entry read before any copy is issued (one round trip, not one a box); -1 past `end` (read as zeros,
// no table entry past the sequence's). `bad`: a visible key's page is outside the cache.
constexpr int kMaxBoxes = kKeys / 8;
__device__ __forceinline__ void box_pages(const Args& a, const int* table_row, int start, int end, int rows,
                                          int (&pages)[kMaxBoxes], bool& bad) {
#pragma unroll
  for (int r = 0; r < kMaxBoxes; ++r) {
    const int key = start + r * rows;
    const bool visible = r * rows < kKeys && key < end;
    pages[r] = visible ? table_row[key / a.page_size] : -1;
    bad |= visible && (pages[r] < 0 || pages[r] >= a.num_pages);
  }
}

// Copies of the keys [start, start + 64) into the tile at `dst` by the tensor memory accelerator, from one thread,
// awaited on `bar`: column chunks [first, first + count) and, with `rope`, the rotary chunk 8, in boxes of
// min(page_size, 64) rows. Returns whether a page index of a visible key (< `end`) is outside the cache (its boxes
// land as zeros; the rows are NaN in the end).
// The boxes of a tile's keys [start, start + 64): box(r, first row of the box in the tile, its row in its page)
// for each box r of min(page_size, 64) rows (the box's page: pages[r])
template <class Box>
__device__ __forceinline__ void for_each_box(const Args& a, int start, Box box) {
  const int rows = min(a.page_size, kKeys);
#pragma unroll
  for (int r = 0; r < kMaxBoxes; ++r)
    if (r * rows < kKeys) box(r, r * rows, (start + r * rows) % a.page_size);
}
// tma_boxes: the same with the boxes' pages already read (box_pages)
__device__ __forceinline__ void tma_boxes(const Args& a, const int (&pages)[kMaxBoxes], int start, uint32_t dst,
                                          uint32_t bar, int first, int count, bool rope) {
  mbarrier_expect_bytes(bar, (count + (rope ? 1 : 0)) * kChunkBytes);
  for_each_box(a, start, [&](int r, int tile_row, int row) {
#pragma unroll
    for (int c = 0; c < kChunks - 1; ++c)
      if (c < count)
        tma_box(dst + (first + c) * kChunkBytes + tile_row * 128, &a.kv_map, bar, (first + c) * 64, row, pages[r]);
    if (rope) tma_box(dst + 8 * kChunkBytes + tile_row * 128, &a.kv_map, bar, 8 * 64, row, pages[r]);
  });
}
// An L2 prefetch of the boxes tma_boxes copies (the same coordinates, no shared memory, no mbarrier): a tile whose
// stage is not yet free starts its way from memory, and the copy issued once it is lands from L2
// (kBoxes: the 64-value boxes of a row, from its start; DeepSeek's fp8 layout's 656-byte rows are 11 of 64 bytes)
template <int kBoxes = kChunks>
__device__ __forceinline__ void tma_prefetch(const Args& a, const int (&pages)[kMaxBoxes], int start) {
  for_each_box(a, start, [&](int r, int, int row) {
#pragma unroll
    for (int c = 0; c < kBoxes; ++c)
      asm volatile("cp.async.bulk.prefetch.tensor.3d.L2.global.tile [%0, {%1, %2, %3}];\n" ::"l"(
                       reinterpret_cast<uint64_t>(&a.kv_map)),
                   "r"(c * 64), "r"(row), "r"(pages[r])
                   : "memory");
  });
}

// Rows [visible, 64) of a tile's eight value chunks zeroed by one warpgroup (thread wg_tid; the split's last tile:
// rows past a sequence's end may hold anything, NaN included, and P V must not meet them; their scores are masked).
// The caller fences and syncs before the MMAs read them.
__device__ __forceinline__ void zero_rows_past(uint8_t* tile, int visible, int wg_tid) {
  for (int z = wg_tid; z < (kKeys - visible) * 8 * 8; z += 128) {
    const int row = visible + z / 64, chunk = (z / 8) % 8, piece = z % 8;
    *reinterpret_cast<uint4*>(tile + chunk * kChunkBytes + row * 128 + piece * 16) = make_uint4(0, 0, 0, 0);
  }
}

// Warpgroup 0's S = Q K^T over 576 values (Q and the tile K-major, swizzled), issued and committed, not awaited
__device__ __forceinline__ void issue_scores(float (&s)[32], uint32_t s_q, uint32_t tile) {
#pragma unroll
  for (int z = 0; z < 32; ++z) s[z] = 0.0f;
  pin(s);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) {
    const uint32_t offset = (kk >> 2) * kChunkBytes + (kk & 3) * 32;
    wgmma_m64n64k16_ss(s, descriptor(s_q + offset, 16, 1024), descriptor(tile + offset, 16, 1024), kk > 0);
  }
  wgmma_commit();
}

__device__ __forceinline__ bool tma_chunks(const Args& a, const int* table_row, int start, int end, uint32_t dst,
                                           uint32_t bar, int first, int count, bool rope) {
  int pages[kMaxBoxes];
  bool bad = false;
  box_pages(a, table_row, start, end, min(a.page_size, kKeys), pages, bad);
  tma_boxes(a, pages, start, dst, bar, first, count, rope);
  return bad;
}

// Two e4m3 values as a bf16 pair, times `scale` in fp32 and rounded once (scale 1: exactly, every e4m3 value is a
// bf16 value)
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint16_t pair, float scale = 1.0f) {
  const __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3);
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&raw));
  return pack_bf16(f.x * scale, f.y * scale);
}

// 16 staged e4m3 values (one 16-byte word, in order) times `scale` as the bf16 pieces 2 piece and 2 piece + 1 of
// the tile's row `row` (swizzled)
__device__ __forceinline__ void widen_piece(uint8_t* tile, int row, int piece, const uint4& v, float scale) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
  uint32_t out[8];
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    out[2 * w] = e4m3x2_to_bf16x2(static_cast<uint16_t>(words[w] & 0xffff), scale);
    out[2 * w + 1] = e4m3x2_to_bf16x2(static_cast<uint16_t>(words[w] >> 16), scale);
  }
  *reinterpret_cast<uint4*>(tile + swizzled(row, 2 * piece)) = make_uint4(out[0], out[1], out[2], out[3]);
  *reinterpret_cast<uint4*>(tile + swizzled(row, 2 * piece + 1)) = make_uint4(out[4], out[5], out[6], out[7]);
}

// fp8: a staged tile's rows [64 x 576 bytes] as the bf16 tile QK and PV read (thread tid: row tid / 4, 16-byte
// pieces tid % 4 + 4 j of it, each two bf16 pieces)
__device__ __forceinline__ void to_bf16_tile(const uint8_t* stage, uint8_t* tile, int tid) {
  const int row = tid >> 2;
#pragma unroll
  for (int j = 0; j < kD / 16 / 4; ++j) {
    const int piece = (tid & 3) + 4 * j;
    widen_piece(tile, row, piece, *reinterpret_cast<const uint4*>(stage + row * kD + piece * 16), 1.0f);
  }
}

// DeepSeek's fp8 layout: a staged tile's rows [64 x 656 bytes] as the bf16 tile (thread tid: row tid / 4, its
// 16-byte pieces of e4m3 values tid % 4 + 4 j, each value times its 128's scale in fp32 and rounded once, and rotary
// pieces tid % 4 and + 4 copied). Rows the copy zero-filled (past the end, bad pages) read as zeros, scales too.
__device__ __forceinline__ void ds_to_bf16_tile(const uint8_t* stage, uint8_t* tile, int tid) {
  const int row = tid >> 2;
  const uint8_t* src = stage + row * kDsRowBytes;
  const float4 scale4 = *reinterpret_cast<const float4*>(src + kR);
  const float scales[kDsParts] = {scale4.x, scale4.y, scale4.z, scale4.w};
#pragma unroll
  for (int j = 0; j < kR / 16 / 4; ++j) {
    const int piece = (tid & 3) + 4 * j;  // (values 16 piece ..: the 128 j / 2)
    widen_piece(tile, row, piece, *reinterpret_cast<const uint4*>(src + piece * 16), scales[j / 2]);
  }
#pragma unroll
  for (int k = tid & 3; k < kP / 8; k += 4)
    *reinterpret_cast<uint4*>(tile + swizzled(row, kR / 8 + k)) =
        *reinterpret_cast<const uint4*>(src + kR + 4 * kDsParts + 16 * k);
}

// Warpgroup 0's online softmax of a tile's scores s (base 2; s[4 j + c]: row row0 (c < 2) or row1, key start + 8 j + 2
// t4 + c % 2; the keys at or past the row's end, end0 or end1, masked): the rows' running maxima and this thread's sums
// updated, P to registers (the A fragments of P V) and to shared memory (p_bytes: P [64 x 64] K-major, swizzled), the
// rows' factors returned and written to s_alpha for warpgroup 1; fenced for the MMAs' reads. s is only read (it may be
// a wgmma's accumulator, which no other instruction may write while a wgmma is in flight: ptxas would serialise the
// kernel's wgmmas).
__device__ __forceinline__ void softmax_tile(const float (&s)[32], int start, int end0, int end1, int t4, int row0,
                                             int row1, float qk_scale_log2, float& m0, float& m1, float& l0,
                                             float& l1, uint32_t (&p_frag)[4][4], uint8_t* p_bytes, float* s_alpha,
                                             float& alpha0, float& alpha1) {
  const auto masked = [&](int j, int c) {  // (-inf past the end)
    return start + 8 * j + 2 * t4 + (c & 1) < (c < 2 ? end0 : end1) ? s[4 * j + c] * qk_scale_log2 : -INFINITY;
  };
  float max0 = -INFINITY, max1 = -INFINITY;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    max0 = fmaxf(max0, fmaxf(masked(j, 0), masked(j, 1)));
    max1 = fmaxf(max1, fmaxf(masked(j, 2), masked(j, 3)));
  }
  const float new0 = fmaxf(m0, quad_max(max0)), new1 = fmaxf(m1, quad_max(max1));
  const float base0 = new0 == -INFINITY ? 0.0f : new0, base1 = new1 == -INFINITY ? 0.0f : new1;
  alpha0 = exp2f(m0 - base0);
  alpha1 = exp2f(m1 - base1);
  m0 = new0;
  m1 = new1;
  float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float p0 = exp2f(masked(j, 0) - base0), p1 = exp2f(masked(j, 1) - base0);
    const float p2 = exp2f(masked(j, 2) - base1), p3 = exp2f(masked(j, 3) - base1);
    sum0 += p0 + p1;
    sum1 += p2 + p3;
    const uint32_t pair0 = pack_bf16(p0, p1), pair1 = pack_bf16(p2, p3);
    // shared memory: P [64 x 64] K-major, keys 8 j .. 8 j + 7 are piece j of the row
    *reinterpret_cast<uint32_t*>(p_bytes + row0 * 128 + ((j ^ (row0 & 7)) << 4) + t4 * 4) = pair0;
    *reinterpret_cast<uint32_t*>(p_bytes + row1 * 128 + ((j ^ (row1 & 7)) << 4) + t4 * 4) = pair1;
    // registers: the A fragments of 16-key step j / 2 (keys + 0..7: a0 a1; + 8..15: a2 a3)
    p_frag[j >> 1][(j & 1) * 2] = pair0;
    p_frag[j >> 1][(j & 1) * 2 + 1] = pair1;
  }
  l0 = l0 * alpha0 + sum0;
  l1 = l1 * alpha1 + sum1;
  if (t4 == 0) {
    s_alpha[row0] = alpha0;
    s_alpha[row1] = alpha1;
  }
  fence_proxy_async();
}

// O *= the rows' factors (row0: scale0, row1: scale1)
__device__ __forceinline__ void scale_rows(float (&o)[128], float scale0, float scale1) {
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    o[4 * j] *= scale0;
    o[4 * j + 1] *= scale0;
    o[4 * j + 2] *= scale1;
    o[4 * j + 3] *= scale1;
  }
}

// O (+)= P V over a tile's 64 keys, V = the tile's 256 columns at `v_cols` (N-major), P from registers or from
// shared memory (an SS operand)
__device__ __forceinline__ void pv_rs(float (&o)[128], const uint32_t (&p_frag)[4][4], uint32_t v_cols) {
#pragma unroll
  for (int kk = 0; kk < kKeys / 16; ++kk)
    wgmma_m64n256k16_rs(o, p_frag[kk], descriptor(v_cols + kk * 2048, kChunkBytes, 1024));
}
__device__ __forceinline__ void pv_ss(float (&o)[128], uint32_t s_p, uint32_t v_cols) {
#pragma unroll
  for (int kk = 0; kk < kKeys / 16; ++kk)
    wgmma_m64n256k16_ss(o, descriptor(s_p + kk * 32, 16, 1024), descriptor(v_cols + kk * 2048, kChunkBytes, 1024));
}

// The end of a block: this thread's rows (row0, row1) of its warpgroup's 256 output columns, normalised by the
// rows' sums s_l with their maxima s_m (base 2): with one split, out (bf16) and the LSE; with more, the split's
// partial (fp32) and base-2 LSE for mla_merge_kernel. A row that sees key `bad_from` (nan_from) is NaN.
template <bool kPacked = false>
__device__ __forceinline__ void store_rows(const Args& a, const float (&o)[128], int wg, int t4, int row0, int row1,
                                           const BlockKeys& k, const float* s_m, const float* s_l, int bad_from,
                                           float kv_scale) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = r ? row1 : row0;
    const Row q = row_of<kPacked>(a, k, row);
    if (!q.valid) continue;
    const bool nan_row = row_end<kPacked>(a, k, row) > bad_from;
    const float l = s_l[row], m = s_m[row];
    const bool has_keys = l > 0.0f;
    const float inv = nan_row ? NAN : (has_keys ? kv_scale / l : 0.0f);
    const float lse2 = nan_row ? NAN : (has_keys ? m + log2f(l) : -INFINITY);
    const int col = wg * 256 + 2 * t4;
    const int64_t row_index = static_cast<int64_t>(q.token) * a.num_heads + q.head;
    if (a.splits == 1) {
      __nv_bfloat16* dst = a.out + q.token * a.out_token + q.head * a.out_head + col;
#pragma unroll
      for (int j = 0; j < 32; ++j)
        *reinterpret_cast<__nv_bfloat162*>(dst + 8 * j) =
            __floats2bfloat162_rn(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
      if (a.lse != nullptr && wg == 0 && t4 == 0) a.lse[row_index] = lse2 * kLn2;
    } else {
      const int64_t part = row_index * a.splits + k.split;
      float* dst = a.part_out + part * kR + col;
#pragma unroll
      for (int j = 0; j < 32; ++j)
        *reinterpret_cast<float2*>(dst + 8 * j) = make_float2(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
      if (wg == 0 && t4 == 0) a.part_lse[part] = lse2;
    }
  }
}

// The first key whose sight makes a row NaN (store_rows' bad_from): -1 with a bad length (every row); with a bad
// page seen in the split (`poisoned`, block-uniform), the split's first key where every row sees the whole split
// (group 1), else the first key of the split in a page outside the cache, looked up in the table by the block's
// threads through one shared int `scratch` (the rows of a group's earlier tokens may stop before it: exact);
// none (INT_MAX) otherwise
template <bool kPacked = false>
__device__ __forceinline__ int nan_from(const Args& a, const BlockKeys& k, bool poisoned, int tid, int* scratch) {
  if (k.len_bad) return -1;
  if (!poisoned) return INT_MAX;
  if constexpr (!kPacked) return k.lo;
  if (tid == 0) *scratch = INT_MAX;
  __syncthreads();
  for (int p = k.lo / a.page_size + tid; p <= (k.hi - 1) / a.page_size; p += kThreads) {
    const int page = k.table_row[p];
    if (page < 0 || page >= a.num_pages) atomicMin(scratch, max(p * a.page_size, k.lo));
  }
  __syncthreads();
  const int first = *scratch;
  __syncthreads();  // (every thread has read it before the scratch is reused)
  return first;
}

// Q [64 x 576] of the block's rows into shared memory (swizzled; zeros in rows that are no query: row_of):
// cp.async, committed by the caller; thread tid: row tid / 4, pieces tid % 4 + 4 j
template <bool kPacked = false>
__device__ __forceinline__ void load_q(const Args& a, uint32_t s_q, const BlockKeys& k, int tid) {
  const int row = tid >> 2;
  const Row q = row_of<kPacked>(a, k, row);
  const int token = q.valid ? q.token : k.token, head = q.valid ? q.head : 0;
  const __nv_bfloat16* nope = a.q_nope + token * a.q_nope_token + head * a.q_nope_head;
  const __nv_bfloat16* pe = a.q_pe + token * a.q_pe_token + head * a.q_pe_head;
#pragma unroll
  for (int j = 0; j < kPieces / 4; ++j) {
    const int piece = (tid & 3) + 4 * j;
    cp_async_16(s_q + swizzled(row, piece), piece < kR / 8 ? nope + piece * 8 : pe + (piece - kR / 8) * 8, q.valid);
  }
}

// The end of a heads-as-rows block (both warpgroups): a bad page seen by any thread recorded and the rows that see
// it made NaN (nan_from), warpgroup 0's row sums reduced and handed over with the maxima (s_m, s_l), the rows
// stored (store_rows)
template <bool kPacked = false>
__device__ __forceinline__ void finish_rows(const Args& a, const float (&o)[128], bool saw_bad, const BlockKeys& k,
                                            int tid, int wg, int t4, int row0, int row1, float m0, float m1, float l0,
                                            float l1, float* s_m, float* s_l, float kv_scale) {
  const bool poisoned = __syncthreads_or(saw_bad) != 0;  // a visible key of this split in a bad page
  if (poisoned && tid == 0) atomicMin(a.errors + kErrBlockTable, sequence_of(a, k.token));
  const int bad_from = nan_from<kPacked>(a, k, poisoned, tid, reinterpret_cast<int*>(s_m));  // (before s_m's writes)
  if (wg == 0) {
    l0 = quad_sum(l0);
    l1 = quad_sum(l1);
    if (t4 == 0) {
      s_m[row0] = m0;
      s_m[row1] = m1;
      s_l[row0] = l0;
      s_l[row1] = l1;
    }
  }
  __syncthreads();
  store_rows<kPacked>(a, o, wg, t4, row0, row1, k, s_m, s_l, bad_from, kv_scale);
}

// kFp8: an fp8 e4m3 cache, staged as bytes (two stages in the second tile's place) and widened to one bf16 tile
// before the MMAs; kv_scale joins the scores' scale and the output, never the MMAs.
// kTma (bf16, pages of 8 rows or more; the bf16 default, faster than cp.async: docs/bench.md): a whole tile is copied
// by the tensor memory accelerator, issued by one thread of warpgroup 1 and awaited on its stage's mbarrier, not by 256
// threads' cp.async (whose copies held up the MMAs behind them); the last, partial tile of a split still by cp.async,
// which fills the keys past the end with zeros (rows past a sequence's end may hold anything, NaN included, and P V
// must not meet them).
// kPacked: a.group query tokens of a sequence a block (verify at up to 32 heads: block_keys), each row masked at its
// own end (row_end); a separate instantiation, so that the one-token kernels keep their code.
// kDs (with kFp8): DeepSeek's fp8 layout, one byte stage.
template <bool kFp8, bool kTma, bool kPacked, bool kDs = false>
__global__ void __launch_bounds__(kThreads, 1) mla_decode_kernel(const __grid_constant__ Args a) {
  static_assert(!(kFp8 && kTma), "the TMA path copies bf16 tiles");
  static_assert(kFp8 || !kDs, "DeepSeek's layout is staged as fp8 bytes");
#if defined(ATTNOPS_MLA_SM90A)
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = aligned_smem(smem_raw);
  const uint32_t s_q = smem_u32(smem);
  const uint32_t s_k = s_q + kTileBytes;  // bf16: two stages of kTileBytes; fp8: the tile, then two byte stages
  constexpr int kStageBytes = kFp8 ? kKeys * kD : kTileBytes;  // (kDs: one stage of kKeys * kDsRowBytes)
  const uint32_t s_stage = kFp8 ? s_k + kTileBytes : s_k;
  const uint32_t s_p = s_q + 3 * kTileBytes;
  uint8_t* p_bytes = smem + 3 * kTileBytes;
  float* s_alpha = reinterpret_cast<float*>(p_bytes + kPBytes);
  float* s_m = s_alpha + kRows;
  float* s_l = s_m + kRows;

  const int tid = threadIdx.x, warp = (tid >> 5) & 3, lane = tid & 31;
  // the warpgroup through a shuffle: the compiler then knows it is warp-uniform, and keeps the wgmmas of a
  // branch on it pipelined (it serialises them in what it takes for a divergent path)
  const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
  const int g = lane >> 2, t4 = lane & 3;
  const int row0 = warp * 16 + g, row1 = row0 + 8;  // this thread's two rows of the block's 64 (both warpgroups)
  const BlockKeys keys = block_keys<kPacked>(a, tid);
  if (empty_split<kPacked>(a, keys, tid)) return;
  const int lo = keys.lo, hi = keys.hi, tiles = keys.tiles;
  const int end0 = row_end<kPacked>(a, keys, row0), end1 = row_end<kPacked>(a, keys, row1);  // (hi but packed)
  const int* table_row = keys.table_row;
  const float kv_scale = kFp8 && !kDs ? *a.kv_scale : 1.0f;
  const float qk_scale_log2 = a.qk_scale_log2 * kv_scale;

  load_q<kPacked>(a, s_q, keys, tid);
  const uint32_t s_bar = smem_u32(s_l + kRows);  // the TMA path: a stage's mbarrier (8 bytes each)
  constexpr int kIssuer = kThreads - 1;           // the TMA path's issuing thread (warpgroup 1's)
  uint32_t phases = 0;                            // bit s: the parity stage s's mbarrier completes next
  if constexpr (kTma) {
    if (tid == kIssuer) {
      mbarrier_init(s_bar);
      mbarrier_init(s_bar + 8);
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
  }
  const auto by_tma = [&](int start) { return kTma && start + kKeys <= hi; };  // (uniform)
  bool saw_bad = false;
  if (tiles > 0) {
    if (by_tma(lo)) {
      if (tid == kIssuer) saw_bad = tma_chunks(a, table_row, lo, hi, s_stage, s_bar, 0, kChunks - 1, true);
    } else {
      saw_bad = load_tile<kFp8, kDs>(a, page_of(a, table_row, lo, hi, tid), lo, hi, s_stage, tid);
    }
  }
  int next_page = by_tma(lo + kKeys) ? 0 : page_of(a, table_row, lo + kKeys, hi, tid);  // (tile 1's)
  cp_async_commit();

  float o[128];  // warpgroup wg's columns [256 wg, 256 wg + 256) of rows row0, row1
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.0f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;  // warpgroup 0: running max, this thread's sums

  for (int i = 0; i < tiles; ++i) {
    const int start = lo + i * kKeys;
    const uint32_t tile = kFp8 ? s_k : s_k + (i & 1) * kTileBytes;
    cp_async_wait<0>();
    if (by_tma(start) && (a.stages != kNoLoadsAfterFirst || i <= 1)) {
      mbarrier_wait(s_bar + (i & 1) * 8, (phases >> (i & 1)) & 1);
      phases ^= 1u << (i & 1);
    }
    fence_proxy_async();
    __syncthreads();  // stage i in place; every use of the other stage (and fp8: of the tile) done
    if constexpr (kDs) {  // one stage: widened first, then the next tile's copy into it
      ds_to_bf16_tile(smem + (s_stage - s_q), smem + (s_k - s_q), tid);
      fence_proxy_async();
      __syncthreads();  // the widened tile in place, the stage read
      if (i + 1 < tiles && (a.stages != kNoLoadsAfterFirst || i == 0))
        saw_bad |= load_tile<true, true>(a, next_page, start + kKeys, hi, s_stage, tid);
      cp_async_commit();
      next_page = page_of(a, table_row, start + 2 * kKeys, hi, tid);
    } else if (i + 1 < tiles && (a.stages != kNoLoadsAfterFirst || i == 0)) {
      const uint32_t next = s_stage + ((i + 1) & 1) * kStageBytes;
      if (by_tma(start + kKeys)) {
        if (tid == kIssuer)
          saw_bad |= tma_chunks(a, table_row, start + kKeys, hi, next, s_bar + ((i + 1) & 1) * 8, 0, kChunks - 1, true);
      } else {
        saw_bad |= load_tile<kFp8>(a, next_page, start + kKeys, hi, next, tid);
      }
    }
    if constexpr (!kDs) {
      cp_async_commit();
      next_page = by_tma(start + 2 * kKeys) ? 0 : page_of(a, table_row, start + 2 * kKeys, hi, tid);
    }
    if constexpr (kFp8 && !kDs) {
      to_bf16_tile(smem + (s_stage - s_q) + (i & 1) * kStageBytes, smem + (s_k - s_q), tid);
      fence_proxy_async();
      __syncthreads();  // the widened tile in place
    }

    if (a.stages == kLoadsOnly) continue;
    uint32_t p_frag[4][4];
    float alpha0, alpha1;
    if (wg == 0) {
      float s[32];
      issue_scores(s, s_q, tile);
      wgmma_wait_all();
      pin(s);
      softmax_tile(s, start, end0, end1, t4, row0, row1, qk_scale_log2, m0, m1, l0, l1, p_frag, p_bytes, s_alpha,
                   alpha0, alpha1);
    }
    __syncthreads();  // P and the factors in shared memory
    if (wg == 1) {
      alpha0 = s_alpha[row0];
      alpha1 = s_alpha[row1];
    }
    scale_rows(o, alpha0, alpha1);
    pin(o);
    wgmma_fence();
    const uint32_t v_cols = tile + wg * 4 * kChunkBytes;  // this warpgroup's 256 columns of V
    if (wg == 0) {
      pv_rs(o, p_frag, v_cols);
    } else {
      pv_ss(o, s_p, v_cols);
    }
    wgmma_commit();
    wgmma_wait_all();
    pin(o);
  }
  cp_async_wait<0>();

  finish_rows<kPacked>(a, o, saw_bad, keys, tid, wg, t4, row0, row1, m0, m1, l0, l1, s_m, s_l, kv_scale);
#endif
}

// The kernel of a cache format, copy path and rows (one token a block, or packed) (a name for each instantiation:
// any file that includes this compiles them)
inline void (*decode_kernel(bool fp8, bool tma, bool packed, bool ds))(Args) {
  if (ds) return packed ? mla_decode_kernel<true, false, true, true> : mla_decode_kernel<true, false, false, true>;
  if (packed)
    return fp8 ? mla_decode_kernel<true, false, true> : tma ? mla_decode_kernel<false, true, true>
                                                            : mla_decode_kernel<false, false, true>;
  return fp8 ? mla_decode_kernel<true, false, false> : tma ? mla_decode_kernel<false, true, false>
                                                           : mla_decode_kernel<false, false, false>;
}

// With several query tokens a sequence: one block finds each token's sequence (the last whose rows start at or
// before it) and how many of its rows follow it, once, for every block of the decode kernel; a cu_seqlens_q that
// does not run non-decreasing from 0 to T is recorded at its first bad entry and makes every token's sequence -1.
// Plain CUDA: any arch runs it.
__global__ void __launch_bounds__(1024) mla_rows_kernel(const Args a) {
  __shared__ int first_bad;
  if (threadIdx.x == 0) first_bad = a.batch + 1;
  __syncthreads();
  for (int i = threadIdx.x; i <= a.batch; i += blockDim.x) {
    if (cu_seqlens_entry_bad(a.cu_q, i, a.batch, a.num_tokens)) atomicMin(&first_bad, i);
  }
  __syncthreads();
  const bool bad = first_bad <= a.batch;
  if (bad && threadIdx.x == 0) atomicMin(a.errors + kErrCuSeqlensQ, first_bad);
  for (int t = threadIdx.x; t < a.num_tokens; t += blockDim.x) {
    int lo = 0, hi = a.batch - 1;
    while (!bad && lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (a.cu_q[mid] <= t) lo = mid; else hi = mid - 1;
    }
    a.token_seq[t] = bad ? -1 : lo;
    a.token_later[t] = bad ? 0 : a.cu_q[lo + 1] - 1 - t;
  }
}

// The sink's base-2 logit of a head (-inf: no sinks)
__device__ __forceinline__ float sink_logit2(const float* sinks, int head) {
  return sinks != nullptr ? sinks[head] * 1.4426950408889634f : -INFINITY;
}

// A merged row's base-2 maximum `mx` over its splits' LSEs made the weights' base: the sink's logit counted, 0 where
// the row has neither keys nor a sink (every weight then 0). Returns whether the row has keys.
__device__ __forceinline__ bool settle_max(float& mx, float sink) {
  const bool keys = mx != -INFINITY;
  mx = fmaxf(mx, sink);
  if (mx == -INFINITY) mx = 0.0f;
  return keys;
}

// A merged row's end (thread t: values 4 t .. 4 t + 3 of row `row` = (token, head), `o` their weighted sums over
// the splits, `denom` the splits' weights, `mx` the base-2 maximum, `sink` the sink's base-2 logit): normalised with
// the sink in the denominator where the row has keys, stored in bf16, and the LSE (thread 0)
__device__ __forceinline__ void store_merged_row(const Args& a, const float* sinks, int token, int head, int64_t row,
                                                 float4 o, float denom, float mx, float sink, bool keys,
                                                 bool any_nan) {
  const float sink_w = sinks != nullptr ? exp2f(sink - mx) : 0.0f;
  const float total = denom + sink_w;
  if (keys) denom += sink_w;
  const float inv = any_nan ? NAN : 1.0f / (denom > 0.0f ? denom : 1.0f);
  __nv_bfloat16* dst = a.out + token * a.out_token + head * a.out_head + 4 * threadIdx.x;
  *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(o.x * inv, o.y * inv);
  *reinterpret_cast<__nv_bfloat162*>(dst + 2) = __floats2bfloat162_rn(o.z * inv, o.w * inv);
  if (a.lse != nullptr && threadIdx.x == 0)
    a.lse[row] = any_nan ? NAN : (total == 0.0f ? -INFINITY : (mx + log2f(total)) * kLn2);
}

// Block (token, head): the splits' partials of a row combined by their base-2 LSEs, the sink (if any) in the
// denominator (a row with no key stays 0 whatever its sink); a NaN partial (a bad index its split met) makes the
// row and its LSE NaN. 128 threads, four columns each. Plain CUDA: any arch runs it.
__global__ void __launch_bounds__(128) mla_merge_kernel(const Args a, const float* sinks) {
  const int token = blockIdx.x, head = blockIdx.y;
  const int64_t row = static_cast<int64_t>(token) * a.num_heads + head;
  const float* lse = a.part_lse + row * a.splits;
  float mx = -INFINITY;
  bool any_nan = false;
  for (int s = 0; s < a.splits; ++s) {
    const float v = lse[s];
    any_nan |= v != v;
    if (v == v) mx = fmaxf(mx, v);
  }
  const float sink = sink_logit2(sinks, head);
  const bool keys = settle_max(mx, sink);
  float denom = 0.0f;
  float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  const float* part = a.part_out + row * a.splits * kR + 4 * threadIdx.x;
  for (int s = 0; s < a.splits; ++s) {
    const float v = lse[s];
    const float w = v == v ? exp2f(v - mx) : 0.0f;
    denom += w;
    if (w > 0.0f) {
      const float4 p = *reinterpret_cast<const float4*>(part + static_cast<int64_t>(s) * kR);
      o.x += w * p.x, o.y += w * p.y, o.z += w * p.z, o.w += w * p.w;
    }
  }
  store_merged_row(a, sinks, token, head, row, o, denom, mx, sink, keys, any_nan);
}

// mla_merge_kernel's work with a row's loads in flight together (the default from 32 splits a row: merge_form).
// Why: mla_merge_kernel takes a row's splits one after another, each load awaited before the next is issued, so a
// long sequence alone (one row a head, 128 splits) costs 128 round trips to L2 in 16 blocks.
// 128 threads: the LSEs' maximum over all of them; then warp w takes the splits w, w + 4, ... in rounds of
// kMergeDepth (lane l the row's values 16 l .. 16 l + 15), each round's loads issued before its weights are known,
// so that 32 splits' loads are in flight, not one; the four warps' sums added in warp order. The order of the sums
// is a function of the split count alone (batch-invariant mode's bits hold: a split past a sequence's end adds an
// exact 0). Plain CUDA: any arch runs it.
constexpr int kMergeWarps = 4, kMergeDepth = 8;
__global__ void __launch_bounds__(32 * kMergeWarps) mla_merge_warps_kernel(const Args a, const float* sinks) {
  __shared__ float s_sums[kMergeWarps][kR];
  __shared__ float s_scalars[2][kMergeWarps];  // the warps' maxima, then their denominators
  const int token = blockIdx.x, head = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(token) * a.num_heads + head;
  const float* lse = a.part_lse + row * a.splits;
  float mx = -INFINITY;
  bool nan_seen = false;
  for (int s = threadIdx.x; s < a.splits; s += 32 * kMergeWarps) {
    const float v = lse[s];
    nan_seen |= v != v;
    if (v == v) mx = fmaxf(mx, v);
  }
#pragma unroll
  for (int mask = 16; mask >= 1; mask >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, mask));
  if (lane == 0) s_scalars[0][warp] = mx;
  const bool any_nan = __syncthreads_or(nan_seen) != 0;
#pragma unroll
  for (int w = 0; w < kMergeWarps; ++w) mx = fmaxf(mx, s_scalars[0][w]);
  const float sink = sink_logit2(sinks, head);
  const bool keys = settle_max(mx, sink);
  float denom = 0.0f;
  float4 o[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) o[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  const float* part = a.part_out + row * a.splits * kR + 16 * lane;
  for (int first = warp; first < a.splits; first += kMergeWarps * kMergeDepth) {
    // (every load of the round issued before any weight is known; an empty split's partial was never written: read,
    // weighed 0, never added)
    float4 p[kMergeDepth][4];
    float v[kMergeDepth];
#pragma unroll
    for (int d = 0; d < kMergeDepth; ++d) {
      const int s = first + d * kMergeWarps;
      v[d] = s < a.splits ? lse[s] : -INFINITY;
#pragma unroll
      for (int i = 0; i < 4; ++i)
        p[d][i] = s < a.splits ? *reinterpret_cast<const float4*>(part + static_cast<int64_t>(s) * kR + 4 * i)
                               : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
#pragma unroll
    for (int d = 0; d < kMergeDepth; ++d) {
      const float w = v[d] == v[d] ? exp2f(v[d] - mx) : 0.0f;
      denom += w;
      if (w > 0.0f) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          o[i].x += w * p[d][i].x, o[i].y += w * p[d][i].y;
          o[i].z += w * p[d][i].z, o[i].w += w * p[d][i].w;
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) *reinterpret_cast<float4*>(&s_sums[warp][16 * lane + 4 * i]) = o[i];
  if (lane == 0) s_scalars[1][warp] = denom;
  __syncthreads();
  denom = 0.0f;
  float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
  for (int w = 0; w < kMergeWarps; ++w) {
    denom += s_scalars[1][w];
    const float4 q = *reinterpret_cast<const float4*>(&s_sums[w][4 * threadIdx.x]);
    sum.x += q.x, sum.y += q.y, sum.z += q.z, sum.w += q.w;
  }
  store_merged_row(a, sinks, token, head, row, sum, denom, mx, sink, keys, any_nan);
}

// Which code this device runs, told by the host through cudaFuncGetAttributes (a function attribute, not a stream
// operation: allowed inside a capture, unlike a copy of a device symbol): the sm_90a variant alone holds static
// shared memory
__global__ void sm90a_marker() {
#if defined(ATTNOPS_MLA_SM90A)
  __shared__ int marker[kMarkerInts];
  marker[threadIdx.x % kMarkerInts] = 0;
  asm volatile("" ::"r"(marker[0]));
#endif
}

}  // namespace attnops::mla_sm90
