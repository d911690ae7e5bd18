"""The contract between the op layer and the backends: what one call looks like to dispatch (shapes, dtypes and
flags, never tensor data). checks.py builds these; dispatch.py and every backend read them."""
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
    batch: int = 1  # sequences (seq_lens.shape[0])
    max_kv_len: int = 0  # the block table's capacity in tokens (its width x page_size): a shape, not the lengths
    sinks: bool = False  # a per-head sink logit joins each row's softmax denominator
    tree_mask: bool = False  # a draft tree's mask replaces the causal rule inside each query block
    # query tokens a sequence, T / B rounded up (1 in decode; VERIFY_MAX_Q + 1 for every prefill): with the GQA
    # group, the query rows a verify kernel computes for each (sequence, KV head)
    q_per_seq: int = 1

    def __hash__(self) -> int:  # computed once: dispatch looks a case up on every op call
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
            object.__setattr__(self, "_hash", cached)
        return cached


VERIFY_MAX_Q = 16


def q_per_seq(decode: bool, num_tokens: int, batch: int) -> int:
    """Query tokens a sequence, T / B rounded up; VERIFY_MAX_Q + 1 stands for every prefill."""
    if decode:
        return 1
    return min(-(-num_tokens // max(batch, 1)), VERIFY_MAX_Q + 1)


def shape_class(decode: bool, num_tokens: int, batch: int) -> str:
    if decode:
        return "decode"
    return "verify" if q_per_seq(decode, num_tokens, batch) <= VERIFY_MAX_Q else "prefill"


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
