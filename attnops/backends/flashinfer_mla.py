"""The FlashInfer backend's latent attention (MLA): mla_attention through FlashInfer's
`BatchMLAPagedAttentionWrapper` (FA3 on sm_90, FA2 elsewhere: its own choice), for the shape its kernels are built
for (DeepSeek's R 512, P 64) with a bf16/fp16 cache of q's dtype.

Why a room of its own beside flashinfer.py: the wrapper, its metadata, its plan records and its declines are MLA's;
what it shares with the paged path lives in flashinfer_steps.py: the per-device workspace, the step key (one plan a
step, whatever the number of layers), and the page-layout safety (checked_pages, page_metadata).

As the paged path: plan() reads the page layout on the host (one sync a step); the layout is made safe on the device
first (bad lengths as 0, pages outside the cache as a good page of the same sequence); rows the contract makes NaN,
and rows that see no key (decode rows of empty sequences, extend rows before their sequence's first key: FlashInfer
leaves them undefined) are set after run(); a bad cu_seqlens_q (checked on the host at plan time) makes every row
NaN with no run. Inside any CUDA graph capture it declines (no re-plan of latent graphs: Triton's kernels, which
need no plan, serve captures).
"""
from __future__ import annotations

import functools

import torch

from .. import capture, errors
from ..cases import query_rows
from .base import common_reasons
from .flashinfer_steps import (LN2, Q_DTYPES, checked_pages, fill_nan, page_metadata, same_step, set_rows,
                               step_key, workspace)


class _Plans:
    """The MLA wrappers of one device (on the device's shared workspace), and per wrapper: the step it was last
    planned for, the rows to set after run() on that step, whether that step's cu_seqlens_q is bad."""

    def __init__(self, device: torch.device):
        self.workspace = workspace(device)
        self.wrappers: dict = {}
        self.planned_for: dict = {}
        self.fix_now: dict = {}
        self.bad_cu: dict = {}


@functools.lru_cache(maxsize=None)
def _plans(device: torch.device) -> _Plans:
    return _Plans(device)


# (R, P) of the latent rows FlashInfer's MLA kernels are built for
SHAPES = ((512, 64),)
KV_FORMATS = ("bf16", "fp16")
_FORMAT_OF = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def reasons(case) -> list[str]:
    """Why FlashInfer's MLA kernels cannot serve an MLACase (empty: they can)."""
    found = common_reasons(case, devices=("cuda",), q_dtypes=Q_DTYPES, kv_formats=KV_FORMATS,
                           archs=lambda arch: arch >= (8, 0))
    if (case.latent_dim, case.rope_dim) not in SHAPES:
        found.append(f"latent rows of R {case.latent_dim}, P {case.rope_dim}: FlashInfer's MLA kernels are built "
                     f"for {' or '.join(f'R {r}, P {p}' for r, p in SHAPES)}")
    if case.kv_format in KV_FORMATS and _FORMAT_OF.get(case.q_dtype) not in (None, case.kv_format):
        found.append(f"a {case.kv_format} cache under {case.q_dtype} q: FlashInfer's MLA takes the cache in q's dtype")
    if case.sinks:
        found.append("sinks not supported")
    if case.tree_mask:
        found.append("tree_mask not supported")
    if case.topk:
        found.append("the sparse form (topk_indices) not supported")
    # (a capture nobody re-plans: dispatch passes every host-planned backend over; attnops' own, which re-plan
    # paged attention, have no re-plan for latent attention)
    if capture.current_capture() is not None:
        found.append("inside a CUDA graph capture: no re-plan for latent attention (triton serves captures)")
    return found


def _rows_without_keys(seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor | None, num_tokens: int) -> torch.Tensor:
    """bool [T]: the query rows that see no key (their position in the sequence is before its first key)."""
    return query_rows(seq_lens, cu_seqlens_q, num_tokens)[1] < 0


def _plan(call):
    """The wrapper planned for this call's step (planned now unless the step was seen), the rows to set after run()
    ((mask [T, 1, 1], values [T, 1, 1] in q's dtype: flashinfer_steps.set_rows) or None) and whether the step's
    cu_seqlens_q is bad."""
    case, q_nope = call.case, call.q_nope
    block_table, seq_lens, cu_seqlens_q = call.block_table, call.seq_lens, call.cu_seqlens_q
    plans = _plans(q_nope.device)
    key = ("mla", q_nope.dtype, case.num_heads, case.latent_dim, case.rope_dim, case.page_size, call.scale)
    if key not in plans.wrappers:
        import flashinfer
        plans.wrappers[key] = flashinfer.mla.BatchMLAPagedAttentionWrapper(plans.workspace, backend="auto")
    wrapper = plans.wrappers[key]
    if same_step(plans.planned_for.get(key), block_table, seq_lens, cu_seqlens_q):
        return wrapper, plans.fix_now.get(key), plans.bad_cu.get(key)
    if q_nope.is_cuda and torch.cuda.is_current_stream_capturing():  # (reasons() keeps captures away: a backstop)
        raise RuntimeError("attnops.mla_attention (flashinfer): no plan inside a CUDA graph capture")
    import flashinfer

    num_tokens = q_nope.shape[0]
    plans.planned_for[key] = step_key(block_table, seq_lens, cu_seqlens_q)
    plans.bad_cu[key], plans.fix_now[key] = False, None
    if cu_seqlens_q is not None:
        bad_entry = errors.cu_seqlens_violation(cu_seqlens_q.tolist(), num_tokens)
        if bad_entry is not None:  # which rows are whose is undefined: every row NaN, FlashInfer not run
            errors.record(q_nope.device, errors.CU_SEQLENS_Q, bad_entry)
            plans.bad_cu[key] = True
            return wrapper, None, True
    lens, table, nan_rows = checked_pages(block_table, seq_lens, case.page_size, call.kv_cache.shape[0], -1,
                                          cu_seqlens_q, num_tokens)
    indptr, indices, _ = page_metadata(table, lens, case.page_size)
    qo_indptr = cu_seqlens_q if cu_seqlens_q is not None else \
        torch.arange(seq_lens.shape[0] + 1, dtype=torch.int32, device=q_nope.device)
    wrapper.plan(metadata=flashinfer.mla.MLAPlanMetadata.csr(qo_indptr, indptr, indices, lens),
                 num_heads=case.num_heads, head_dim_ckv=case.latent_dim, head_dim_kpe=case.rope_dim,
                 page_size=case.page_size, causal=cu_seqlens_q is not None, sm_scale=call.scale,
                 q_data_type=q_nope.dtype, kv_data_type=call.kv_cache.dtype, query_layout="split",
                 kv_cache_layout="packed", lse_mode="base2")
    mask = nan_rows | _rows_without_keys(lens, cu_seqlens_q, num_tokens)
    if bool(mask.any()):  # (planning synced already: one more read, once a step)
        values = torch.zeros(num_tokens, dtype=q_nope.dtype, device=q_nope.device).masked_fill_(nan_rows,
                                                                                               float("nan"))
        plans.fix_now[key] = (mask.view(-1, 1, 1), values.view(-1, 1, 1))
    return wrapper, plans.fix_now[key], False


def mla_attention(call) -> None:
    """mla_attention (and _with_lse) of one call into call.out (and call.lse)."""
    wrapper, row_fix, bad_cu = _plan(call)
    out, lse = call.out, call.lse
    if bad_cu:
        fill_nan(out, lse)
        return
    num_tokens, num_heads, _ = call.q_nope.shape
    out_buffer = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype, device=out.device)
    lse_buffer = lse if lse is not None and lse.is_contiguous() else \
        torch.empty(num_tokens, num_heads, dtype=torch.float32, device=out.device)
    wrapper.run(query=(call.q_nope.contiguous(), call.q_pe.contiguous()), kv_cache=call.kv_cache, out=out_buffer,
                lse=lse_buffer, return_lse=True)
    if lse is not None:
        lse_buffer.mul_(LN2)  # run()'s LSE is a base-2 log: to the contract's natural log
    if row_fix is not None:
        set_rows(row_fix, out_buffer, lse_buffer if lse is not None else None)
    if out_buffer is not out:
        out.copy_(out_buffer)
    if lse is not None and lse_buffer is not lse:
        lse.copy_(lse_buffer)
