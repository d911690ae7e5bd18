"""What a backend is: the cases it is asked about, and the interface it implements.

A backend states what it supports as data and answers `supports(case)` with the list of reasons it cannot serve a
case (empty: it can), in the style of xformers' fmha operators. Dispatch (attnops/dispatch.py) walks an ordered
list of backends and takes the first with no reasons.
"""
from __future__ import annotations

import contextlib

import torch

from .. import errors
from ..cases import (AttentionCall, AttentionCase, CacheWriteCall, CacheWriteCase, MLACall, MLACase,  # noqa: F401
                     MLAWriteCall, MLAWriteCase, VERIFY_MAX_Q, shape_class)  # (re-exported)


class Backend:
    """A family of kernels. Subclasses set `name` and `description` and implement the methods below."""

    name: str = ""
    description: str = ""
    writes_cache: bool = True  # False: reshape_and_cache is always another backend's, even when this one is pinned
    # True: its kernels run a plan made on the host from the step's lengths, so a CUDA graph that captures them
    # replays correctly only if its driver re-plans before each replay (attnops.capture); dispatch passes such a
    # backend over inside any other capture
    plans_on_host: bool = False
    # True: it has latent-attention kernels (mla_attention, mla_cache_write) and its `supports` answers MLACase
    # and MLAWriteCase; dispatch passes over every other backend for them
    serves_mla: bool = False

    def invariance_reasons(self, case: AttentionCase | MLACase) -> list[str]:
        """Why this backend cannot serve `case` batch-invariantly (attnops.invariance: a row's bits independent of
        the rest of the call); empty if it can. Asked only in batch-invariant mode, only of attention cases (cache
        writes are per-row copies, invariant by construction). The default: it cannot."""
        return ["not batch-invariant: its reduction order may depend on the rest of the batch"]

    def forget_steps(self) -> None:
        """Drops whatever the backend keeps from one call to the next of a step (plans, replays); dispatch calls it
        when the pinned backend changes."""

    def unavailable(self) -> list[str]:
        """Reasons this backend cannot run at all here (a package missing, no GPU). Empty if it can."""
        return []

    def supports(self, case: AttentionCase | CacheWriteCase) -> list[str]:
        """Reasons this backend cannot serve `case`; empty if it can."""
        raise NotImplementedError

    def paged_attention(self, call: AttentionCall) -> None:
        """Writes the attention output into `call.out` ([T, Hq, D], q's dtype) and, when `call.lse` is given
        (float32 [T, Hq], any strides), each row's log-sum-exp into it (docs/design.md, paged_attention_with_lse).
        The call is validated and `call.case` is the case this backend's `supports` accepted (its format resolved,
        decode, batch, GQA group, table capacity: read them there, not from the tensors); `call.scale` is a float
        and `call.soft_cap` 0.0 for no cap. `sinks` and `tree_mask` come only with a case that has them."""
        raise NotImplementedError

    def mla_attention(self, call: MLACall) -> None:
        """Latent attention into `call.out` [T, H, R] (and `call.lse` [T, H] when given): docs/design.md,
        "mla_attention". Only for a backend that `serves_mla`."""
        raise NotImplementedError

    def mla_cache_write(self, call: MLAWriteCall) -> None:
        """Rows `call.slot_mapping` of `call.kv_cache` = [kv_c, k_pe], quantized to the case's format."""
        raise NotImplementedError

    def reshape_and_cache(self, call: CacheWriteCall) -> None:
        """Writes `call.key`/`call.value` into the caches at `call.slot_mapping` in `call.case.kv_format`
        (validated), and a 4-bit format's block scales into `call.k_block_scale`/`call.v_block_scale`."""
        raise NotImplementedError


def _head_dims_text(head_dims) -> str:
    """A backend's head dims for a reason: a run of every multiple of a step as its rule, else the list."""
    dims = sorted(head_dims)
    step = dims[0]
    if len(dims) > 2 and dims == list(range(step, dims[-1] + 1, step)):
        return f"every multiple of {step} from {step} to {dims[-1]}"
    return ", ".join(map(str, dims))


def common_reasons(case, *, devices=None, q_dtypes=None, kv_formats=None, head_dims=None,
                   soft_cap: bool = True, sliding_window: bool = True, sinks: bool = True, tree_mask: bool = True,
                   archs=None) -> list[str]:
    """The reasons shared by most backends' `supports`, from what each declares as data."""
    reasons = []
    if devices is not None and case.device_type not in devices:
        reasons.append(f"runs on {'/'.join(devices)}, not {case.device_type}")
    if archs is not None and case.arch is not None and not archs(case.arch):
        reasons.append(f"not built for sm_{case.arch[0]}{case.arch[1]}")
    attends = hasattr(case, "q_dtype")  # an attention case (paged or latent), not a cache write
    dtype = case.q_dtype if attends else case.src_dtype
    if q_dtypes is not None and dtype not in q_dtypes:
        reasons.append(f"{'q' if attends else 'key/value'} dtype {dtype} not supported")
    if kv_formats is not None and case.kv_format not in kv_formats:
        reasons.append(f"kv_format {case.kv_format} not supported")
    if head_dims is not None and case.head_dim not in head_dims:
        reasons.append(f"head_dim {case.head_dim} not supported (its kernels take {_head_dims_text(head_dims)})")
    if isinstance(case, AttentionCase):
        if case.soft_cap and not soft_cap:
            reasons.append("soft_cap not supported")
        if case.sliding_window and not sliding_window:
            reasons.append("sliding window not supported")
        if case.sinks and not sinks:
            reasons.append("sinks not supported")
        if case.tree_mask and not tree_mask:
            reasons.append("tree_mask not supported")
    return reasons


def unit_inner_stride(out) -> bool:
    return out.stride(-1) == 1


def pairs_aligned(out: torch.Tensor) -> bool:
    """Whether out [T, H, D] takes a CUDA kernel's stores of two 16-bit values at once: unit inner stride, even outer
    strides, a 4-byte aligned start."""
    return out.stride(-1) == 1 and out.data_ptr() % 4 == 0 and all(s % 2 == 0 for s in out.stride()[:2])


@contextlib.contextmanager
def kernel_outputs(out, lse, writable=unit_inner_stride):
    """`out` as the kernels can write it (`writable(out)`; by default unit inner stride) and `lse` contiguous
    (rows at token x Hq + head): the tensors themselves where they are so, else contiguous temporaries whose values
    are copied into the caller's tensors when the block ends."""
    out_w = out if writable(out) else torch.empty_like(out, memory_format=torch.contiguous_format)
    lse_w = lse if lse is None or lse.is_contiguous() else torch.empty(lse.shape, dtype=lse.dtype, device=lse.device)
    yield out_w, lse_w
    if out_w is not out:
        out.copy_(out_w)
    if lse_w is not lse:
        lse.copy_(lse_w)


def rows_without_a_sequence(out, lse) -> None:
    """Query rows but no sequence (seq_lens empty): cu_seqlens_q ([0]) cannot run from 0 to num_tokens, so by
    docs/design.md's "Bad indices" every row (and its LSE) is NaN and cu_seqlens_q is recorded at entry 0."""
    out.fill_(float("nan"))
    if lse is not None:
        lse.fill_(float("nan"))
    errors.record(out.device, errors.CU_SEQLENS_Q, 0)
