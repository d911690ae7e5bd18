"""What a backend is: the cases it is asked about, and the interface it implements.

A backend states what it supports as data and answers `supports(case)` with the list of reasons it cannot serve a
case (empty: it can), in the style of xformers' fmha operators. Dispatch (attnops/dispatch.py) walks an ordered
list of backends and takes the first with no reasons.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionCase:
    """Everything dispatch may look at for one paged_attention call: shapes, dtypes and flags, never values."""

    device_type: str
    arch: tuple[int, int] | None  # CUDA compute capability, None on the CPU
    q_dtype: torch.dtype
    kv_format: str  # resolved: "bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2", "nvfp4", "mxfp4"
    head_dim: int
    page_size: int
    num_q_heads: int
    num_kv_heads: int
    decode: bool  # one query token per sequence (cu_seqlens_q is None)
    soft_cap: bool
    sliding_window: bool
    scale_kind: str  # "none", "per_tensor", "per_head" (fp8) or "block" (4-bit)
    # "decode", "verify" (at most VERIFY_MAX_Q query tokens per sequence on average, from shapes: T / B) or
    # "prefill": the class the measured dispatch tables are keyed on
    shape_class: str = "decode"

    def __hash__(self) -> int:  # computed once: dispatch looks a case up on every op call
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
            object.__setattr__(self, "_hash", cached)
        return cached


VERIFY_MAX_Q = 16


def shape_class(decode: bool, num_tokens: int, batch: int) -> str:
    if decode:
        return "decode"
    return "verify" if num_tokens <= VERIFY_MAX_Q * max(batch, 1) else "prefill"


@dataclass(frozen=True)
class CacheWriteCase:
    """Everything dispatch may look at for one reshape_and_cache call."""

    device_type: str
    arch: tuple[int, int] | None
    src_dtype: torch.dtype
    kv_format: str
    head_dim: int
    page_size: int
    num_kv_heads: int
    scale_kind: str


class Backend:
    """A family of kernels. Subclasses set `name` and `description` and implement the methods below."""

    name: str = ""
    description: str = ""
    writes_cache: bool = True  # False: reshape_and_cache is always another backend's, even when this one is pinned

    def unavailable(self) -> list[str]:
        """Reasons this backend cannot run at all here (a package missing, no GPU). Empty if it can."""
        return []

    def supports(self, case: AttentionCase | CacheWriteCase) -> list[str]:
        """Reasons this backend cannot serve `case`; empty if it can."""
        raise NotImplementedError

    def paged_attention(self, q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, *, scale: float,
                        soft_cap: float, window_left: int, kv_format: str, k_scale, v_scale, out) -> None:
        """Writes the attention output into `out` ([T, Hq, D], q's dtype). Inputs are already validated;
        `kv_format` is resolved and `scale` is a float."""
        raise NotImplementedError

    def reshape_and_cache(self, key, value, k_cache, v_cache, slot_mapping, *, kv_format: str, k_scale, v_scale,
                          k_block_scale, v_block_scale) -> None:
        raise NotImplementedError


def common_reasons(case, *, devices=None, q_dtypes=None, kv_formats=None, head_dims=None,
                   soft_cap: bool = True, sliding_window: bool = True, archs=None) -> list[str]:
    """The reasons shared by most backends' `supports`, from what each declares as data."""
    reasons = []
    if devices is not None and case.device_type not in devices:
        reasons.append(f"runs on {'/'.join(devices)}, not {case.device_type}")
    if archs is not None and case.arch is not None and not archs(case.arch):
        reasons.append(f"not built for sm_{case.arch[0]}{case.arch[1]}")
    dtype = case.q_dtype if isinstance(case, AttentionCase) else case.src_dtype
    if q_dtypes is not None and dtype not in q_dtypes:
        reasons.append(f"{'q' if isinstance(case, AttentionCase) else 'key/value'} dtype {dtype} not supported")
    if kv_formats is not None and case.kv_format not in kv_formats:
        reasons.append(f"kv_format {case.kv_format} not supported")
    if head_dims is not None and case.head_dim not in head_dims:
        reasons.append(f"head_dim {case.head_dim} not supported")
    if isinstance(case, AttentionCase):
        if case.soft_cap and not soft_cap:
            reasons.append("soft_cap not supported")
        if case.sliding_window and not sliding_window:
            reasons.append("sliding window not supported")
    return reasons
