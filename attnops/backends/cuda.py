"""attnops' CUDA C++ kernels (csrc/cuda, built by setup.py where torch has CUDA and nvcc is found): paged attention
over a 4-bit KV cache (nvfp4, mxfp4) for decode and verify, read in place with a register layout Triton cannot
express (csrc/cuda/fp4_paged_attention.cu says how).

The split of each sequence's keys is planned from shapes only (the block table's capacity, the batch, the GPU's SM
count), so a CUDA graph replays it for any lengths; partial results live in a workspace the size of the output
times the splits, never of the cache.
"""
from __future__ import annotations

import functools
import math
import warnings

import torch

from .. import _C  # noqa: F401  (registers the C++ and CUDA ops)
from .. import errors
from .base import AttentionCase, Backend, common_reasons, kernel_outputs, rows_without_a_sequence

HEAD_DIMS = (64, 128, 256)
KV_FORMATS = ("nvfp4", "mxfp4")
Q_DTYPES = (torch.bfloat16, torch.float16)
MIN_ARCH = (8, 9)  # cvt.rn.f16x2.e4m3x2
TILE = 128  # keys a block's step takes; splits are whole tiles
MAX_SPLITS = 64
MAX_BATCH = 65535
SPLIT_KEYS = 8192  # a split takes at most this many keys (a long sequence next to short ones is not one block's tail)


def built() -> bool:
    """Whether this build of attnops has the CUDA kernels (a CUDA torch and nvcc at build time)."""
    return hasattr(torch.ops.attnops, "fp4_paged_attention_cuda")


@functools.lru_cache(maxsize=None)
def built_arch(device_index: int) -> int:
    """The virtual arch (10 x major + minor) the kernels' code on this device was compiled for; 0 if none."""
    return int(torch.ops.attnops.fp4_cuda_built_arch(device_index))


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def plan_splits(device_index: int, batch: int, num_kv_heads: int, capacity: int) -> tuple[int, int]:
    """(splits, keys a split) for a call of these shapes: enough blocks for about one and a half waves of four
    blocks an SM, no split longer than SPLIT_KEYS, none shorter than two tiles. Shapes only: graph-safe."""
    tiles = max(1, math.ceil(capacity / TILE))
    work = max(1, batch * num_kv_heads)
    splits = max(math.ceil(6 * _sm_count(device_index) / work), math.ceil(capacity / SPLIT_KEYS))
    splits = max(1, min(splits, MAX_SPLITS, math.ceil(tiles / 2)))
    chunk = math.ceil(tiles / splits) * TILE
    return math.ceil(tiles * TILE / chunk), chunk


def _layout_reasons(head_dim, k_cache, v_cache, k_scale, v_scale) -> list[str]:
    """What of these tensors' layout the kernel cannot read (a lane copies D / 8 bytes of a key, at most 16 at once,
    and a key's whole scale row): empty if it can."""
    reasons = []
    if k_cache.stride() != v_cache.stride() or k_scale.stride() != v_scale.stride():
        reasons.append("k and v caches (or their scales) have different strides")
    chunk = min(head_dim // 8, 16)  # bytes a copy of a key takes
    scale_row = min(k_scale.shape[-1] * k_scale.element_size(), 16)  # (2 (mxfp4 at 64: a plain load), 4, 8 or 16)
    for name, t, align in (("k_cache", k_cache, chunk), ("v_cache", v_cache, chunk), ("k_scale", k_scale, scale_row),
                           ("v_scale", v_scale, scale_row)):
        strides = [s * t.element_size() for s in t.stride()[:3]]
        if t.data_ptr() % align or any(s % align or s < 0 for s in strides) or t.stride(3) != 1:
            reasons.append(f"{name} is not {align}-byte aligned with unit inner stride")
        if strides[0] >= 2 ** 32:
            reasons.append(f"{name}'s pages are 4 GiB or more apart")
    return reasons


class CudaBackend(Backend):
    name = "cuda"
    description = ("attnops' CUDA C++ kernels: 4-bit KV (nvfp4, mxfp4) at head dims 64/128/256, decode and verify, "
                   "windows and soft cap, read in place")
    writes_cache = False  # reshape_and_cache goes to the Triton kernels

    def unavailable(self) -> list[str]:
        if not torch.cuda.is_available():
            return ["no CUDA GPU"]
        if not built():
            return ["attnops was built without its CUDA kernels (they need a CUDA torch and nvcc when attnops is "
                    "built: pip install --no-build-isolation -e .)"]
        arch = built_arch(torch.cuda.current_device())
        if arch < MIN_ARCH[0] * 10 + MIN_ARCH[1]:
            return [f"its kernels were built for no arch of sm_{MIN_ARCH[0]}{MIN_ARCH[1]} or later on this GPU "
                    f"(TORCH_CUDA_ARCH_LIST at build time)"]
        return []

    def supports(self, case) -> list[str]:
        if not isinstance(case, AttentionCase):
            return ["attention only (cache writes are the Triton kernels')"]
        reasons = common_reasons(case, devices=("cuda",), q_dtypes=Q_DTYPES, kv_formats=KV_FORMATS,
                                 head_dims=HEAD_DIMS, sinks=False, tree_mask=False, archs=lambda arch: arch >= MIN_ARCH)
        if case.shape_class == "prefill":
            reasons.append("prefill (more than 16 query tokens a sequence on average): decode and verify only")
        if case.batch > MAX_BATCH:
            reasons.append(f"more than {MAX_BATCH} sequences (a grid dimension of its launch)")
        return reasons

    def paged_attention(self, q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, *, scale, soft_cap,
                        window_left, kv_format, k_scale, v_scale, out, sinks=None, tree_mask=None,
                        lse=None) -> None:
        layout = _layout_reasons(q.shape[-1], k_cache, v_cache, k_scale, v_scale)
        if layout:
            # views the kernel cannot copy by words (odd offsets, mixed strides): the Triton kernels read any
            warnings.warn(f"attnops cuda backend: {'; '.join(layout)}; the Triton kernels serve this call",
                          RuntimeWarning, stacklevel=2)
            from .triton.launch import launch
            launch(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale=scale, soft_cap=soft_cap,
                   window_left=window_left, kv_format=kv_format, k_scale=k_scale, v_scale=v_scale, out=out,
                   sinks=sinks, tree_mask=tree_mask, lse=lse)
            return
        if out.stride(-1) != 1 or (lse is not None and not lse.is_contiguous()):
            with kernel_outputs(out, lse) as (out_w, lse_w):
                self.paged_attention(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale=scale,
                                     soft_cap=soft_cap, window_left=window_left, kv_format=kv_format,
                                     k_scale=k_scale, v_scale=v_scale, out=out_w, lse=lse_w)
            return
        if q.stride(-1) != 1:
            q = q.contiguous()
        if block_table.stride(1) != 1:
            block_table = block_table.contiguous()
        seq_lens = seq_lens.contiguous()
        if cu_seqlens_q is not None:
            cu_seqlens_q = cu_seqlens_q.contiguous()
        num_tokens, num_q_heads, head_dim = q.shape
        if seq_lens.shape[0] == 0 and num_tokens > 0:
            rows_without_a_sequence(out, lse)
            return
        page_size = k_cache.shape[1]
        splits, chunk = plan_splits(q.device.index if q.device.index is not None else torch.cuda.current_device(),
                                    seq_lens.shape[0], k_cache.shape[2], block_table.shape[1] * page_size)
        workspace = torch.empty(num_tokens * num_q_heads * splits * (head_dim + 1) if splits > 1 else 0,
                                dtype=torch.float32, device=q.device)
        torch.ops.attnops.fp4_paged_attention_cuda(
            q, k_cache, v_cache, k_scale.view(torch.uint8), v_scale.view(torch.uint8), block_table, seq_lens,
            cu_seqlens_q, out, lse, workspace, errors.buffer(q.device), float(scale),
            float(soft_cap) if math.isfinite(soft_cap) else 0.0, int(window_left), kv_format == "mxfp4", splits, chunk)
