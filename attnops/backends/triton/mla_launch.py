"""Runs the latent-attention (MLA) kernels for one op call: the split plan (from shapes only), the workspace for
split partials, and the launches."""
from __future__ import annotations

import torch
import triton

from ... import errors, formats
from ..base import kernel_outputs, rows_without_a_sequence
from . import interpreting
from .mla_kernel import mla_attention_kernel, mla_cache_write_kernel, mla_merge_kernel


# the kernels' FMT for each latent cache format (mla_kernel._latent_tile)
_FMT = {"auto": 0, "bf16": 0, "fp16": 0, "fp32": 0, "fp8_e4m3": 1, formats.LATENT_FP8_FORMAT: 2}

# batch-invariant mode (attnops.invariance): keys a split, fixed, so that a sequence's splits (and the order of its
# sums) follow from its own length only; the interpreter's is small, so that CPU tests cover several splits
INVARIANT_CHUNK = 2048
INTERPRETER_INVARIANT_CHUNK = 32


def mla_plan(num_tokens: int, num_heads: int, capacity: int, latent_dim: int, on_gpu: bool,
             config: dict | None = None, invariant: bool = False) -> dict:
    """Tiles and splits of a call, from shapes only (a captured graph replays any lengths within the table).
    Heads are the tile's rows: at most 64 a program (the fp32 accumulator of 64 x 512 is what a program holds, with
    8 warps), at least 16 (tl.dot's smallest M). Splits bring the programs to about 256 (two waves of the H100's and
    H200's 132 SMs), in chunks of at least 256 keys; fitted to benchmarks/mla_decode.py --sweep (docs/bench.md).
    `config` overrides tiles and CHUNK; the split count always follows from CHUNK, so that the splits cover the
    table. `invariant` (batch-invariant mode): CHUNK fixed; the tiles depend on heads and R only, so a row is
    computed by the same program code over the same splits whatever the batch and the table's width."""
    if on_gpu:
        block_h = max(16, min(64, triton.next_power_of_2(num_heads)))
        if latent_dim <= 256:
            block_n, num_warps = 64, 4
        else:  # a 64-head tile's accumulator needs 8 warps' registers; it reads each latent row half as often
            block_n, num_warps = (64, 8) if block_h == 64 else (32, 4)
        programs = max(num_tokens, 1) * triton.cdiv(num_heads, block_h)
        splits = triton.cdiv(256, programs)
        chunk = max(256, triton.cdiv(triton.cdiv(max(capacity, 1), splits), block_n) * block_n)
    else:
        block_h = max(16, min(32, triton.next_power_of_2(num_heads)))
        block_n, num_warps = 16, 4
        splits = max(1, min(4, triton.cdiv(capacity, 64)))
        chunk = triton.cdiv(triton.cdiv(max(capacity, 1), splits), block_n) * block_n
    if invariant:
        chunk = INVARIANT_CHUNK if on_gpu else INTERPRETER_INVARIANT_CHUNK
    plan = dict(BLOCK_H=block_h, BLOCK_N=block_n, CHUNK=chunk, num_warps=num_warps, num_stages=2 if on_gpu else 1)
    plan.update(config or {})
    plan["MAX_SPLITS"] = triton.cdiv(max(capacity, 1), plan["CHUNK"])
    return plan


def mla_launch(q_nope, q_pe, kv_cache, block_table, seq_lens, cu_seqlens_q, *, scale: float, kv_format: str,
               kv_scale, sinks, tree_mask, out, lse=None, topk_indices=None, config: dict | None = None,
               invariant: bool = False) -> None:
    """Latent attention into `out` [T, H, R] (and each row's natural-log LSE into `lse` [T, H]); with
    topk_indices [T, K], each row over the key positions it lists (the splits divide its K entries). Inputs are
    validated by the op."""
    num_tokens, num_heads, latent = q_nope.shape
    rope = q_pe.shape[2]
    page_size = kv_cache.shape[1]
    batch = seq_lens.shape[0]
    if num_tokens == 0:
        return
    if batch == 0:
        rows_without_a_sequence(out, lse)
        return
    if out.stride(-1) != 1 or (lse is not None and not lse.is_contiguous()):
        with kernel_outputs(out, lse) as (out_w, lse_w):
            mla_launch(q_nope, q_pe, kv_cache, block_table, seq_lens, cu_seqlens_q, scale=scale, kv_format=kv_format,
                       kv_scale=kv_scale, sinks=sinks, tree_mask=tree_mask, out=out_w, lse=lse_w,
                       topk_indices=topk_indices, config=config, invariant=invariant)
        return
    block_table = block_table.contiguous()
    seq_lens = seq_lens.contiguous()
    capacity = block_table.shape[1] * page_size
    topk_len = topk_indices.shape[1] if topk_indices is not None else 0
    plan = mla_plan(num_tokens, num_heads, topk_len or capacity, latent, q_nope.is_cuda and not interpreting(),
                    config, invariant)
    splits = plan["MAX_SPLITS"]
    fmt = _FMT[kv_format]
    fp8 = fmt == 1
    kv = kv_cache.view(torch.uint8) if fp8 else kv_cache
    r_p2, p_p2 = triton.next_power_of_2(latent), triton.next_power_of_2(rope)
    part_out = part_lse = out  # (placeholders: one split writes out directly)
    if splits > 1:
        part_out = torch.empty(num_tokens * num_heads * splits * r_p2, dtype=torch.float32, device=q_nope.device)
        part_lse = torch.empty(num_tokens * num_heads * splits, dtype=torch.float32, device=q_nope.device)
    cu = cu_seqlens_q.contiguous() if cu_seqlens_q is not None else seq_lens
    tm = tree_mask.view(torch.uint8) if tree_mask is not None else seq_lens
    grid = (num_tokens * triton.cdiv(num_heads, plan["BLOCK_H"]), splits)
    mla_attention_kernel[grid](
        qn_ptr=q_nope, qp_ptr=q_pe, kv_ptr=kv, bt_ptr=block_table, seq_lens_ptr=seq_lens, cu_ptr=cu,
        kv_scale_ptr=kv_scale if fp8 else seq_lens, sinks_ptr=sinks if sinks is not None else seq_lens, tm_ptr=tm,
        topk_ptr=topk_indices if topk_indices is not None else seq_lens,
        out_ptr=out, lse_ptr=lse if lse is not None else seq_lens, part_out_ptr=part_out, part_lse_ptr=part_lse,
        err_ptr=errors.buffer(q_nope.device),
        num_seqs=batch, num_tokens=num_tokens, num_pages=kv_cache.shape[0], capacity=capacity, sm_scale=float(scale),
        CHUNK=plan["CHUNK"], tm_cols=tree_mask.shape[1] if tree_mask is not None else 0, MAX_SPLITS=splits,
        topk_len=topk_len,
        stride_qn_t=q_nope.stride(0), stride_qn_h=q_nope.stride(1), stride_qp_t=q_pe.stride(0),
        stride_qp_h=q_pe.stride(1), stride_page=kv_cache.stride(0), stride_tok=kv_cache.stride(1),
        stride_bt=block_table.stride(0), stride_ot=out.stride(0), stride_oh=out.stride(1),
        stride_tm=tree_mask.stride(0) if tree_mask is not None else 0,
        stride_topk=topk_indices.stride(0) if topk_indices is not None else 0,
        NUM_HEADS=num_heads, R=latent, P=rope, R_P2=r_p2, P_P2=p_p2, PAGE=page_size, BLOCK_H=plan["BLOCK_H"],
        BLOCK_N=plan["BLOCK_N"], SPLIT=splits > 1, IS_DECODE=cu_seqlens_q is None, FMT=fmt,
        HAS_SINKS=sinks is not None, HAS_TREE=tree_mask is not None, HAS_TOPK=topk_indices is not None,
        WRITE_LSE=lse is not None, num_warps=plan["num_warps"], num_stages=plan["num_stages"])
    if splits > 1:
        mla_merge_kernel[(num_tokens, num_heads)](
            out_ptr=out, lse_ptr=lse if lse is not None else part_lse, part_out_ptr=part_out, part_lse_ptr=part_lse,
            sinks_ptr=sinks if sinks is not None else part_lse, stride_ot=out.stride(0), stride_oh=out.stride(1),
            MAX_SPLITS=splits, NUM_HEADS=num_heads, R=latent, R_P2=r_p2, SPLITS_P2=triton.next_power_of_2(splits),
            SPLIT_BLOCK=min(8, triton.next_power_of_2(splits)), HAS_SINKS=sinks is not None,
            WRITE_LSE=lse is not None, num_warps=4)


def mla_cache_write(kv_c, k_pe, kv_cache, slot_mapping, *, kv_format: str, kv_scale) -> None:
    """Row slot_mapping[i] of the cache = [kv_c[i], k_pe[i]], quantized for fp8 (validated by the op)."""
    num_tokens, latent = kv_c.shape
    if num_tokens == 0:
        return
    rope = k_pe.shape[1]
    fmt = _FMT[kv_format]
    fp8 = fmt == 1
    kv = kv_cache.view(torch.uint8) if fp8 else kv_cache
    mla_cache_write_kernel[(num_tokens,)](
        kv_c_ptr=kv_c, k_pe_ptr=k_pe, kv_ptr=kv, slot_ptr=slot_mapping.contiguous(),
        kv_scale_ptr=kv_scale if fp8 else slot_mapping, err_ptr=errors.buffer(kv_c.device),
        num_slots=kv_cache.shape[0] * kv_cache.shape[1], stride_c=kv_c.stride(0), stride_pe=k_pe.stride(0),
        stride_page=kv_cache.stride(0), stride_tok=kv_cache.stride(1), R=latent, P=rope,
        R_P2=triton.next_power_of_2(latent), P_P2=triton.next_power_of_2(rope), PAGE=kv_cache.shape[1], FMT=fmt,
        SOFT_FP8=interpreting() or not kv_c.is_cuda, num_warps=4)
