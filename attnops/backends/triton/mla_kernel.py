"""Triton kernels of latent attention (MLA, DeepSeek's absorbed form): every query head attends to one latent row a
token, `[c_j (R values), r_j (P values)]`, scores `scale (q_nope . c_j + q_pe . r_j)`, output the softmax-weighted
sum of the c_j (docs/design.md, "mla_attention").

Why a kernel of its own, not paged_attention's: the key (R + P values) and the value (its first R) are one row, and
every query head of a token reads the same rows. So a program takes a block of a token's heads as the M dimension
of its tiles (the heads are what GQA packing is to paged_attention: 8 to 128 rows that share every key), loads a
tile of latent rows once, and uses it as K (both parts) and as V (the c part): the cache is read once a token and
split, whatever H. Split-KV as paged_attention's decode: the splits' partials merged by their LSEs in a second
kernel; a split plan from shapes only, so a CUDA graph replays new lengths.

The sparse form (topk_indices: DeepSeek-V3.2's indexer picks each row's keys) runs the same loop over a row's
listed positions instead of the positions themselves: a tile gathers the rows of its entries, each entry visible
where it names a key the row may see (causal, tree mask), and splits divide the entries.

Bad indices follow paged_attention's rules: a bad length makes the token's rows NaN and reads nothing; a page index
outside the cache is never read and makes NaN the rows that see one of its keys (all heads of a token see the same
keys, so the check is one vector a tile); bad cu_seqlens_q makes every row NaN; a listed position outside its
sequence makes its row NaN. Each is recorded in the error buffer with atomic min.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import (ERR_BLOCK_TABLE, ERR_CU_SEQLENS_Q, ERR_SEQ_LENS, ERR_SLOT_MAPPING, ERR_TOPK_INDICES, LN2, LOG2E,
                     cu_seqlens_violation, find_sequence, fp8_decoded, to_fp8_bits)


@triton.jit
def _latent_rows(bt_row, kpos, vis, num_pages, stride_page, stride_tok, PAGE: tl.constexpr):
    """The cache offsets of the keys kpos's rows, which of them to read (visible, in a good page), and which visible
    keys sit in a bad page (never read)."""
    page = tl.load(bt_row + kpos // PAGE, mask=vis, other=0)
    bad = vis & (page.to(tl.uint32, bitcast=True) >= num_pages.to(tl.uint32))  # (a negative index too)
    row = page.to(tl.int64) * stride_page + (kpos % PAGE) * stride_tok
    return row, vis & ~bad, bad


@triton.jit
def _latent_tile(kv_ptr, row, ok, offs, width, FMT: tl.constexpr, ROPE: tl.constexpr, R: tl.constexpr,
                 DOT_DTYPE: tl.constexpr):
    """The latent values `offs` (< width) of the rows (ROPE: their rotary values), [BLOCK_N, len(offs)] in
    DOT_DTYPE (0 where a row is not read).
    FMT: 0 values as stored, 1 fp8 e4m3 (the call's scale applied by the caller), 2 "fp8_ds_mla" (a row of bytes:
    R e4m3 values, a float32 scale a 128 of them, then the rotary values as bf16; R, len(offs) multiples of 128),
    each value times its 128's scale: the tile reshaped to meet a tile of the scales (measured faster than a scale
    vector chosen per column, and than the scales applied to each 128's products: docs/bench.md)."""
    mask = ok[:, None] & (offs[None, :] < width)
    if FMT == 2 and ROPE:  # bf16 bits widened by a shift (exact; the interpreter reads no bf16)
        bits = tl.load((kv_ptr + row[:, None] + (R + R // 32) + 2 * offs[None, :]).to(tl.pointer_type(tl.int16)),
                       mask=mask, other=0)
        value = (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True).to(DOT_DTYPE)
    elif FMT >= 1:
        bits = tl.load(kv_ptr + row[:, None] + offs[None, :], mask=mask, other=0)
        value = fp8_decoded(bits.to(tl.int32), bits.to(tl.float8e4nv, bitcast=True).to(tl.float32), tl.float8e4nv)
        if FMT == 2:  # times each 128 values' scale, read once a tile of them
            TILES: tl.constexpr = offs.shape[0] // 128
            tiles = tl.arange(0, TILES)
            scale = tl.load((kv_ptr + row[:, None] + R + 4 * tiles[None, :]).to(tl.pointer_type(tl.float32)),
                            mask=ok[:, None] & (tiles[None, :] < width // 128), other=0.0)
            value = tl.reshape(tl.reshape(value, (value.shape[0], TILES, 128)) * scale[:, :, None],
                               (value.shape[0], offs.shape[0]))
        value = value.to(DOT_DTYPE)
    else:
        value = tl.load(kv_ptr + row[:, None] + offs[None, :], mask=mask, other=0.0).to(DOT_DTYPE)
    return value


# (the split count and length are runtime values: a new batch size or table width compiles nothing new)
@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "num_pages", "capacity", "CHUNK", "tm_cols",
                               "MAX_SPLITS", "topk_len"])
def mla_attention_kernel(
    qn_ptr, qp_ptr, kv_ptr, bt_ptr, seq_lens_ptr, cu_ptr, kv_scale_ptr, sinks_ptr, tm_ptr, topk_ptr, out_ptr, lse_ptr,
    part_out_ptr, part_lse_ptr, err_ptr,
    num_seqs, num_tokens, num_pages, capacity, sm_scale, CHUNK, tm_cols, MAX_SPLITS, topk_len,
    stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, stride_page, stride_tok, stride_bt, stride_ot, stride_oh,
    stride_tm, stride_topk,
    NUM_HEADS: tl.constexpr, R: tl.constexpr, P: tl.constexpr, R_P2: tl.constexpr, P_P2: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    IS_DECODE: tl.constexpr, FMT: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_TREE: tl.constexpr,
    HAS_TOPK: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    """Program (token t and head block, split): the token's heads of the block against the split's keys of its
    sequence (those at or before its position; a tree mask decides inside its query block). With one split it
    writes out (and lse); with more (SPLIT), its partial (normalized output, base-2 LSE) for mla_merge_kernel.
    HAS_TOPK: the split's entries of the token's topk_indices row (topk_len a row) name its keys instead."""
    # the head blocks of a token are neighbours in launch order: they run together and read the same latent rows,
    # so all but the first find them in L2
    HEAD_BLOCKS: tl.constexpr = (NUM_HEADS + BLOCK_H - 1) // BLOCK_H
    t = tl.program_id(0) // HEAD_BLOCKS
    head_block = tl.program_id(0) % HEAD_BLOCKS
    split = tl.program_id(1)
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    hvalid = heads < NUM_HEADS
    DOT_DTYPE: tl.constexpr = qn_ptr.dtype.element_ty

    if IS_DECODE:
        b = t
        q_start = t
        q_len = 1
        cu_bad = t < 0  # (false, as a tensor)
    else:
        violation = cu_seqlens_violation(cu_ptr, num_seqs, num_tokens, 128)
        cu_bad = violation <= num_seqs
        if cu_bad & (t == 0) & (head_block == 0) & (split == 0):
            tl.atomic_min(err_ptr + ERR_CU_SEQLENS_Q, violation)
        b = find_sequence(cu_ptr, t, num_seqs, 1, False)
        q_start = tl.load(cu_ptr + b)
        q_len = tl.load(cu_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    len_bad = (seq_len < 0) | (seq_len > capacity)
    if len_bad & (head_block == 0) & (split == 0) & ~cu_bad:
        tl.atomic_min(err_ptr + ERR_SEQ_LENS, b)
    seq_len = tl.where(len_bad | cu_bad, 0, seq_len)
    block_start = seq_len - q_len  # the query block's first position
    kv_end = tl.maximum(block_start + (t - q_start) + 1, 0)  # keys [0, kv_end) are causally visible
    if HAS_TREE:  # every key before the block, and the block's keys as the mask says
        kv_end = seq_len
    lo = split * CHUNK
    if HAS_TOPK:  # entries [lo, hi) of the row's list
        hi = tl.minimum(lo + CHUNK, topk_len)
        topk_row = topk_ptr + t.to(tl.int64) * stride_topk
    else:  # keys [lo, hi)
        hi = tl.minimum(lo + CHUNK, kv_end)

    offs_r = tl.arange(0, R_P2)
    offs_p = tl.arange(0, P_P2)
    qn = tl.load(qn_ptr + t.to(tl.int64) * stride_qn_t + heads[:, None] * stride_qn_h + offs_r[None, :],
                 mask=hvalid[:, None] & (offs_r[None, :] < R), other=0.0)
    qp = tl.load(qp_ptr + t.to(tl.int64) * stride_qp_t + heads[:, None] * stride_qp_h + offs_p[None, :],
                 mask=hvalid[:, None] & (offs_p[None, :] < P), other=0.0)
    qk_scale = sm_scale * LOG2E
    v_mul = 1.0
    if FMT == 1:  # stored = value / kv_scale: the scale joins the scores and the output, never the dots
        kv_scale = tl.load(kv_scale_ptr)
        qk_scale = qk_scale * kv_scale
        v_mul = kv_scale
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, R_P2], dtype=tl.float32)
    saw_bad = tl.zeros([BLOCK_N], dtype=tl.int1)
    saw_bad_entry = tl.zeros([BLOCK_N], dtype=tl.int1)
    for start in range(lo, hi, BLOCK_N):
        if HAS_TOPK:  # each entry a key position (-1: none); one outside the sequence poisons the row
            entry = start + tl.arange(0, BLOCK_N)
            kpos = tl.load(topk_row + entry, mask=entry < hi, other=-1)
            saw_bad_entry = saw_bad_entry | (kpos < -1) | (kpos >= seq_len)
            vis = (kpos >= 0) & (kpos < kv_end)
        else:
            kpos = start + tl.arange(0, BLOCK_N)
            vis = kpos < hi
        if HAS_TREE:  # inside the block: key j of it iff tree_mask[t, j] (columns past tm_cols: not seen)
            col = kpos - block_start
            in_block = col >= 0
            seen = tl.load(tm_ptr + t.to(tl.int64) * stride_tm + col, mask=vis & in_block & (col < tm_cols),
                           other=0)
            vis = vis & (~in_block | (seen != 0))
        row, ok, bad = _latent_rows(bt_row, kpos, vis, num_pages, stride_page, stride_tok, PAGE)
        saw_bad = saw_bad | bad
        c = _latent_tile(kv_ptr, row, ok, offs_r, R, FMT, False, R, DOT_DTYPE)
        rp = _latent_tile(kv_ptr if FMT == 2 else kv_ptr + R, row, ok, offs_p, P, FMT, True, R, DOT_DTYPE)
        s = tl.dot(qn, tl.trans(c)) + tl.dot(qp, tl.trans(rp))
        s = tl.where(vis[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), c)
        m_i = m_new

    row_bad = tl.max(saw_bad.to(tl.int32), 0) > 0
    if row_bad:
        tl.atomic_min(err_ptr + ERR_BLOCK_TABLE, b)
    # (a bad length or cu_seqlens_q already poisons the row: its entries are not judged against a length of 0)
    entry_bad = (tl.max(saw_bad_entry.to(tl.int32), 0) > 0) & ~(cu_bad | len_bad)
    if entry_bad & (head_block == 0):
        tl.atomic_min(err_ptr + ERR_TOPK_INDICES, t)
    poison = cu_bad | len_bad | row_bad | entry_bad | (l_i != l_i)
    has_keys = l_i > 0.0
    inv_l = tl.where(has_keys, v_mul / tl.where(has_keys, l_i, 1.0), 0.0)
    lse2 = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    if not SPLIT:
        if HAS_SINKS:  # the sink joins the denominator; a row with no key stays 0 whatever its sink
            sink = tl.load(sinks_ptr + heads, mask=hvalid, other=0.0) * LOG2E
            big = tl.maximum(m_i, sink)
            big = tl.where(big == float("-inf"), 0.0, big)
            keep = tl.exp2(m_i - big) * l_i
            inv_l = inv_l * tl.where(has_keys, keep / tl.where(has_keys, keep + tl.exp2(sink - big), 1.0), 1.0)
            both = tl.maximum(lse2, sink)
            both = tl.where(both == float("-inf"), 0.0, both)
            total = tl.exp2(lse2 - both) + tl.exp2(sink - both)
            lse2 = tl.where(total == 0.0, float("-inf"), both + tl.log2(tl.where(total == 0.0, 1.0, total)))
        inv_l = tl.where(poison, float("nan"), inv_l)
        o_ptr = out_ptr + t.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_r[None, :]
        tl.store(o_ptr, (acc * inv_l[:, None]).to(out_ptr.dtype.element_ty),
                 mask=hvalid[:, None] & (offs_r[None, :] < R))
        if WRITE_LSE:
            lse2 = tl.where(poison, float("nan"), lse2)
            tl.store(lse_ptr + t.to(tl.int64) * NUM_HEADS + heads, lse2 * LN2, mask=hvalid)
    else:
        inv_l = tl.where(poison, float("nan"), inv_l)
        part_row = (t.to(tl.int64) * NUM_HEADS + heads) * MAX_SPLITS + split
        tl.store(part_out_ptr + part_row[:, None] * R_P2 + offs_r[None, :], acc * inv_l[:, None],
                 mask=hvalid[:, None])
        tl.store(part_lse_ptr + part_row, tl.where(poison, float("nan"), lse2), mask=hvalid)


@triton.jit(do_not_specialize=["MAX_SPLITS"])
def mla_merge_kernel(out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, sinks_ptr, stride_ot, stride_oh, MAX_SPLITS,
                     NUM_HEADS: tl.constexpr, R: tl.constexpr, R_P2: tl.constexpr, SPLITS_P2: tl.constexpr,
                     SPLIT_BLOCK: tl.constexpr, HAS_SINKS: tl.constexpr, WRITE_LSE: tl.constexpr):
    """Program (token, head): its splits' partials combined by their LSEs (base 2), the sink in the denominator;
    a NaN partial (a bad index its split met) makes the row NaN. The LSEs are read at once, the partials
    SPLIT_BLOCK splits at a time (a single long sequence has up to a few hundred splits: their rows at once
    would not fit in registers)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    row = (t * NUM_HEADS + h) * MAX_SPLITS
    offs_s = tl.arange(0, SPLITS_P2)
    lse = tl.load(part_lse_ptr + row + offs_s, mask=offs_s < MAX_SPLITS, other=float("-inf"))
    any_nan = tl.sum((lse != lse).to(tl.int32), 0) > 0
    lse = tl.where(lse != lse, float("-inf"), lse)
    mx = tl.max(lse, 0)
    keys = mx != float("-inf")
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h) * LOG2E
        mx = tl.maximum(mx, sink)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    denom = tl.sum(tl.exp2(lse - mx), 0)
    total = denom
    if HAS_SINKS:
        sink_w = tl.exp2(sink - mx)
        denom += tl.where(keys, sink_w, 0.0)  # a row with no key stays 0
        total += sink_w
    offs_r = tl.arange(0, R_P2)
    o = tl.zeros([R_P2], dtype=tl.float32)
    for first in range(0, MAX_SPLITS, SPLIT_BLOCK):
        offs_b = first + tl.arange(0, SPLIT_BLOCK)
        inside = offs_b < MAX_SPLITS
        lse_b = tl.load(part_lse_ptr + row + offs_b, mask=inside, other=float("-inf"))
        w = tl.exp2(tl.where(lse_b != lse_b, float("-inf"), lse_b) - mx)
        part = tl.load(part_out_ptr + (row + offs_b)[:, None] * R_P2 + offs_r[None, :], mask=inside[:, None],
                       other=0.0)
        o += tl.sum(tl.where(w[:, None] > 0.0, w[:, None] * part, 0.0), 0)
    o = o / tl.where(denom > 0.0, denom, 1.0)
    o = tl.where(any_nan, float("nan"), o)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_r, o.to(out_ptr.dtype.element_ty), mask=offs_r < R)
    if WRITE_LSE:
        row_lse = tl.where(total == 0.0, float("-inf"), mx + tl.log2(tl.where(total == 0.0, 1.0, total)))
        row_lse = tl.where(any_nan, float("nan"), row_lse)
        tl.store(lse_ptr + t * NUM_HEADS + h, row_lse * LN2)


@triton.jit
def mla_cache_write_kernel(kv_c_ptr, k_pe_ptr, kv_ptr, slot_ptr, kv_scale_ptr, err_ptr, num_slots, stride_c,
                           stride_pe, stride_page, stride_tok,
                           R: tl.constexpr, P: tl.constexpr, R_P2: tl.constexpr, P_P2: tl.constexpr,
                           PAGE: tl.constexpr, FMT: tl.constexpr, SOFT_FP8: tl.constexpr):
    """Program i: row slot_mapping[i] = [kv_c[i], k_pe[i]] (FMT 1, fp8: value / kv_scale, saturated; FMT 2,
    "fp8_ds_mla": each 128 latent values over their own scale, the rotary values as bf16, as attnops.formats
    writes them); slot -1 is padding, any other slot outside the cache writes nothing and is recorded."""
    i = tl.program_id(0)
    slot = tl.load(slot_ptr + i)
    if (slot < -1) | (slot >= num_slots):
        tl.atomic_min(err_ptr + ERR_SLOT_MAPPING, i)
    if (slot >= 0) & (slot < num_slots):
        row = kv_ptr + (slot // PAGE) * stride_page + (slot % PAGE) * stride_tok
        offs_r = tl.arange(0, R_P2)
        offs_p = tl.arange(0, P_P2)
        c = tl.load(kv_c_ptr + i.to(tl.int64) * stride_c + offs_r, mask=offs_r < R, other=0.0).to(tl.float32)
        pe = tl.load(k_pe_ptr + i.to(tl.int64) * stride_pe + offs_p, mask=offs_p < P, other=0.0).to(tl.float32)
        if FMT == 2:
            TILES: tl.constexpr = R_P2 // 128
            tiles = tl.reshape(c, (TILES, 128))
            amax = tl.max(tl.abs(tiles), 1)
            has_nan = tl.max((tiles != tiles).to(tl.int32), 1) > 0
            scale = tl.math.div_rn(tl.maximum(amax, 1e-4), 448.0 + tl.zeros([TILES], tl.float32))
            scale = tl.where(has_nan, float("nan"), scale)
            y = tl.reshape(tl.math.div_rn(tiles, scale[:, None] + tl.zeros([TILES, 128], tl.float32)), (R_P2,))
            nan = y != y
            y = tl.where(nan, 0.0, tl.minimum(tl.maximum(y, -448.0), 448.0))
            bits = tl.where(nan, 0x7F, to_fp8_bits(y, tl.float8e4nv, SOFT_FP8))  # (one NaN, unsigned)
            tl.store(row + offs_r, bits.to(tl.uint8), mask=offs_r < R)
            offs_t = tl.arange(0, TILES)
            tl.store((row + R + 4 * offs_t).to(tl.pointer_type(tl.float32)), scale, mask=offs_t < R // 128)
            tl.store((row + R + R // 32 + 2 * offs_p).to(tl.pointer_type(tl.int16)), to_bf16_bits(pe),
                     mask=offs_p < P)
        elif FMT == 1:  # as attnops.formats quantizes: a rounded division, saturated at 448, NaN kept
            scale = tl.load(kv_scale_ptr)
            y = tl.math.div_rn(c, scale + tl.zeros([R_P2], tl.float32))
            y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -448.0), 448.0))
            tl.store(row + offs_r, to_fp8_bits(y, tl.float8e4nv, SOFT_FP8), mask=offs_r < R)
            y = tl.math.div_rn(pe, scale + tl.zeros([P_P2], tl.float32))
            y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -448.0), 448.0))
            tl.store(row + R + offs_p, to_fp8_bits(y, tl.float8e4nv, SOFT_FP8), mask=offs_p < P)
        else:
            tl.store(row + offs_r, c.to(kv_ptr.dtype.element_ty), mask=offs_r < R)
            tl.store(row + R + offs_p, pe.to(kv_ptr.dtype.element_ty), mask=offs_p < P)


@triton.jit
def to_bf16_bits(x):
    """fp32 -> bf16 bits (int16), rounded to nearest even as torch rounds (a NaN: 0x7FC0), in integer code: the
    interpreter has no bf16."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(x != x, 0x7FC0, rounded).to(tl.uint16).to(tl.int16, bitcast=True)
