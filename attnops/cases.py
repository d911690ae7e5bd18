"""The contract between the op layer and the backends: what one call looks like to dispatch (a case: shapes,
dtypes and flags, never tensor data) and what a backend is handed to run it (a call: the case and the call's
tensors and scalars). checks.py builds both after validating; dispatch.py reads cases, every backend reads calls."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .env import device_arch
from .formats import FORMATS, KVFormat


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
    # every key row of the caches (and of 4-bit block scales) can be copied by aligned words, K and V alike, with
    # 32-bit page offsets (checks.kv_layout_reasons): from strides and addresses, what a kernel that copies rows
    # to shared memory by words needs (the cuda backend's)
    aligned_kv: bool = True

    @classmethod
    def of_shapes(cls, *, device_type: str, arch: tuple[int, int] | None, q_dtype: torch.dtype, kv_format: str,
                  head_dim: int, page_size: int, num_q_heads: int, num_kv_heads: int, batch: int, num_tokens: int,
                  max_kv_len: int, decode: bool, scale_kind: str | None = None, soft_cap: bool = False,
                  sliding_window: bool = False, sinks: bool = False, tree_mask: bool = False,
                  aligned_kv: bool = True) -> AttentionCase:
        """The case of a call of these shapes: shape_class and q_per_seq follow from decode, the query tokens and
        the batch; the scale kind defaults to the format's."""
        return cls(device_type=device_type, arch=arch, q_dtype=q_dtype, kv_format=kv_format, head_dim=head_dim,
                   page_size=page_size, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, decode=decode,
                   soft_cap=soft_cap, sliding_window=sliding_window,
                   scale_kind=FORMATS[kv_format].default_scale_kind if scale_kind is None else scale_kind,
                   shape_class=shape_class(decode, num_tokens, batch), batch=batch, max_kv_len=max_kv_len,
                   sinks=sinks, tree_mask=tree_mask, q_per_seq=q_per_seq(decode, num_tokens, batch),
                   aligned_kv=aligned_kv)

    @property
    def format(self) -> KVFormat:
        return FORMATS[self.kv_format]

    @property
    def group(self) -> int:
        """Query heads a KV head serves."""
        return self.num_q_heads // self.num_kv_heads

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


class AttentionCall(NamedTuple):
    """One paged_attention (or paged_attention_with_lse) call as a backend runs it: its case and its arguments,
    validated, `kv_format` resolved into the case, `scale` a float, `soft_cap` 0.0 for no cap (an infinite cap is
    0 here). The op builds it once (checks.attention_call); `Backend.paged_attention(call)` takes it.

    A NamedTuple rather than a frozen dataclass: one is built on every op call, and a frozen dataclass's __init__
    costs three times as much (1.8 against 0.6 us here)."""

    case: AttentionCase
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [num_pages, page_size, Hkv, D (D/2 for 4-bit)]
    v_cache: torch.Tensor
    block_table: torch.Tensor  # int32 [B, max_pages]
    seq_lens: torch.Tensor  # int32 [B]
    cu_seqlens_q: torch.Tensor | None  # int32 [B + 1]; None: decode
    out: torch.Tensor  # written: [T, Hq, D], q's dtype
    scale: float
    soft_cap: float = 0.0
    window_left: int = -1
    k_scale: torch.Tensor | None = None  # fp8: float32 per tensor or per KV head; 4-bit: the block scales
    v_scale: torch.Tensor | None = None
    sinks: torch.Tensor | None = None  # float32 [Hq]
    tree_mask: torch.Tensor | None = None  # bool [T, Q]
    lse: torch.Tensor | None = None  # written when given: float32 [T, Hq]

    @classmethod
    def of(cls, q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q=None, *, scale: float | None, soft_cap,
           window_left: int, kv_format: str, k_scale, v_scale, out, sinks=None, tree_mask=None,
           lse=None) -> AttentionCall:
        """The call of these arguments, its case read from their shapes, for a caller that validated them itself
        (the op validates, then builds the call with checks.attention_call): `kv_format` resolved, scales as the
        format needs them. The layout is taken as aligned (`aligned_kv`): only checks.py measures it."""
        num_tokens, num_q_heads, head_dim = q.shape
        _, page_size, num_kv_heads, _ = k_cache.shape
        fmt = FORMATS[kv_format]
        case = AttentionCase.of_shapes(
            device_type=q.device.type, arch=device_arch(q.device), q_dtype=q.dtype, kv_format=kv_format,
            head_dim=head_dim, page_size=page_size, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
            batch=seq_lens.shape[0], num_tokens=num_tokens, max_kv_len=block_table.shape[1] * page_size,
            decode=cu_seqlens_q is None, scale_kind=fmt.scale_kind(k_scale, v_scale),
            soft_cap=0 < soft_cap < math.inf, sliding_window=window_left >= 0, sinks=sinks is not None,
            tree_mask=tree_mask is not None)
        return cls.of_case(case, q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale, soft_cap,
                           window_left, k_scale, v_scale, sinks, tree_mask, out, lse)

    @classmethod
    def of_case(cls, case: AttentionCase, q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale, soft_cap,
                window_left, k_scale, v_scale, sinks, tree_mask, out, lse=None) -> AttentionCall:
        """The call of these arguments and their case: `scale` resolved (D^-0.5 by default), `soft_cap` 0.0 where
        the case has no cap."""
        return cls(case, q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, out,
                   q.shape[-1] ** -0.5 if scale is None else float(scale), float(soft_cap) if case.soft_cap else 0.0,
                   int(window_left), k_scale, v_scale, sinks, tree_mask, lse)

    @property
    def kv_format(self) -> str:
        return self.case.kv_format

    @property
    def format(self) -> KVFormat:
        return FORMATS[self.case.kv_format]

    @property
    def decode(self) -> bool:
        return self.case.decode

    @property
    def batch(self) -> int:
        return self.case.batch

    @property
    def num_tokens(self) -> int:
        return self.q.shape[0]

    @property
    def group(self) -> int:
        return self.case.group

    @property
    def capacity(self) -> int:
        """The block table's capacity in tokens (its width x page_size)."""
        return self.case.max_kv_len

    @property
    def num_pages(self) -> int:
        return self.k_cache.shape[0]

    @property
    def device(self) -> torch.device:
        return self.q.device


class CacheWriteCall(NamedTuple):
    """One reshape_and_cache call as a backend runs it: its case and its arguments, validated (`kv_format`
    resolved into the case). The op builds it once (checks.cache_write_call)."""

    case: CacheWriteCase
    key: torch.Tensor  # [T, Hkv, D]
    value: torch.Tensor
    k_cache: torch.Tensor  # written
    v_cache: torch.Tensor  # written
    slot_mapping: torch.Tensor  # int64 [T]
    k_scale: torch.Tensor | None = None  # fp8: read-only, per tensor or per KV head
    v_scale: torch.Tensor | None = None
    k_block_scale: torch.Tensor | None = None  # 4-bit: written, paged like the cache
    v_block_scale: torch.Tensor | None = None

    @property
    def kv_format(self) -> str:
        return self.case.kv_format

    @property
    def format(self) -> KVFormat:
        return FORMATS[self.case.kv_format]


@dataclass(frozen=True)
class MLACase:
    """Everything dispatch may look at for one mla_attention call (latent attention: one latent row of
    latent_dim + rope_dim values a token, shared by num_heads query heads)."""

    device_type: str
    arch: tuple[int, int] | None
    q_dtype: torch.dtype
    kv_format: str  # resolved: "bf16", "fp16", "fp32" (the cache's dtype) or "fp8_e4m3"
    latent_dim: int  # R: the compressed KV's width, and the output's
    rope_dim: int  # P: the rotary part's
    num_heads: int
    page_size: int
    decode: bool
    shape_class: str = "decode"
    batch: int = 1
    max_kv_len: int = 0  # the block table's capacity in tokens
    sinks: bool = False
    tree_mask: bool = False
    aligned_kv: bool = True  # every latent row starts on a 16-byte boundary (checks_mla.rows_16_byte_aligned)
    topk: int = 0  # the sparse form's entries a row (topk_indices.shape[1]); 0: every key its rules let it see


@dataclass(frozen=True)
class MLAWriteCase:
    """Everything dispatch may look at for one mla_cache_write call."""

    device_type: str
    arch: tuple[int, int] | None
    src_dtype: torch.dtype
    kv_format: str
    latent_dim: int
    rope_dim: int
    page_size: int


class MLACall(NamedTuple):
    """One mla_attention (or mla_attention_with_lse) call as a backend runs it: its case and its validated
    arguments (the op builds it once; `Backend.mla_attention(call)` takes it)."""

    case: MLACase
    q_nope: torch.Tensor  # [T, H, R]
    q_pe: torch.Tensor  # [T, H, P]
    kv_cache: torch.Tensor  # [num_pages, page_size, R + P]
    block_table: torch.Tensor  # int32 [B, max_pages]
    seq_lens: torch.Tensor  # int32 [B]
    cu_seqlens_q: torch.Tensor | None  # int32 [B + 1]; None: decode
    out: torch.Tensor  # written: [T, H, R], q's dtype
    scale: float
    kv_scale: torch.Tensor | None = None  # fp8: float32, one element
    sinks: torch.Tensor | None = None  # float32 [H]
    tree_mask: torch.Tensor | None = None  # bool [T, Q]
    lse: torch.Tensor | None = None  # written when given: float32 [T, H]
    topk_indices: torch.Tensor | None = None  # int32 [T, K]: each row's key positions (the sparse form); -1 none


class MLAWriteCall(NamedTuple):
    """One mla_cache_write call as a backend runs it."""

    case: MLAWriteCase
    kv_c: torch.Tensor  # [N, R]
    k_pe: torch.Tensor  # [N, P]
    kv_cache: torch.Tensor  # written
    slot_mapping: torch.Tensor  # int64 [N]
    kv_scale: torch.Tensor | None = None


def query_rows(seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor | None,
               num_tokens: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each query row's sequence, position in it and its query block's first position (int64 [T] each, on
    seq_lens' device): in decode (cu_seqlens_q None; num_tokens unused) row t is sequence t's last position; else
    the rows cu_seqlens_q[b]:cu_seqlens_q[b+1] are sequence b's last positions, in order. Device ops on shapes only
    (graph-safe); cu_seqlens_q is taken as valid (from 0 to num_tokens, non-decreasing)."""
    lengths = seq_lens.long()
    if cu_seqlens_q is None:
        return torch.arange(lengths.shape[0], device=seq_lens.device), lengths - 1, lengths - 1
    tokens = torch.arange(num_tokens, device=seq_lens.device)
    starts, counts = cu_seqlens_q[:-1].long(), cu_seqlens_q.long().diff()
    seq = torch.repeat_interleave(torch.arange(lengths.shape[0], device=seq_lens.device), counts,
                                  output_size=num_tokens)
    block_start = (lengths - counts)[seq]
    return seq, block_start + tokens - starts[seq], block_start

