"""reshape_and_cache in Triton: writes each new token's K and V into its cache slot, quantizing on the way, for
every format. Bit-exact with attnops.formats (the definition of the formats), NaN and Inf included:
- divisions use IEEE round-to-nearest (tl.math.div_rn), as torch does (Triton's `/` on fp32 is approximate);
- fp32 -> fp8/fp16 conversions round to nearest even, as torch's; fp8 saturates finite values and Inf at the
  format's max and keeps NaN a NaN (0x7F with its sign, torch's encoding) where a min/max clamp would drop it;
- nvfp4 block scale = e4m3(min(amax / 6, 448)), NaN (0x7F) for a block holding a NaN, whose codes are then all 0
  (the reference encodes only where the scale is > 0); mxfp4 block scale = clamp(floor(log2(amax)) - 2 + 127, 0,
  254), floor(log2(amax)) read exactly from amax's exponent bits (formats.py computes it with torch.log2 in fp32,
  which agrees except when amax lies within a rounding error of a power of two with a large exponent): 254 for a
  block holding an Inf, 0 for one holding a NaN (torch's float -> uint8 of a NaN);
- e2m1 codes: round |x| / scale to the nearest of 0, 0.5, ..., 6 (saturating; a NaN, as torch.bucketize places
  it, takes 6), ties to the even code, no -0.
amax is computed with explicit NaN tests: a reduction's max on the GPU drops NaN operands.

One program per (token, KV head) writes both K and V. Slot -1 (padding) is skipped on the device: no host sync. A
slot below -1 or past the cache is a bad index: the token writes nothing (neither K, V nor block scales) and the
device error buffer (attnops.errors) records it; every other token is written.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import errors, formats
from . import head_tile
from .common import ERR_SLOT_MAPPING, FMT_CODE, FMT_FP8, FMT_MXFP4, FMT_NVFP4, e8m0_to_f32, to_fp8_bits


@triton.jit
def _e2m1_encode(y):
    """|x| / scale (fp32, >= 0) -> e2m1 magnitude code 0..7 (int32): nearest value, ties to the even code,
    saturating at 6. Codes k and k+1 meet at the midpoint mid_k; a value equal to mid_k belongs to code k
    (bucketize's rule) unless k is odd, then to k+1."""
    y = tl.where(y != y, 6.0, tl.minimum(y, 6.0))  # NaN: code 7, where torch.bucketize puts it
    code = ((y > 0.25).to(tl.int32) + (y > 0.75).to(tl.int32) + (y > 1.25).to(tl.int32)
            + (y > 1.75).to(tl.int32) + (y > 2.5).to(tl.int32) + (y > 3.5).to(tl.int32) + (y > 5.0).to(tl.int32))
    tie = (y == 0.75) | (y == 1.75) | (y == 3.5)  # the midpoints whose lower code (1, 3, 5) is odd
    return tl.where(tie, code + 1, code)


@triton.jit
def _write_row(src_ptr, cache_ptr, scale_ptr, bscale_ptr, cache_off, bscale_off, FMT: tl.constexpr,
               HEAD_DIM: tl.constexpr, SCALE_BLOCK: tl.constexpr, FP8_DTYPE: tl.constexpr, FP8_MAX: tl.constexpr,
               SOFT_FP8: tl.constexpr, VALID_DIM: tl.constexpr):
    """Quantizes one head's row (src_ptr -> VALID_DIM values) into the cache row at cache_ptr + cache_off.
    HEAD_DIM: the row's tile, VALID_DIM rounded up to a power of two (4-bit: VALID_DIM a multiple of the scale
    block; the blocks past it are neither read nor written)."""
    if FMT == FMT_NVFP4 or FMT == FMT_MXFP4:
        NB: tl.constexpr = HEAD_DIM // SCALE_BLOCK
        HB: tl.constexpr = SCALE_BLOCK // 2
        offs_b = tl.arange(0, NB)[:, None]
        offs_j = tl.arange(0, HB)[None, :]
        elem = offs_b * SCALE_BLOCK + 2 * offs_j  # even elements; the odd one follows each
        if VALID_DIM < HEAD_DIM:  # (a padded tile: whole blocks past the head dim)
            blocks = offs_b < VALID_DIM // SCALE_BLOCK  # [NB, 1]
            x_e = tl.load(src_ptr + elem, mask=blocks, other=0.0).to(tl.float32)
            x_o = tl.load(src_ptr + elem + 1, mask=blocks, other=0.0).to(tl.float32)
        else:
            blocks = None
            x_e = tl.load(src_ptr + elem).to(tl.float32)
            x_o = tl.load(src_ptr + elem + 1).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(x_e), 1), tl.max(tl.abs(x_o), 1))  # [NB]
        has_nan = tl.max(((x_e != x_e) | (x_o != x_o)).to(tl.int32), 1) > 0
        if FMT == FMT_NVFP4:
            sc = tl.minimum(tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32)), 448.0)
            stored_scale = to_fp8_bits(tl.where(has_nan, float("nan"), sc), tl.float8e4nv, SOFT_FP8)
            scale = stored_scale.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            exponent_field = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF  # floor(log2(amax)) + 127
            s = tl.minimum(tl.maximum(exponent_field - 2, 0), 254)
            s = tl.where(exponent_field == 255, 254, s)  # Inf: log2 is inf, clamped to 254
            s = tl.where(has_nan, 0, s)
            scale = e8m0_to_f32(s)
            stored_scale = s.to(tl.uint8)
        if VALID_DIM < HEAD_DIM:
            tl.store(bscale_ptr + bscale_off + tl.arange(0, NB), stored_scale,
                     mask=tl.arange(0, NB) < VALID_DIM // SCALE_BLOCK)
        else:
            tl.store(bscale_ptr + bscale_off + tl.arange(0, NB), stored_scale)
        # encoded where the scale is > 0, as formats.py does: not under nvfp4's NaN scale (tested on has_nan, since
        # the interpreter does not decode e4m3's NaN byte as NaN); mxfp4's scale is never NaN
        pos = scale[:, None] > 0.0
        if FMT == FMT_NVFP4:
            pos = pos & (has_nan[:, None] == 0)
        safe = tl.where(pos, scale[:, None], 1.0)
        c_e = tl.where(pos, _e2m1_encode(tl.math.div_rn(tl.abs(x_e), safe + tl.zeros_like(x_e))), 0)
        c_o = tl.where(pos, _e2m1_encode(tl.math.div_rn(tl.abs(x_o), safe + tl.zeros_like(x_o))), 0)
        c_e = c_e | tl.where((x_e < 0) & (c_e > 0), 8, 0)  # no negative zero
        c_o = c_o | tl.where((x_o < 0) & (c_o > 0), 8, 0)
        packed = (c_e | (c_o << 4)).to(tl.uint8)
        tl.store(cache_ptr + cache_off + offs_b * HB + offs_j, packed, mask=blocks)
    else:
        offs_d = tl.arange(0, HEAD_DIM)
        if VALID_DIM < HEAD_DIM:  # (a padded tile)
            cols = offs_d < VALID_DIM
            x = tl.load(src_ptr + offs_d, mask=cols, other=0.0)
        else:
            cols = None
            x = tl.load(src_ptr + offs_d)
        if FMT == FMT_FP8:
            y = tl.math.div_rn(x.to(tl.float32), tl.load(scale_ptr) + tl.zeros([HEAD_DIM], tl.float32))
            y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX))  # saturate; NaN stays NaN
            # stored through a uint8 view of the cache
            tl.store(cache_ptr + cache_off + offs_d, to_fp8_bits(y, FP8_DTYPE, SOFT_FP8), mask=cols)
        else:
            tl.store(cache_ptr + cache_off + offs_d, x.to(cache_ptr.dtype.element_ty), mask=cols)


@triton.jit(do_not_specialize=["num_slots"])
def reshape_and_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr, kb_ptr, vb_ptr, err_ptr,
    num_slots, stride_kt, stride_kh, stride_vt, stride_vh, stride_cp, stride_ct, stride_ch,
    stride_kbp, stride_kbt, stride_kbh, stride_vbp, stride_vbt, stride_vbh, stride_ksh, stride_vsh,
    PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, FMT: tl.constexpr, SCALE_BLOCK: tl.constexpr,
    FP8_DTYPE: tl.constexpr, FP8_MAX: tl.constexpr, SOFT_FP8: tl.constexpr, VALID_DIM: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t)
    if (slot < 0) | (slot >= num_slots):
        # -1: padding; anything else outside the cache: a bad index, dropped whole (no K without its V)
        if (slot != -1) & (h == 0):
            tl.atomic_min(err_ptr + ERR_SLOT_MAPPING, t)
        return
    page = slot // PAGE  # int64 slot: page x page stride stays in int64
    off = slot % PAGE
    cache_off = page * stride_cp + off * stride_ct + h * stride_ch
    k_bs_off = page * stride_kbp + off * stride_kbt + h * stride_kbh
    v_bs_off = page * stride_vbp + off * stride_vbt + h * stride_vbh
    t64 = t.to(tl.int64)
    _write_row(key_ptr + t64 * stride_kt + h * stride_kh, k_cache_ptr, k_scale_ptr + h * stride_ksh, kb_ptr,
               cache_off, k_bs_off, FMT, HEAD_DIM, SCALE_BLOCK, FP8_DTYPE, FP8_MAX, SOFT_FP8, VALID_DIM)
    _write_row(value_ptr + t64 * stride_vt + h * stride_vh, v_cache_ptr, v_scale_ptr + h * stride_vsh, vb_ptr,
               cache_off, v_bs_off, FMT, HEAD_DIM, SCALE_BLOCK, FP8_DTYPE, FP8_MAX, SOFT_FP8, VALID_DIM)


def reshape_and_cache(call) -> None:
    """Writes call.key/call.value [T, Hkv, D] to their slots in the caches (a validated CacheWriteCall)."""
    key, value, slot_mapping = call.key, call.value, call.slot_mapping
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    kv_format, f = call.kv_format, call.format
    page_size = call.case.page_size
    if slot_mapping.stride(0) != 1:
        slot_mapping = slot_mapping.contiguous()
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    k_cache, v_cache = call.k_cache, call.v_cache
    fp8_dtype, fp8_max = tl.float8e4nv, 0.0
    if formats.is_fp8(kv_format):  # fp8 values written as their bytes
        fp8_dtype = tl.float8e4nv if kv_format == "fp8_e4m3" else tl.float8e5
        fp8_max = formats.fp8_max(kv_format)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    # the scales by the format's kind; placeholders the kernel never reads where a kind has none
    scale_block, ks_h, vs_h, kb_strides, vb_strides = 16, 0, 0, (0, 0, 0), (0, 0, 0)
    if f.scale == formats.TENSOR_SCALE:  # read-only; per tensor: every head reads element 0
        k_scale, v_scale, kb, vb = call.k_scale, call.v_scale, k_cache, v_cache
        ks_h = 0 if k_scale.numel() == 1 else k_scale.stride(0)
        vs_h = 0 if v_scale.numel() == 1 else v_scale.stride(0)
    elif f.scale == formats.BLOCK_SCALE:  # computed here and written, paged like the cache (e4m3 ones as bytes)
        scale_block = f.block
        kb_strides, vb_strides = call.k_block_scale.stride()[:3], call.v_block_scale.stride()[:3]
        k_scale, v_scale = k_cache, v_cache
        kb, vb = call.k_block_scale.view(torch.uint8), call.v_block_scale.view(torch.uint8)
    elif f.scale == formats.NO_SCALE:
        k_scale, v_scale, kb, vb = k_cache, v_cache, k_cache, v_cache
    else:
        raise ValueError(f"attnops Triton cache write: kv_format {kv_format} has scales of kind {f.scale!r}, which "
                         f"the kernel cannot write (known: {formats.SCALES})")
    reshape_and_cache_kernel[(num_tokens, num_kv_heads)](
        key_ptr=key, value_ptr=value, k_cache_ptr=k_cache, v_cache_ptr=v_cache, slot_ptr=slot_mapping,
        k_scale_ptr=k_scale, v_scale_ptr=v_scale, kb_ptr=kb, vb_ptr=vb, err_ptr=errors.buffer(key.device),
        num_slots=k_cache.shape[0] * page_size, stride_kt=key.stride(0), stride_kh=key.stride(1),
        stride_vt=value.stride(0), stride_vh=value.stride(1),
        stride_cp=k_cache.stride(0), stride_ct=k_cache.stride(1), stride_ch=k_cache.stride(2),
        stride_kbp=kb_strides[0], stride_kbt=kb_strides[1], stride_kbh=kb_strides[2],
        stride_vbp=vb_strides[0], stride_vbt=vb_strides[1], stride_vbh=vb_strides[2],
        stride_ksh=ks_h, stride_vsh=vs_h,
        PAGE=page_size, HEAD_DIM=head_tile(head_dim), FMT=FMT_CODE[kv_format], SCALE_BLOCK=scale_block,
        FP8_DTYPE=fp8_dtype, FP8_MAX=fp8_max, SOFT_FP8=not key.is_cuda, VALID_DIM=head_dim,
        num_warps=1 if head_dim <= 64 else 2)
