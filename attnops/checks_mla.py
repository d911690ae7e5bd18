"""Argument validation of the latent-attention (MLA) ops, as attnops/checks.py does for paged_attention: every bad
input is a TypeError or ValueError naming the argument, before any kernel runs; `check_*` read shapes, dtypes,
strides and devices only (the fakes run them too) and return the dispatch case; the data checks run only under
ATTNOPS_CHECK=1 and are paged_attention's own (the block table, lengths and query rows follow the same rules)."""
from __future__ import annotations

import math

import torch

from . import formats
from .cases import MLACall, MLACase, MLAWriteCall, MLAWriteCase, query_rows, shape_class
from .checks import (MAX_PAGE_SIZE, Q_DTYPES, _address, _check_tensor, _describe, _fail, check_batch,
                     check_fp8_scale_values, check_paged_attention_values, check_sinks_and_tree,
                     check_slot_mapping_values, is_page_size)
from .env import device_arch

MAX_LATENT_DIM, MAX_ROPE_DIM, MAX_HEADS = 512, 64, 128
KV_FORMATS = ("auto", "fp8_e4m3", formats.LATENT_FP8_FORMAT)


def _tensor(op, name, t, dtypes=None, dim=None):
    """A tensor, of one of `dtypes` and of `dim` dimensions where given."""
    _check_tensor(op, name, t)
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        _fail(op, TypeError, f"{name} must be {names} (got {t.dtype})")
    if dim is not None and t.dim() != dim:
        _fail(op, ValueError, f"{name} must have {dim} dimensions (got {_describe(t)})")


def _check_latent_cache(op, kv_cache, kv_format, kv_scale, latent_dim, rope_dim, value_dtype):
    """The cache holds rows of latent_dim + rope_dim values in kv_format (for "fp8_ds_mla", their bytes); returns
    the resolved format."""
    _tensor(op, "kv_cache", kv_cache, dim=3)
    if kv_format not in KV_FORMATS:
        _fail(op, ValueError, f"kv_format must be one of {KV_FORMATS} (got {kv_format!r})")
    if kv_format == formats.LATENT_FP8_FORMAT:  # DeepSeek's fp8 layout: a row of bytes (attnops.formats)
        if latent_dim % formats.LATENT_FP8_TILE:
            _fail(op, ValueError, f"kv_format {kv_format!r} takes R a multiple of {formats.LATENT_FP8_TILE} (one "
                                  f"scale a {formats.LATENT_FP8_TILE} values; got R = {latent_dim})")
        if kv_cache.dtype != torch.uint8:
            _fail(op, TypeError, f"kv_cache of kv_format {kv_format!r} must be uint8 (got {kv_cache.dtype})")
        row_bytes = formats.latent_fp8_row_bytes(latent_dim, rope_dim)
        if kv_cache.shape[2] != row_bytes:
            _fail(op, ValueError, f"kv_cache of kv_format {kv_format!r} must be [num_pages, page_size, R + 4 R/128 + "
                                  f"2 P] = [.., .., {row_bytes}] bytes (got {_describe(kv_cache)})")
        if _address(kv_cache) % 4 or kv_cache.stride(0) % 4 or kv_cache.stride(1) % 4:
            _fail(op, ValueError, f"kv_cache of kv_format {kv_format!r} must start every row on a 4-byte boundary "
                                  f"(its float32 scales; address and strides {kv_cache.stride()})")
    elif kv_cache.dtype == torch.uint8:
        _fail(op, TypeError, f"a uint8 kv_cache holds DeepSeek's fp8 layout: kv_format={formats.LATENT_FP8_FORMAT!r} "
                             f"(got {kv_format!r})")
    elif kv_cache.shape[2] != latent_dim + rope_dim:
        _fail(op, ValueError, f"kv_cache must be [num_pages, page_size, R + P] = [.., .., {latent_dim + rope_dim}] "
                              f"(got {_describe(kv_cache)})")
    if kv_cache.stride(-1) != 1:
        _fail(op, ValueError, f"kv_cache must be contiguous in its last dimension (strides {kv_cache.stride()})")
    page_size = kv_cache.shape[1]
    if not is_page_size(page_size):
        _fail(op, ValueError, f"page_size (kv_cache.shape[1]) must be a power of two from 1 to {MAX_PAGE_SIZE} "
                              f"(got {page_size})")
    if kv_format == formats.LATENT_FP8_FORMAT:
        if kv_scale is not None:
            _fail(op, ValueError, f"kv_scale is only for kv_format 'fp8_e4m3' ({kv_format!r} keeps its scales in "
                                  f"its rows)")
        return kv_format
    if kv_format == "fp8_e4m3":
        if kv_cache.dtype != torch.float8_e4m3fn:
            _fail(op, TypeError, f"kv_cache of kv_format 'fp8_e4m3' must be float8_e4m3fn (got {kv_cache.dtype})")
        if kv_scale is None:
            _fail(op, ValueError, "kv_format 'fp8_e4m3' needs kv_scale (float32, one element: stored = value / "
                                  "kv_scale)")
        _tensor(op, "kv_scale", kv_scale, (torch.float32,))
        if kv_scale.numel() != 1 or kv_scale.dim() > 1:
            _fail(op, ValueError, f"kv_scale must be 0-d or [1] (got {list(kv_scale.shape)})")
        return "fp8_e4m3"
    if kv_cache.dtype != value_dtype:
        _fail(op, TypeError, f"kv_cache must have the dtype of the values it takes ({value_dtype}) for kv_format "
                             f"'auto' (got {kv_cache.dtype}); a float8_e4m3fn cache is kv_format='fp8_e4m3', a "
                             f"uint8 one kv_format={formats.LATENT_FP8_FORMAT!r}")
    if kv_scale is not None:
        _fail(op, ValueError, "kv_scale is only for kv_format 'fp8_e4m3'")
    return formats.resolve_kv_format("auto", kv_cache.dtype)


def _check_dims(op, latent_dim, rope_dim, what):
    if not (latent_dim % 64 == 0 and 64 <= latent_dim <= MAX_LATENT_DIM):
        _fail(op, ValueError, f"R ({what}) must be a multiple of 64 from 64 to {MAX_LATENT_DIM} (got {latent_dim})")
    if not (rope_dim % 16 == 0 and 16 <= rope_dim <= MAX_ROPE_DIM):
        _fail(op, ValueError, f"P ({what}) must be a multiple of 16 from 16 to {MAX_ROPE_DIM} (got {rope_dim})")


def _check_topk_indices(op, topk_indices, num_tokens) -> int:
    """The sparse form's key lists: int32 [T, K], K >= 1, unit stride along K; returns K (0 without them)."""
    if topk_indices is None:
        return 0
    _tensor(op, "topk_indices", topk_indices, (torch.int32,), 2)
    if topk_indices.shape[0] != num_tokens or topk_indices.shape[1] < 1:
        _fail(op, ValueError, f"topk_indices must be [num_query_rows, K] = [{num_tokens}, K >= 1] (got "
                              f"{_describe(topk_indices)})")
    if topk_indices.stride(1) != 1 and topk_indices.shape[1] > 1 and topk_indices.numel():  # (a stride unused)
        _fail(op, ValueError, f"topk_indices must be contiguous in its last dimension (strides "
                              f"{topk_indices.stride()})")
    return topk_indices.shape[1]


def check_mla_attention(q_nope, q_pe, kv_cache, block_table, seq_lens, cu_seqlens_q, scale, kv_format, kv_scale,
                        sinks=None, tree_mask=None, out=None, lse=None, topk_indices=None) -> MLACase:
    op = "mla_attention" if lse is None else "mla_attention_with_lse"
    _tensor(op, "q_nope", q_nope, Q_DTYPES, 3)
    _tensor(op, "q_pe", q_pe, Q_DTYPES, 3)
    num_tokens, num_heads, latent_dim = q_nope.shape
    rope_dim = q_pe.shape[2]
    if q_pe.dtype != q_nope.dtype or q_pe.shape[:2] != q_nope.shape[:2]:
        _fail(op, ValueError, f"q_pe must be [T, H, P] of q_nope's dtype and [T, H] = {list(q_nope.shape[:2])} (got "
                              f"{_describe(q_pe)})")
    for name, t in (("q_nope", q_nope), ("q_pe", q_pe)):
        if t.stride(-1) != 1:
            _fail(op, ValueError, f"{name} must be contiguous in its last dimension (strides {t.stride()})")
    if not 1 <= num_heads <= MAX_HEADS:
        _fail(op, ValueError, f"num_heads (q_nope.shape[1]) must be from 1 to {MAX_HEADS} (got {num_heads})")
    _check_dims(op, latent_dim, rope_dim, "q_nope.shape[2]; P: q_pe.shape[2]")
    fmt = _check_latent_cache(op, kv_cache, kv_format, kv_scale, latent_dim, rope_dim, q_nope.dtype)
    batch = check_batch(op, "q_nope", num_tokens, block_table, seq_lens, cu_seqlens_q)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (math.isfinite(scale) and scale > 0):
        _fail(op, ValueError, f"scale must be a finite float > 0, the model's softmax scale (got {scale!r})")
    check_sinks_and_tree(op, "num_heads", num_heads, num_tokens, cu_seqlens_q, sinks, tree_mask)
    topk = _check_topk_indices(op, topk_indices, num_tokens)
    if out is not None:
        _tensor(op, "out", out)
        if tuple(out.shape) != (num_tokens, num_heads, latent_dim) or out.dtype != q_nope.dtype:
            _fail(op, ValueError, f"out must be {str(q_nope.dtype).replace('torch.', '')} "
                                  f"[{num_tokens}, {num_heads}, {latent_dim}] like q_nope (got {_describe(out)})")
    if lse is not None:
        _tensor(op, "lse", lse, (torch.float32,))
        if tuple(lse.shape) != (num_tokens, num_heads):
            _fail(op, ValueError, f"lse must be [num_query_rows, num_heads] = [{num_tokens}, {num_heads}] (got "
                                  f"{list(lse.shape)})")
    for name, t in (("q_pe", q_pe), ("kv_cache", kv_cache), ("block_table", block_table), ("seq_lens", seq_lens),
                    ("cu_seqlens_q", cu_seqlens_q), ("kv_scale", kv_scale), ("sinks", sinks),
                    ("tree_mask", tree_mask), ("topk_indices", topk_indices), ("out", out), ("lse", lse)):
        if t is not None and t.device != q_nope.device:
            _fail(op, ValueError, f"{name} must be on the same device as q_nope ({q_nope.device}), got {t.device}")
    return MLACase(device_type=q_nope.device.type, arch=device_arch(q_nope.device), q_dtype=q_nope.dtype,
                   kv_format=fmt, latent_dim=latent_dim, rope_dim=rope_dim, num_heads=num_heads,
                   page_size=kv_cache.shape[1], decode=cu_seqlens_q is None,
                   shape_class=shape_class(cu_seqlens_q is None, num_tokens, batch), batch=batch,
                   max_kv_len=block_table.shape[1] * kv_cache.shape[1], sinks=sinks is not None,
                   tree_mask=tree_mask is not None, aligned_kv=rows_16_byte_aligned(kv_cache), topk=topk)


def rows_16_byte_aligned(t: torch.Tensor) -> bool:
    """Whether every row (last dimension, unit stride) of a 3-D tensor starts on a 16-byte boundary, so that a
    kernel copies rows by 16-byte words: the base address and both outer strides. A latent cache's answer is
    MLACase.aligned_kv."""
    size = t.element_size()
    return _address(t) % 16 == 0 and t.stride(0) * size % 16 == 0 and t.stride(1) * size % 16 == 0


def check_mla_attention_values(q_nope, kv_cache, block_table, seq_lens, cu_seqlens_q, kv_scale, tree_mask,
                               topk_indices=None) -> None:
    """The data checks (ATTNOPS_CHECK=1 only): paged_attention's, under this op's name; then each row's listed
    positions inside its sequence (-1: none)."""
    check_paged_attention_values(q_nope, kv_cache, block_table, seq_lens, cu_seqlens_q, kv_scale, None, tree_mask,
                                 op="mla_attention", scale_names=("kv_scale", "kv_scale"))
    if topk_indices is None or topk_indices.numel() == 0:
        return
    row_len = seq_lens.long()[query_rows(seq_lens, cu_seqlens_q, q_nope.shape[0])[0]]
    bad = (topk_indices < -1) | (topk_indices.long() >= row_len[:, None])
    if bool(bad.any()):
        t, e = (int(i) for i in bad.nonzero()[0])
        _fail("mla_attention", ValueError,
              f"topk_indices[{t}, {e}] = {int(topk_indices[t, e])} is outside its sequence (positions 0 to "
              f"{int(row_len[t]) - 1}, or -1 for no key)")


def check_mla_cache_write(kv_c, k_pe, kv_cache, slot_mapping, kv_format, kv_scale) -> MLAWriteCase:
    op = "mla_cache_write"
    _tensor(op, "kv_c", kv_c, Q_DTYPES, 2)
    _tensor(op, "k_pe", k_pe, Q_DTYPES, 2)
    if k_pe.dtype != kv_c.dtype or k_pe.shape[0] != kv_c.shape[0]:
        _fail(op, ValueError, f"k_pe must be [N, P] of kv_c's dtype with N = {kv_c.shape[0]} (got {_describe(k_pe)})")
    latent_dim, rope_dim = kv_c.shape[1], k_pe.shape[1]
    _check_dims(op, latent_dim, rope_dim, "kv_c.shape[1]; P: k_pe.shape[1]")
    fmt = _check_latent_cache(op, kv_cache, kv_format, kv_scale, latent_dim, rope_dim, kv_c.dtype)
    _tensor(op, "slot_mapping", slot_mapping, (torch.int64,), 1)
    if slot_mapping.shape[0] != kv_c.shape[0]:
        _fail(op, ValueError, f"slot_mapping must be [N] = [{kv_c.shape[0]}] (got {_describe(slot_mapping)})")
    for name, t in (("k_pe", k_pe), ("kv_cache", kv_cache), ("slot_mapping", slot_mapping), ("kv_scale", kv_scale)):
        if t is not None and t.device != kv_c.device:
            _fail(op, ValueError, f"{name} must be on the same device as kv_c ({kv_c.device}), got {t.device}")
    return MLAWriteCase(device_type=kv_c.device.type, arch=device_arch(kv_c.device), src_dtype=kv_c.dtype,
                        kv_format=fmt, latent_dim=latent_dim, rope_dim=rope_dim, page_size=kv_cache.shape[1])


def check_mla_cache_write_values(kv_cache, slot_mapping, kv_scale) -> None:
    check_fp8_scale_values("mla_cache_write", kv_scale, None, ("kv_scale", "kv_scale"))
    check_slot_mapping_values(kv_cache, slot_mapping, op="mla_cache_write")


def mla_call(q_nope, q_pe, kv_cache, block_table, seq_lens, cu_seqlens_q, scale, kv_format, kv_scale, sinks,
             tree_mask, out, lse=None, topk_indices=None) -> MLACall:
    """The validated call the chosen backend runs."""
    case = check_mla_attention(q_nope, q_pe, kv_cache, block_table, seq_lens, cu_seqlens_q, scale, kv_format,
                               kv_scale, sinks, tree_mask, out, lse, topk_indices)
    return MLACall(case, q_nope, q_pe, kv_cache, block_table, seq_lens, cu_seqlens_q, out, float(scale), kv_scale,
                   sinks, tree_mask, lse, topk_indices)


def mla_write_call(kv_c, k_pe, kv_cache, slot_mapping, kv_format, kv_scale) -> MLAWriteCall:
    case = check_mla_cache_write(kv_c, k_pe, kv_cache, slot_mapping, kv_format, kv_scale)
    return MLAWriteCall(case, kv_c, k_pe, kv_cache, slot_mapping, kv_scale)
