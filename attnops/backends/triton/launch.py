"""Runs the Triton attention kernel (and, where a sequence is split, the merge kernel) for one op call: strides,
scales, the workspace for split partials, and the step down to a smaller tile where a GPU cannot fit the chosen one.
"""
from __future__ import annotations

import warnings

import torch
import triton
from triton.runtime.errors import OutOfResources

from ... import errors, formats
from ...cases import AttentionCall
from ..base import kernel_outputs, rows_without_a_sequence
from . import head_tile, interpreting
from .heuristics import (_capability, _num_sms, fill_waves, forced_tunables, heuristic_config, kernel_constexprs,
                         smaller_tile, wave_plan)
from .kernel import merge_splits_kernel, paged_attention_kernel


def _largest_offset(t: torch.Tensor) -> int:
    """The largest element offset from t's first element that indexing t reaches (0 for an empty t)."""
    if t.numel() == 0:
        return 0
    return sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


def launch(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, *, scale, soft_cap, window_left, kv_format,
           k_scale, v_scale, out, sinks=None, tree_mask=None, lse=None, config=None):
    """Runs paged attention (decode when cu_seqlens_q is None) into `out`, and each row's LSE into `lse` when
    given (float32 [T, Hq]), from loose arguments (tests and benchmarks; the backend runs an AttentionCall with
    launch_call). Inputs are valid (the op validates; here nothing is checked), `kv_format` resolved."""
    launch_call(AttentionCall.of(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale=scale,
                                 soft_cap=soft_cap, window_left=window_left, kv_format=kv_format, k_scale=k_scale,
                                 v_scale=v_scale, out=out, sinks=sinks, tree_mask=tree_mask, lse=lse), config)


def _scale_arguments(call: AttentionCall) -> tuple:
    """(k scales, v scales, their page/token/head strides each) as the kernel indexes them, by the format's scale:
    a tensor scale per tensor has stride 0 (every head reads element 0) and per head stride 1; block scales are
    paged like the cache (e4m3 ones read as bytes); a format without scales passes placeholders the kernel never
    reads."""
    scale = call.format.scale
    k_scale, v_scale = call.k_scale, call.v_scale
    if scale == formats.TENSOR_SCALE:
        return (k_scale, v_scale, (0, 0, 0 if k_scale.numel() == 1 else k_scale.stride(0)),
                (0, 0, 0 if v_scale.numel() == 1 else v_scale.stride(0)))
    if scale == formats.BLOCK_SCALE:
        return k_scale.view(torch.uint8), v_scale.view(torch.uint8), k_scale.stride()[:3], v_scale.stride()[:3]
    if scale == formats.NO_SCALE:
        return call.k_cache, call.k_cache, (0, 0, 0), (0, 0, 0)
    raise ValueError(f"attnops Triton attention: kv_format {call.kv_format} has scales of kind {scale!r}, which "
                     f"the kernel cannot index (known: {formats.SCALES})")


def launch_call(call: AttentionCall, config: dict | None = None) -> None:
    """Runs the attention kernel (and the merge kernel where a sequence is split) for one validated call. `config`
    overrides tunables of the heuristic's choice (tests, benchmarks/triton_tuning.py)."""
    case = call.case
    num_tokens, batch = call.num_tokens, case.batch
    if num_tokens == 0:
        return
    if batch == 0:
        rows_without_a_sequence(call.out, call.lse)
        return
    q = call.q
    on_gpu = q.is_cuda and not interpreting()
    chosen, cfg = _tunables(case, num_tokens, q.device, config)
    cfg = wave_plan(fill_waves(cfg, case, num_tokens, q.device), case, num_tokens, on_gpu)
    if call.out.stride(-1) != 1 or (call.lse is not None and not call.lse.is_contiguous()):
        with kernel_outputs(call.out, call.lse) as (out_w, lse_w):
            launch_call(call._replace(out=out_w, lse=lse_w), config)
        return
    out, lse, sinks, tree_mask = call.out, call.lse, call.sinks, call.tree_mask
    # the kernels index these with unit inner strides (always so from the usual callers; copies are tiny)
    block_table = call.block_table if call.block_table.stride(1) == 1 else call.block_table.contiguous()
    seq_lens = call.seq_lens if call.seq_lens.stride(0) == 1 else call.seq_lens.contiguous()
    cu_seqlens_q = call.cu_seqlens_q
    if cu_seqlens_q is not None and cu_seqlens_q.stride(0) != 1:
        cu_seqlens_q = cu_seqlens_q.contiguous()
    block_q = cfg["BLOCK_Q"]
    max_splits, chunk = cfg["MAX_SPLITS"], cfg["CHUNK"]
    assert cfg["BLOCK_N"] >= 16 and chunk >= 1  # split lengths are rounded up to BLOCK_N multiples on the device
    k_cache, v_cache, k_scale, v_scale, ks_strides, vs_strides, cfg = _cache_arguments(call, cfg)
    if sinks is not None and sinks.stride(0) != 1:
        sinks = sinks.contiguous()
    # placeholders where absent (the kernel never reads or writes them); the mask as bytes
    sinks_arg = out if sinks is None else sinks
    lse_arg = out if lse is None else lse
    tm_arg, tm_stride, tm_cols = (out, 0, 0) if tree_mask is None else (
        tree_mask.view(torch.uint8), tree_mask.stride(0), tree_mask.shape[1])
    decode = case.decode
    cu = seq_lens if decode else cu_seqlens_q
    num_q_blocks = batch if decode else num_tokens // block_q + batch
    offsets_fit_32 = bool(cfg["OFFSETS_32"]) and all(
        _largest_offset(t) < 2 ** 31 for t in (k_cache, v_cache, k_scale, v_scale))
    num_q_heads, head_dim = case.num_q_heads, case.head_dim
    tile = head_tile(head_dim)  # (the kernels' padded width: the workspace's rows and the merge's)
    part_out, part_lse = _split_workspace(out, num_tokens, num_q_heads, tile, max_splits, q.device)
    window_left, capacity = int(call.window_left), call.capacity
    # WAVE_PLAN: the sequences' splits one wave holds (WAVE_PLAN programs an SM, over the KV heads)
    wave_splits = max(1, cfg["WAVE_PLAN"] * _num_sms(q.device) // case.num_kv_heads) if cfg.get("WAVE_PLAN") else 0
    # the runtime arguments, by the kernel's names (the constexprs come from kernel_constexprs)
    arguments = dict(
        q_ptr=q, k_ptr=k_cache, v_ptr=v_cache, ks_ptr=k_scale, vs_ptr=v_scale, bt_ptr=block_table,
        seq_lens_ptr=seq_lens, cu_ptr=cu, out_ptr=out, lse_ptr=lse_arg, part_out_ptr=part_out,
        part_lse_ptr=part_lse, err_ptr=errors.buffer(q.device), sinks_ptr=sinks_arg, tm_ptr=tm_arg, num_seqs=batch,
        sm_scale=float(call.scale), soft_cap=float(call.soft_cap), window_left=window_left, MAX_SPLITS=max_splits,
        CHUNK=chunk, wave_splits=wave_splits, num_tokens=num_tokens, num_pages=call.num_pages, capacity=capacity,
        stride_qt=q.stride(0), stride_qh=q.stride(1),
        stride_kp=k_cache.stride(0), stride_kt=k_cache.stride(1), stride_kh=k_cache.stride(2),
        stride_ksp=ks_strides[0], stride_kst=ks_strides[1], stride_ksh=ks_strides[2],
        stride_vsp=vs_strides[0], stride_vst=vs_strides[1], stride_vsh=vs_strides[2],
        stride_table=block_table.stride(0), stride_ot=out.stride(0), stride_oh=out.stride(1), stride_tm=tm_stride,
        tm_cols=tm_cols)
    kernel_options = dict(on_gpu=on_gpu, lse=lse is not None, offsets_fit_32=offsets_fit_32)
    cfg, constexprs = _run_attention(arguments, num_q_blocks, case, cfg, chosen, config, kernel_options)
    if max_splits > 1:
        merge_splits_kernel[(num_tokens, num_q_heads)](
            out_ptr=out, lse_ptr=lse_arg, part_out_ptr=part_out, part_lse_ptr=part_lse, seq_lens_ptr=seq_lens,
            cu_ptr=cu, sinks_ptr=sinks_arg, num_seqs=batch, window_left=window_left, MAX_SPLITS=max_splits,
            CHUNK=chunk, wave_splits=wave_splits, capacity=capacity, stride_ot=out.stride(0), stride_oh=out.stride(1),
            NUM_Q_HEADS=num_q_heads, HEAD_DIM=tile, VALID_DIM=head_dim, BLOCK_Q=block_q,
            BLOCK_N=cfg["BLOCK_N"],
            SPLITS_P2=max(2, triton.next_power_of_2(max_splits)), IS_DECODE=decode,
            HAS_WINDOW=case.sliding_window, HAS_TREE=case.tree_mask, HAS_SINKS=case.sinks,
            PDL=constexprs["PDL"], BOUNDS=constexprs["BOUNDS"], WRITE_LSE=constexprs["WRITE_LSE"],
            WAVE_PLAN=constexprs["WAVE_PLAN"],
            # the attention kernel's alignment of a window's first tile (kernel.py), whose split plan this repeats
            ALIGN=min(case.page_size, cfg["BLOCK_N"]) if constexprs["BOUNDS"] and case.sliding_window
            else cfg["BLOCK_N"],
            launch_pdl=constexprs["PDL"],
            num_warps=4 if tile >= 128 else 2)


def _tunables(case, num_tokens: int, device: torch.device, config: dict | None) -> tuple[dict, dict]:
    """(the heuristic's choice for the case, as cached: a step down to a smaller tile is recorded in it; the tunables
    to launch: that choice with forced_tunables() and `config` over it, PDL off below sm_90, and FILL_WAVES off where
    CHUNK or MAX_SPLITS is forced but FILL_WAVES is not)."""
    chosen = heuristic_config(case, num_tokens, device)
    overrides = dict(forced_tunables(), **{k: v for k, v in (config or {}).items() if v is not None})
    cfg = dict(chosen, **overrides)
    if ("CHUNK" in overrides or "MAX_SPLITS" in overrides) and "FILL_WAVES" not in overrides:
        cfg["FILL_WAVES"] = 0  # a plan asked for runs as asked (FILL_WAVES reshapes the heuristic's own)
    if cfg["PDL"] and _capability(device) < 9:
        cfg["PDL"] = False  # a forced PDL: griddepcontrol (programmatic dependent launch) is sm_90+
    return chosen, cfg


def _cache_arguments(call: AttentionCall, cfg: dict) -> tuple:
    """(k cache, v cache, k scales, v scales, their strides, cfg) as the kernel reads them: fp8 caches as bytes, and
    cfg without FP8_V_PAIRS/FP8_K_PAIRS where a cache's address or strides are odd."""
    k_scale, v_scale, ks_strides, vs_strides = _scale_arguments(call)
    k_cache, v_cache = call.k_cache, call.v_cache
    if formats.is_fp8(call.kv_format):  # read fp8 as bytes (masked lanes load 0) and reinterpret in registers
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        if (cfg["FP8_V_PAIRS"] or cfg["FP8_K_PAIRS"]) and not all(
                c.data_ptr() % 2 == 0 and all(st % 2 == 0 for st in c.stride()[:3]) for c in (k_cache, v_cache)):
            # FP8_V_PAIRS/FP8_K_PAIRS read 16-bit words: an odd address (a view at an odd offset) reads bytes
            cfg = dict(cfg, FP8_V_PAIRS=False, FP8_K_PAIRS=False)
    return k_cache, v_cache, k_scale, v_scale, ks_strides, vs_strides, cfg


def _split_workspace(out: torch.Tensor, num_tokens: int, num_q_heads: int, head_dim: int, max_splits: int,
                     device: torch.device) -> tuple:
    """(partial outputs [T, Hq, MAX_SPLITS, D], their LSEs [T, Hq, MAX_SPLITS]) for a sequence's splits, in one
    allocation (host time per call matters for short decode steps); with one split, `out` as placeholders (unused:
    every program writes `out` directly)."""
    if max_splits > 1:
        rows = num_tokens * num_q_heads * max_splits
        workspace = torch.empty(rows * (head_dim + 1), dtype=torch.float32, device=device)
        return workspace[: rows * head_dim], workspace[rows * head_dim:]
    return out, out


def _run_attention(arguments: dict, num_q_blocks: int, case, cfg: dict, chosen: dict, config: dict | None,
                   kernel_options: dict) -> tuple[dict, dict]:
    """Launches the attention kernel, stepping down to a smaller tile (warning once) where the GPU cannot load the
    chosen one. Returns the tunables and constexprs it ran with."""
    constexprs, options = kernel_constexprs(cfg, case, **kernel_options)
    heads_inner = constexprs["HEADS_INNER"]
    num_kv_heads, max_splits = case.num_kv_heads, cfg["MAX_SPLITS"]
    grid = (num_q_blocks * num_kv_heads, 1, max_splits) if heads_inner else (num_q_blocks, num_kv_heads, max_splits)
    first_tile, error = (cfg["BLOCK_N"], cfg["num_stages"]), None
    while True:
        try:
            paged_attention_kernel[grid](**arguments, **constexprs, **options)
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
            constexprs, options = kernel_constexprs(cfg, case, **kernel_options)
    if error is not None:
        warnings.warn(f"attnops Triton attention: a tile of {first_tile[0]} keys in {first_tile[1]} stages does "
                      f"not fit this GPU ({error}); this shape now runs {cfg['BLOCK_N']} keys in "
                      f"{cfg['num_stages']} stages", RuntimeWarning)
    return cfg, constexprs
