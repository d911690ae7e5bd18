"""attnops' CUDA C++ kernels (csrc/cuda, built by setup.py where torch has CUDA and nvcc is found): paged attention
over a 4-bit KV cache (nvfp4, mxfp4) for decode and verify, read in place with a register layout Triton cannot
express (csrc/cuda/fp4_paged_attention.cu says how).

A cache view it cannot copy by aligned words (AttentionCase.aligned_kv: an odd byte offset, a scale row off its own
size's alignment, K's and V's scales with different strides) is declined, so dispatch gives it to Triton, which
reads any layout, and `attnops.explain` says why.

The split of each sequence's keys is planned from shapes only (the block table's capacity, the batch, the GPU's SM
count), so a CUDA graph replays it for any lengths; partial results live in a workspace the size of the output
times the splits, never of the cache.
"""
from __future__ import annotations

import functools
import math

import torch

from .. import _C  # noqa: F401  (registers the C++ and CUDA ops)
from .. import errors, invariance
from ..env import environ_get, sm_count
from . import cuda_mla, cuda_prefill
from .base import AttentionCase, Backend, MLACase, common_reasons, kernel_outputs, rows_without_a_sequence

HEAD_DIMS = (64, 128, 256)
KV_FORMATS = ("nvfp4", "mxfp4")
Q_DTYPES = (torch.bfloat16, torch.float16)
MIN_ARCH = (8, 9)  # cvt.rn.f16x2.e4m3x2
TILE = 128  # keys a block's step takes; splits are whole tiles
MAX_SPLITS = 64
MAX_BATCH = 65535
SPLIT_KEYS = 8192  # a split takes at most this many keys (a long sequence next to short ones is not one block's tail)
INVARIANT_CHUNK = 2048  # batch-invariant mode: keys a split, whatever the call (a multiple of TILE)
# A split that holds no key of its sequence (the short sequences of a ragged batch, whose splits cover the table's
# capacity) only marks its partials empty, and the merge reads no partial of weight 0: the same bits either way,
# ragged batches faster (docs/bench.md). ATTNOPS_CUDA_SKIP_EMPTY_SPLITS=0 runs them instead (an A/B).
SKIP_EMPTY_SPLITS_ENV = "ATTNOPS_CUDA_SKIP_EMPTY_SPLITS"


def built() -> bool:
    """Whether this build of attnops has the CUDA kernels (a CUDA torch and nvcc at build time)."""
    return hasattr(torch.ops.attnops, "fp4_paged_attention_cuda")


@functools.lru_cache(maxsize=None)
def built_arch(device_index: int) -> int:
    """The virtual arch (10 x major + minor) the kernels' code on this device was compiled for; 0 if none."""
    return int(torch.ops.attnops.fp4_cuda_built_arch(device_index))


def plan_splits(device_index: int, batch: int, num_kv_heads: int, capacity: int) -> tuple[int, int]:
    """(splits, keys a split) for a call of these shapes: enough blocks for about one and a half waves of four
    blocks an SM, no split longer than SPLIT_KEYS, none shorter than two tiles. Shapes only: graph-safe."""
    tiles = max(1, math.ceil(capacity / TILE))
    work = max(1, batch * num_kv_heads)
    splits = max(math.ceil(6 * sm_count(device_index) / work), math.ceil(capacity / SPLIT_KEYS))
    splits = max(1, min(splits, MAX_SPLITS, math.ceil(tiles / 2)))
    chunk = math.ceil(tiles / splits) * TILE
    return math.ceil(tiles * TILE / chunk), chunk


class CudaBackend(Backend):
    name = "cuda"
    description = ("attnops' CUDA C++ kernels: 4-bit KV (nvfp4, mxfp4) at head dims 64/128/256, decode and verify, "
                   "windows and soft cap, read in place; latent-attention (MLA) decode on sm_90a (bf16 and fp8 "
                   "caches); prefill over bf16/fp16 caches at head dim 128 on sm_90a (off until measured: "
                   "ATTNOPS_CUDA_PREFILL=1)")
    writes_cache = False  # reshape_and_cache goes to the Triton kernels
    serves_mla = True  # latent-attention decode on sm_90a (cuda_mla.py)

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

    def invariance_reasons(self, case) -> list[str]:
        if isinstance(case, AttentionCase) and case.kv_format in cuda_prefill.KV_FORMATS:
            return ["bf16/fp16 caches: its prefill kernel is not yet tested in batch-invariant mode"]
        return []  # (invariance.fixed_splits in the mode; a block's warps split its keys by position only)

    def supports(self, case) -> list[str]:
        if isinstance(case, MLACase):
            return cuda_mla.reasons(case)
        if not isinstance(case, AttentionCase):
            return ["attention only (cache writes are the Triton kernels')"]
        if case.kv_format in cuda_prefill.KV_FORMATS:
            return cuda_prefill.reasons(case)
        reasons = common_reasons(case, devices=("cuda",), q_dtypes=Q_DTYPES, kv_formats=KV_FORMATS,
                                 head_dims=HEAD_DIMS, sinks=False, tree_mask=False, archs=lambda arch: arch >= MIN_ARCH)
        if case.shape_class == "prefill":
            reasons.append("prefill (more than 16 query tokens a sequence on average): decode and verify only")
        if case.batch > MAX_BATCH:
            reasons.append(f"more than {MAX_BATCH} sequences (a grid dimension of its launch)")
        if not case.aligned_kv:
            reasons.append("a cache view it cannot copy by aligned words (an odd byte offset, a scale row off its "
                           "own size's alignment, K's and V's scales with different strides, pages 4 GiB or more "
                           "apart): checks.kv_layout_reasons names which")
        return reasons

    def mla_attention(self, call) -> None:
        cuda_mla.mla_attention(call)

    def paged_attention(self, call) -> None:
        if call.case.kv_format in cuda_prefill.KV_FORMATS:
            cuda_prefill.paged_attention(call)
            return
        out, lse = call.out, call.lse
        if out.stride(-1) != 1 or (lse is not None and not lse.is_contiguous()):
            with kernel_outputs(out, lse) as (out_w, lse_w):
                self.paged_attention(call._replace(out=out_w, lse=lse_w))
            return
        case = call.case
        q = call.q if call.q.stride(-1) == 1 else call.q.contiguous()
        block_table = call.block_table if call.block_table.stride(1) == 1 else call.block_table.contiguous()
        seq_lens = call.seq_lens.contiguous()
        cu_seqlens_q = None if call.cu_seqlens_q is None else call.cu_seqlens_q.contiguous()
        if case.batch == 0 and call.num_tokens > 0:
            rows_without_a_sequence(out, lse)
            return
        if invariance.enabled():
            splits, chunk = invariance.fixed_splits(call.capacity, INVARIANT_CHUNK)
        else:
            splits, chunk = plan_splits(q.device.index if q.device.index is not None else torch.cuda.current_device(),
                                        case.batch, case.num_kv_heads, call.capacity)
        workspace = torch.empty(call.num_tokens * case.num_q_heads * splits * (case.head_dim + 1) if splits > 1 else 0,
                                dtype=torch.float32, device=q.device)
        torch.ops.attnops.fp4_paged_attention_cuda(
            q, call.k_cache, call.v_cache, call.k_scale.view(torch.uint8), call.v_scale.view(torch.uint8), block_table,
            seq_lens, cu_seqlens_q, out, lse, workspace, errors.buffer(q.device), float(call.scale),
            float(call.soft_cap) if math.isfinite(call.soft_cap) else 0.0, int(call.window_left),
            call.kv_format == "mxfp4", splits, chunk, environ_get(SKIP_EMPTY_SPLITS_ENV) != "0")
