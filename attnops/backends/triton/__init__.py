"""attnops' own Triton kernels: split-KV paged attention (decode, verify, extend, prefill) over every KV format,
and reshape_and_cache for every format; latent attention (MLA: mla_kernel.py) and its cache write.

Triton is imported lazily: attnops imports (and this backend declines, saying why) where triton is missing.
"""
from __future__ import annotations

import functools
import os

import torch

from ... import checks, invariance
from ...env import environ_get
from ..base import AttentionCase, Backend, MLACase, MLAWriteCase, common_reasons

# the kernels' tiles span the head dim with tl.arange, whose lengths are powers of two: a head dim between (80, 96,
# 192 ...) runs in the next power of two's tile with the columns past it masked (head_tile, below), every format
# (4-bit: the bytes and block scales past it too), or in two tiles (heuristics.head_parts: decode at 160 and 192).
# Those tiles and 512 pass the GPU tests and, at 80, 96 and 512, read 87-97% of head dim 128's bytes/s in bf16
# (docs/bench.md, "Every head dim"); no other GPU kernel serves those sizes, so they are served by default, and
# ATTNOPS_TRITON_PADDED_HEADS=0 leaves them to the reference on a GPU. TUNED_HEAD_DIMS: the sizes whose tiles were
# tuned.
HEAD_DIMS = checks.HEAD_DIMS
TUNED_HEAD_DIMS = (32, 64, 128, 256)
# the formats the kernels read in place and write (kernel.py and common.py decode each by its FMT code,
# cache_write.py encodes each): a new format is served here once its kernels are
KV_FORMATS = ("bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2", "nvfp4", "mxfp4")
Q_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def head_tile(head_dim: int) -> int:
    """The kernels' tile width for a head dim (tl.arange takes powers of two): the next power of two; the columns
    past the head dim are masked (loaded as 0, never stored)."""
    return 1 << (head_dim - 1).bit_length()


def _head_dim_reasons(case) -> list[str]:
    """Why a head dim outside the tuned ones is not served (empty: it is)."""
    head_dim = case.head_dim
    if head_dim in TUNED_HEAD_DIMS or head_dim not in HEAD_DIMS:
        return []
    if case.device_type == "cuda" and environ_get("ATTNOPS_TRITON_PADDED_HEADS") == "0":
        tile = f"in {head_tile(head_dim)}'s padded tile" if head_tile(head_dim) != head_dim else "its tile"
        return [f"head_dim {head_dim} ({tile}): turned off on a GPU (ATTNOPS_TRITON_PADDED_HEADS=0)"]
    return []


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=1)
def _import_error() -> str | None:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        return f"triton cannot be imported ({type(e).__name__}: {e})"
    return None


class TritonBackend(Backend):
    name = "triton"
    description = ("attnops' Triton kernels: split-KV paged attention with GQA packing (decode/verify/prefill), "
                   "fp8 and 4-bit KV read in-kernel, reshape_and_cache for every format; latent attention (MLA)")
    serves_mla = True

    def unavailable(self) -> list[str]:
        error = _import_error()
        reasons = [error] if error else []
        if not torch.cuda.is_available() and not interpreting():
            reasons.append("no CUDA GPU (TRITON_INTERPRET=1 runs its kernels on the CPU, slowly: for tests)")
        return reasons

    def supports(self, case) -> list[str]:
        # CUDA tensors; CPU tensors only under the interpreter (tests)
        devices = ("cuda", "cpu") if interpreting() else ("cuda",)
        if isinstance(case, (MLACase, MLAWriteCase)):  # (checks_mla bounds the latent formats and shapes)
            reasons = common_reasons(case, devices=devices, archs=lambda arch: arch >= (8, 0))
        else:
            reasons = common_reasons(case, devices=devices, q_dtypes=Q_DTYPES, kv_formats=KV_FORMATS,
                                     head_dims=HEAD_DIMS, archs=lambda arch: arch >= (8, 0))
            reasons += _head_dim_reasons(case)
        src_dtype = case.q_dtype if isinstance(case, (AttentionCase, MLACase)) else case.src_dtype
        if case.device_type == "cpu" and (src_dtype == torch.bfloat16 or case.kv_format == "bf16"):
            reasons.append("bf16 is not supported by the Triton interpreter (CPU)")
        if case.kv_format in ("fp8_e4m3", "nvfp4", "fp8_ds_mla") and case.arch is not None and case.arch < (8, 9):
            # Triton has no fp8e4nv (e4m3: the fp8 format, and nvfp4's block scales) before sm_89
            reasons.append(f"{case.kv_format} needs e4m3 conversions, which Triton supports from sm_89 "
                           f"(this GPU is sm_{case.arch[0]}{case.arch[1]})")
        return reasons

    def invariance_reasons(self, case) -> list[str]:
        return []  # (in the mode, heuristic_config and mla_plan take a fixed split length and batch-free tiles)

    def paged_attention(self, call) -> None:
        from .launch import launch_call
        launch_call(call)

    def mla_attention(self, call) -> None:
        from .mla_launch import mla_launch
        mla_launch(call.q_nope, call.q_pe, call.kv_cache, call.block_table, call.seq_lens, call.cu_seqlens_q,
                   scale=call.scale, kv_format=call.case.kv_format, kv_scale=call.kv_scale, sinks=call.sinks,
                   tree_mask=call.tree_mask, out=call.out, lse=call.lse, topk_indices=call.topk_indices,
                   invariant=invariance.enabled())

    def mla_cache_write(self, call) -> None:
        from .mla_launch import mla_cache_write
        mla_cache_write(call.kv_c, call.k_pe, call.kv_cache, call.slot_mapping, kv_format=call.case.kv_format,
                        kv_scale=call.kv_scale)

    def reshape_and_cache(self, call) -> None:
        from .cache_write import reshape_and_cache
        reshape_and_cache(call)
