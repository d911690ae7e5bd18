"""Split-KV (flash-decoding) paged attention: the attention kernel every query shape goes through, and the
log-sum-exp merge of its splits.

One program handles (query block, KV head, split):
- rows of its tl.dot tile are the query heads of one KV head's GQA group, times the block's query tokens
  (decode: 1 token, so the group's heads padded to 16 rows; a verify block of 4 tokens x 4 heads is one
  16-row tile), so each KV tile is read once for all of them, on tensor cores;
- the keys it reads are one split of the block's causal/window range: the number of splits is computed on the
  device from seq_lens (common.kv_plan: about CHUNK keys per program, capped by MAX_SPLITS), so the launch
  grid depends on shapes only (CUDA-graph capturable, no host sync) while every program gets a similar amount
  of work whatever the mix of lengths (ragged batches balance by work, not by sequence);
- online softmax in fp32 (base 2, log2(e) folded into the score scale);
- KV formats are decoded in registers right after the load (fp8 with the per-tensor/per-head scale folded
  into the score scale and the output, 4-bit with per-block scales applied per element): there is no
  dequantized copy of the cache anywhere.
A head dim between powers of two (80, 96, 160 ...) runs in the next power of two's tile (HEAD_DIM) with the columns
from VALID_DIM on masked: loaded as 0 (so they add nothing to q.k or to the output) and never stored; or, with
DIM_B (heuristics.head_parts), in two tiles: the power of two below it (HEAD_DIM / 2) and DIM_B columns after
those, two dots for q.k and two accumulators for the output, so that 96 computes on 64 + 32 columns, not 128.
A program whose sequence needs only one split writes the normalized output directly; otherwise it writes its
partial output and LSE to a workspace of [T, Hq, MAX_SPLITS] rows and the merge kernel combines them. With
WRITE_LSE (paged_attention_with_lse) whichever writes a row's output also writes its LSE, as a natural log.

Every query shape (decode, verify, extend, prefill: IS_DECODE) shares these kernels. heuristics.py chooses their
tunables from shapes; launch.py runs them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .common import (ERR_BLOCK_TABLE, ERR_CU_SEQLENS_Q, ERR_SEQ_LENS, FMT_FP8, FMT_MXFP4, FMT_NVFP4,
                     FP8_PAIR_E4M3_EVEN, FP8_PAIR_E4M3_ODD, FP8_PAIR_E5M2_EVEN, FP8_PAIR_E5M2_ODD, LN2, LOG2E,
                     WAVE_PROGRAM_KEYS, bad_page_rows, check_pages, cu_seqlens_violation, e2m1_nibbles,
                     e8m0_to_f32, fp8_decoded, find_sequence, kv_plan, opaque_one, wave_chunk)

# torch dtypes of tl.dot operands as Triton's
TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def _head_part(mask, offs, LIMIT: tl.constexpr, ALONG_ROWS: tl.constexpr):
    """`mask` narrowed to a padded tile's own part (offs < LIMIT along the tile's rows, or its columns): the head
    dim's values, words, bytes or block scales. Unchanged (no instruction) where the tile is the head dim's own."""
    if LIMIT < offs.shape[0]:
        if ALONG_ROWS:
            mask = mask & (offs < LIMIT)[:, None]
        else:
            mask = mask & (offs < LIMIT)[None, :]
    return mask


@triton.jit
def _padded_cols(offs, mask, LIMIT: tl.constexpr, ALONG_ROWS: tl.constexpr, PAD_WRAP: tl.constexpr):
    """A 16-bit or fp8 tile's head-dim offsets and load mask: `mask` narrowed to the head dim (_head_part), or, with
    PAD_WRAP, a padded tile's offsets from LIMIT on wrapped onto its first columns (offs % LIMIT) and `mask` kept:
    copies that meet q's zero columns in q.k and fill output columns never stored, so that the load carries no
    column mask, whose predicates take registers (docs/bench.md, "Every head dim")."""
    if PAD_WRAP and LIMIT < offs.shape[0]:
        cols = offs % LIMIT
    else:
        cols = offs
        mask = _head_part(mask, offs, LIMIT, ALONG_ROWS)
    return cols, mask


@triton.jit
def _load_fp4_tile(c_ptr, s_ptr, tok_off, s_off, offs_h, kvalid, TRANSPOSED: tl.constexpr, FMT: tl.constexpr,
                   DOT_DTYPE: tl.constexpr, SCALE_BCAST: tl.constexpr, FP4_ASM: tl.constexpr,
                   VALID_DIM: tl.constexpr):
    """A tile of 4-bit K or V as its even and odd elements (D/2 columns each), dequantized to DOT_DTYPE, times
    fp4_fold(FMT, DOT_DTYPE) (the kernel divides that back out of its score and output scales).

    Keeping even and odd elements apart avoids interleaving them in registers: the kernel multiplies the even
    half of q with the even half of K (and the odd with the odd) and accumulates V's halves separately.
    TRANSPOSED gives [D/2, BLOCK_N] tiles (K^T), else [BLOCK_N, D/2] (V). A padded tile (VALID_DIM < D, a multiple
    of the scale block): the bytes and scales past the head dim load as 0, so their values are 0."""
    # element 2i (even) and 2i+1 (odd) are both in block (2i) // BLOCK = i // (BLOCK / 2)
    half_block: tl.constexpr = 8 if FMT == FMT_NVFP4 else 16
    HALF: tl.constexpr = offs_h.shape[0]
    NB: tl.constexpr = HALF // half_block  # block scales per row
    BN: tl.constexpr = tok_off.shape[0]
    if TRANSPOSED:
        mask = _head_part(kvalid[None, :], offs_h, VALID_DIM // 2, True)
        packed = tl.load(c_ptr + tok_off[None, :] + offs_h[:, None], mask=mask, other=0)
    else:
        mask = _head_part(kvalid[:, None], offs_h, VALID_DIM // 2, False)
        packed = tl.load(c_ptr + tok_off[:, None] + offs_h[None, :], mask=mask, other=0)
    if SCALE_BCAST:
        # one load and one decode per block scale ([NB, BLOCK_N]), repeated across its values in registers
        offs_b = tl.arange(0, NB)
        if TRANSPOSED:
            s_mask = _head_part(kvalid[None, :], offs_b, VALID_DIM // (2 * half_block), True)
            sc = tl.load(s_ptr + s_off[None, :] + offs_b[:, None], mask=s_mask, other=0)
            scale = _fp4_scale(sc, FMT, DOT_DTYPE)
            scale = tl.reshape(tl.broadcast_to(scale[:, None, :], (NB, half_block, BN)), (HALF, BN))
        else:
            s_mask = _head_part(kvalid[:, None], offs_b, VALID_DIM // (2 * half_block), False)
            sc = tl.load(s_ptr + s_off[:, None] + offs_b[None, :], mask=s_mask, other=0)
            scale = _fp4_scale(sc, FMT, DOT_DTYPE)
            scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BN, NB, half_block)), (BN, HALF))
    else:
        # one (cached) load per value: simple layouts, more load instructions (the bytes' mask is the scales')
        if TRANSPOSED:
            sc = tl.load(s_ptr + s_off[None, :] + (offs_h // half_block)[:, None], mask=mask, other=0)
        else:
            sc = tl.load(s_ptr + s_off[:, None] + (offs_h // half_block)[None, :], mask=mask, other=0)
        scale = _fp4_scale(sc, FMT, DOT_DTYPE)
    return _dequant_fp4(packed, scale, FMT, DOT_DTYPE, FP4_ASM)


@triton.jit
def _dequant_fp4(packed, scale, FMT: tl.constexpr, DOT_DTYPE: tl.constexpr, FP4_ASM: tl.constexpr):
    """Packed nibbles (uint8: even element low, odd high) and their block scales (_fp4_scale, one per value) ->
    the even and odd values in DOT_DTYPE, times fp4_fold(FMT, DOT_DTYPE), exactly (an e2m1 value has 2
    significant bits, an e4m3 scale 4: every product fits the dot dtype).

    4-bit decode is bound by its instructions, not bytes (the package README has the measurements), so each case
    takes the fewest: the nibble's bits are moved into a 16-bit float (value x 2^-14
    as fp16, value x 2^-126 as bf16; inline PTX on two values at once with FP4_ASM) and the scale applied in that
    float with packed multiplies where the range allows, through fp32 only where it does not."""
    # (one return at the end: Triton 3.6 refuses returns of different dtypes in constexpr branches)
    if FMT == FMT_MXFP4 and DOT_DTYPE == tl.bfloat16:
        # (value x 2^-126) x 2^126 x 2^(s-127), two packed bf16 multiplies a value pair: bf16 has fp32's exponent
        # range, so every s is exact (s = 0 as a subnormal) with no conversion through fp32; one multiply by
        # 2^(s-1) could not hold s > 128. (The fp32 route: 3617 instructions a 128-key step of the default decode
        # tile instead of 2074, sm_90 SASS.)
        even, odd = e2m1_nibbles(packed, True, FP4_ASM)
        even = (even * 8.507059173023462e37) * scale
        odd = (odd * 8.507059173023462e37) * scale
    else:
        even, odd = e2m1_nibbles(packed, False, FP4_ASM)
        if FMT == FMT_NVFP4 and DOT_DTYPE == tl.float16:
            # (value x 2^-14) x (scale x 2^7) = value x scale x 2^-7, one packed fp16 multiply a value pair: the
            # product lies in [2^-17, 21], which fp16 holds exactly (its subnormals step by 2^-24)
            even = even * scale
            odd = odd * scale
        else:
            # fp32 (fp16 dots of mxfp4, whose scales overflow fp16; fp32 dots)
            even = (even.to(tl.float32) * scale).to(DOT_DTYPE)
            odd = (odd.to(tl.float32) * scale).to(DOT_DTYPE)
    return even, odd


@triton.jit
def _fp4_scale(sc, FMT: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Stored block scales (bytes; masked lanes 0, not a NaN pattern) -> the factor _dequant_fp4 multiplies its
    nibbles by: nvfp4 with fp16 dots, the e4m3 scale x 2^7 in fp16 (< 65504); mxfp4 with bf16 dots, 2^(s-127) in
    bf16; otherwise the scale in fp32 (x 2^14 where fp4_fold is 1, to undo the fp16 nibble's 2^-14)."""
    # (one return at the end: Triton 3.6 refuses returns of different dtypes in constexpr branches)
    if FMT == FMT_NVFP4 and DOT_DTYPE == tl.float16:
        scale = fp8_decoded(sc, sc.to(tl.float8e4nv, bitcast=True).to(tl.float16), tl.float8e4nv) * 128.0
    elif FMT == FMT_NVFP4:
        scale = fp8_decoded(sc, sc.to(tl.float8e4nv, bitcast=True).to(tl.float32), tl.float8e4nv) * 16384.0
    elif DOT_DTYPE == tl.float16:
        # capped at 2^127 (s > 240): fp16 cannot hold those blocks' nonzero values (inf either way), and a zero
        # value must stay 0, not 0 x inf
        scale = tl.minimum(e8m0_to_f32(sc) * 16384.0, 1.7014118346046923e38)
    elif DOT_DTYPE == tl.bfloat16:
        si = sc.to(tl.int16)
        scale = tl.maximum(si << 7, 64).to(tl.int16).to(tl.bfloat16, bitcast=True)  # 2^(s-127); s = 0: 2^-127
    else:
        scale = e8m0_to_f32(sc)
    return scale


@triton.jit
def fp4_fold(FMT: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """The power of two _dequant_fp4's values carry (the kernel divides it out of its score and output scales):
    nvfp4 with fp16 dots 2^-7 (value x scale x 2^-7 stays inside fp16); mxfp4 with fp32 dots 2^-14 (the fp16
    nibble's value x 2^-14 times the plain 2^(s-127), exact in fp32 for every s, where x 2^14 in the scale would
    overflow for s > 240); 1 otherwise."""
    if FMT == FMT_NVFP4 and DOT_DTYPE == tl.float16:
        return 0.0078125
    if FMT == FMT_MXFP4 and DOT_DTYPE == tl.float32:
        return 0.00006103515625
    return 1.0


@triton.jit
def _load_fp8_pairs(c_ptr, tok_off, offs_h, kvalid, TRANSPOSED: tl.constexpr, FP8_DTYPE: tl.constexpr,
                    ASM: tl.constexpr, VALID_DIM: tl.constexpr):
    """A tile of fp8 K or V read as 16-bit words (two neighbouring elements each), returned as its even and odd
    elements in fp16: [D/2, BLOCK_N] tiles (K^T) if TRANSPOSED, else [BLOCK_N, D/2] (V).

    Why: as the B operand of P @ V, fp8 V's register pairs run along keys, not memory, so an 8-bit tile reaches the
    mma layout one shared-memory byte load at a time; a 16-bit tile gets there by ldmatrix.trans, and each
    register pair (two keys' words) then splits into two fp16 pairs with one byte permute and one packed
    conversion each. The kernel multiplies P with both halves and interleaves the output columns at the end. For
    K (FP8_K_PAIRS) the gain is q's operand: next to a 16-bit K it is loaded by ldmatrix rather than rebuilt from
    64-bit loads and register moves every step."""
    if TRANSPOSED:
        # (a padded tile: the words past the head dim are 0; it is even)
        mask = _head_part(kvalid[None, :], offs_h, VALID_DIM // 2, True)
        words = tl.load(c_ptr.to(tl.pointer_type(tl.uint16)) + (tok_off // 2)[None, :] + offs_h[:, None],
                        mask=mask, other=0)
    else:
        mask = _head_part(kvalid[:, None], offs_h, VALID_DIM // 2, False)
        words = tl.load(c_ptr.to(tl.pointer_type(tl.uint16)) + (tok_off // 2)[:, None] + offs_h[None, :],
                        mask=mask, other=0)
    if ASM:  # (pack=2: one register holds two keys' words; the PTX is a module constexpr, as in e2m1_nibbles)
        if FP8_DTYPE == tl.float8e4nv:
            even = tl.inline_asm_elementwise(FP8_PAIR_E4M3_EVEN, "=r,r", [words], tl.float16, True, 2)
            odd = tl.inline_asm_elementwise(FP8_PAIR_E4M3_ODD, "=r,r", [words], tl.float16, True, 2)
        else:
            even = tl.inline_asm_elementwise(FP8_PAIR_E5M2_EVEN, "=r,r", [words], tl.float16, True, 2)
            odd = tl.inline_asm_elementwise(FP8_PAIR_E5M2_ODD, "=r,r", [words], tl.float16, True, 2)
    else:
        even = (words & 0xFF).to(tl.uint8).to(FP8_DTYPE, bitcast=True).to(tl.float16)
        odd = (words >> 8).to(tl.uint8).to(FP8_DTYPE, bitcast=True).to(tl.float16)
        even = fp8_decoded(words, even, FP8_DTYPE)
        odd = fp8_decoded(words >> 8, odd, FP8_DTYPE)
    return even, odd


@triton.jit
def _fp8_to_dot(x, FP8_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """fp8 bytes (loaded as uint8, so that masked lanes are a plain 0, never a NaN pattern) -> DOT_DTYPE (on
    sm_89+ Triton lowers e4m3 -> fp16 to the packed cvt.rn.f16x2.e4m3x2 itself)."""
    return fp8_decoded(x, x.to(FP8_DTYPE, bitcast=True).to(DOT_DTYPE), FP8_DTYPE)


@triton.jit
def _log2_add_exp2(a, b):
    """log2(2^a + 2^b): -inf where both are -inf, NaN where either is NaN."""
    big = tl.maximum(a, b)
    big = tl.where(big == float("-inf"), 0.0, big)
    return _log2_or_neg_inf(tl.exp2(a - big) + tl.exp2(b - big)) + big


@triton.jit
def _log2_or_neg_inf(x):
    """log2(x) for x >= 0 (or NaN), with no log of 0 evaluated: the interpreter warns on one."""
    return tl.where(x == 0.0, float("-inf"), tl.log2(tl.where(x == 0.0, 1.0, x)))


@triton.jit
def _nan_rows(out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, tok, row_head, row_valid, split, MAX_SPLITS, stride_ot,
              stride_oh, NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, WRITE_LSE: tl.constexpr,
              VALID_DIM: tl.constexpr):
    """NaN into the rows (tok, row_head) of `out` and `lse` (split 0) and into this split's partial rows, which
    the merge kernel may read for them."""
    cols = tl.arange(0, HEAD_DIM)
    nan = tl.full([tok.shape[0], HEAD_DIM], float("nan"), tl.float32)
    if split == 0:
        o_ptr = out_ptr + tok[:, None] * stride_ot + row_head.to(tl.int64)[:, None] * stride_oh + cols[None, :]
        tl.store(o_ptr, nan.to(out_ptr.dtype.element_ty), mask=_head_part(row_valid[:, None], cols, VALID_DIM, False))
        if WRITE_LSE:
            tl.store(lse_ptr + tok * NUM_Q_HEADS + row_head, tl.full([tok.shape[0]], float("nan"), tl.float32),
                     mask=row_valid)
    if MAX_SPLITS > 1:
        part_row = (tok * NUM_Q_HEADS + row_head) * MAX_SPLITS + split
        tl.store(part_out_ptr + part_row[:, None] * HEAD_DIM + cols[None, :], nan, mask=row_valid[:, None])
        tl.store(part_lse_ptr + part_row, tl.full([tok.shape[0]], float("nan"), tl.float32), mask=row_valid)


@triton.jit
def _mask_scores(s, kpos, kvalid, block_start, tm_ptr, tok, stride_tm, tm_cols, row_valid, q_pos, window_left,
                 HAS_TREE: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """The scores of a tile with the keys each row does not see at -inf: the causal rule (or the tree mask, for
    the keys of the sequence's query block), the window, the end of the keys."""
    if HAS_TREE:
        # row i sees block key j (at block_start + j) iff tree_mask[its row, j], j < the mask's width
        col = kpos - block_start
        in_block = col >= 0
        tm = tl.load(tm_ptr + tok[:, None] * stride_tm + col[None, :],
                     mask=row_valid[:, None] & (in_block & (col < tm_cols) & kvalid)[None, :], other=0)
        visible = kvalid[None, :] & (~in_block[None, :] | (tm != 0))
    else:
        visible = kpos[None, :] <= q_pos[:, None]
    if HAS_WINDOW:
        visible = visible & (kpos[None, :] >= q_pos[:, None] - window_left)
    s = tl.where(visible, s, float("-inf"))
    return s


@triton.jit
def _tile_qk(qa, qb, k_ptr, ks_ptr, tok_off, page_v, in_page, kvh, stride_ksp, stride_kst, stride_ksh, offs_d, kvalid,
             FMT: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, FP8_DTYPE: tl.constexpr,
             SCALE_BCAST: tl.constexpr, FP4_ASM: tl.constexpr, SOFT_FP8: tl.constexpr, PAIRED_K: tl.constexpr,
             VALID_DIM: tl.constexpr, PAD_WRAP: tl.constexpr):
    """q K^T of one tile, unscaled: K loaded at tok_off and decoded to the dot dtype, one dot, or (PAIRED_K) two
    over q's and K's even and odd elements (qa, qb). PAD_WRAP: a padded tile's columns past the head dim read the
    row's first columns again, not masked (_padded_cols)."""
    IS_FP4: tl.constexpr = FMT == FMT_NVFP4 or FMT == FMT_MXFP4
    if PAIRED_K:
        if IS_FP4:
            ks_off = page_v * stride_ksp + in_page * stride_kst + kvh * stride_ksh
            k_e, k_o = _load_fp4_tile(k_ptr, ks_ptr, tok_off, ks_off, offs_d, kvalid, True, FMT, DOT_DTYPE,
                                      SCALE_BCAST, FP4_ASM, VALID_DIM)
        else:
            k_e, k_o = _load_fp8_pairs(k_ptr, tok_off, offs_d, kvalid, True, FP8_DTYPE, not SOFT_FP8, VALID_DIM)
        qk = tl.dot(qa, k_e, input_precision=DOT_PRECISION)
        qk = tl.dot(qb, k_o, acc=qk, input_precision=DOT_PRECISION)
    else:
        # (a padded tile: K's columns past the head dim are 0, as q's; or, PAD_WRAP, copies of its first ones)
        cols, mask = _padded_cols(offs_d, kvalid[None, :], VALID_DIM, True, PAD_WRAP)
        k = tl.load(k_ptr + tok_off[None, :] + cols[:, None], mask=mask, other=0.0)
        if FMT == FMT_FP8:
            k = _fp8_to_dot(k, FP8_DTYPE, DOT_DTYPE)
        else:
            k = k.to(DOT_DTYPE)
        qk = tl.dot(qa, k, input_precision=DOT_PRECISION)
    return qk


@triton.jit
def _masked_scores(s, start, kpos, kvalid, block_start, tm_ptr, tok, stride_tm, tm_cols, row_valid, q_pos,
                   window_left, full_lo, full_hi, BLOCK_N: tl.constexpr, EDGE: tl.constexpr,
                   HAS_TREE: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """The tile's scores masked (_mask_scores) where some row may not see some key: every tile with EDGE, else only
    the tiles at the causal/window/length edges, outside [full_lo, full_hi) (a runtime branch: most tiles skip
    the mask's instructions)."""
    if EDGE:
        s = _mask_scores(s, kpos, kvalid, block_start, tm_ptr, tok, stride_tm, tm_cols, row_valid, q_pos,
                         window_left, HAS_TREE, HAS_WINDOW)
    else:
        needs_mask = start + BLOCK_N > full_hi
        if HAS_WINDOW:
            needs_mask = needs_mask | (start < full_lo)
        if needs_mask:
            s = _mask_scores(s, kpos, kvalid, block_start, tm_ptr, tok, stride_tm, tm_cols, row_valid, q_pos,
                             window_left, HAS_TREE, HAS_WINDOW)
    return s


@triton.jit
def _tile_pv(p, alpha, acc, acc_o, v_ptr, vs_ptr, tok_off, page_v, in_page, kvh, stride_vsp, stride_vst, stride_vsh,
             offs_d, kvalid, sm_scale, HEAD_DIM: tl.constexpr, FMT: tl.constexpr, DOT_DTYPE: tl.constexpr,
             DOT_PRECISION: tl.constexpr, FP8_DTYPE: tl.constexpr, SCALE_BCAST: tl.constexpr,
             FP4_ASM: tl.constexpr, SOFT_FP8: tl.constexpr, V_DEQUANT_FIRST: tl.constexpr, PAIRED_V: tl.constexpr,
             VALID_DIM: tl.constexpr, PAD_WRAP: tl.constexpr):
    """(acc, acc_o) rescaled by alpha plus the tile's weights p times V (loaded at tok_off, decoded to the dot
    dtype): one dot, or (PAIRED_V) two into V's even and odd halves (acc, acc_o). PAD_WRAP: as _tile_qk's.

    V_DEQUANT_FIRST (fp8, 4-bit): Triton moves V's conversion (a cast, or the 4-bit decode) behind the change to
    the mma operand layout, where V's operand pairs run along tokens, not memory: fp8 V then takes one
    shared-memory load a byte and 4-bit V one load per scale per value pair. A multiply by a 1.0 it cannot see
    through (inline PTX; ptxas drops the multiply) keeps the conversion in the load's layout, so the converted
    16-bit tile goes through shared memory and ldmatrix.trans like a bf16 V tile. sm_90 SASS of the default
    decode tiles (Triton 3.6), instructions a thread per 128-key step: fp8 1419 -> 989, nvfp4 1866 -> 1545,
    mxfp4 2074 -> 1665 (doing the same to K adds instructions). On by default for mxfp4 only (heuristic_config)."""
    IS_FP4: tl.constexpr = FMT == FMT_NVFP4 or FMT == FMT_MXFP4
    if PAIRED_V:
        if IS_FP4:
            vs_off = page_v * stride_vsp + in_page * stride_vst + kvh * stride_vsh
            v_e, v_o = _load_fp4_tile(v_ptr, vs_ptr, tok_off, vs_off, offs_d, kvalid, False, FMT, DOT_DTYPE,
                                      SCALE_BCAST, FP4_ASM, VALID_DIM)
            if V_DEQUANT_FIRST:
                one = opaque_one(sm_scale).to(DOT_DTYPE)
                v_e = v_e * one
                v_o = v_o * one
        else:
            v_e, v_o = _load_fp8_pairs(v_ptr, tok_off, tl.arange(0, HEAD_DIM // 2), kvalid, False, FP8_DTYPE,
                                       not SOFT_FP8, VALID_DIM)
        p = p.to(DOT_DTYPE)
        acc = tl.dot(p, v_e, acc=acc * alpha[:, None], input_precision=DOT_PRECISION)
        acc_o = tl.dot(p, v_o, acc=acc_o * alpha[:, None], input_precision=DOT_PRECISION)
    else:
        cols, mask = _padded_cols(tl.arange(0, HEAD_DIM), kvalid[:, None], VALID_DIM, False, PAD_WRAP)
        v = tl.load(v_ptr + tok_off[:, None] + cols[None, :], mask=mask, other=0.0)
        if FMT == FMT_FP8:
            v = _fp8_to_dot(v, FP8_DTYPE, DOT_DTYPE)
            if V_DEQUANT_FIRST:
                v = v * opaque_one(sm_scale).to(DOT_DTYPE)
        else:
            v = v.to(DOT_DTYPE)
        acc = tl.dot(p.to(DOT_DTYPE), v, acc=acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, acc_o


@triton.jit
def _kv_tiles(lo, hi, split_hi, acc, acc_o, acc2, acc2_o, m_i, l_i, qa, qb, qa2, qb2, k_ptr, v_ptr, ks_ptr, vs_ptr,
              bt_row, tm_ptr, num_pages, fallback, head_off, kvh, stride_kp, stride_kt, stride_ksp, stride_kst,
              stride_ksh, stride_vsp, stride_vst, stride_vsh, qk_scale, sm_scale, soft_cap, full_lo, full_hi,
              block_start, window_left, tok, q_pos, row_valid, stride_tm, tm_cols,
              EDGE: tl.constexpr, HAS_TREE: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr, FMT: tl.constexpr, DOT_DTYPE: tl.constexpr,
              DOT_PRECISION: tl.constexpr, FP8_DTYPE: tl.constexpr, SCALE_BCAST: tl.constexpr,
              FP4_ASM: tl.constexpr, SOFT_FP8: tl.constexpr, V_DEQUANT_FIRST: tl.constexpr,
              HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, BOUNDS: tl.constexpr, PAIRED_K: tl.constexpr,
              PAIRED_V: tl.constexpr, PAGE_CLAMP: tl.constexpr, MASK_LOADS: tl.constexpr,
              OFFSETS_32: tl.constexpr, VALID_DIM: tl.constexpr, DIM_B: tl.constexpr, PAIRED_K2: tl.constexpr,
              PAIRED_V2: tl.constexpr, PAD_WRAP: tl.constexpr):
    """The key loop over the tiles [lo, hi) of a split (split_hi: where the split's keys end): the online softmax
    of the rows' scores into (acc, acc_o, acc2, acc2_o, m_i, l_i), returned updated. q is (qa, qb): q's even and
    odd elements with PAIRED_K, else q twice; acc_o is V's odd half with PAIRED_V, else unused. HEAD_DIM is the
    first tile's width; with DIM_B the head's columns from HEAD_DIM on are a second tile, (qa2, qb2) and
    (acc2, acc2_o) (else unused), in halves with PAIRED_K2 and PAIRED_V2. EDGE: every tile gets the masks
    (the tiles at a query block's keys), else only those a runtime check finds at an edge. PAGE_CLAMP: page indices
    are clamped into [0, num_pages) (the caller checks them after the loop and discards what a bad one gave).
    MASK_LOADS: the loads skip keys at or past split_hi; off only where every tile ends by split_hi (FULL_TILES),
    so that no load carries a mask. OFFSETS_32: element offsets in int32 (the caller's check: every offset into
    the caches fits)."""
    OFF_T: tl.constexpr = tl.int32 if OFFSETS_32 else tl.int64
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM // 2) if PAIRED_K else tl.arange(0, HEAD_DIM)
    VALID_A: tl.constexpr = min(VALID_DIM, HEAD_DIM)
    IS_FP4: tl.constexpr = FMT == FMT_NVFP4 or FMT == FMT_MXFP4
    # fp8's second V tile (plain bytes) converted in its load's layout (V_DEQUANT_FIRST): fewer instructions there
    V2_DEQUANT_FIRST: tl.constexpr = FMT == FMT_FP8 and not SOFT_FP8
    DIM_B_P: tl.constexpr = max(DIM_B, 2)  # (an unused tile's width, so that the aranges below stay valid)
    offs_d2 = tl.arange(0, DIM_B_P // 2) if PAIRED_K2 else tl.arange(0, DIM_B_P)
    # the second tile's K/V bytes and 4-bit block scales start HEAD_DIM values into a head's row
    B_BYTES: tl.constexpr = HEAD_DIM // 2 if IS_FP4 else HEAD_DIM
    B_SCALES: tl.constexpr = HEAD_DIM // (16 if FMT == FMT_NVFP4 else 32) if IS_FP4 else 0
    for start in range(lo, hi, BLOCK_N):
        kpos = start + offs_n
        if MASK_LOADS:
            kvalid = kpos < split_hi
        else:
            kvalid = tl.full([BLOCK_N], 1, tl.int1)
        # page of each key; a page of >= BLOCK_N tokens holds the whole (aligned) tile: one scalar load
        if PAGE >= BLOCK_N:
            page = tl.load(bt_row + start // PAGE)
            if BOUNDS and BLOCK_Q > 1:  # a bad page is read as `fallback`: the rows that see its keys are NaN
                page = tl.where(page.to(tl.uint32, bitcast=True) < num_pages.to(tl.uint32), page, fallback)
            if PAGE_CLAMP:  # (a negative index is a huge unsigned one)
                page = tl.minimum(page.to(tl.uint32, bitcast=True), (num_pages - 1).to(tl.uint32)).to(tl.int32,
                                                                                                   bitcast=True)
            page_v = page.to(OFF_T) + tl.zeros([BLOCK_N], dtype=OFF_T)
        else:
            page_v = tl.load(bt_row + kpos // PAGE, mask=kvalid, other=0)
            if BOUNDS and BLOCK_Q > 1:  # (as above)
                page_v = tl.where(page_v.to(tl.uint32, bitcast=True) < num_pages.to(tl.uint32), page_v, fallback)
            if PAGE_CLAMP:
                page_v = tl.minimum(page_v.to(tl.uint32, bitcast=True), (num_pages - 1).to(tl.uint32)).to(
                    tl.int32, bitcast=True)
            page_v = page_v.to(OFF_T)
        in_page = (kpos % PAGE).to(OFF_T)
        # int64 unless the caches are small: page index x page stride passes 2^31 elements on large caches
        tok_off = page_v * stride_kp + in_page * stride_kt + head_off

        qk = _tile_qk(qa, qb, k_ptr, ks_ptr, tok_off, page_v, in_page, kvh, stride_ksp, stride_kst, stride_ksh, offs_d,
                      kvalid, FMT, DOT_DTYPE, DOT_PRECISION, FP8_DTYPE, SCALE_BCAST, FP4_ASM, SOFT_FP8, PAIRED_K,
                      VALID_A, PAD_WRAP)
        if DIM_B > 0:
            qk += _tile_qk(qa2, qb2, k_ptr + B_BYTES, ks_ptr + B_SCALES, tok_off, page_v, in_page, kvh, stride_ksp,
                           stride_kst, stride_ksh, offs_d2, kvalid, FMT, DOT_DTYPE, DOT_PRECISION, FP8_DTYPE,
                           SCALE_BCAST, FP4_ASM, SOFT_FP8, PAIRED_K2, VALID_DIM - HEAD_DIM, PAD_WRAP)
        qk = qk * qk_scale
        if HAS_SOFTCAP:
            # soft_cap * tanh(s / soft_cap), tanh through exp2 (stable: exp2 -> inf gives 1, -> 0 gives -1)
            t = tl.exp2(qk * (2.0 * LOG2E / soft_cap))
            s = (soft_cap * LOG2E) * (1.0 - 2.0 / (t + 1.0))
        else:
            s = qk
        s = _masked_scores(s, start, kpos, kvalid, block_start, tm_ptr, tok, stride_tm, tm_cols, row_valid, q_pos,
                           window_left, full_lo, full_hi, BLOCK_N, EDGE, HAS_TREE, HAS_WINDOW)

        # online softmax (base 2)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet: no NaN
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

        acc, acc_o = _tile_pv(p, alpha, acc, acc_o, v_ptr, vs_ptr, tok_off, page_v, in_page, kvh, stride_vsp,
                              stride_vst, stride_vsh, offs_d, kvalid, sm_scale, HEAD_DIM, FMT, DOT_DTYPE,
                              DOT_PRECISION, FP8_DTYPE, SCALE_BCAST, FP4_ASM, SOFT_FP8, V_DEQUANT_FIRST, PAIRED_V,
                              VALID_A, PAD_WRAP)
        if DIM_B > 0:
            acc2, acc2_o = _tile_pv(p, alpha, acc2, acc2_o, v_ptr + B_BYTES, vs_ptr + B_SCALES, tok_off, page_v,
                                    in_page, kvh, stride_vsp, stride_vst, stride_vsh, offs_d2, kvalid, sm_scale, DIM_B,
                                    FMT, DOT_DTYPE, DOT_PRECISION, FP8_DTYPE, SCALE_BCAST, FP4_ASM, SOFT_FP8,
                                    V_DEQUANT_FIRST or V2_DEQUANT_FIRST, PAIRED_V2, VALID_DIM - HEAD_DIM, PAD_WRAP)
    return acc, acc_o, acc2, acc2_o, m_i, l_i


# Runtime values that change from call to call (batch size, window, split plan, the sizes the bounds checks compare
# with, the block table's width) must not be specialized on (Triton compiles a variant for an int argument equal to
# 1 or divisible by 16): a batch of 1, MAX_SPLITS=1 or a table of 3 pages a row reuses the same binary.
@triton.jit
def _program(NUM_KV_HEADS: tl.constexpr, HEADS_INNER: tl.constexpr, IS_DECODE: tl.constexpr):
    """This program's (query block, KV head, split). HEADS_INNER: axis 0 walks (query block, KV head) with the
    heads fastest, so that the programs the GPU runs at the same time read every head of the same pages (an NHD page
    holds all heads of its tokens side by side) rather than one head of many pages; otherwise axis 0 walks query
    blocks and axis 1 the KV heads."""
    if HEADS_INNER:
        pid_q = tl.program_id(0) // NUM_KV_HEADS
        kvh = tl.program_id(0) % NUM_KV_HEADS
        num_q_programs = tl.num_programs(0) // NUM_KV_HEADS
    else:
        pid_q = tl.program_id(0)
        kvh = tl.program_id(1)
        num_q_programs = tl.num_programs(0)
    if not IS_DECODE:
        # heaviest first: a sequence's last query blocks see the most keys, and the grid runs roughly in order,
        # so walking it backwards leaves the short blocks for the tail (longest-processing-time scheduling)
        pid_q = num_q_programs - 1 - pid_q
    return pid_q, kvh, tl.program_id(2)


@triton.jit
def _folded_scales(ks_ptr, vs_ptr, kvh, stride_ksh, stride_vsh, sm_scale, FMT: tl.constexpr, DOT_DTYPE: tl.constexpr,
                   HAS_SOFTCAP: tl.constexpr):
    """(score scale, output multiplier): the per-tensor (stride 0) or per-head fp8 scales folded, k into the score
    scale, v into the output; 4-bit tiles' fp4_fold taken out of both; log2(e) in the score scale (base-2 softmax)
    unless a soft cap must see the natural scores first."""
    qk_scale = sm_scale
    v_mul = 1.0
    if FMT == FMT_FP8:
        qk_scale = qk_scale * tl.load(ks_ptr + kvh * stride_ksh)
        v_mul = tl.load(vs_ptr + kvh * stride_vsh)
    if FMT == FMT_NVFP4 or FMT == FMT_MXFP4:  # _load_fp4_tile's values are value x scale x fp4_fold
        qk_scale = qk_scale / fp4_fold(FMT, DOT_DTYPE)
        v_mul = v_mul / fp4_fold(FMT, DOT_DTYPE)
    if not HAS_SOFTCAP:
        qk_scale = qk_scale * LOG2E
    return qk_scale, v_mul


@triton.jit
def _load_q(q_ptr, q_row_off, row_valid, HEAD_DIM: tl.constexpr, VALID_DIM: tl.constexpr, PAIRED_K: tl.constexpr,
            DOT_DTYPE: tl.constexpr):
    """The rows' queries as dot operands: whole (columns from VALID_DIM on 0), or (PAIRED_K) their even and odd
    elements as two tiles."""
    if PAIRED_K:
        offs_d = tl.arange(0, HEAD_DIM // 2)
        # (pairs of a padded tile, fp8 or 4-bit: the head dim is even)
        mask = _head_part(row_valid[:, None], offs_d, VALID_DIM // 2, False)
        q_e = tl.load(q_ptr + q_row_off[:, None] + 2 * offs_d[None, :], mask=mask, other=0.0)
        q_o = tl.load(q_ptr + q_row_off[:, None] + 2 * offs_d[None, :] + 1, mask=mask, other=0.0)
        qa = q_e.to(DOT_DTYPE)
        qb = q_o.to(DOT_DTYPE)
    else:
        offs_d = tl.arange(0, HEAD_DIM)
        mask = _head_part(row_valid[:, None], offs_d, VALID_DIM, False)
        q = tl.load(q_ptr + q_row_off[:, None] + offs_d[None, :], mask=mask, other=0.0)
        qa = q.to(DOT_DTYPE)
        qb = qa
    return qa, qb


@triton.jit
def _store_cols(row_ptr, acc, acc_o, factor, row_valid, COLS: tl.constexpr, PAIRED_V: tl.constexpr,
                VALID: tl.constexpr):
    """acc times each row's factor, in row_ptr's dtype, at row_ptr[row] + column for the columns below VALID of a
    tile of COLS; with PAIRED_V acc holds the even columns and acc_o the odd ones (VALID is even)."""
    if PAIRED_V:
        col = 2 * tl.arange(0, COLS // 2)
    else:
        col = tl.arange(0, COLS)
    ptr = row_ptr[:, None] + col[None, :]
    mask = row_valid[:, None]
    if VALID < COLS:  # (a padded tile: its columns from VALID on are not the output's)
        mask = mask & (col < VALID)[None, :]
    tl.store(ptr, (acc * factor[:, None]).to(row_ptr.dtype.element_ty), mask=mask)
    if PAIRED_V:
        tl.store(ptr + 1, (acc_o * factor[:, None]).to(row_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_rows(acc, acc_o, acc2, acc2_o, m_i, l_i, v_mul, seq_bad, row_bad, n_splits, split, MAX_SPLITS, tok,
                row_head, row_valid, sinks_ptr, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, stride_ot, stride_oh,
                NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAIRED_V: tl.constexpr, HAS_SINKS: tl.constexpr,
                WRITE_LSE: tl.constexpr, BOUNDS: tl.constexpr, VALID_DIM: tl.constexpr, DIM_B: tl.constexpr,
                PAIRED_V2: tl.constexpr):
    """A program's rows after its key loop: normalized (v_mul: the V scale folded out of the dots), NaN (with
    BOUNDS) where the sequence's length is bad, the row saw a bad page's key or its sum is NaN, written to out (and
    lse) when its sequence has one split, else as this split's partial (normalized output, base-2 LSE) for
    merge_splits_kernel. HEAD_DIM: the workspace's row width; with DIM_B the output is two tiles, (acc, acc_o) of
    HEAD_DIM / 2 columns and (acc2, acc2_o) of DIM_B after them (halves with PAIRED_V2)."""
    has_keys = l_i > 0.0
    inv_l = tl.where(has_keys, v_mul / tl.where(has_keys, l_i, 1.0), 0.0)  # no key seen: the row is 0
    if BOUNDS:
        # (a NaN sum: it read a NaN; has_keys is false there, and 0 x a NaN accumulator would depend on the hardware)
        poison = (l_i != l_i) | seq_bad | row_bad
        inv_l = tl.where(poison, float("nan"), inv_l)
    DIM_A: tl.constexpr = HEAD_DIM if DIM_B == 0 else HEAD_DIM // 2
    if n_splits == 1:
        if HAS_SINKS:
            # the sink joins the denominator: out = acc e^(m-M) / (l e^(m-M) + e^(s-M)), M = max(m, s) (base 2)
            sink = tl.load(sinks_ptr + row_head, mask=row_valid, other=0.0) * LOG2E
            # a row with no key stays 0 (inv_l is 0 there): with a sink of -inf too, M would be -inf and the
            # factor NaN, so M falls back to 0 and the factor to 1
            big = tl.maximum(m_i, sink)
            big = tl.where(big == float("-inf"), 0.0, big)
            keep = tl.exp2(m_i - big) * l_i
            inv_l = inv_l * tl.where(has_keys, keep / tl.where(has_keys, keep + tl.exp2(sink - big), 1.0), 1.0)
        o_row = out_ptr + tok * stride_ot + row_head.to(tl.int64) * stride_oh
        _store_cols(o_row, acc, acc_o, inv_l, row_valid, DIM_A, PAIRED_V, min(VALID_DIM, DIM_A))
        if DIM_B > 0:
            _store_cols(o_row + DIM_A, acc2, acc2_o, inv_l, row_valid, DIM_B, PAIRED_V2, VALID_DIM - DIM_A)
        if WRITE_LSE:
            # base 2 like the scores; no key: -inf, or with a sink its term alone (a merge stays exact)
            row_lse = m_i + _log2_or_neg_inf(l_i)
            if HAS_SINKS:
                row_lse = _log2_add_exp2(row_lse, sink)
            if BOUNDS:
                row_lse = tl.where(poison, float("nan"), row_lse)
            tl.store(lse_ptr + tok * NUM_Q_HEADS + row_head, row_lse * LN2, mask=row_valid)
    else:
        part_row = (tok * NUM_Q_HEADS + row_head) * MAX_SPLITS + split  # int64
        # (whole tiles: the merge stores only the head dim's columns of what it sums)
        _store_cols(part_out_ptr + part_row * HEAD_DIM, acc, acc_o, inv_l, row_valid, DIM_A, PAIRED_V, DIM_A)
        if DIM_B > 0:
            _store_cols(part_out_ptr + part_row * HEAD_DIM + DIM_A, acc2, acc2_o, inv_l, row_valid, DIM_B, PAIRED_V2,
                        DIM_B)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        if BOUNDS:  # NaN weighs every split of the row NaN in the merge, whatever the other splits' LSEs
            lse = tl.where(poison, float("nan"), lse)
        tl.store(part_lse_ptr + part_row, lse, mask=row_valid)


@triton.jit
def _bad_cu_seqlens(cu_ptr, err_ptr, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, pid_q, kvh, split, num_seqs,
                    num_tokens, MAX_SPLITS, stride_ot, stride_oh, NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, WRITE_LSE: tl.constexpr,
                    VALID_DIM: tl.constexpr):
    """cu_seqlens_q must run non-decreasing from 0 to num_tokens, or which rows are whose is undefined (and the
    sequence search could give two programs the same rows): then every row is NaN, this program's BLOCK_Q rows by
    position, and the first bad entry is recorded. Returns whether it was bad (the program then reads nothing)."""
    bad_entry = cu_seqlens_violation(cu_ptr, num_seqs, num_tokens, 128)
    if bad_entry <= num_seqs:
        offs_m = tl.arange(0, BLOCK_M)
        tok = (pid_q * BLOCK_Q + offs_m // GROUP).to(tl.int64)
        _nan_rows(out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, tok, kvh * GROUP + offs_m % GROUP,
                  (offs_m < BLOCK_Q * GROUP) & (tok < num_tokens), split, MAX_SPLITS, stride_ot, stride_oh,
                  NUM_Q_HEADS, HEAD_DIM, WRITE_LSE, VALID_DIM)
        if (pid_q == 0) & (kvh == 0) & (split == 0):
            tl.atomic_min(err_ptr + ERR_CU_SEQLENS_Q, bad_entry)
    return bad_entry <= num_seqs


@triton.jit
def _bad_rows(bt_row, split_lo, split_hi, split_bad, num_pages, q_pos, seq_len, window_left, offs_m,
              PAGE: tl.constexpr, BLOCK_Q: tl.constexpr, CLAMP: tl.constexpr, HAS_TREE: tl.constexpr,
              HAS_WINDOW: tl.constexpr):
    """(row_bad, fallback, split_hi): the rows a bad page of the split makes NaN, the page read in place of a bad
    one, and the end of the keys the loop reads (split_lo: none). With one query token a block (decode) every row
    sees every page read: a bad one makes them all NaN, and nothing is read (the loop is empty). With more, a row
    is NaN if it sees a key of a bad page; the loop reads a good page of the split in place of the bad ones
    (`fallback`; with none, nothing is read). CLAMP: the loop reads every page clamped into the cache, and what a
    bad one gave is made NaN after it; a cache of no pages has none to read in place of a bad one."""
    fallback = tl.full([], 0, tl.int32)
    if CLAMP:
        row_bad = offs_m < 0  # (all false until the check after the loop)
        no_read = num_pages <= 0
    elif BLOCK_Q == 1:
        row_bad = split_bad > 0
        no_read = row_bad
    else:
        row_bad = offs_m < 0  # (all false)
        if split_bad > 0:
            # the last key each row may see: its own position, or with a tree mask the sequence's end
            q_hi = q_pos if not HAS_TREE else q_pos * 0 + seq_len - 1
            row_bad, fallback = bad_page_rows(bt_row, split_lo, split_hi, num_pages, q_pos, q_hi, window_left,
                                              PAGE, HAS_WINDOW)
        no_read = fallback < 0
    return row_bad, fallback, tl.where(no_read, split_lo, split_hi)


@triton.jit
def _init_acc(BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, PAIRED_V: tl.constexpr):
    """The output accumulator (PAIRED_V: V's even and odd halves, acc and acc_o), each row's running max and sum."""
    if PAIRED_V:
        acc = tl.zeros([BLOCK_M, HEAD_DIM // 2], dtype=tl.float32)
        acc_o = tl.zeros([BLOCK_M, HEAD_DIM // 2], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        acc_o = acc  # (unused)
    return acc, acc_o, tl.full([BLOCK_M], float("-inf"), dtype=tl.float32), tl.zeros([BLOCK_M], dtype=tl.float32)


@triton.jit
def _tile_rows(q_start, q_block, q_len, first_pos, kvh, stride_qt, stride_qh, GROUP: tl.constexpr,
               BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr):
    """A tile's rows, (query token, head of the group): their index, head, validity, token, position and q offset."""
    offs_m = tl.arange(0, BLOCK_M)
    row_tok = offs_m // GROUP
    row_head = kvh * GROUP + offs_m % GROUP
    row_valid = (offs_m < BLOCK_Q * GROUP) & (q_block * BLOCK_Q + row_tok < q_len)
    tok = (q_start + q_block * BLOCK_Q + row_tok).to(tl.int64)
    q_pos = first_pos + row_tok
    q_row_off = tok * stride_qt + row_head.to(tl.int64) * stride_qh
    return offs_m, row_head, row_valid, tok, q_pos, q_row_off


@triton.jit
def _loop_bounds(seq_len, q_len, first_pos, last_pos, window_left, split_lo, split_hi, BLOCK_N: tl.constexpr,
                 HAS_TREE: tl.constexpr, FULL_TILES: tl.constexpr):
    """Where the key loop's parts start and end, and the keys every valid row sees without masking (full_lo,
    full_hi): the causal bound of the first query (with a tree mask, the start of the sequence's query block: the
    mask decides each block key) and the window bound of the last.

    With a tree mask the loop is in two parts: the tiles before the one holding the query block's first key
    (tree_lo), which every row sees whole (windows aside), without the tree mask, then the block's tiles, each
    masked. One loop with the tree mask behind its runtime edge check made Triton 3.6 keep each score tile in two
    layouts and reduce it twice in every tile (sm_90, 128 rows, bf16: 1494 instructions a 128-key step and spills,
    against about 1080 in the first part now; docs/bench.md, "Cascade decode"). FULL_TILES: the tiles before
    tree_lo that end by it (all but the last of a split, usually) run in a loop whose loads carry no mask (their
    keys are all before split_hi), the rest in a masked one (full_end)."""
    block_start = seq_len - q_len
    if HAS_TREE:
        full_hi = block_start
    else:
        full_hi = first_pos + 1
    full_lo = last_pos - window_left
    tree_lo = split_hi
    if HAS_TREE:
        tree_lo = tl.minimum(split_lo + tl.maximum(block_start - split_lo, 0) // BLOCK_N * BLOCK_N, split_hi)
    full_end = tree_lo
    if FULL_TILES:
        full_end = split_lo + tl.maximum(tree_lo - split_lo, 0) // BLOCK_N * BLOCK_N
    return block_start, full_lo, full_hi, tree_lo, full_end


@triton.jit(do_not_specialize=["num_seqs", "window_left", "MAX_SPLITS", "CHUNK", "wave_splits", "num_tokens",
                               "num_pages", "capacity", "stride_table", "stride_tm", "tm_cols"])
def paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, seq_lens_ptr, cu_ptr, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
    err_ptr,
    sinks_ptr, tm_ptr, num_seqs, sm_scale, soft_cap, window_left, MAX_SPLITS, CHUNK, wave_splits, num_tokens,
    num_pages, capacity,
    stride_qt, stride_qh, stride_kp, stride_kt, stride_kh,
    stride_ksp, stride_kst, stride_ksh, stride_vsp, stride_vst, stride_vsh,
    stride_table, stride_ot, stride_oh, stride_tm, tm_cols,
    NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FMT: tl.constexpr,
    IS_DECODE: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    HAS_TREE: tl.constexpr, WRITE_LSE: tl.constexpr, DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FP8_DTYPE: tl.constexpr, SCALE_BCAST: tl.constexpr,
    FP4_ASM: tl.constexpr, SOFT_FP8: tl.constexpr,
    V_DEQUANT_FIRST: tl.constexpr, HEADS_INNER: tl.constexpr, PDL: tl.constexpr, FP8_V_PAIRS: tl.constexpr,
    FP8_K_PAIRS: tl.constexpr, BOUNDS: tl.constexpr, PAGE_CLAMP: tl.constexpr, FULL_TILES: tl.constexpr,
    OFFSETS_32: tl.constexpr, VALID_DIM: tl.constexpr, DIM_B: tl.constexpr = 0, PAD_WRAP: tl.constexpr = False,
    WAVE_PLAN: tl.constexpr = 0,
):
    if PDL:  # the merge kernel may start now: its programs wait (griddepcontrol.wait) before reading partials
        gdc_launch_dependents()
    pid_q, kvh, split = _program(NUM_Q_HEADS // GROUP, HEADS_INNER, IS_DECODE)

    # --- which sequence and which of its query tokens -------------------------------------------------------
    if IS_DECODE:
        b = pid_q
        q_start = pid_q
        q_len = 1
        q_block = 0
    else:
        if BOUNDS:
            if _bad_cu_seqlens(cu_ptr, err_ptr, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, pid_q, kvh, split,
                               num_seqs, num_tokens, MAX_SPLITS, stride_ot, stride_oh, NUM_Q_HEADS, HEAD_DIM, GROUP,
                               BLOCK_Q, BLOCK_M, WRITE_LSE, VALID_DIM):
                return
        # the grid has T // BLOCK_Q + B programs along axis 0 (an upper bound of the blocks needed): find ours
        b = find_sequence(cu_ptr, pid_q, num_seqs, BLOCK_Q, True)
        q_start = tl.load(cu_ptr + b)
        q_len = tl.load(cu_ptr + b + 1) - q_start
        q_block = pid_q - (q_start // BLOCK_Q + b)
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    if BOUNDS:
        # a length outside [0, the table's capacity] has no defined keys: the sequence reads none and its rows are
        # NaN (the merge kernel clamps it the same way, so both see one split)
        seq_bad = (seq_len < 0) | (seq_len > capacity)
        seq_len = tl.where(seq_bad, 0, seq_len)
        # tiles start at the page of the first query's window start (not the tile before it): every page read holds
        # a key some query sees, so a bad one among them is a bad index of the call
        ALIGN: tl.constexpr = BLOCK_N if not HAS_WINDOW else min(PAGE, BLOCK_N)
    else:
        ALIGN: tl.constexpr = BLOCK_N
    chunk = CHUNK
    if WAVE_PLAN:  # decode: keys a split from the call's lengths (at least 2^WAVE_PLAN)
        # a split past any plan's splits of its sequence reads no length (the plan then gives 2^WAVE_PLAN keys a
        # split, and the program leaves below)
        past = (split << WAVE_PLAN >= seq_len) & (split > 0)
        chunk = wave_chunk(seq_lens_ptr, tl.where(past, 0, num_seqs), capacity, wave_splits, WAVE_PLAN,
                           WAVE_PROGRAM_KEYS)
    first_pos, last_pos, kv_lo, kv_hi, n_splits, split_len = kv_plan(
        seq_len, q_len, q_block, window_left, MAX_SPLITS, chunk, BLOCK_Q, BLOCK_N, HAS_WINDOW, HAS_TREE, ALIGN)
    if split >= n_splits:
        return
    split_lo = kv_lo + split * split_len
    split_hi = tl.minimum(split_lo + split_len, kv_hi)
    bt_row = bt_ptr + b.to(tl.int64) * stride_table
    # PAGE_CLAMP (decode tiles): instead of a check of the pages before the loop, whose dependent load of the block
    # table delays every program's start, the loop reads pages clamped into the cache and the check comes after it
    CLAMP: tl.constexpr = BOUNDS and BLOCK_Q == 1 and PAGE_CLAMP
    if BOUNDS:
        if seq_bad & (split == 0) & (kvh == 0) & (q_block == 0):
            tl.atomic_min(err_ptr + ERR_SEQ_LENS, b)
        # The pages this program reads, checked once before its loop (SOFT_FP8: the interpreter, which cannot run
        # the PTX vote), or with CLAMP after it. Every one holds a key some row sees (kv_plan's ALIGN), so a bad one
        # is recorded.
        split_bad = 0
        if not CLAMP:
            split_bad = check_pages(bt_row, split_lo, split_hi, num_pages, PAGE, not SOFT_FP8)
            if split_bad > 0:
                tl.atomic_min(err_ptr + ERR_BLOCK_TABLE, b)

    # --- rows: (query token, head of the group) --------------------------------------------------------------
    offs_m, row_head, row_valid, tok, q_pos, q_row_off = _tile_rows(q_start, q_block, q_len, first_pos, kvh, stride_qt,
                                                                    stride_qh, GROUP, BLOCK_Q, BLOCK_M)
    if BOUNDS:
        split_end = split_hi  # (the keys checked after the loop, with CLAMP)
        row_bad, fallback, split_hi = _bad_rows(bt_row, split_lo, split_hi, split_bad, num_pages, q_pos, seq_len,
                                                window_left, offs_m, PAGE, BLOCK_Q, CLAMP, HAS_TREE, HAS_WINDOW)
    else:
        fallback = tl.full([], 0, tl.int32)

    qk_scale, v_mul = _folded_scales(ks_ptr, vs_ptr, kvh, stride_ksh, stride_vsh, sm_scale, FMT, DOT_DTYPE,
                                     HAS_SOFTCAP)

    IS_FP4: tl.constexpr = FMT == FMT_NVFP4 or FMT == FMT_MXFP4
    # q's and K's even and odd elements in two tiles each, two score dots: 4-bit, and fp8 with FP8_K_PAIRS
    PAIRED_K: tl.constexpr = IS_FP4 or (FMT == FMT_FP8 and FP8_K_PAIRS)
    # V's even and odd elements in two tiles and two accumulators (output columns interleaved at the end): 4-bit
    # (_load_fp4_tile) and, with FP8_V_PAIRS, fp8 (_load_fp8_pairs)
    PAIRED_V: tl.constexpr = IS_FP4 or (FMT == FMT_FP8 and FP8_V_PAIRS)
    # DIM_B: the head in two tiles, its first DIM_A columns and DIM_B after them (else one tile of HEAD_DIM)
    DIM_A: tl.constexpr = HEAD_DIM if DIM_B == 0 else HEAD_DIM // 2
    # the second tile in halves for 4-bit only: fp8's as plain bytes (halves of a narrow tile made the loop 3x
    # longer: sm_90 SASS, Triton 3.9)
    PAIRED_K2: tl.constexpr = PAIRED_K and IS_FP4
    PAIRED_V2: tl.constexpr = PAIRED_V and IS_FP4
    qa, qb = _load_q(q_ptr, q_row_off, row_valid, DIM_A, min(VALID_DIM, DIM_A), PAIRED_K, DOT_DTYPE)
    acc, acc_o, m_i, l_i = _init_acc(BLOCK_M, DIM_A, PAIRED_V)
    if DIM_B > 0:
        qa2, qb2 = _load_q(q_ptr + DIM_A, q_row_off, row_valid, DIM_B, VALID_DIM - DIM_A, PAIRED_K2, DOT_DTYPE)
        acc2, acc2_o, _, _ = _init_acc(BLOCK_M, DIM_B, PAIRED_V2)
    else:
        qa2, qb2, acc2, acc2_o = qa, qb, acc, acc  # (unused)

    head_off = kvh.to(tl.int32 if OFFSETS_32 else tl.int64) * stride_kh
    block_start, full_lo, full_hi, tree_lo, full_end = _loop_bounds(seq_len, q_len, first_pos, last_pos, window_left,
                                                                    split_lo, split_hi, BLOCK_N, HAS_TREE, FULL_TILES)
    NUM_PARTS: tl.constexpr = 1 + FULL_TILES + HAS_TREE
    for part in tl.static_range(NUM_PARTS):
        # part: the full tiles (with FULL_TILES), the rest before tree_lo, the query block's tiles (with a tree)
        acc, acc_o, acc2, acc2_o, m_i, l_i = _kv_tiles(
            split_lo if part == 0 else full_end if FULL_TILES and part == 1 else tree_lo,
            full_end if part == 0 else tree_lo if FULL_TILES and part == 1 else split_hi, split_hi, acc, acc_o,
            acc2, acc2_o, m_i, l_i, qa, qb, qa2, qb2, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, tm_ptr, num_pages, fallback,
            head_off, kvh, stride_kp, stride_kt, stride_ksp, stride_kst, stride_ksh, stride_vsp, stride_vst, stride_vsh,
            qk_scale, sm_scale, soft_cap, full_lo, full_hi, block_start, window_left, tok, q_pos, row_valid, stride_tm,
            tm_cols,
            EDGE=HAS_TREE and part == NUM_PARTS - 1, HAS_TREE=HAS_TREE and part == NUM_PARTS - 1, HEAD_DIM=DIM_A,
            PAGE=PAGE, BLOCK_N=BLOCK_N, BLOCK_Q=BLOCK_Q,
            FMT=FMT, DOT_DTYPE=DOT_DTYPE, DOT_PRECISION=DOT_PRECISION, FP8_DTYPE=FP8_DTYPE, SCALE_BCAST=SCALE_BCAST,
            FP4_ASM=FP4_ASM, SOFT_FP8=SOFT_FP8, V_DEQUANT_FIRST=V_DEQUANT_FIRST, HAS_SOFTCAP=HAS_SOFTCAP,
            HAS_WINDOW=HAS_WINDOW, BOUNDS=BOUNDS, PAIRED_K=PAIRED_K, PAIRED_V=PAIRED_V, PAGE_CLAMP=CLAMP,
            MASK_LOADS=not (FULL_TILES and part == 0), OFFSETS_32=OFFSETS_32, VALID_DIM=VALID_DIM, DIM_B=DIM_B,
            PAIRED_K2=PAIRED_K2, PAIRED_V2=PAIRED_V2, PAD_WRAP=PAD_WRAP)

    if CLAMP:
        split_bad = check_pages(bt_row, split_lo, split_end, num_pages, PAGE, not SOFT_FP8)
        if split_bad > 0:
            tl.atomic_min(err_ptr + ERR_BLOCK_TABLE, b)
        row_bad = row_bad | (split_bad > 0)

    # --- epilogue: normalized output, directly or as a split partial ---------------------------------------
    if not BOUNDS:
        seq_bad = False  # (unused)
        row_bad = False
    _write_rows(acc, acc_o, acc2, acc2_o, m_i, l_i, v_mul, seq_bad, row_bad, n_splits, split, MAX_SPLITS, tok,
                row_head, row_valid, sinks_ptr, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, stride_ot, stride_oh,
                NUM_Q_HEADS=NUM_Q_HEADS, HEAD_DIM=HEAD_DIM, PAIRED_V=PAIRED_V, HAS_SINKS=HAS_SINKS,
                WRITE_LSE=WRITE_LSE, BOUNDS=BOUNDS, VALID_DIM=VALID_DIM, DIM_B=DIM_B, PAIRED_V2=PAIRED_V2)


@triton.jit(do_not_specialize=["num_seqs", "window_left", "MAX_SPLITS", "CHUNK", "wave_splits", "capacity"])
def merge_splits_kernel(
    out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, seq_lens_ptr, cu_ptr, sinks_ptr, num_seqs, window_left, MAX_SPLITS,
    CHUNK, wave_splits, capacity, stride_ot, stride_oh,
    NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLITS_P2: tl.constexpr, IS_DECODE: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_TREE: tl.constexpr,
    HAS_SINKS: tl.constexpr, PDL: tl.constexpr, BOUNDS: tl.constexpr, ALIGN: tl.constexpr,
    WRITE_LSE: tl.constexpr, VALID_DIM: tl.constexpr, WAVE_PLAN: tl.constexpr = 0,
):
    """One program per (query token, query head): combines the token's split partials by their LSE (and, with
    WRITE_LSE, writes the merged LSE as a natural log). It
    recomputes the split plan of the attention kernel (same kv_plan) and leaves single-split rows alone (the
    attention kernel wrote them directly). PDL (launched as a programmatic dependent of the attention kernel):
    the split plan, from inputs the attention kernel does not write, is worked out while that kernel finishes, and
    the partials are read after griddepcontrol.wait.

    Whatever the metadata holds, it reads and writes only its own row and that row's MAX_SPLITS partials (the
    search returns a sequence in [0, num_seqs), kv_plan at most MAX_SPLITS splits): with a bad cu_seqlens_q the
    attention kernel has made all of those NaN."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    if IS_DECODE:
        b = t
        q_start = t
        q_len = 1
    else:
        b = find_sequence(cu_ptr, t, num_seqs, 1, False)
        q_start = tl.load(cu_ptr + b)
        q_len = tl.load(cu_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    if BOUNDS:  # as the attention kernel does: a bad length is one split (written there, NaN)
        seq_len = tl.where((seq_len < 0) | (seq_len > capacity), 0, seq_len)
    q_block = (t - q_start) // BLOCK_Q
    chunk = CHUNK
    if WAVE_PLAN:  # (the attention kernel's plan, from the same lengths)
        chunk = wave_chunk(seq_lens_ptr, num_seqs, capacity, wave_splits, WAVE_PLAN, WAVE_PROGRAM_KEYS)
    _, _, _, _, n_splits, _ = kv_plan(seq_len, q_len, q_block, window_left, MAX_SPLITS, chunk, BLOCK_Q, BLOCK_N,
                                      HAS_WINDOW, HAS_TREE, ALIGN)
    if PDL:  # every program waits, so that this grid completes after the attention kernel does
        gdc_wait()
    if n_splits <= 1:
        return
    row = (t.to(tl.int64) * NUM_Q_HEADS + h) * MAX_SPLITS
    offs_s = tl.arange(0, SPLITS_P2)
    lse = tl.load(part_lse_ptr + row + offs_s, mask=offs_s < n_splits, other=float("-inf"))
    mx = tl.max(lse, 0)
    if HAS_SINKS:  # one more logit in the denominator (base 2), with no value; a row with no key stays 0
        sink = tl.load(sinks_ptr + h) * LOG2E
        mx = tl.maximum(mx, sink)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    denom = tl.sum(tl.exp2(lse - mx), 0)
    if HAS_SINKS:
        denom += tl.where(tl.max(lse, 0) == float("-inf"), 0.0, tl.exp2(sink - mx))
    offs_d = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    # partials a tile of SPLIT_TILE splits at a time, all of a tile's loads in flight together: one split a
    # loop turn made 1 x 32768's merge (32 programs, 32 splits each) a chain of 32 dependent L2 round trips
    SPLIT_TILE: tl.constexpr = min(SPLITS_P2, 4096 // HEAD_DIM)
    offs_t = tl.arange(0, SPLIT_TILE)
    for s0 in range(0, n_splits, SPLIT_TILE):
        valid = s0 + offs_t < n_splits
        w = tl.exp2(tl.load(part_lse_ptr + row + s0 + offs_t, mask=valid, other=float("-inf")) - mx)
        part = tl.load(part_out_ptr + (row + s0 + offs_t)[:, None] * HEAD_DIM + offs_d[None, :],
                       mask=valid[:, None], other=0.0)
        acc += tl.sum(w[:, None] * part, 0)
    o = acc / tl.where(denom > 0.0, denom, 1.0)
    if VALID_DIM < HEAD_DIM:  # (a padded tile)
        tl.store(out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty),
                 mask=offs_d < VALID_DIM)
    else:
        tl.store(out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty))
    if WRITE_LSE:
        total = denom
        if HAS_SINKS:  # a row with no key: the sink's term alone (its output stays 0)
            total += tl.where(tl.max(lse, 0) == float("-inf"), tl.exp2(sink - mx), 0.0)
        row_lse = mx + _log2_or_neg_inf(total)  # (NaN stays NaN)
        tl.store(lse_ptr + t.to(tl.int64) * NUM_Q_HEADS + h, row_lse * LN2)
