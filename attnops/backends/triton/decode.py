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
A program whose sequence needs only one split writes the normalized output directly; otherwise it writes its
partial output and LSE to a workspace of [T, Hq, MAX_SPLITS] rows and the merge kernel combines them.

The multi-token (cu_seqlens_q) form shares this kernel (IS_DECODE=False); its host side is extend.py.
"""
from __future__ import annotations

import functools
import warnings

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.runtime.errors import OutOfResources

from ... import formats
from . import interpreting
from .common import (FMT_CODE, FMT_FP8, FMT_MXFP4, FMT_NVFP4, FMT_PLAIN, LOG2E, e2m1_nibbles, e8m0_to_f32,
 elsewhere (same log).                 find_sequence, kv_plan, opaque_one, to_fp8_bits)


@triton.jit
def _load_fp4_tile(c_ptr, s_ptr, tok_off, s_off, offs_h, kvalid, TRANSPOSED: tl.constexpr, FMT: tl.constexpr,
 elsewhere (same log).               DOT_DTYPE: tl.constexpr, SCALE_BCAST: tl.constexpr, FP4_ASM: tl.constexpr):
 elsewhere (same log)."""A tile of 4-bit K or V as its even and odd elements (D/2 columns each), dequantized to DOT_DTYPE, times
 elsewhere (same log).fp4_fold(FMT, DOT_DTYPE) (the kernel divides that back out of its score and output scales).

 elsewhere (same log).Keeping even and odd elements apart avoids interleaving them in registers: the kernel multiplies the even
 elsewhere (same log).half of q with the even half of K (and the odd with the odd) and accumulates V's halves separately.
 elsewhere (same log).TRANSPOSED gives [D/2, BLOCK_N] tiles (K^T), else [BLOCK_N, D/2] (V)."""
 elsewhere (same log).# element 2i (even) and 2i+1 (odd) are both in block (2i) // BLOCK = i // (BLOCK / 2)
 elsewhere (same log).half_block: tl.constexpr = 8 if FMT == FMT_NVFP4 else 16
 elsewhere (same log).HALF: tl.constexpr = offs_h.shape[0]
 elsewhere (same log).NB: tl.constexpr = HALF // half_block  # block scales per row
 elsewhere (same log).BN: tl.constexpr = tok_off.shape[0]
 elsewhere (same log).if TRANSPOSED:
 elsewhere (same log).    packed = tl.load(c_ptr + tok_off[None, :] + offs_h[:, None], mask=kvalid[None, :], other=0)
 elsewhere (same log).else:
 elsewhere (same log).    packed = tl.load(c_ptr + tok_off[:, None] + offs_h[None, :], mask=kvalid[:, None], other=0)
 elsewhere (same log).if SCALE_BCAST:
 elsewhere (same log).    # one load and one decode per block scale ([NB, BLOCK_N]), repeated across its values in registers
 elsewhere (same log).    offs_b = tl.arange(0, NB)
 elsewhere (same log).    if TRANSPOSED:
 elsewhere (same log).        sc = tl.load(s_ptr + s_off[None, :] + offs_b[:, None], mask=kvalid[None, :], other=0)
 elsewhere (same log).        scale = _fp4_scale(sc, FMT, DOT_DTYPE)
 elsewhere (same log).        scale = tl.reshape(tl.broadcast_to(scale[:, None, :], (NB, half_block, BN)), (HALF, BN))
 elsewhere (same log).    else:
 elsewhere (same log).        sc = tl.load(s_ptr + s_off[:, None] + offs_b[None, :], mask=kvalid[:, None], other=0)
 elsewhere (same log).        scale = _fp4_scale(sc, FMT, DOT_DTYPE)
 elsewhere (same log).        scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BN, NB, half_block)), (BN, HALF))
 elsewhere (same log).else:
 elsewhere (same log).    # one (cached) load per value: simple layouts, more load instructions
 elsewhere (same log).    if TRANSPOSED:
 elsewhere (same log).        sc = tl.load(s_ptr + s_off[None, :] + (offs_h // half_block)[:, None], mask=kvalid[None, :], other=0)
 elsewhere (same log).    else:
 elsewhere (same log).        sc = tl.load(s_ptr + s_off[:, None] + (offs_h // half_block)[None, :], mask=kvalid[:, None], other=0)
 elsewhere (same log).    scale = _fp4_scale(sc, FMT, DOT_DTYPE)
 elsewhere (same log).return _dequant_fp4(packed, scale, FMT, DOT_DTYPE, FP4_ASM)


@triton.jit
def _dequant_fp4(packed, scale, FMT: tl.constexpr, DOT_DTYPE: tl.constexpr, FP4_ASM: tl.constexpr):
 elsewhere (same log)."""Packed nibbles (uint8: even element low, odd high) and their block scales (_fp4_scale, one per value) ->
 elsewhere (same log).the even and odd values in DOT_DTYPE, times fp4_fold(FMT, DOT_DTYPE), exactly (an e2m1 value has 2
 elsewhere (same log).significant bits, an e4m3 scale 4: every product fits the dot dtype).

 elsewhere (same log).4-bit decode is bound by its instructions, not bytes (H200: 43% fewer instructions a step made mxfp4 decode
 elsewhere (same log).1.74x faster), so each case takes the fewest: the nibble's bits are moved into a 16-bit float (value x 2^-14 as fp16, value x 2^-126
 elsewhere (same log).as bf16; inline PTX on two values at once with FP4_ASM) and the scale applied in that float with packed
 elsewhere (same log).multiplies where the range allows, through fp32 only where it does not."""
 elsewhere (same log).# (one return at the end: Triton 3.6 refuses returns of different dtypes in constexpr branches)
 elsewhere (same log).if FMT == FMT_MXFP4 and DOT_DTYPE == tl.bfloat16:
 elsewhere (same log).    # (value x 2^-126) x 2^126 x 2^(s-127), two packed bf16 multiplies a value pair: bf16 has fp32's exponent
 elsewhere (same log).    # range, so every s is exact (s = 0 as a subnormal) with no conversion through fp32; one multiply by
 elsewhere (same log).    # 2^(s-1) could not hold s > 128. (The fp32 route: 3617 instructions a 128-key step of the default decode
 elsewhere (same log).    # tile instead of 2074, sm_90 SASS.)
 elsewhere (same log).    even, odd = e2m1_nibbles(packed, True, FP4_ASM)
 elsewhere (same log).    even = (even * 8.507059173023462e37) * scale
 elsewhere (same log).    odd = (odd * 8.507059173023462e37) * scale
 elsewhere (same log).else:
 elsewhere (same log).    even, odd = e2m1_nibbles(packed, False, FP4_ASM)
 elsewhere (same log).    if FMT == FMT_NVFP4 and DOT_DTYPE == tl.float16:
 elsewhere (same log).        # (value x 2^-14) x (scale x 2^7) = value x scale x 2^-7, one packed fp16 multiply a value pair: the
 elsewhere (same log).        # product lies in [2^-17, 21], which fp16 holds exactly (its subnormals step by 2^-24)
 elsewhere (same log).        even = even * scale
 elsewhere (same log).        odd = odd * scale
 elsewhere (same log).    else:
 elsewhere (same log).        # fp32 (fp16 dots of mxfp4, whose scales overflow fp16; fp32 dots)
 elsewhere (same log).        even = (even.to(tl.float32) * scale).to(DOT_DTYPE)
 elsewhere (same log).        odd = (odd.to(tl.float32) * scale).to(DOT_DTYPE)
 elsewhere (same log).return even, odd


@triton.jit
def _fp4_scale(sc, FMT: tl.constexpr, DOT_DTYPE: tl.constexpr):
 elsewhere (same log)."""Stored block scales (bytes; masked lanes 0, not a NaN pattern) -> the factor _dequant_fp4 multiplies its
 elsewhere (same log).nibbles by: nvfp4 with fp16 dots, the e4m3 scale x 2^7 in fp16 (< 65504); mxfp4 with bf16 dots, 2^(s-127) in
 elsewhere (same log).bf16; otherwise the scale in fp32 (x 2^14 where fp4_fold is 1, to undo the fp16 nibble's 2^-14)."""
 elsewhere (same log).# (one return at the end: Triton 3.6 refuses returns of different dtypes in constexpr branches)
 elsewhere (same log).if FMT == FMT_NVFP4 and DOT_DTYPE == tl.float16:
 elsewhere (same log).    scale = sc.to(tl.float8e4nv, bitcast=True).to(tl.float16) * 128.0
 elsewhere (same log).elif FMT == FMT_NVFP4:
 elsewhere (same log).    scale = sc.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 16384.0
 elsewhere (same log).elif DOT_DTYPE == tl.float16:
 elsewhere (same log).    # capped at 2^127 (s > 240): fp16 cannot hold those blocks' nonzero values (inf either way), and a zero
 elsewhere (same log).    # value must stay 0, not 0 x inf
 elsewhere (same log).    scale = tl.minimum(e8m0_to_f32(sc) * 16384.0, 1.7014118346046923e38)
 elsewhere (same log).elif DOT_DTYPE == tl.bfloat16:
 elsewhere (same log).    si = sc.to(tl.int16)
 elsewhere (same log).    scale = tl.maximum(si << 7, 64).to(tl.int16).to(tl.bfloat16, bitcast=True)  # 2^(s-127); s = 0: 2^-127
 elsewhere (same log).else:
 elsewhere (same log).    scale = e8m0_to_f32(sc)
 elsewhere (same log).return scale


@triton.jit
def fp4_fold(FMT: tl.constexpr, DOT_DTYPE: tl.constexpr):
 elsewhere (same log)."""The power of two _dequant_fp4's values carry (the kernel divides it out of its score and output scales):
 elsewhere (same log).nvfp4 with fp16 dots 2^-7 (value x scale x 2^-7 stays inside fp16); mxfp4 with fp32 dots 2^-14 (the fp16
 elsewhere (same log).nibble's value x 2^-14 times the plain 2^(s-127), exact in fp32 for every s, where x 2^14 in the scale would
 elsewhere (same log).overflow for s > 240); 1 otherwise."""
 elsewhere (same log).if FMT == FMT_NVFP4 and DOT_DTYPE == tl.float16:
 elsewhere (same log).    return 0.0078125
 elsewhere (same log).if FMT == FMT_MXFP4 and DOT_DTYPE == tl.float32:
 elsewhere (same log).    return 0.00006103515625
 elsewhere (same log).return 1.0


@triton.jit
def _fp8_to_dot(x, FP8_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, FP8_ASM: tl.constexpr):
 elsewhere (same log)."""fp8 bytes (loaded as uint8, so that masked lanes are a plain 0, never a NaN pattern) -> DOT_DTYPE.
 elsewhere (same log).FP8_ASM (sm_89+, fp16 target, e4m3 only): the packed PTX conversion that turns two e4m3 values into two fp16
 elsewhere (same log).per instruction."""
 elsewhere (same log).if FP8_ASM:
 elsewhere (same log).    return tl.inline_asm_elementwise(
 elsewhere (same log).        # pack=2: two uint8 inputs arrive in one 16-bit register, two fp16 outputs leave in one 32-bit one
 elsewhere (same log).        asm="cvt.rn.f16x2.e4m3x2 $0, $1;",
 elsewhere (same log).        constraints="=r,h",
 elsewhere (same log).        args=[x], dtype=tl.float16, is_pure=True, pack=2)
 elsewhere (same log).return x.to(FP8_DTYPE, bitcast=True).to(DOT_DTYPE)


# Runtime values that change from call to call (batch size, window, split plan) must not be specialized on
# (Triton compiles a variant for an int argument equal to 1): a batch of 1 or MAX_SPLITS=1 reuses the same binary.
@triton.jit(do_not_specialize=["num_seqs", "window_left", "MAX_SPLITS", "CHUNK"])
def paged_attention_kernel(
 elsewhere (same log).q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, seq_lens_ptr, cu_ptr, out_ptr, part_out_ptr, part_lse_ptr,
 elsewhere (same log).num_seqs, sm_scale, soft_cap, window_left, MAX_SPLITS, CHUNK,
 elsewhere (same log).stride_qt, stride_qh, stride_kp, stride_kt, stride_kh,
 elsewhere (same log).stride_ksp, stride_kst, stride_ksh, stride_vsp, stride_vst, stride_vsh,
 elsewhere (same log).stride_bt, stride_ot, stride_oh,
 elsewhere (same log).NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, GROUP: tl.constexpr,
 elsewhere (same log).BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FMT: tl.constexpr,
 elsewhere (same log).IS_DECODE: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, DOT_DTYPE: tl.constexpr,
 elsewhere (same log).DOT_PRECISION: tl.constexpr, FP8_ASM: tl.constexpr, FP8_DTYPE: tl.constexpr, SCALE_BCAST: tl.constexpr,
 elsewhere (same log).FP4_ASM: tl.constexpr, FP8_DOT: tl.constexpr, WGMMA: tl.constexpr, SOFT_FP8: tl.constexpr,
 elsewhere (same log).V_DEQUANT_FIRST: tl.constexpr,
 elsewhere (same log).HEADS_INNER: tl.constexpr,
 elsewhere (same log).PDL: tl.constexpr,
):
 elsewhere (same log).if PDL:
 elsewhere (same log).    # launched as a programmatic dependent of the previous kernel in the stream (its launch and scheduling
 elsewhere (same log).    # overlap that kernel's tail): nothing is read before the wait. Then the merge kernel may start: its
 elsewhere (same log).    # programs wait again before reading partials.
 elsewhere (same log).    gdc_wait()
 elsewhere (same log).    gdc_launch_dependents()
 elsewhere (same log).# HEADS_INNER: axis 0 walks (query block, KV head) with the heads fastest, so that the programs the GPU runs
 elsewhere (same log).# at the same time read every head of the same pages (an NHD page holds all heads of its tokens side by side)
 elsewhere (same log).# rather than one head of many pages; otherwise axis 0 walks query blocks and axis 1 the KV heads.
 elsewhere (same log).NUM_KV_HEADS: tl.constexpr = NUM_Q_HEADS // GROUP
 elsewhere (same log).if HEADS_INNER:
 elsewhere (same log).    pid_q = tl.program_id(0) // NUM_KV_HEADS
 elsewhere (same log).    kvh = tl.program_id(0) % NUM_KV_HEADS
 elsewhere (same log).    num_q_programs = tl.num_programs(0) // NUM_KV_HEADS
 elsewhere (same log).else:
 elsewhere (same log).    pid_q = tl.program_id(0)
 elsewhere (same log).    kvh = tl.program_id(1)
 elsewhere (same log).    num_q_programs = tl.num_programs(0)
 elsewhere (same log).if not IS_DECODE:
 elsewhere (same log).    # heaviest first: a sequence's last query blocks see the most keys, and the grid runs roughly in order,
 elsewhere (same log).    # so walking it backwards leaves the short blocks for the tail (longest-processing-time scheduling)
 elsewhere (same log).    pid_q = num_q_programs - 1 - pid_q
 elsewhere (same log).split = tl.program_id(2)

 elsewhere (same log).# --- which sequence and which of its query tokens -------------------------------------------------------
 elsewhere (same log).if IS_DECODE:
 elsewhere (same log).    b = pid_q
 elsewhere (same log).    q_start = pid_q
 elsewhere (same log).    q_len = 1
 elsewhere (same log).    q_block = 0
 elsewhere (same log).else:
 elsewhere (same log).    # the grid has T // BLOCK_Q + B programs along axis 0 (an upper bound of the blocks needed): find ours
 elsewhere (same log).    b = find_sequence(cu_ptr, pid_q, num_seqs, BLOCK_Q, True)
 elsewhere (same log).    q_start = tl.load(cu_ptr + b)
 elsewhere (same log).    q_len = tl.load(cu_ptr + b + 1) - q_start
 elsewhere (same log).    q_block = pid_q - (q_start // BLOCK_Q + b)
 elsewhere (same log).if q_block * BLOCK_Q >= q_len:
 elsewhere (same log).    return
 elsewhere (same log).seq_len = tl.load(seq_lens_ptr + b)
 elsewhere (same log).first_pos, last_pos, kv_lo, kv_hi, n_splits, split_len = kv_plan(
 elsewhere (same log).    seq_len, q_len, q_block, window_left, MAX_SPLITS, CHUNK, BLOCK_Q, BLOCK_N, HAS_WINDOW)
 elsewhere (same log).if split >= n_splits:
 elsewhere (same log).    return
 elsewhere (same log).split_lo = kv_lo + split * split_len
 elsewhere (same log).split_hi = tl.minimum(split_lo + split_len, kv_hi)

 elsewhere (same log).# --- rows: (query token, head of the group) --------------------------------------------------------------
 elsewhere (same log).offs_m = tl.arange(0, BLOCK_M)
 elsewhere (same log).row_tok = offs_m // GROUP
 elsewhere (same log).row_head = kvh * GROUP + offs_m % GROUP
 elsewhere (same log).row_valid = (offs_m < BLOCK_Q * GROUP) & (q_block * BLOCK_Q + row_tok < q_len)
 elsewhere (same log).tok = (q_start + q_block * BLOCK_Q + row_tok).to(tl.int64)
 elsewhere (same log).q_pos = first_pos + row_tok
 elsewhere (same log).q_row_off = tok * stride_qt + row_head.to(tl.int64) * stride_qh

 elsewhere (same log).# per-tensor (stride 0) or per-head fp8 scales, folded: k into the score scale, v into the output
 elsewhere (same log).qk_scale = sm_scale
 elsewhere (same log).v_mul = 1.0
 elsewhere (same log).if FMT == FMT_FP8:
 elsewhere (same log).    qk_scale = qk_scale * tl.load(ks_ptr + kvh * stride_ksh)
 elsewhere (same log).    v_mul = tl.load(vs_ptr + kvh * stride_vsh)
 elsewhere (same log).if FMT == FMT_NVFP4 or FMT == FMT_MXFP4:  # _load_fp4_tile's values are value x scale x fp4_fold
 elsewhere (same log).    qk_scale = qk_scale / fp4_fold(FMT, DOT_DTYPE)
 elsewhere (same log).    v_mul = v_mul / fp4_fold(FMT, DOT_DTYPE)
 elsewhere (same log).if not HAS_SOFTCAP:
 elsewhere (same log).    qk_scale = qk_scale * LOG2E

 elsewhere (same log).IS_FP4: tl.constexpr = FMT == FMT_NVFP4 or FMT == FMT_MXFP4
 elsewhere (same log).# V_DEQUANT_FIRST (fp8, 4-bit): Triton moves V's conversion (a cast, or the 4-bit decode) behind the change to
 elsewhere (same log).# the mma operand layout, where V's operand pairs run along tokens, not memory: fp8 V then takes one
 elsewhere (same log).# shared-memory load a byte and 4-bit V one load per scale per value pair. A multiply by a 1.0 it cannot see
 elsewhere (same log).# through (inline PTX; ptxas drops the multiply) keeps the conversion in the load's layout, so the converted
 elsewhere (same log).# 16-bit tile goes through shared memory and ldmatrix.trans like a bf16 V tile. sm_90 SASS of the default
 elsewhere (same log).# decode tiles (Triton 3.6), instructions a thread per 128-key step: fp8 1419 -> 989, nvfp4 1866 -> 1545,
 elsewhere (same log).# mxfp4 2074 -> 1665 (doing the same to K adds instructions). On by default for mxfp4 only (heuristic_config).
 elsewhere (same log).HALF: tl.constexpr = HEAD_DIM // 2
 elsewhere (same log).# Swapped dots, so that the KV tile is the 64+-row operand that Hopper's wgmma needs (decode has only 16 rows of
 elsewhere (same log).# q): scores as (K q^T)^T, and for plain formats (WGMMA) the output as (V^T P^T)^T, both tiles read by the
 elsewhere (same log).# tensor cores from shared memory where the pipelined load put them (fp8 tiles are converted in registers
 elsewhere (same log).# first).
 elsewhere (same log).# FP8_DOT (e4m3 caches): the swapped score dot in e4m3 on K's stored bytes, with no per-element conversion of
 elsewhere (same log).# K (on sm_90 only wgmma multiplies fp8, and its fp8 A operand must be K-major: K [BLOCK_N, D] is, V^T is not,
 elsewhere (same log).# so V keeps the conversion). q enters as two e4m3 terms, hi + lo / 16 (scaled per row): about bf16's
 elsewhere (same log).# precision.
 elsewhere (same log).FP8_QK: tl.constexpr = FMT == FMT_FP8 and FP8_DOT
 elsewhere (same log).SWAP_QK: tl.constexpr = FP8_QK or (not IS_FP4 and WGMMA)
 elsewhere (same log).SWAP_PV: tl.constexpr = not IS_FP4 and WGMMA
 elsewhere (same log).if IS_FP4:
 elsewhere (same log).    offs_d = tl.arange(0, HALF)
 elsewhere (same log).    q_e = tl.load(q_ptr + q_row_off[:, None] + 2 * offs_d[None, :], mask=row_valid[:, None], other=0.0)
 elsewhere (same log).    q_o = tl.load(q_ptr + q_row_off[:, None] + 2 * offs_d[None, :] + 1, mask=row_valid[:, None], other=0.0)
 elsewhere (same log).    q_e = q_e.to(DOT_DTYPE)
 elsewhere (same log).    q_o = q_o.to(DOT_DTYPE)
 elsewhere (same log).    acc = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
 elsewhere (same log).    acc_o = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
 elsewhere (same log).else:
 elsewhere (same log).    offs_d = tl.arange(0, HEAD_DIM)
 elsewhere (same log).    q = tl.load(q_ptr + q_row_off[:, None] + offs_d[None, :], mask=row_valid[:, None], other=0.0)
 elsewhere (same log).    if FP8_QK:
 elsewhere (same log).        # per row, q x q_mul maps the row's largest |q| to 256 (e4m3 holds up to 448); score scale / q_mul
 elsewhere (same log).        qf = q.to(tl.float32)
 elsewhere (same log).        amax = tl.max(tl.abs(qf), 1)
 elsewhere (same log).        q_mul = tl.where(amax > 0.0, 256.0 / tl.where(amax > 0.0, amax, 1.0), 1.0)
 elsewhere (same log).        qs = qf * q_mul[:, None]
 elsewhere (same log).        q_hi = to_fp8_bits(qs, tl.float8e4nv, SOFT_FP8).to(tl.float8e4nv, bitcast=True)
 elsewhere (same log).        q_lo = to_fp8_bits((qs - q_hi.to(tl.float32)) * 16.0, tl.float8e4nv, SOFT_FP8).to(
 elsewhere (same log).            tl.float8e4nv, bitcast=True)
 elsewhere (same log).        q_hi_t = tl.trans(q_hi)  # [D, BLOCK_M]
 elsewhere (same log).        q_lo_t = tl.trans(q_lo)
 elsewhere (same log).        row_qk_scale = qk_scale / q_mul
 elsewhere (same log).    else:
 elsewhere (same log).        q = q.to(DOT_DTYPE)
 elsewhere (same log).        if SWAP_QK:
 elsewhere (same log).            q_t = tl.trans(q)  # [D, BLOCK_M]
 elsewhere (same log).    if SWAP_PV:
 elsewhere (same log).        acc = tl.zeros([HEAD_DIM, BLOCK_M], dtype=tl.float32)  # transposed
 elsewhere (same log).    else:
 elsewhere (same log).        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
 elsewhere (same log).m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
 elsewhere (same log).l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

 elsewhere (same log).offs_n = tl.arange(0, BLOCK_N)
 elsewhere (same log).bt_row = bt_ptr + b.to(tl.int64) * stride_bt
 elsewhere (same log).head_off = kvh.to(tl.int64) * stride_kh
 elsewhere (same log).# keys every valid row sees without masking: causal bound of the first query, window bound of the last
 elsewhere (same log).full_hi = first_pos + 1
 elsewhere (same log).full_lo = last_pos - window_left

 elsewhere (same log).for start in range(split_lo, split_hi, BLOCK_N):
 elsewhere (same log).    kpos = start + offs_n
 elsewhere (same log).    kvalid = kpos < split_hi
 elsewhere (same log).    # page of each key; a page of >= BLOCK_N tokens holds the whole (aligned) tile: one scalar load
 elsewhere (same log).    if PAGE >= BLOCK_N:
 elsewhere (same log).        page = tl.load(bt_row + start // PAGE).to(tl.int64)
 elsewhere (same log).        page_v = page + tl.zeros([BLOCK_N], dtype=tl.int64)
 elsewhere (same log).    else:
 elsewhere (same log).        page_v = tl.load(bt_row + kpos // PAGE, mask=kvalid, other=0).to(tl.int64)
 elsewhere (same log).    in_page = (kpos % PAGE).to(tl.int64)
 elsewhere (same log).    # int64: page index x page stride passes 2^31 elements on large caches
 elsewhere (same log).    tok_off = page_v * stride_kp + in_page * stride_kt + head_off

 elsewhere (same log).    if IS_FP4:
 elsewhere (same log).        ks_off = page_v * stride_ksp + in_page * stride_kst + kvh * stride_ksh
 elsewhere (same log).        k_e, k_o = _load_fp4_tile(k_ptr, ks_ptr, tok_off, ks_off, offs_d, kvalid, True, FMT, DOT_DTYPE,
 elsewhere (same log).                                  SCALE_BCAST, FP4_ASM)
 elsewhere (same log).        qk = tl.dot(q_e, k_e, input_precision=DOT_PRECISION)
 elsewhere (same log).        qk = tl.dot(q_o, k_o, acc=qk, input_precision=DOT_PRECISION)
 elsewhere (same log).    else:
 elsewhere (same log).        if FP8_QK:
 elsewhere (same log).            k = tl.load(k_ptr + tok_off[:, None] + offs_d[None, :], mask=kvalid[:, None], other=0)
 elsewhere (same log).            k = k.to(tl.float8e4nv, bitcast=True)  # [BLOCK_N, D]
 elsewhere (same log).            qk_t = tl.dot(k, q_lo_t) * 0.0625
 elsewhere (same log).            qk_t = tl.dot(k, q_hi_t, acc=qk_t)
 elsewhere (same log).            qk = tl.trans(qk_t)
 elsewhere (same log).        elif SWAP_QK:
 elsewhere (same log).            k = tl.load(k_ptr + tok_off[:, None] + offs_d[None, :], mask=kvalid[:, None], other=0.0)
 elsewhere (same log).            if FMT == FMT_FP8:
 elsewhere (same log).                k = _fp8_to_dot(k, FP8_DTYPE, DOT_DTYPE, FP8_ASM)
 elsewhere (same log).            else:
 elsewhere (same log).                k = k.to(DOT_DTYPE)
 elsewhere (same log).            qk = tl.trans(tl.dot(k, q_t))
 elsewhere (same log).        else:
 elsewhere (same log).            k = tl.load(k_ptr + tok_off[None, :] + offs_d[:, None], mask=kvalid[None, :], other=0.0)
 elsewhere (same log).            if FMT == FMT_FP8:
 elsewhere (same log).                k = _fp8_to_dot(k, FP8_DTYPE, DOT_DTYPE, FP8_ASM)
 elsewhere (same log).            else:
 elsewhere (same log).                k = k.to(DOT_DTYPE)
 elsewhere (same log).            qk = tl.dot(q, k, input_precision=DOT_PRECISION)

 elsewhere (same log).    if FP8_QK:
 elsewhere (same log).        qk = qk * row_qk_scale[:, None]
 elsewhere (same log).    else:
 elsewhere (same log).        qk = qk * qk_scale
 elsewhere (same log).    if HAS_SOFTCAP:
 elsewhere (same log).        # soft_cap * tanh(s / soft_cap), tanh through exp2 (stable: exp2 -> inf gives 1, -> 0 gives -1)
 elsewhere (same log).        t = tl.exp2(qk * (2.0 * LOG2E / soft_cap))
 elsewhere (same log).        s = (soft_cap * LOG2E) * (1.0 - 2.0 / (t + 1.0))
 elsewhere (same log).    else:
 elsewhere (same log).        s = qk
 elsewhere (same log).    # mask only the tiles at the causal/window/length edges
 elsewhere (same log).    needs_mask = start + BLOCK_N > full_hi
 elsewhere (same log).    if HAS_WINDOW:
 elsewhere (same log).        needs_mask = needs_mask | (start < full_lo)
 elsewhere (same log).    if needs_mask:
 elsewhere (same log).        visible = kpos[None, :] <= q_pos[:, None]
 elsewhere (same log).        if HAS_WINDOW:
 elsewhere (same log).            visible = visible & (kpos[None, :] >= q_pos[:, None] - window_left)
 elsewhere (same log).        s = tl.where(visible, s, float("-inf"))

 elsewhere (same log).    m_new = tl.maximum(m_i, tl.max(s, 1))
 elsewhere (same log).    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet: no NaN
 elsewhere (same log).    alpha = tl.exp2(m_i - m_use)
 elsewhere (same log).    p = tl.exp2(s - m_use[:, None])
 elsewhere (same log).    l_i = l_i * alpha + tl.sum(p, 1)
 elsewhere (same log).    m_i = m_new

 elsewhere (same log).    if IS_FP4:
 elsewhere (same log).        vs_off = page_v * stride_vsp + in_page * stride_vst + kvh * stride_vsh
 elsewhere (same log).        v_e, v_o = _load_fp4_tile(v_ptr, vs_ptr, tok_off, vs_off, offs_d, kvalid, False, FMT, DOT_DTYPE,
 elsewhere (same log).                                  SCALE_BCAST, FP4_ASM)
 elsewhere (same log).        if V_DEQUANT_FIRST:
 elsewhere (same log).            one = opaque_one(sm_scale).to(DOT_DTYPE)
 elsewhere (same log).            v_e = v_e * one
 elsewhere (same log).            v_o = v_o * one
 elsewhere (same log).        p = p.to(DOT_DTYPE)
 elsewhere (same log).        acc = tl.dot(p, v_e, acc=acc * alpha[:, None], input_precision=DOT_PRECISION)
 elsewhere (same log).        acc_o = tl.dot(p, v_o, acc=acc_o * alpha[:, None], input_precision=DOT_PRECISION)
 elsewhere (same log).    else:
 elsewhere (same log).        v = tl.load(v_ptr + tok_off[:, None] + offs_d[None, :], mask=kvalid[:, None], other=0.0)
 elsewhere (same log).        if FMT == FMT_FP8:
 elsewhere (same log).            v = _fp8_to_dot(v, FP8_DTYPE, DOT_DTYPE, FP8_ASM)
 elsewhere (same log).            if V_DEQUANT_FIRST:
 elsewhere (same log).                v = v * opaque_one(sm_scale).to(DOT_DTYPE)
 elsewhere (same log).        else:
 elsewhere (same log).            v = v.to(DOT_DTYPE)
 elsewhere (same log).        if SWAP_PV:
 elsewhere (same log).            acc = tl.dot(tl.trans(v), tl.trans(p.to(DOT_DTYPE)), acc=acc * alpha[None, :])
 elsewhere (same log).        else:
 elsewhere (same log).            acc = tl.dot(p.to(DOT_DTYPE), v, acc=acc * alpha[:, None], input_precision=DOT_PRECISION)

 elsewhere (same log).# --- epilogue: normalized output, directly or as a split partial ---------------------------------------
 elsewhere (same log).if SWAP_PV:
 elsewhere (same log).    acc = tl.trans(acc)
 elsewhere (same log).has_keys = l_i > 0.0
 elsewhere (same log).inv_l = tl.where(has_keys, v_mul / tl.where(has_keys, l_i, 1.0), 0.0)  # no key seen: the row is 0
 elsewhere (same log).if IS_FP4:
 elsewhere (same log).    col = 2 * offs_d
 elsewhere (same log).else:
 elsewhere (same log).    col = offs_d
 elsewhere (same log).if n_splits == 1:
 elsewhere (same log).    o_ptr = out_ptr + tok[:, None] * stride_ot + row_head.to(tl.int64)[:, None] * stride_oh + col[None, :]
 elsewhere (same log).    tl.store(o_ptr, (acc * inv_l[:, None]).to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
 elsewhere (same log).    if IS_FP4:
 elsewhere (same log).        tl.store(o_ptr + 1, (acc_o * inv_l[:, None]).to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
 elsewhere (same log).else:
 elsewhere (same log).    part_row = (tok * NUM_Q_HEADS + row_head) * MAX_SPLITS + split  # int64
 elsewhere (same log).    p_ptr = part_out_ptr + part_row[:, None] * HEAD_DIM + col[None, :]
 elsewhere (same log).    tl.store(p_ptr, acc * inv_l[:, None], mask=row_valid[:, None])
 elsewhere (same log).    if IS_FP4:
 elsewhere (same log).        tl.store(p_ptr + 1, acc_o * inv_l[:, None], mask=row_valid[:, None])
 elsewhere (same log).    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
 elsewhere (same log).    tl.store(part_lse_ptr + part_row, lse, mask=row_valid)


@triton.jit(do_not_specialize=["num_seqs", "window_left", "MAX_SPLITS", "CHUNK"])
def merge_splits_kernel(
 elsewhere (same log).out_ptr, part_out_ptr, part_lse_ptr, seq_lens_ptr, cu_ptr, num_seqs, window_left, MAX_SPLITS, CHUNK,
 elsewhere (same log).stride_ot, stride_oh,
 elsewhere (same log).NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
 elsewhere (same log).SPLITS_P2: tl.constexpr, IS_DECODE: tl.constexpr, HAS_WINDOW: tl.constexpr, PDL: tl.constexpr,
):
 elsewhere (same log)."""One program per (query token, query head): combines the token's split partials by their LSE. It
 elsewhere (same log).recomputes the split plan of the attention kernel (same kv_plan) and leaves single-split rows alone (the
 elsewhere (same log).attention kernel wrote them directly). PDL (launched as a programmatic dependent of the attention kernel):
 elsewhere (same log).the split plan, from inputs the attention kernel does not write, is worked out while that kernel finishes, and
 elsewhere (same log).the partials are read after griddepcontrol.wait."""
 elsewhere (same log).t = tl.program_id(0)
 elsewhere (same log).h = tl.program_id(1)
 elsewhere (same log).if IS_DECODE:
 elsewhere (same log).    b = t
 elsewhere (same log).    q_start = t
 elsewhere (same log).    q_len = 1
 elsewhere (same log).else:
 elsewhere (same log).    b = find_sequence(cu_ptr, t, num_seqs, 1, False)
 elsewhere (same log).    q_start = tl.load(cu_ptr + b)
 elsewhere (same log).    q_len = tl.load(cu_ptr + b + 1) - q_start
 elsewhere (same log).seq_len = tl.load(seq_lens_ptr + b)
 elsewhere (same log).q_block = (t - q_start) // BLOCK_Q
 elsewhere (same log)._, _, _, _, n_splits, _ = kv_plan(seq_len, q_len, q_block, window_left, MAX_SPLITS, CHUNK, BLOCK_Q, BLOCK_N,
 elsewhere (same log).                                  HAS_WINDOW)
 elsewhere (same log).if PDL:  # every program waits, so that this grid completes after the attention kernel does
 elsewhere (same log).    gdc_wait()
 elsewhere (same log).if n_splits <= 1:
 elsewhere (same log).    return
 elsewhere (same log).row = (t.to(tl.int64) * NUM_Q_HEADS + h) * MAX_SPLITS
 elsewhere (same log).offs_s = tl.arange(0, SPLITS_P2)
 elsewhere (same log).lse = tl.load(part_lse_ptr + row + offs_s, mask=offs_s < n_splits, other=float("-inf"))
 elsewhere (same log).mx = tl.max(lse, 0)
 elsewhere (same log).mx = tl.where(mx == float("-inf"), 0.0, mx)
 elsewhere (same log).denom = tl.sum(tl.exp2(lse - mx), 0)
 elsewhere (same log).offs_d = tl.arange(0, HEAD_DIM)
 elsewhere (same log).acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
 elsewhere (same log).for s in range(0, n_splits):
 elsewhere (same log).    w = tl.exp2(tl.load(part_lse_ptr + row + s) - mx)
 elsewhere (same log).    acc += w * tl.load(part_out_ptr + (row + s) * HEAD_DIM + offs_d)
 elsewhere (same log).o = acc / tl.where(denom > 0.0, denom, 1.0)
 elsewhere (same log).tl.store(out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty))


# ---------------------------------------------------------------------------------------------------------------
# host side

_TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}

WORKSPACE_BYTES = 64 * 2 ** 20  # the most split partials one call may allocate (heuristic; tuning may exceed it)

# Tunables a caller (benchmarks/triton_tuning.py, tests) may force; None entries fall back to the heuristic.
CONFIG_KEYS = ("BLOCK_N", "num_warps", "num_stages", "CHUNK", "MAX_SPLITS", "BLOCK_Q", "FP8_ASM", "SCALE_BCAST",
 elsewhere (same log).           "FP4_ASM", "FP8_DOT", "WGMMA", "maxnreg", "HEADS_INNER", "V_DEQUANT_FIRST", "PDL")


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
 elsewhere (same log).if device.type != "cuda":
 elsewhere (same log).    return 4  # the interpreter: small, so that CPU tests exercise several splits
 elsewhere (same log).return torch.cuda.get_device_properties(device).multi_processor_count


def _capability(device: torch.device) -> int:
 elsewhere (same log)."""The GPU's compute capability major (0 off the GPU)."""
 elsewhere (same log).if device.type != "cuda":
 elsewhere (same log).    return 0
 elsewhere (same log).return torch.cuda.get_device_capability(device)[0]


def _shared_memory_per_block(device: torch.device) -> int:
 elsewhere (same log)."""Bytes of shared memory a block may opt into (0 off the GPU, or where torch does not say)."""
 elsewhere (same log).if device.type != "cuda":
 elsewhere (same log).    return 0
 elsewhere (same log).return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0)


def dot_dtype(q_dtype: torch.dtype, kv_format: str) -> torch.dtype:
 elsewhere (same log)."""The dtype of tl.dot operands: fp32 for fp32 q (exact, input_precision="ieee"); fp16 for fp8 and nvfp4
 elsewhere (same log).caches (their values fit fp16 exactly, fp16 keeps 3 more mantissa bits of q and P than bf16, and fp8 ->
 elsewhere (same log).fp16 is a cheaper conversion than fp8 -> bf16); mxfp4's scales span 2^-127..2^127 so it keeps q's dtype;
 elsewhere (same log).plain caches compute in q's dtype."""
 elsewhere (same log).if q_dtype == torch.float32:
 elsewhere (same log).    return torch.float32
 elsewhere (same log).if formats.is_fp8(kv_format) or kv_format == "nvfp4":
 elsewhere (same log).    return torch.float16
 elsewhere (same log).return q_dtype


@functools.lru_cache(maxsize=4096)
def heuristic_config(device, decode: bool, batch: int, num_tokens: int, num_q_heads: int, num_kv_heads: int,
 elsewhere (same log).                 head_dim: int, page_size: int, capacity: int, kv_format: str, q_dtype: torch.dtype) -> dict:
 elsewhere (same log)."""Tunables from shapes and dtypes only (cached per shape). The number of splits a sequence actually gets is
 elsewhere (same log).decided on the device (common.kv_plan); here: CHUNK (keys per program), MAX_SPLITS (grid size, workspace)
 elsewhere (same log).and tile sizes."""
 elsewhere (same log).group = num_q_heads // num_kv_heads
 elsewhere (same log).sms = _num_sms(device)
 elsewhere (same log).if decode:
 elsewhere (same log).    block_q = 1
 elsewhere (same log).else:
 elsewhere (same log).    avg_q = -(-num_tokens // max(batch, 1))
 elsewhere (same log).    max_rows = 64 if head_dim >= 256 else 128
 elsewhere (same log).    block_q = max(1, min(triton.next_power_of_2(avg_q), max(1, max_rows // group)))
 elsewhere (same log).block_m = max(16, triton.next_power_of_2(block_q * group))
 elsewhere (same log).# decode, and verify blocks whose tokens x heads fit one 16-row tile: streaming the KV once is the whole job
 elsewhere (same log).decode_like = decode or block_m <= 16
 elsewhere (same log).# programs to fill the chip: the decode kernel holds about two programs per SM (registers), and on the H200
 elsewhere (same log).# (benchmarks/triton_tuning.py, benchmarks/results/h200-tune-*.json) 1.5 programs per SM beat more, shorter
 elsewhere (same log).# splits at every decode case (1 x 32768: 256 programs of 1024 keys took 41 us, 512 of 512 keys 50 us)
 elsewhere (same log).target = (3 * sms) // 2 if decode_like else 4 * sms
 elsewhere (same log).# Decode-like tiles: 128 keys up to D=128 (on the H200 every format's decode was fastest with 128, by 5% (bf16)
 elsewhere (same log).# to 36% (nvfp4) over 64). Larger query tiles: about 16 KB of bf16 K, 64 keys at D=128 (registers), 128 at
 elsewhere (same log).# D<=64, 32 at D=256; but prefill tiles of 64+ rows at D=128 take 128 keys (in 2 stages: 293 against 269
 elsewhere (same log).# TFLOP/s on the H200's 8 x 4096 prefill, 306 against 275 for 2048 new tokens after 46,000
 elsewhere (same log).# (benchmarks/results/h200-prefill-probe.log)). The interpreter keeps 64 so that CPU tests cover several tiles
 elsewhere (same log).# and splits with short sequences.
 elsewhere (same log).# (16-bit dots only: fp32 q's fp32 dots at 128 x 128 take 256+ KB of shared memory, more than sm_90's 227 KB,
 elsewhere (same log).# at 2 stages as at 3: `python -m attnops.backends.triton.compile_check --heuristic`)
 elsewhere (same log).prefill_128 = (device.type == "cuda" and not decode_like and block_m >= 64 and head_dim == 128
 elsewhere (same log).               and dot_dtype(q_dtype, kv_format) != torch.float32)
 elsewhere (same log).if device.type != "cuda":
 elsewhere (same log).    block_n = 32 if head_dim >= 256 else 64
 elsewhere (same log).elif decode_like and head_dim <= 128 or prefill_128:
 elsewhere (same log).    block_n = 128
 elsewhere (same log).else:
 elsewhere (same log).    block_n = max(16, min(128, 8192 // head_dim))
 elsewhere (same log).# query blocks that do work (the grid's T // BLOCK_Q + B is an upper bound that counts partial blocks)
 elsewhere (same log).num_q_blocks = batch if decode else max(batch, -(-num_tokens // block_q))
 elsewhere (same log).base = num_q_blocks * num_kv_heads
 elsewhere (same log).if device.type != "cuda":
 elsewhere (same log).    chunk, max_splits = 2 * block_n, 8  # CPU (interpreter): exercise the split + merge path
 elsewhere (same log).elif base >= target and not decode:
 elsewhere (same log).    chunk, max_splits = capacity, 1  # prefill-like: enough programs without splitting, no workspace
 elsewhere (same log).else:
 elsewhere (same log).    # enough splits to fill the chip for the longest possible sequence, but at least 1024 keys a program (a
 elsewhere (same log).    # split's fixed costs: q, the epilogue, the merge) and no more than 4096 whatever the batch, so that one
 elsewhere (same log).    # long sequence in a ragged batch does not become the tail
 elsewhere (same log).    splits_to_fill = -(-target // base)
 elsewhere (same log).    if decode_like and base >= 2 * target and kv_format != "mxfp4":
 elsewhere (same log).        # three or more programs an SM without splitting, yet halves still paid on the H200 (CUDA-graph
 elsewhere (same log).        # times, benchmarks/results/h200-tune-split-heads.log): 64 x 2048 bf16 134 against 142 us, nvfp4 132
 elsewhere (same log).        # against 150, fp8 101 against 105; 128 x 4096 bf16 482 against 489. mxfp4 (ALU-bound) lost 3%.
 elsewhere (same log).        splits_to_fill = 2
 elsewhere (same log).    chunk = 1 << max(0, (capacity // splits_to_fill).bit_length() - 1)  # a power of two, rounded down
 elsewhere (same log).    low, high = (1024, 4096) if decode_like else (4 * block_n, 2048)
 elsewhere (same log).    chunk = max(low, min(chunk, high))
 elsewhere (same log).    max_splits = max(1, min(-(-capacity // chunk), 256))
 elsewhere (same log).    if not decode:  # the workspace is per query token: split only as much as filling the chip needs
 elsewhere (same log).        max_splits = min(max_splits, splits_to_fill)
 elsewhere (same log).    # a bounded workspace ([T, Hq, MAX_SPLITS, D] fp32); past the cap the device lengthens the splits
 elsewhere (same log).    per_split = num_tokens * num_q_heads * head_dim * 4
 elsewhere (same log).    max_splits = max(1, min(max_splits, WORKSPACE_BYTES // per_split))
 elsewhere (same log).num_warps = 8 if block_m >= 64 else 4
 elsewhere (same log).# 128-key prefill tiles of a 16-bit cache pipeline 3 stages deep where a block may take 227 KB of shared
 elsewhere (same log).# memory (sm_90): 304 against 292 TFLOP/s on the H200's 8 x 4096 bf16 prefill, 324 against 305 for 2048 new
 elsewhere (same log).# tokens after 46,000 (benchmarks/results/h200-prefill-stages.log); 2 stages elsewhere (less shared memory)
 elsewhere (same log).deep_prefill = (prefill_128 and kv_format in ("bf16", "fp16")
 elsewhere (same log).                and _shared_memory_per_block(device) >= 227 * 1024)
 elsewhere (same log).num_stages = 2 if head_dim >= 256 or (kv_format == "nvfp4" and decode_like) or (
 elsewhere (same log).    prefill_128 and not deep_prefill) else 3
 elsewhere (same log).# fp8 decode tiles: capping registers at 168 (from 198) fits 3 programs per SM instead of 2, worth its
 elsewhere (same log).# small spills: 356 against 380 us on the H200's 128 x 4096 (benchmarks/results/h200-tune-formats.log)
 elsewhere (same log).maxnreg = 168 if formats.is_fp8(kv_format) and decode_like and device.type == "cuda" else None
 elsewhere (same log).# FP8_ASM off: Triton already lowers e4m3 -> fp16 to cvt.rn.f16x2.e4m3x2 on sm_89+ (seen in the PTX), the asm
 elsewhere (same log).# variant stays for the tuning sweep. SCALE_BCAST on: one load per 4-bit block scale instead of one per value
 elsewhere (same log).# (sm_90 PTX of an nvfp4 decode: 17 global loads instead of 97, half the shared memory). FP4_ASM on (GPU,
 elsewhere (same log).# nvfp4 with fp16 dots): 1.37x on the H200's 128 x 4096 decode, with 2 stages (175 registers, no spill) 5% faster
 elsewhere (same log).# than 3. FP8_DOT and WGMMA off: 2-10% slower there. HEADS_INNER for decode-like tiles: 1-6% faster on the
 elsewhere (same log).# H200 for bf16 and nvfp4 (256 x 8192 nvfp4 1811 against 1921 us), even for fp8, within 1% for mxfp4
 elsewhere (same log).# (h200-tune-split-heads.log). Prefill tiles keep the query-block-major order: HEADS_INNER there was 4% faster
 elsewhere (same log).# on 8 x 4096 but 1.5% slower on 2048 new tokens after 46,000 (h200-prefill-probe.log).
 elsewhere (same log).# V_DEQUANT_FIRST for mxfp4 decode-like tiles only: on the H200 5-7% faster for mxfp4 (256 x 8192 1740 against
 elsewhere (same log).# 1869 us) but 4-7% slower for fp8 and nvfp4, although their SASS has fewer instructions too (fp8 989 against
 elsewhere (same log).# 1419 a step): the converted V's extra trip through shared memory and its barrier cost more there
 elsewhere (same log).# (benchmarks/results/h200-compare-v-dequant-first-3eaba47.log). PDL where the GPU has it (sm_90+): the merge kernel
 elsewhere (same log).# is launched while the attention kernel runs, 2.5-3% off 1 x 32768 (bf16 40.6 -> 39.5 us), the same
 elsewhere (same log).# elsewhere (same log).
 elsewhere (same log).return dict(BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages, CHUNK=chunk, MAX_SPLITS=max_splits,
 elsewhere (same log).            BLOCK_Q=block_q, FP8_ASM=False, SCALE_BCAST=True, FP4_ASM=device.type == "cuda", FP8_DOT=False,
 elsewhere (same log).            WGMMA=False, maxnreg=maxnreg, HEADS_INNER=decode_like,
 elsewhere (same log).            V_DEQUANT_FIRST=kv_format == "mxfp4" and decode_like and device.type == "cuda",
 elsewhere (same log).            PDL=_capability(device) >= 9)


def smaller_tile(cfg: dict) -> dict | None:
 elsewhere (same log)."""The configuration to try when `cfg`'s tile does not fit the GPU: one pipeline stage fewer down to 2, then
 elsewhere (same log).half the keys per tile down to 16, then 1 stage; None past that. (The split plan needs no change: the device
 elsewhere (same log).rounds splits to BLOCK_N multiples.)"""
 elsewhere (same log).if cfg["num_stages"] > 2:
 elsewhere (same log).    return dict(cfg, num_stages=cfg["num_stages"] - 1)
 elsewhere (same log).if cfg["BLOCK_N"] > 16:
 elsewhere (same log).    return dict(cfg, BLOCK_N=cfg["BLOCK_N"] // 2)
 elsewhere (same log).if cfg["num_stages"] > 1:
 elsewhere (same log).    return dict(cfg, num_stages=1)
 elsewhere (same log).return None


def kernel_constexprs(cfg: dict, *, q_dtype: torch.dtype, kv_format: str, decode: bool, num_q_heads: int,
 elsewhere (same log).                  head_dim: int, group: int, page_size: int, window: bool, soft_cap: bool,
 elsewhere (same log).                  on_gpu: bool) -> tuple[dict, dict]:
 elsewhere (same log)."""The attention kernel's constexpr arguments and compiler options (num_warps, num_stages, maxnreg) for a
 elsewhere (same log).configuration: the one place that turns tunables into what Triton compiles, for launch() and for
 elsewhere (same log).compile_check (which compiles the heuristic's choices for a GPU target without one). Tunables that do not
 elsewhere (same log).apply to the format, q dtype or machine are switched off here. on_gpu: compiled for a GPU (not the
 elsewhere (same log).interpreter): inline PTX and register caps apply."""
 elsewhere (same log).ddt = dot_dtype(q_dtype, kv_format)
 elsewhere (same log).constexprs = dict(
 elsewhere (same log).    NUM_Q_HEADS=num_q_heads, HEAD_DIM=head_dim, PAGE=page_size, GROUP=group, BLOCK_Q=cfg["BLOCK_Q"],
 elsewhere (same log).    BLOCK_M=max(16, triton.next_power_of_2(cfg["BLOCK_Q"] * group)), BLOCK_N=cfg["BLOCK_N"],
 elsewhere (same log).    FMT=FMT_CODE[kv_format], IS_DECODE=decode, HAS_WINDOW=window, HAS_SOFTCAP=soft_cap,
 elsewhere (same log).    DOT_DTYPE=_TL_DTYPE[ddt], DOT_PRECISION="ieee" if ddt == torch.float32 else "tf32",
 elsewhere (same log).    FP8_ASM=bool(cfg["FP8_ASM"]) and kv_format == "fp8_e4m3" and ddt == torch.float16 and on_gpu,
 elsewhere (same log).    FP8_DTYPE=tl.float8e4nv if kv_format == "fp8_e4m3" else tl.float8e5,
 elsewhere (same log).    SCALE_BCAST=bool(cfg["SCALE_BCAST"]) and formats.is_fp4(kv_format),
 elsewhere (same log).    FP4_ASM=bool(cfg["FP4_ASM"]) and formats.is_fp4(kv_format) and on_gpu,
 elsewhere (same log).    FP8_DOT=bool(cfg["FP8_DOT"]) and kv_format == "fp8_e4m3" and q_dtype != torch.float32,
 elsewhere (same log).    V_DEQUANT_FIRST=bool(cfg["V_DEQUANT_FIRST"]) and (formats.is_fp8(kv_format) or formats.is_fp4(kv_format))
 elsewhere (same log).    and on_gpu,
 elsewhere (same log).    PDL=bool(cfg["PDL"]) and cfg["MAX_SPLITS"] > 1 and on_gpu,
 elsewhere (same log).    WGMMA=bool(cfg["WGMMA"]) and ddt != torch.float32, SOFT_FP8=not on_gpu,
 elsewhere (same log).    HEADS_INNER=bool(cfg["HEADS_INNER"]))
 elsewhere (same log).options = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
 elsewhere (same log).if cfg["maxnreg"] and on_gpu:  # a register cap: more resident programs per SM at the price of spills
 elsewhere (same log).    options["maxnreg"] = cfg["maxnreg"]
 elsewhere (same log).return constexprs, options


def launch(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, *, scale, soft_cap, window_left, kv_format,
 elsewhere (same log).       k_scale, v_scale, out, config=None):
 elsewhere (same log)."""Runs paged attention (decode when cu_seqlens_q is None) into `out`. Inputs are validated by the op."""
 elsewhere (same log).decode = cu_seqlens_q is None
 elsewhere (same log).num_tokens, num_q_heads, head_dim = q.shape
 elsewhere (same log).page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
 elsewhere (same log).batch = seq_lens.shape[0]
 elsewhere (same log).group = num_q_heads // num_kv_heads
 elsewhere (same log).capacity = block_table.shape[1] * page_size
 elsewhere (same log).if num_tokens == 0 or batch == 0:
 elsewhere (same log).    return
 elsewhere (same log).chosen = heuristic_config(q.device, decode, batch, num_tokens, num_q_heads, num_kv_heads, head_dim, page_size,
 elsewhere (same log).                          capacity, kv_format, q.dtype)
 elsewhere (same log).cfg = dict(chosen)
 elsewhere (same log).if config:
 elsewhere (same log).    cfg.update({k: v for k, v in config.items() if v is not None})
 elsewhere (same log).if cfg["PDL"] and q.is_cuda and torch.cuda.get_device_capability(q.device)[0] < 9:
 elsewhere (same log).    cfg["PDL"] = False  # griddepcontrol (programmatic dependent launch) is sm_90+
 elsewhere (same log).# the kernels index these with unit inner strides (always so from the usual callers; copies are tiny)
 elsewhere (same log).if block_table.stride(1) != 1:
 elsewhere (same log).    block_table = block_table.contiguous()
 elsewhere (same log).if seq_lens.stride(0) != 1:
 elsewhere (same log).    seq_lens = seq_lens.contiguous()
 elsewhere (same log).if cu_seqlens_q is not None and cu_seqlens_q.stride(0) != 1:
 elsewhere (same log).    cu_seqlens_q = cu_seqlens_q.contiguous()
 elsewhere (same log).if out.stride(-1) != 1:
 elsewhere (same log).    result = torch.empty_like(out, memory_format=torch.contiguous_format)
 elsewhere (same log).    launch(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale=scale, soft_cap=soft_cap,
 elsewhere (same log).           window_left=window_left, kv_format=kv_format, k_scale=k_scale, v_scale=v_scale, out=result,
 elsewhere (same log).           config=config)
 elsewhere (same log).    out.copy_(result)
 elsewhere (same log).    return
 elsewhere (same log).block_q = cfg["BLOCK_Q"]
 elsewhere (same log).max_splits, chunk = cfg["MAX_SPLITS"], cfg["CHUNK"]
 elsewhere (same log).assert cfg["BLOCK_N"] >= 16 and chunk >= 1  # split lengths are rounded up to BLOCK_N multiples on the device
 elsewhere (same log).# scales: per tensor -> stride 0 (every head reads element 0); per head -> stride 1; 4-bit: paged strides
 elsewhere (same log).if formats.is_fp8(kv_format):
 elsewhere (same log).    ks_strides = (0, 0, 0 if k_scale.numel() == 1 else k_scale.stride(0))
 elsewhere (same log).    vs_strides = (0, 0, 0 if v_scale.numel() == 1 else v_scale.stride(0))
 elsewhere (same log).elif formats.is_fp4(kv_format):
 elsewhere (same log).    ks_strides, vs_strides = k_scale.stride()[:3], v_scale.stride()[:3]
 elsewhere (same log).    k_scale, v_scale = k_scale.view(torch.uint8), v_scale.view(torch.uint8)
 elsewhere (same log).else:
 elsewhere (same log).    k_scale = v_scale = k_cache  # unused placeholders (the kernel never reads them)
 elsewhere (same log).    ks_strides = vs_strides = (0, 0, 0)

 elsewhere (same log).if formats.is_fp8(kv_format):  # read fp8 as bytes (masked lanes load 0) and reinterpret in registers
 elsewhere (same log).    k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)

 elsewhere (same log).cu = seq_lens if decode else cu_seqlens_q
 elsewhere (same log).num_q_blocks = batch if decode else num_tokens // block_q + batch
 elsewhere (same log).shape = dict(q_dtype=q.dtype, kv_format=kv_format, decode=decode, num_q_heads=num_q_heads, head_dim=head_dim,
 elsewhere (same log).             group=group, page_size=page_size, window=window_left >= 0, soft_cap=soft_cap > 0,
 elsewhere (same log).             on_gpu=q.is_cuda and not interpreting())
 elsewhere (same log).constexprs, options = kernel_constexprs(cfg, **shape)
 elsewhere (same log).if max_splits > 1:
 elsewhere (same log).    # one allocation for both (host time per call matters for short decode steps): partial outputs
 elsewhere (same log).    # [T, Hq, MAX_SPLITS, D] and their LSEs [T, Hq, MAX_SPLITS]
 elsewhere (same log).    rows = num_tokens * num_q_heads * max_splits
 elsewhere (same log).    workspace = torch.empty(rows * (head_dim + 1), dtype=torch.float32, device=q.device)
 elsewhere (same log).    part_out, part_lse = workspace[: rows * head_dim], workspace[rows * head_dim:]
 elsewhere (same log).else:
 elsewhere (same log).    part_out = part_lse = out  # unused: every program writes `out` directly
 elsewhere (same log).heads_inner = constexprs["HEADS_INNER"]
 elsewhere (same log).grid = (num_q_blocks * num_kv_heads, 1, max_splits) if heads_inner else (num_q_blocks, num_kv_heads, max_splits)
 elsewhere (same log).first_tile, error = (cfg["BLOCK_N"], cfg["num_stages"]), None
 elsewhere (same log).while True:
 elsewhere (same log).    try:
 elsewhere (same log).        paged_attention_kernel[grid](
 elsewhere (same log).            q, k_cache, v_cache, k_scale, v_scale, block_table, seq_lens, cu, out, part_out, part_lse,
 elsewhere (same log).            batch, float(scale), float(soft_cap), int(window_left), max_splits, chunk,
 elsewhere (same log).            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
 elsewhere (same log).            *ks_strides, *vs_strides,
 elsewhere (same log).            block_table.stride(0), out.stride(0), out.stride(1), **constexprs, **options,
 elsewhere (same log).            launch_pdl=constexprs["PDL"])
 elsewhere (same log).        break
 elsewhere (same log).    except OutOfResources as e:
 elsewhere (same log).        # Raised when the compiled kernel is loaded, before anything runs: the tile needs more shared
 elsewhere (same log).        # memory (or registers) than this GPU has, as on GPUs the heuristic was not measured on. Step down
 elsewhere (same log).        # and remember the step in the heuristic's cached choice, so later calls of the shape start there.
 elsewhere (same log).        error, cfg = e, smaller_tile(cfg)
 elsewhere (same log).        if cfg is None:
 elsewhere (same log).            raise
 elsewhere (same log).        if not config:
 elsewhere (same log).            chosen.update(BLOCK_N=cfg["BLOCK_N"], num_stages=cfg["num_stages"])
 elsewhere (same log).        constexprs, options = kernel_constexprs(cfg, **shape)
 elsewhere (same log).if error is not None:
 elsewhere (same log).    warnings.warn(f"attnops Triton attention: a tile of {first_tile[0]} keys in {first_tile[1]} stages does "
 elsewhere (same log).                  f"not fit this GPU ({error}); this shape now runs {cfg['BLOCK_N']} keys in "
 elsewhere (same log).                  f"{cfg['num_stages']} stages", RuntimeWarning)
 elsewhere (same log).if max_splits > 1:
 elsewhere (same log).    merge_splits_kernel[(num_tokens, num_q_heads)](
 elsewhere (same log).        out, part_out, part_lse, seq_lens, cu, batch, int(window_left), max_splits, chunk,
 elsewhere (same log).        out.stride(0), out.stride(1),
 elsewhere (same log).        NUM_Q_HEADS=num_q_heads, HEAD_DIM=head_dim, BLOCK_Q=block_q, BLOCK_N=cfg["BLOCK_N"],
 elsewhere (same log).        SPLITS_P2=max(2, triton.next_power_of_2(max_splits)), IS_DECODE=decode,
 elsewhere (same log).        HAS_WINDOW=window_left >= 0, PDL=constexprs["PDL"], launch_pdl=constexprs["PDL"],
 elsewhere (same log).        num_warps=4 if head_dim >= 128 else 2)
