"""Runs the Triton attention kernel (and, where a sequence is split, the merge kernel) for one op call: strides,
scales, the workspace for split partials, and the step down to a smaller tile where a GPU cannot fit the chosen one.
"""
from __future__ import annotations

import warnings

import torch
import triton
from triton.runtime.errors import OutOfResources

from ... import errors, formats
from ..base import kernel_outputs, rows_without_a_sequence
from . import interpreting
from .heuristics import _capability, forced_tunables, heuristic_config, kernel_constexprs, smaller_tile
from .kernel import merge_splits_kernel, paged_attention_kernel


def _largest_offset(t: torch.Tensor) -> int:
    """The largest element offset from t's first element that indexing t reaches (0 for an empty t)."""
    if t.numel() == 0:
        return 0
    return sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


def launch(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, *, scale, soft_cap, window_left, kv_format,
           k_scale, v_scale, out, sinks=None, tree_mask=None, lse=None, config=None):
    """Runs paged attention (decode when cu_seqlens_q is None) into `out`, and each row's LSE into `lse` when
    given (float32 [T, Hq]). Inputs are validated by the op."""
    decode = cu_seqlens_q is None
    num_tokens, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    batch = seq_lens.shape[0]
    group = num_q_heads // num_kv_heads
    capacity = block_table.shape[1] * page_size
    if num_tokens == 0:
        return
    if batch == 0:
        rows_without_a_sequence(out, lse)
        return
    chosen = heuristic_config(q.device, decode, batch, num_tokens, num_q_heads, num_kv_heads, head_dim, page_size,
                              capacity, kv_format, q.dtype)
    cfg = dict(chosen, **forced_tunables())
    if config:
        cfg.update({k: v for k, v in config.items() if v is not None})
    if cfg["PDL"] and _capability(q.device) < 9:
        cfg["PDL"] = False  # a forced PDL: griddepcontrol (programmatic dependent launch) is sm_90+
    # the kernels index these with unit inner strides (always so from the usual callers; copies are tiny)
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    if seq_lens.stride(0) != 1:
        seq_lens = seq_lens.contiguous()
    if cu_seqlens_q is not None and cu_seqlens_q.stride(0) != 1:
        cu_seqlens_q = cu_seqlens_q.contiguous()
    if out.stride(-1) != 1 or (lse is not None and not lse.is_contiguous()):
        with kernel_outputs(out, lse) as (out_w, lse_w):
            launch(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale=scale, soft_cap=soft_cap,
                   window_left=window_left, kv_format=kv_format, k_scale=k_scale, v_scale=v_scale, out=out_w,
                   sinks=sinks, tree_mask=tree_mask, lse=lse_w, config=config)
        return
    block_q = cfg["BLOCK_Q"]
    max_splits, chunk = cfg["MAX_SPLITS"], cfg["CHUNK"]
    assert cfg["BLOCK_N"] >= 16 and chunk >= 1  # split lengths are rounded up to BLOCK_N multiples on the device
    # scales: per tensor -> stride 0 (every head reads element 0); per head -> stride 1; 4-bit: paged strides
    if formats.is_fp8(kv_format):
        ks_strides = (0, 0, 0 if k_scale.numel() == 1 else k_scale.stride(0))
        vs_strides = (0, 0, 0 if v_scale.numel() == 1 else v_scale.stride(0))
    elif formats.is_fp4(kv_format):
        ks_strides, vs_strides = k_scale.stride()[:3], v_scale.stride()[:3]
        k_scale, v_scale = k_scale.view(torch.uint8), v_scale.view(torch.uint8)
    else:
        k_scale = v_scale = k_cache  # unused placeholders (the kernel never reads them)
        ks_strides = vs_strides = (0, 0, 0)

    if formats.is_fp8(kv_format):  # read fp8 as bytes (masked lanes load 0) and reinterpret in registers
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        if (cfg["FP8_V_PAIRS"] or cfg["FP8_K_PAIRS"]) and not all(
                c.data_ptr() % 2 == 0 and all(st % 2 == 0 for st in c.stride()[:3]) for c in (k_cache, v_cache)):
            # FP8_V_PAIRS/FP8_K_PAIRS read 16-bit words: an odd address (a view at an odd offset) reads bytes
            cfg = dict(cfg, FP8_V_PAIRS=False, FP8_K_PAIRS=False)

    if sinks is not None and sinks.stride(0) != 1:
        sinks = sinks.contiguous()
    # placeholders where absent (the kernel never reads or writes them); the mask as bytes
    sinks_arg = out if sinks is None else sinks
    lse_arg = out if lse is None else lse
    tm_arg, tm_stride, tm_cols = (out, 0, 0) if tree_mask is None else (
        tree_mask.view(torch.uint8), tree_mask.stride(0), tree_mask.shape[1])
    cu = seq_lens if decode else cu_seqlens_q
    num_q_blocks = batch if decode else num_tokens // block_q + batch
    shape = dict(q_dtype=q.dtype, kv_format=kv_format, decode=decode, num_q_heads=num_q_heads, head_dim=head_dim,
                 group=group, page_size=page_size, window=window_left >= 0, soft_cap=soft_cap > 0,
                 on_gpu=q.is_cuda and not interpreting(), sinks=sinks is not None, tree=tree_mask is not None,
                 lse=lse is not None, offsets_fit_32=bool(cfg["OFFSETS_32"]) and all(
                     _largest_offset(t) < 2 ** 31 for t in (k_cache, v_cache, k_scale, v_scale)))
    constexprs, options = kernel_constexprs(cfg, **shape)
    if max_splits > 1:
        # one allocation for both (host time per call matters for short decode steps): partial outputs
        # [T, Hq, MAX_SPLITS, D] and their LSEs [T, Hq, MAX_SPLITS]
        rows = num_tokens * num_q_heads * max_splits
        workspace = torch.empty(rows * (head_dim + 1), dtype=torch.float32, device=q.device)
        part_out, part_lse = workspace[: rows * head_dim], workspace[rows * head_dim:]
    else:
        part_out = part_lse = out  # unused: every program writes `out` directly
    error_buffer = errors.buffer(q.device)
    num_pages = k_cache.shape[0]
    heads_inner = constexprs["HEADS_INNER"]
    grid = (num_q_blocks * num_kv_heads, 1, max_splits) if heads_inner else (num_q_blocks, num_kv_heads, max_splits)
    first_tile, error = (cfg["BLOCK_N"], cfg["num_stages"]), None
    while True:
        try:
            paged_attention_kernel[grid](
                q, k_cache, v_cache, k_scale, v_scale, block_table, seq_lens, cu, out, lse_arg, part_out, part_lse,
                error_buffer,
                sinks_arg, tm_arg, batch, float(scale), float(soft_cap), int(window_left), max_splits, chunk,
                num_tokens, num_pages, capacity,
                q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                *ks_strides, *vs_strides,
                block_table.stride(0), out.stride(0), out.stride(1), tm_stride, tm_cols, **constexprs, **options)
            break
        except OutOfResources as e:
            # Raised when the compiled kernel is loaded, before anything runs: the tile needs more shared
            # memory (or registers) than this GPU has, as on GPUs the heuristic was not measured on. Step down
            # and remember the step in the heuristic's cached choice, so later calls of the shape start there.
            error, cfg = e, smaller_tile(cfg)
            if cfg is None:
                raise
            if not config:
                chosen.update(BLOCK_N=cfg["BLOCK_N"], num_stages=cfg["num_stages"])
            constexprs, options = kernel_constexprs(cfg, **shape)
    if error is not None:
        warnings.warn(f"attnops Triton attention: a tile of {first_tile[0]} keys in {first_tile[1]} stages does "
                      f"not fit this GPU ({error}); this shape now runs {cfg['BLOCK_N']} keys in "
                      f"{cfg['num_stages']} stages", RuntimeWarning)
    if max_splits > 1:
        merge_splits_kernel[(num_tokens, num_q_heads)](
            out, lse_arg, part_out, part_lse, seq_lens, cu, sinks_arg, batch, int(window_left), max_splits, chunk,
            capacity,
            out.stride(0), out.stride(1),
            NUM_Q_HEADS=num_q_heads, HEAD_DIM=head_dim, BLOCK_Q=block_q, BLOCK_N=cfg["BLOCK_N"],
            SPLITS_P2=max(2, triton.next_power_of_2(max_splits)), IS_DECODE=decode,
            HAS_WINDOW=window_left >= 0, HAS_TREE=tree_mask is not None, HAS_SINKS=sinks is not None,
            PDL=constexprs["PDL"], BOUNDS=constexprs["BOUNDS"], WRITE_LSE=constexprs["WRITE_LSE"],
            # the attention kernel's alignment of a window's first tile (kernel.py), whose split plan this repeats
            ALIGN=min(page_size, cfg["BLOCK_N"]) if constexprs["BOUNDS"] and window_left >= 0 else cfg["BLOCK_N"],
            launch_pdl=constexprs["PDL"],
            num_warps=4 if head_dim >= 128 else 2)
