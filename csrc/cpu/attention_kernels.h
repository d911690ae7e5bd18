// The inner loops of the CPU paged-attention kernel, written once against at::vec::Vectorized<float> and compiled
// once per instruction set: kernels_default.cpp, kernels_avx2.cpp and kernels_avx512.cpp each define ATTNOPS_ISA
// (the namespace of their copy) and include this file after <ATen/cpu/vec/vec.h>.
//
// One call of attend() runs one work item: a tile of query rows (the tokens of one sequence x the query heads of one
// or more KV heads' groups) against a range of keys. Keys are taken kKeyChunk at a time:
//   scores  S[r][j] = q_r . k_j        (q pre-multiplied by scale * k_scale, so fp8 keys are used as stored)
//   S = soft_cap * tanh(S / soft_cap)  (if soft_cap > 0)
//   mask the keys a row cannot see     (causal and sliding window; only in chunks that cross a row's limits)
//   online softmax: fold the chunk into each row's running max m and sum l, rescaling the accumulators
//   acc[r] += sum_j P[r][j] * v_j
// All math is fp32. The K and V rows are converted to fp32 in registers as they are loaded (bf16, fp16: shifts and
// cvtph; fp8: a 256-entry table), and every row is loaded once per tile, for all the tile's rows.
// Latent attention (MLA) runs the same loops: one KV head whose K row is the latent row [c, r] (head_dim = R + P),
// whose V row is the same row's first value_dim = R values, and whose q row is [q_nope, q_pe] (cpu_kernels.h).
#pragma once

#ifndef ATTNOPS_ISA
#error "define ATTNOPS_ISA (the namespace of this instruction set's copy) before including attention_kernels.h"
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "cpu_kernels.h"

namespace attnops::cpu::ATTNOPS_ISA {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVec = Vec::size();
// Every loop over a row steps by whole vectors: the host takes head dims (and MLA's R + P, R) in multiples of 16.
static_assert(16 % kVec == 0, "a row of a multiple of 16 floats must be a whole number of vectors");
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Prefetches go to L2 (locality 2: prefetcht1): a chunk of K and V rows is up to 32 KB each, too much for L1
// next to the chunk being computed.
constexpr int kPrefetchLocality = 2;

inline float hsum(const Vec& v) {
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
#else
  // the generic vec_reduce_all does one vector op per lane; a scalar loop is faster
  float lanes[kVec];
  v.store(lanes);
  float s = 0.f;
  for (int64_t i = 0; i < kVec; ++i) s += lanes[i];
  return s;
#endif
}

// max that keeps a NaN (std::max drops one in its second argument): a NaN score must reach its row's output
inline float nan_max(float a, float b) {
  return (std::isnan(a) || std::isnan(b)) ? std::numeric_limits<float>::quiet_NaN() : std::max(a, b);
}

inline float hmax(const Vec& v) {
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, v);
#else
  float lanes[kVec];
  v.store(lanes);
  float s = lanes[0];
  for (int64_t i = 1; i < kVec; ++i) s = nan_max(s, lanes[i]);
  return s;
#endif
}

// ---------------------------------------------------------------------------------------------------------------
// Loading kVec consecutive elements of a cache row as fp32. One struct per storage type; fp8 carries its table.

struct FloatLoader {
  using T = float;
  Vec load(const float* p) const { return Vec::loadu(p); }
};

template <typename Half_t>  // c10::BFloat16 or c10::Half
struct ReducedLoader {
  using T = Half_t;
  Vec load(const Half_t* p) const {
    Vec v;
    at::vec::load_to_float(p, v);
    return v;
  }
};

struct Fp8Loader {
  using T = uint8_t;
  const float* lut;  // 256 entries: the value of each fp8 byte
  Vec load(const uint8_t* p) const {
#if defined(CPU_CAPABILITY_AVX512)
    const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return Vec(_mm512_i32gather_ps(idx, lut, 4));
#elif defined(CPU_CAPABILITY_AVX2)
    const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return Vec(_mm256_i32gather_ps(lut, idx, 4));
#else
    float values[kVec];
    for (int64_t i = 0; i < kVec; ++i) values[i] = lut[p[i]];
    return Vec::loadu(values);
#endif
  }
};

// 4-bit caches (nvfp4, mxfp4) are not loaded vector by vector: attend_impl dequantizes each chunk's K and V rows
// into scratch memory (dequantize_fp4_row) and runs the fp32 loops on them. This marks that path.
struct Fp4Loader : FloatLoader {};

// Latent rows in DeepSeek's fp8 layout (MLA's "fp8_ds_mla") are dequantized the same way (dequantize_latent_row),
// and so are fp8 rows that many query rows share (dequantize_fp8_row: a tile whose rows a K row serves number
// kFp8RowsMinShare or more, as latent attention's heads): widened once a chunk rather than once a query row, the same
// values into the same loops, so the same bits as Fp8Loader's.
struct LatentFp8Loader : FloatLoader {};
struct Fp8RowsLoader : FloatLoader {};

// e2m1 codes (bit 3: the sign) as values
alignas(64) inline constexpr float kE2m1[16] = {0.f,  0.5f,  1.f,  1.5f,  2.f,  3.f,  4.f,  6.f,
                                                -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

// A 4-bit cache row of D values (D/2 bytes, D/block scales) as fp32: code * its block's scale (nvfp4: an e4m3 scale
// through the fp8 table; mxfp4: e8m0, 2^(s - 127)). A null row (a page outside the cache) reads zeros.
inline void dequantize_fp4_row(const AttentionParams& p, const uint8_t* packed, const uint8_t* scales, int64_t D,
                               float* dst) {
  if (packed == nullptr) {
    std::fill(dst, dst + D, 0.f);
    return;
  }
  const int64_t block = p.fp4_block;
  for (int64_t b0 = 0; b0 < D; b0 += block) {
    const uint8_t s = scales[b0 / block];
    const float scale = block == 16 ? p.fp8_lut[s] : std::ldexp(1.f, static_cast<int>(s) - 127);
    for (int64_t i = b0; i < b0 + block; i += 2) {
      const uint8_t byte = packed[i / 2];
      dst[i] = kE2m1[byte & 15] * scale;
      dst[i + 1] = kE2m1[byte >> 4] * scale;
    }
  }
}

// An fp8 row of D values as fp32, through fp8_lut (before the scale, which q and the output norm carry). A null row
// reads zeros.
inline void dequantize_fp8_row(const AttentionParams& p, const uint8_t* row, int64_t D, float* dst) {
  if (row == nullptr) {
    std::fill(dst, dst + D, 0.f);
    return;
  }
  const Fp8Loader ld{p.fp8_lut};
  for (int64_t i = 0; i < D; i += kVec) ld.load(row + i).store(dst + i);  // (D: whole vectors, as the loops take)
}

// A latent row in DeepSeek's fp8 layout as fp32 (R + P values): its R e4m3 values (through fp8_lut) times their
// 128's float32 scale (at byte R + 4 i), then its P bf16 values (from byte R + R/32). A null row reads zeros.
inline void dequantize_latent_row(const AttentionParams& p, const uint8_t* row, float* dst) {
  const int64_t R = p.q_nope_dim, D = p.head_dim;
  if (row == nullptr) {
    std::fill(dst, dst + D, 0.f);
    return;
  }
  const Fp8Loader ld{p.fp8_lut};
  for (int64_t t0 = 0; t0 < R; t0 += 128) {
    float scale;
    std::memcpy(&scale, row + R + t0 / 32, sizeof(float));
    const Vec vscale(scale);
    for (int64_t i = t0; i < t0 + 128; i += kVec) (ld.load(row + i) * vscale).store(dst + i);
  }
  const uint8_t* rope = row + R + R / 32;
  for (int64_t i = R; i < D; ++i) {
    uint16_t bits;
    std::memcpy(&bits, rope + 2 * (i - R), sizeof(bits));
    const uint32_t wide = static_cast<uint32_t>(bits) << 16;
    std::memcpy(dst + i, &wide, sizeof(float));
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Register blocks. The micro-kernels below keep up to 8 accumulators in registers across a loop. Held in an array
// (Vec acc[4][2]), GCC 12 spills them to the stack at every iteration whenever the loop also loads through a
// may_alias pointer (the bf16 / fp16 loads), so they are named members, selected by compile-time indices only.

struct Regs {
  Vec r0, r1, r2, r3, r4, r5, r6, r7;
  template <int I>
  Vec& at() {
    static_assert(I >= 0 && I < 8, "a register block holds 8 vectors");
    if constexpr (I == 0)
      return r0;
    else if constexpr (I == 1)
      return r1;
    else if constexpr (I == 2)
      return r2;
    else if constexpr (I == 3)
      return r3;
    else if constexpr (I == 4)
      return r4;
    else if constexpr (I == 5)
      return r5;
    else if constexpr (I == 6)
      return r6;
    else
      return r7;
  }
};

template <typename F, int... I>
inline void unroll_impl(F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}

// f(std::integral_constant<int, 0>{}), ..., f(std::integral_constant<int, N - 1>{})
template <int N, typename F>
inline void unroll(F&& f) {
  unroll_impl(f, std::make_integer_sequence<int, N>{});
}

// sums[i] = the sum of the lanes of r.at<i>(), for i < N. Eight vectors are reduced together, by a transpose-add
// tree (23 shuffles and adds for 8 sums, where one reduction per vector takes 8 each): in decode it is as much
// work as the dot products themselves.
template <int N>
inline void reduce_lanes(Regs& r, float* sums) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (N == 8) {
    // pairs at 256-bit granularity: [a_lo + a_hi | b_lo + b_hi], as 128-bit lanes [a0+a2, a1+a3, b0+b2, b1+b3]
    auto fold256 = [](__m512 a, __m512 b) {
      return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
    };
    // then at 128-bit granularity: one 128-bit lane of 4 partial sums per vector: [A, B, C, D]
    auto fold128 = [](__m512 x, __m512 y) {
      return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
    };
    const __m512 z1 = fold128(fold256(r.r0, r.r1), fold256(r.r2, r.r3));  // lanes: sums of r0, r1, r2, r3
    const __m512 z2 = fold128(fold256(r.r4, r.r5), fold256(r.r6, r.r7));  // lanes: sums of r4, r5, r6, r7
    // within each 128-bit lane k: [z1 partials | z2 partials] -> [z1_k, z1_k, z2_k, z2_k]
    const __m512 t = _mm512_add_ps(_mm512_shuffle_ps(z1, z2, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_ps(z1, z2, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 u = _mm512_add_ps(t, _mm512_permute_ps(t, _MM_SHUFFLE(2, 3, 0, 1)));
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, u);
    for (int i = 0; i < 8; ++i) sums[i] = lanes[(i % 4) * 4 + (i / 4) * 2];
    return;
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (N == 8) {
    // pairs at 128-bit granularity: [a_lo + a_hi | b_lo + b_hi]
    auto fold128 = [](__m256 a, __m256 b) {
      return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
    };
    // within each 128-bit lane: [x partials | y partials] -> [x, x, y, y]
    auto fold_lane = [](__m256 x, __m256 y) {
      const __m256 t = _mm256_add_ps(_mm256_shuffle_ps(x, y, _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm256_shuffle_ps(x, y, _MM_SHUFFLE(3, 2, 3, 2)));
      return _mm256_add_ps(t, _mm256_permute_ps(t, _MM_SHUFFLE(2, 3, 0, 1)));
    };
    // lanes of u1: [r0 r0 r2 r2 | r1 r1 r3 r3], of u2: the same for r4..r7
    const __m256 u1 = fold_lane(fold128(r.r0, r.r1), fold128(r.r2, r.r3));
    const __m256 u2 = fold_lane(fold128(r.r4, r.r5), fold128(r.r6, r.r7));
    alignas(32) float lanes[16];
    _mm256_store_ps(lanes, u1);
    _mm256_store_ps(lanes + 8, u2);
    for (int i = 0; i < 8; ++i) sums[i] = lanes[(i / 4) * 8 + (i % 2) * 4 + ((i % 4) / 2) * 2];
    return;
  }
#endif
  unroll<N>([&](auto i) { sums[decltype(i)::value] = hsum(r.at<decltype(i)::value>()); });
}

// ---------------------------------------------------------------------------------------------------------------
// Scores: S[r][j] = q_r . k_j for RB rows x KB keys at once. RB * KB independent accumulators hide the FMA latency,
// and each key vector is loaded (and converted) once for the RB rows.

template <int RB, int KB, typename Loader>
inline void qk_block(const Loader& ld, const float* q, int64_t D, const typename Loader::T* const* k, float* S) {
  static_assert(RB * KB <= 8, "8 accumulators at most");
  Regs acc;
  unroll<RB * KB>([&](auto i) { acc.at<decltype(i)::value>() = Vec(0.f); });
  for (int64_t d = 0; d < D; d += kVec) {
    Regs kv;
    unroll<KB>([&](auto j) { kv.at<decltype(j)::value>() = ld.load(k[decltype(j)::value] + d); });
    unroll<RB * KB>([&](auto i) {
      constexpr int r = decltype(i)::value / KB, j = decltype(i)::value % KB;
      acc.at<decltype(i)::value>() =
          at::vec::fmadd(Vec::loadu(q + r * D + d), kv.at<j>(), acc.at<decltype(i)::value>());
    });
  }
  float sums[RB * KB];
  reduce_lanes<RB * KB>(acc, sums);
  // (unrolled: as a loop, GCC vectorizes these 8 stores into a scatter, which is slow)
  unroll<RB * KB>([&](auto i) {
    constexpr int r = decltype(i)::value / KB, j = decltype(i)::value % KB;
    S[r * kKeyChunk + j] = sums[decltype(i)::value];
  });
}

// The rows of the next chunk of keys, prefetched while this chunk's scores are computed (see attend_impl).
template <typename T>
struct Ahead {
  const T* const* k;
  const T* const* v;
  int64_t n;  // rows to prefetch (0: none)
  int64_t row_bytes;

  void fetch(int64_t j0, int64_t j1) const {
    // (GCC 12 deletes this loop as dead when the bound is written std::min(j1, n) in the condition)
    if (j1 > n) j1 = n;
    for (int64_t j = j0; j < j1; ++j) {
      const char* k_row = reinterpret_cast<const char*>(k[j]);
      const char* v_row = reinterpret_cast<const char*>(v[j]);
      for (int64_t b = 0; b < row_bytes; b += 64) {
        __builtin_prefetch(k_row + b, 0, kPrefetchLocality);
        __builtin_prefetch(v_row + b, 0, kPrefetchLocality);
      }
    }
  }
};

template <int RB, typename Loader>
inline void qk_rows(const Loader& ld, const float* q, int64_t D, const typename Loader::T* const* k, int64_t n,
                    float* S, const Ahead<typename Loader::T>& ahead) {
  // about 8 accumulators whatever the number of rows: few rows (MHA decode) block over more keys
  constexpr int KB = RB == 1 ? 8 : RB == 2 ? 4 : 2;
  int64_t j = 0;
  for (; j + KB <= n; j += KB) {
    ahead.fetch(j, j + KB);  // a few prefetches per block: a burst of them would stall on the miss buffers
    qk_block<RB, KB>(ld, q, D, k + j, S + j);
  }
  for (; j < n; ++j) {
    ahead.fetch(j, j + 1);
    qk_block<RB, 1>(ld, q, D, k + j, S + j);
  }
  ahead.fetch(n, kKeyChunk);
}

template <typename Loader>
void qk(const Loader& ld, const float* q, int64_t rows, int64_t D, const typename Loader::T* const* k, int64_t n,
        float* S, Ahead<typename Loader::T> ahead) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) {
    qk_rows<4>(ld, q + r * D, D, k, n, S + r * kKeyChunk, ahead);
    ahead.n = 0;  // prefetched once, during the first rows' pass
  }
  switch (rows - r) {
    case 3: qk_rows<3>(ld, q + r * D, D, k, n, S + r * kKeyChunk, ahead); break;
    case 2: qk_rows<2>(ld, q + r * D, D, k, n, S + r * kKeyChunk, ahead); break;
    case 1: qk_rows<1>(ld, q + r * D, D, k, n, S + r * kKeyChunk, ahead); break;
    default: break;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Values: acc[r][d0 : d0 + DB*kVec] += sum_j P[r][j] * v_j[d0 : ...], for RB rows. The accumulators stay in
// registers across the chunk's keys; each value vector is loaded once for the RB rows.

template <int RB, int DB, typename Loader>
inline void pv_block(const Loader& ld, const float* P, int64_t n, const typename Loader::T* const* v, int64_t d0,
                     float* acc, int64_t D) {
  static_assert(RB * DB <= 8, "8 accumulators at most");
  Regs a;
  unroll<RB * DB>([&](auto i) {
    constexpr int r = decltype(i)::value / DB, x = decltype(i)::value % DB;
    a.at<decltype(i)::value>() = Vec::loadu(acc + r * D + d0 + x * kVec);
  });
  for (int64_t j = 0; j < n; ++j) {
    Regs vv;
    unroll<DB>([&](auto x) { vv.at<decltype(x)::value>() = ld.load(v[j] + d0 + decltype(x)::value * kVec); });
    unroll<RB * DB>([&](auto i) {
      constexpr int r = decltype(i)::value / DB, x = decltype(i)::value % DB;
      a.at<decltype(i)::value>() = at::vec::fmadd(Vec(P[r * kKeyChunk + j]), vv.at<x>(), a.at<decltype(i)::value>());
    });
  }
  unroll<RB * DB>([&](auto i) {
    constexpr int r = decltype(i)::value / DB, x = decltype(i)::value % DB;
    a.at<decltype(i)::value>().store(acc + r * D + d0 + x * kVec);
  });
}

// The accumulator columns from d0 on in blocks of DB vectors, then what is left in blocks of DB/2, ..., 1: a row
// of a number of vectors that DB does not divide (head_dim 80: 5 vectors of 16 floats, or 10 of 8) ends in a few
// narrower blocks.
template <int RB, int DB, typename Loader>
inline void pv_columns(const Loader& ld, const float* P, int64_t n, const typename Loader::T* const* v, int64_t d0,
                       float* acc, int64_t D) {
  for (; d0 + DB * kVec <= D; d0 += DB * kVec) pv_block<RB, DB>(ld, P, n, v, d0, acc, D);
  if constexpr (DB > 1) pv_columns<RB, DB / 2>(ld, P, n, v, d0, acc, D);
}

template <int RB, typename Loader>
inline void pv_rows(const Loader& ld, const float* P, int64_t n, const typename Loader::T* const* v, float* acc,
                    int64_t D) {
  constexpr int DB = RB == 1 ? 8 : RB == 2 ? 4 : 2;  // about 8 accumulators, as in qk_rows
  pv_columns<RB, DB>(ld, P, n, v, 0, acc, D);
}

template <typename Loader>
void pv(const Loader& ld, const float* P, int64_t rows, int64_t n, const typename Loader::T* const* v, float* acc,
        int64_t D) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) pv_rows<4>(ld, P + r * kKeyChunk, n, v, acc + r * D, D);
  switch (rows - r) {
    case 3: pv_rows<3>(ld, P + r * kKeyChunk, n, v, acc + r * D, D); break;
    case 2: pv_rows<2>(ld, P + r * kKeyChunk, n, v, acc + r * D, D); break;
    case 1: pv_rows<1>(ld, P + r * kKeyChunk, n, v, acc + r * D, D); break;
    default: break;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Scalar conversions for q (in) and out (out): a tile's q rows are converted once, outputs written once.

template <typename T>
inline float to_float(T x) {
  return static_cast<float>(x);
}

template <typename T>
inline T from_float(float x) {
  return static_cast<T>(x);  // c10::BFloat16 / c10::Half round to nearest even, like Tensor.to()
}

// Rows of a tile, head-major: row r is query head (kv_head + r / rows_per_head) * group + r % group of token
// q_begin + (r % rows_per_head) / group, where rows_per_head = tokens x group. The rows of one KV head are
// consecutive, so the micro-kernels run on them as one block.
struct TileRows {
  int64_t tokens, per_head, total;
  TileRows(const AttentionParams& p, const Tile& tile)
      : tokens(tile.q_end - tile.q_begin), per_head(tokens * p.group), total(per_head * tile.num_heads) {}
  int64_t token(const AttentionParams& p, int64_t r) const { return (r % per_head) / p.group; }
  int64_t q_head(const AttentionParams& p, const Tile& tile, int64_t r) const {
    return (tile.kv_head + r / per_head) * p.group + r % p.group;
  }
};

// The visible key range of a token of a tile: positions [lo, hi] (hi < lo: none).
struct RowLimits {
  int64_t lo, hi;
};

// What a key on a page outside the cache reads instead (head_dim <= kMaxHeadDim elements of up to 4 bytes).
alignas(64) inline constexpr unsigned char kZeroRow[kMaxHeadDim * 4] = {};

inline RowLimits token_limits(const AttentionParams& p, const Tile& tile, int64_t token) {
  const int64_t pos = tile.first_pos + token;
  // with a tree mask, keys of the block after the row's own position may be visible: the mask decides those
  return {p.window_left >= 0 ? std::max<int64_t>(0, pos - p.window_left) : 0,
          p.tree_mask != nullptr ? tile.kv_end - 1 : pos};
}

// Whether row `token` of a tile sees the key at `pos` of its sequence's query block (pos >= tile.block_start),
// by the tree mask: columns at or past the mask's width are not visible.
inline bool tree_visible(const AttentionParams& p, const Tile& tile, int64_t token, int64_t pos) {
  const int64_t col = pos - tile.block_start;
  return col < p.tree_mask_cols && p.tree_mask[(tile.q_begin + token) * p.tree_mask_stride + col];
}

// The factor that turns a row's accumulator (sum_j e^(x_j - m) v_j over its keys, with running max m and sum l)
// into its output, v_scale included: 1/l, or with a sink s e^(m - M) / (l e^(m - M) + e^(s - M)), M = max(m, s).
// A row that saw no key is 0; one that read a NaN is NaN.
inline float output_norm(const AttentionParams& p, const Tile& tile, const TileRows& rows, int64_t r, float m,
                         float l) {
  const float v_scale = p.v_scale[tile.kv_head + r / rows.per_head];
  if (std::isnan(l)) return std::numeric_limits<float>::quiet_NaN();
  if (!(l > 0.f)) return 0.f;
  if (p.sinks == nullptr) return v_scale / l;
  const float s = p.sinks[rows.q_head(p, tile, r)];
  const float big = nan_max(m, s);
  const float keep = std::exp(m - big);
  return v_scale * keep / (l * keep + std::exp(s - big));
}

// A row's log-sum-exp (natural log: the scores are in natural units) from its running max m and sum l: m + log(l),
// with a sink s log(l e^(m - M) + e^(s - M)) + M, M = max(m, s). -inf for a row that saw no key (s with a sink:
// the sink's term alone, so that a merge with another part's keys stays exact); NaN for one that read a NaN.
inline float row_lse(const AttentionParams& p, const Tile& tile, const TileRows& rows, int64_t r, float m, float l) {
  if (std::isnan(l) || std::isnan(m)) return std::numeric_limits<float>::quiet_NaN();
  const float keys = l > 0.f ? m + std::log(l) : kNegInf;
  if (p.sinks == nullptr) return keys;
  const float s = p.sinks[rows.q_head(p, tile, r)];
  const float big = nan_max(keys, s);
  if (big == kNegInf) return kNegInf;
  return big + std::log(std::exp(keys - big) + std::exp(s - big));
}

inline void store_lse(const AttentionParams& p, const Tile& tile, const TileRows& rows, int64_t r, float m, float l) {
  p.lse[(tile.q_begin + rows.token(p, r)) * p.lse_stride_token + rows.q_head(p, tile, r) * p.lse_stride_head] =
      row_lse(p, tile, rows, r, m, l);
}

template <typename QT, typename Loader>
void attend_impl(const AttentionParams& p, const Loader& ld, const Tile& tile, const WorkItem& item,
                 const Partials& partials, float* scratch) {
  using KT = typename Loader::T;
  // kDequantized: KT float, the chunk's rows widened into k_dq/v_dq (4-bit, latent fp8, shared fp8 rows); where
  // v_cache is k_cache (latent attention) the V rows are the K rows just widened
  constexpr bool kFp4 = std::is_same_v<Loader, Fp4Loader>;
  constexpr bool kLatentFp8 = std::is_same_v<Loader, LatentFp8Loader>;
  constexpr bool kFp8Rows = std::is_same_v<Loader, Fp8RowsLoader>;
  constexpr bool kDequantized = kFp4 || kLatentFp8 || kFp8Rows;
  const int64_t D = p.head_dim, Dv = p.value_dim;
  const TileRows rows(p, tile);
  float* qf = scratch;                               // [rows][D]
  float* acc = qf + p.max_tile_rows * D;             // [rows][Dv]
  float* S = acc + p.max_tile_rows * Dv;             // [rows][kKeyChunk]
  float* row_max = S + p.max_tile_rows * kKeyChunk;  // [rows]
  float* row_sum = row_max + p.max_tile_rows;        // [rows]
  float* k_dq = row_sum + p.max_tile_rows;           // kDequantized: [kKeyChunk][D], then V's
  float* v_dq = k_dq + kKeyChunk * D;

  // q rows in fp32, times the softmax scale and the head's key scale (so that stored fp8 keys are used as stored)
  // (MLA: the values from q_nope_dim on come from q_pe)
  const QT* q = static_cast<const QT*>(p.q);
  const QT* q_pe = static_cast<const QT*>(p.q_pe);
  const int64_t q_dim = q_pe != nullptr ? p.q_nope_dim : D;
  for (int64_t r = 0; r < rows.total; ++r) {
    const float q_mult = p.scale * p.k_scale[tile.kv_head + r / rows.per_head];
    const int64_t token = tile.q_begin + rows.token(p, r), head = rows.q_head(p, tile, r);
    const QT* src = q + token * p.q_stride_token + head * p.q_stride_head;
    for (int64_t d = 0; d < q_dim; ++d) qf[r * D + d] = to_float(src[d]) * q_mult;
    if (q_pe != nullptr) {
      const QT* pe = q_pe + token * p.q_pe_stride_token + head * p.q_pe_stride_head;
      for (int64_t d = q_dim; d < D; ++d) qf[r * D + d] = to_float(pe[d - q_dim]) * q_mult;
    }
  }
  std::fill(acc, acc + rows.total * Dv, 0.f);
  std::fill(row_max, row_max + rows.total, kNegInf);
  std::fill(row_sum, row_sum + rows.total, 0.f);

  // Tokens whose limits lie strictly inside a chunk need masking there; for the rest of the range the whole chunk
  // is visible to every row. The tile's tokens are consecutive positions, so the tightest limits are those of the
  // first token (causal: smallest hi) and the last (window: largest lo).
  // (with a tree mask, the block's keys are masked by the mask: every chunk that reaches the block needs it)
  const int64_t min_hi = p.tree_mask != nullptr ? tile.block_start - 1 : tile.first_pos;
  const int64_t max_lo = token_limits(p, tile, rows.tokens - 1).lo;

  const KT* k_cache = static_cast<const KT*>(p.k_cache);
  const KT* v_cache = static_cast<const KT*>(p.v_cache);
  const int32_t* pages = p.block_table + tile.seq * p.bt_stride_seq;
  const int64_t slot_mask = (int64_t{1} << p.page_shift) - 1;
  // Offsets of the chunk's key slots in the caches (chunks ignore page boundaries: each key's page is looked up),
  // and of the next chunk's, whose rows are prefetched while this chunk's scores are computed: a row is 64 to 512
  // bytes at a stride of a cache slot in a random page, and without the prefetch the loop waits on DRAM latency
  // at every row. The KV heads of the tile are taken in turn over the same slots, so the memory of a chunk is
  // read as a few contiguous runs (one per slot, all heads), not scattered pieces.
  int64_t offsets_a[kKeyChunk], offsets_b[kKeyChunk];
  int64_t* offsets = offsets_a;
  int64_t* offsets_next = offsets_b;
  int64_t scale_offsets_a[kKeyChunk], scale_offsets_b[kKeyChunk];  // 4-bit caches: of the rows' block scales
  int64_t* scale_offsets = scale_offsets_a;
  int64_t* scale_offsets_next = scale_offsets_b;
  // A page index outside the cache is never dereferenced: its keys read a row of zeros (offset -1 below) and are
  // NaN scores to the rows that see them, so those rows (only) are NaN.
  bool bad_a[kKeyChunk], bad_b[kKeyChunk];
  bool* bad = bad_a;
  bool* bad_next = bad_b;
  bool chunk_bad = false, chunk_bad_next = false;
  auto locate = [&](int64_t c0, int64_t* off, int64_t* scale_off, bool* bad_keys, bool& any_bad) {
    const int64_t n = std::min(kKeyChunk, item.kv_end - c0);
    any_bad = false;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t pos = c0 + j;
      const int64_t page = pages[(pos >> p.page_shift) * p.bt_stride_page];
      bad_keys[j] = page < 0 || page >= p.num_pages;
      any_bad |= bad_keys[j];
      off[j] = bad_keys[j] ? -1 : page * p.cache_stride_page + (pos & slot_mask) * p.cache_stride_slot;
      if constexpr (kFp4)  // (4-bit: the rows' block scales)
        scale_off[j] = bad_keys[j] ? -1 : page * p.scale_stride_page + (pos & slot_mask) * p.scale_stride_slot;
    }
    return n;
  };
  const KT* zeros = reinterpret_cast<const KT*>(kZeroRow);
  auto row = [&](const KT* cache, int64_t head, int64_t offset) { return offset < 0 ? zeros : cache + head + offset; };
  // kDequantized: the chunk's rows of KV head `kv_head`, widened into `dst` ([kKeyChunk][D]), pointed to by `ptrs`
  auto dequantized_rows = [&](const void* cache, const uint8_t* block_scales, int64_t kv_head, int64_t n, float* dst,
                              const KT** ptrs) {
    const uint8_t* bytes = static_cast<const uint8_t*>(cache) + kv_head * p.cache_stride_head;
    for (int64_t j = 0; j < n; ++j) {
      const uint8_t* src = offsets[j] < 0 ? nullptr : bytes + offsets[j];  // (a bad page reads zeros, as kZeroRow)
      if constexpr (kLatentFp8) {
        dequantize_latent_row(p, src, dst + j * D);
      } else if constexpr (kFp8Rows) {
        dequantize_fp8_row(p, src, D, dst + j * D);
      } else {
        const uint8_t* scales = block_scales + kv_head * p.scale_stride_head + scale_offsets[j];
        dequantize_fp4_row(p, src, src == nullptr ? nullptr : scales, D, dst + j * D);
      }
      ptrs[j] = reinterpret_cast<const KT*>(dst + j * D);
    }
  };
  const KT* k_rows[kKeyChunk];
  const KT* v_rows[kKeyChunk];
  const KT* k_next[kKeyChunk];
  const KT* v_next[kKeyChunk];
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(KT));
  if (item.kv_begin < item.kv_end) {  // the first chunk has nothing before it to hide its loads behind
    const int64_t n = locate(item.kv_begin, offsets, scale_offsets, bad, chunk_bad);
    for (int64_t hi = 0; hi < tile.num_heads && !kDequantized; ++hi) {
      const int64_t head = (tile.kv_head + hi) * p.cache_stride_head;
      for (int64_t j = 0; j < n; ++j) {
        k_next[j] = row(k_cache, head, offsets[j]);
        v_next[j] = row(v_cache, head, offsets[j]);
      }
      Ahead<KT>{k_next, v_next, n, row_bytes}.fetch(0, n);
    }
  }

  for (int64_t c0 = item.kv_begin; c0 < item.kv_end; c0 += kKeyChunk) {
    const int64_t n = std::min(kKeyChunk, item.kv_end - c0);
    const int64_t n_next = c0 + kKeyChunk < item.kv_end
                               ? locate(c0 + kKeyChunk, offsets_next, scale_offsets_next, bad_next, chunk_bad_next)
                               : 0;

    for (int64_t hi = 0; hi < tile.num_heads; ++hi) {
      const int64_t head = (tile.kv_head + hi) * p.cache_stride_head;
      if constexpr (kDequantized) {  // (no prefetch: the rows are read once, into the scratch rows)
        dequantized_rows(p.k_cache, p.k_block_scale, tile.kv_head + hi, n, k_dq, k_rows);
        qk(ld, qf + hi * rows.per_head * D, rows.per_head, D, k_rows, n, S + hi * rows.per_head * kKeyChunk,
           Ahead<KT>{k_next, v_next, 0, row_bytes});
        continue;
      }
      for (int64_t j = 0; j < n; ++j) k_rows[j] = row(k_cache, head, offsets[j]);
      for (int64_t j = 0; j < n_next; ++j) {
        k_next[j] = row(k_cache, head, offsets_next[j]);
        v_next[j] = row(v_cache, head, offsets_next[j]);
      }
      qk(ld, qf + hi * rows.per_head * D, rows.per_head, D, k_rows, n, S + hi * rows.per_head * kKeyChunk,
         Ahead<KT>{k_next, v_next, n_next, row_bytes});
    }

    const bool needs_mask = c0 + n - 1 > min_hi || c0 < max_lo;
    for (int64_t r = 0; r < rows.total; ++r) {
      float* s = S + r * kKeyChunk;
      if (p.soft_cap > 0.f) {
        const Vec cap(p.soft_cap), inv_cap(1.f / p.soft_cap);
        for (int64_t j = 0; j < kKeyChunk; j += kVec) (cap * (Vec::loadu(s + j) * inv_cap).tanh()).store(s + j);
      }
      // -inf (after the soft cap, which would turn it into -soft_cap) for the chunk's unused tail...
      for (int64_t j = n; j < kKeyChunk; ++j) s[j] = kNegInf;
      // ...and for the keys this row cannot see
      if (needs_mask) {
        const int64_t token = rows.token(p, r);
        const RowLimits lim = token_limits(p, tile, token);
        for (int64_t j = 0; j < n; ++j)
          if (c0 + j < lim.lo || c0 + j > lim.hi) s[j] = kNegInf;
        if (p.tree_mask != nullptr) {
          for (int64_t j = std::max<int64_t>(0, tile.block_start - c0); j < n; ++j)
            if (!tree_visible(p, tile, token, c0 + j)) s[j] = kNegInf;
        }
      }
      if (chunk_bad) {  // ...and NaN for the keys of a bad page it does see
        const RowLimits lim = token_limits(p, tile, rows.token(p, r));
        for (int64_t j = 0; j < n; ++j)
          if (bad[j] && c0 + j >= lim.lo && c0 + j <= lim.hi) s[j] = std::numeric_limits<float>::quiet_NaN();
      }

      // online softmax: fold this chunk into the row's running max and sum
      Vec vmax(kNegInf);
      for (int64_t j = 0; j < kKeyChunk; j += kVec) vmax = at::vec::maximum(vmax, Vec::loadu(s + j));
      const float m_old = row_max[r];
      const float m_new = nan_max(m_old, hmax(vmax));
      if (m_new == kNegInf) {  // the row has seen no visible key yet: nothing to add
        std::fill(s, s + kKeyChunk, 0.f);
        continue;
      }
      const Vec vm(m_new);
      Vec vsum(0.f);
      for (int64_t j = 0; j < kKeyChunk; j += kVec) {
        const Vec e = (Vec::loadu(s + j) - vm).exp_u20();  // exp(-inf) = 0 for masked keys
        e.store(s + j);
        vsum = vsum + e;
      }
      const float alpha = std::exp(m_old - m_new);  // 0 on the row's first visible chunk
      row_sum[r] = row_sum[r] * alpha + hsum(vsum);
      row_max[r] = m_new;
      if (alpha != 1.f) {
        float* a = acc + r * Dv;
        const Vec va(alpha);
        for (int64_t d = 0; d < Dv; d += kVec) (Vec::loadu(a + d) * va).store(a + d);
      }
    }

    for (int64_t hi = 0; hi < tile.num_heads; ++hi) {
      const int64_t head = (tile.kv_head + hi) * p.cache_stride_head;
      if constexpr (kDequantized) {
        if (p.v_cache == p.k_cache && tile.num_heads == 1)  // (latent attention: the K rows just widened)
          std::copy(k_rows, k_rows + n, v_rows);
        else
          dequantized_rows(p.v_cache, p.v_block_scale, tile.kv_head + hi, n, v_dq, v_rows);
      } else {
        for (int64_t j = 0; j < n; ++j) v_rows[j] = row(v_cache, head, offsets[j]);
      }
      pv(ld, S + hi * rows.per_head * kKeyChunk, rows.per_head, n, v_rows, acc + hi * rows.per_head * Dv, Dv);
    }
    std::swap(offsets, offsets_next);
    std::swap(scale_offsets, scale_offsets_next);
    std::swap(bad, bad_next);
    std::swap(chunk_bad, chunk_bad_next);
  }

  if (item.slot >= 0) {  // a split: leave the unnormalized partial result for merge()
    std::copy(acc, acc + rows.total * Dv, partials.acc + item.slot * p.max_tile_rows * Dv);
    std::copy(row_max, row_max + rows.total, partials.max + item.slot * p.max_tile_rows);
    std::copy(row_sum, row_sum + rows.total, partials.sum + item.slot * p.max_tile_rows);
    return;
  }
  QT* out = static_cast<QT*>(p.out);
  for (int64_t r = 0; r < rows.total; ++r) {
    QT* dst =
        out + (tile.q_begin + rows.token(p, r)) * p.out_stride_token + rows.q_head(p, tile, r) * p.out_stride_head;
    const float norm = output_norm(p, tile, rows, r, row_max[r], row_sum[r]);
    const float* a = acc + r * Dv;
    for (int64_t d = 0; d < Dv; ++d) dst[d * p.out_stride_dim] = from_float<QT>(a[d] * norm);
    if (p.lse != nullptr) store_lse(p, tile, rows, r, row_max[r], row_sum[r]);
  }
}

template <typename QT>
void merge_impl(const AttentionParams& p, const Tile& tile, int64_t first_slot, int64_t num_slots,
                const Partials& partials) {
  const int64_t Dv = p.value_dim;
  const TileRows rows(p, tile);
  QT* out = static_cast<QT*>(p.out);
  float merged[kMaxValueDim];  // value_dim <= kMaxValueDim (checked by the host)
  for (int64_t r = 0; r < rows.total; ++r) {
    // log-sum-exp merge: out = sum_s acc_s * exp(m_s - M) / sum_s l_s * exp(m_s - M), M = max_s m_s
    float m = kNegInf;
    for (int64_t s = first_slot; s < first_slot + num_slots; ++s)
      m = nan_max(m, partials.max[s * p.max_tile_rows + r]);
    std::fill(merged, merged + Dv, 0.f);
    float l = 0.f;
    if (m != kNegInf) {
      for (int64_t s = first_slot; s < first_slot + num_slots; ++s) {
        const float ms = partials.max[s * p.max_tile_rows + r];
        if (ms == kNegInf) continue;  // this split had no key visible to the row
        const float w = std::exp(ms - m);
        l += partials.sum[s * p.max_tile_rows + r] * w;
        const float* a = partials.acc + (s * p.max_tile_rows + r) * Dv;
        const Vec vw(w);
        for (int64_t d = 0; d < Dv; d += kVec)
          at::vec::fmadd(Vec::loadu(a + d), vw, Vec::loadu(merged + d)).store(merged + d);
      }
    }
    const float norm = output_norm(p, tile, rows, r, m, l);
    QT* dst =
        out + (tile.q_begin + rows.token(p, r)) * p.out_stride_token + rows.q_head(p, tile, r) * p.out_stride_head;
    for (int64_t d = 0; d < Dv; ++d) dst[d * p.out_stride_dim] = from_float<QT>(merged[d] * norm);
    if (p.lse != nullptr) store_lse(p, tile, rows, r, m, l);
  }
}

template <typename QT>
void attend_q(const AttentionParams& p, const Tile& tile, const WorkItem& item, const Partials& partials,
              float* scratch) {
  switch (p.kv_dtype) {
    case DType::Float: return attend_impl<QT>(p, FloatLoader{}, tile, item, partials, scratch);
    case DType::BFloat16: return attend_impl<QT>(p, ReducedLoader<c10::BFloat16>{}, tile, item, partials, scratch);
    case DType::Half: return attend_impl<QT>(p, ReducedLoader<c10::Half>{}, tile, item, partials, scratch);
    case DType::Fp8:
      if (TileRows(p, tile).per_head >= kFp8RowsMinShare)
        return attend_impl<QT>(p, Fp8RowsLoader{}, tile, item, partials, scratch);
      return attend_impl<QT>(p, Fp8Loader{p.fp8_lut}, tile, item, partials, scratch);
    case DType::Fp4: return attend_impl<QT>(p, Fp4Loader{}, tile, item, partials, scratch);
    case DType::LatentFp8: return attend_impl<QT>(p, LatentFp8Loader{}, tile, item, partials, scratch);
  }
}

inline void attend(const AttentionParams& p, const Tile& tile, const WorkItem& item, const Partials& partials,
                   float* scratch) {
  switch (p.q_dtype) {
    case DType::Float: return attend_q<float>(p, tile, item, partials, scratch);
    case DType::BFloat16: return attend_q<c10::BFloat16>(p, tile, item, partials, scratch);
    case DType::Half: return attend_q<c10::Half>(p, tile, item, partials, scratch);
    case DType::Fp8:
    case DType::Fp4:
    case DType::LatentFp8: return;  // q is never fp8 or 4-bit (the host checks)
  }
}

inline void merge(const AttentionParams& p, const Tile& tile, int64_t first_slot, int64_t num_slots,
                  const Partials& partials) {
  switch (p.q_dtype) {
    case DType::Float: return merge_impl<float>(p, tile, first_slot, num_slots, partials);
    case DType::BFloat16: return merge_impl<c10::BFloat16>(p, tile, first_slot, num_slots, partials);
    case DType::Half: return merge_impl<c10::Half>(p, tile, first_slot, num_slots, partials);
    case DType::Fp8:
    case DType::Fp4:
    case DType::LatentFp8: return;
  }
}

inline const KernelTable* table(const char* isa) {
  static const KernelTable t{isa, &attend, &merge};
  return &t;
}

}  // namespace attnops::cpu::ATTNOPS_ISA
