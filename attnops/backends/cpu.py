"""The CPU backend: binds the C++ kernels of csrc/cpu (paged_attention.cpp, mla_attention.cpp,
reshape_and_cache.cpp).

The kernels are registered as internal ops, `torch.ops.attnops.cpu_paged_attention`,
`torch.ops.attnops.cpu_reshape_and_cache`, and for latent attention (MLA) `cpu_mla_attention` and
`cpu_mla_cache_write`, which take already-validated arguments (attnops/ops.py validates, then dispatches here) and
the device's error buffer (attnops.errors), where they record bad indices. They run on at::parallel_for's threads
(torch.get_num_threads()), with inner loops compiled for AVX-512, AVX2 and portable C++ and picked at run time;
latent attention runs paged attention's, as multi-query attention over the latent rows, and its sparse form as a
decode of each query row over the keys it lists (_listed_rows).
"""
from __future__ import annotations

import torch

from .. import _C  # noqa: F401  (registers the C++ ops)
from .. import checks, errors, invariance
from ..cases import query_rows
from .base import Backend, CacheWriteCase, MLACase, MLAWriteCase, common_reasons

# What the kernels serve, as data (dispatch and `attnops.explain` read the reasons built from it).
DEVICES = ("cpu",)
Q_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # also key/value of reshape_and_cache
KV_FORMATS = ("fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "nvfp4", "mxfp4")
# every head dim the ops take (16, 32, ..., 512): the inner loops take a row in whole vectors of 8 or 16 floats
HEAD_DIMS = checks.HEAD_DIMS
# 4-bit caches are read (a chunk of rows dequantized at a time), not written
WRITE_KV_FORMATS = ("fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2")
# latent attention's caches (read and written): the plain ones, fp8 e4m3 and DeepSeek's fp8 layout
MLA_KV_FORMATS = ("fp32", "bf16", "fp16", "fp8_e4m3", "fp8_ds_mla")
FP4_WRITE_REASON = ("4-bit cache writes (nvfp4, mxfp4) are not implemented in the C++ CPU kernels; the reference "
                    "backend writes them")


OPS = ("cpu_paged_attention", "cpu_reshape_and_cache", "cpu_mla_attention", "cpu_mla_cache_write")


def _ops_built() -> bool:
    return all(hasattr(torch.ops.attnops, name) for name in OPS)


class CPUBackend(Backend):
    name = "cpu"
    serves_mla = True

    @property
    def description(self) -> str:
        isa = self.isa() if _ops_built() else "not built"
        return ("C++ kernels (csrc/cpu): at::parallel_for over sequences x KV heads x KV splits, online softmax in "
                f"fp32, at::vec inner loops (running the {isa} copy of avx512/avx2/default); GQA groups share each "
                "K/V row; latent attention (MLA) as multi-query attention over the latent rows")

    def __init__(self):
        self._ops_cache = None

    def unavailable(self) -> list[str]:
        if not _ops_built():
            return ["attnops._C was built without the C++ CPU kernels (csrc/cpu)"]
        return []

    def invariance_reasons(self, case) -> list[str]:
        return []  # in the mode the kernels split a sequence's keys by its own length only (batch_invariant=True)

    def supports(self, case) -> list[str]:
        if isinstance(case, (MLACase, MLAWriteCase)):  # (checks_mla bounds the latent shapes)
            return common_reasons(case, devices=DEVICES, q_dtypes=Q_DTYPES, kv_formats=MLA_KV_FORMATS)
        reasons = common_reasons(case, devices=DEVICES, q_dtypes=Q_DTYPES, kv_formats=KV_FORMATS,
                                 head_dims=HEAD_DIMS)
        if isinstance(case, CacheWriteCase) and case.kv_format in KV_FORMATS and \
                case.kv_format not in WRITE_KV_FORMATS:
            reasons.append(FP4_WRITE_REASON)
        return reasons

    def isa(self) -> str:
        """The instruction set of the inner loops in use: "avx512", "avx2" or "default" (portable)."""
        return torch.ops.attnops.cpu_kernel_isa()

    # The op overloads are looked up once (torch.ops attribute lookups cost microseconds per call): OPS' order.
    def _ops(self):
        if self._ops_cache is None:
            self._ops_cache = tuple(getattr(torch.ops.attnops, name).default for name in OPS)
        return self._ops_cache

    def paged_attention(self, call) -> None:
        attention = self._ops()[0]
        args = (call.q, call.k_cache, call.v_cache, call.block_table, call.seq_lens, call.cu_seqlens_q,
                float(call.scale), float(call.soft_cap), int(call.window_left), call.k_scale, call.v_scale,
                call.sinks, call.tree_mask, call.out, errors.buffer(call.q.device))
        # (lse: the kernel writes each row's LSE from its online softmax's running max and sum)
        attention(*args, call.lse, invariance.enabled())

    def reshape_and_cache(self, call) -> None:
        cache_write = self._ops()[1]
        cache_write(call.key, call.value, call.k_cache, call.v_cache, call.slot_mapping, call.k_scale, call.v_scale,
                    errors.buffer(call.key.device))

    def mla_attention(self, call) -> None:
        attention = self._ops()[2]
        if call.topk_indices is None:
            attention(call.q_nope, call.q_pe, call.kv_cache, call.block_table, call.seq_lens, call.cu_seqlens_q,
                      call.scale, call.kv_scale, call.sinks, call.tree_mask, call.out,
                      errors.buffer(call.q_nope.device), call.lse, invariance.enabled())
            return
        listed = _listed_rows(call)
        if listed is None:  # bad cu_seqlens_q: which rows are whose is undefined
            call.out.fill_(float("nan"))
            if call.lse is not None:
                call.lse.fill_(float("nan"))
            return
        rows, table, lengths, poison = listed
        attention(call.q_nope, call.q_pe, rows, table, lengths, None, call.scale, call.kv_scale, call.sinks, None,
                  call.out, errors.buffer(call.q_nope.device), call.lse, invariance.enabled())
        call.out[poison] = float("nan")
        if call.lse is not None:
            call.lse[poison] = float("nan")

    def mla_cache_write(self, call) -> None:
        cache_write = self._ops()[3]
        cache_write(call.kv_c, call.k_pe, call.kv_cache, call.slot_mapping, call.kv_scale,
                    errors.buffer(call.kv_c.device))


def _listed_rows(call):
    """The sparse form (topk_indices) as the kernels' dense decode: query row t becomes a sequence of its own whose
    keys are the rows its list names and lets it see (causal; a tree mask inside its block), in list order, read
    through a page-size-1 view of the cache whose table holds their slots. Returns (that view, the table, the
    lengths, the rows to poison with NaN: a bad length, a listed position outside the sequence, a seen key on a
    page outside the cache; each recorded as the other backends record it), or None for a bad cu_seqlens_q."""
    q, listed = call.q_nope, call.topk_indices.long()
    num_tokens = q.shape[0]
    num_pages, page = call.kv_cache.shape[0], call.kv_cache.shape[1]
    lengths, width = call.seq_lens.long(), call.block_table.shape[1]
    if call.cu_seqlens_q is not None:
        bad = errors.cu_seqlens_violation(call.cu_seqlens_q.tolist(), num_tokens)
        if bad is not None:
            errors.record(q.device, errors.CU_SEQLENS_Q, bad)
            return None
    seq, position, block_start = query_rows(call.seq_lens, call.cu_seqlens_q, num_tokens)
    row_len = lengths[seq]
    len_bad = (row_len < 0) | (row_len > width * page)
    entry_bad = ((listed < -1) | (listed >= row_len[:, None])).any(1) & ~len_bad
    if call.tree_mask is None:  # each row sees the keys at or before its position
        seen = listed <= position[:, None]
    else:  # every key before the block, and the block's keys its mask row names
        column = listed - block_start[:, None]
        inside = (column >= 0) & (column < call.tree_mask.shape[1])
        named = call.tree_mask.gather(1, torch.where(inside, column, 0).clamp(max=call.tree_mask.shape[1] - 1))
        seen = (column < 0) | (inside & named)
    seen &= (listed >= 0) & (listed < row_len[:, None]) & ~len_bad[:, None]
    table = call.block_table.long() if width else torch.full((lengths.shape[0], 1), -1)  # (an empty table: no page)
    page_index = table[seq[:, None], (listed.clamp(min=0) // page).clamp(max=table.shape[1] - 1)]
    page_bad = seen & ((page_index < 0) | (page_index >= num_pages))
    for argument, rows, where in ((errors.SEQ_LENS, len_bad, seq), (errors.TOPK_INDICES, entry_bad,
                                                                     torch.arange(num_tokens)),
                                  (errors.BLOCK_TABLE, page_bad.any(1), seq)):
        if bool(rows.any()):
            errors.record(q.device, argument, int(where[rows].min()))
    keep = seen & ~page_bad
    slots = torch.where(keep, page_index * page + listed % page, 0)
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)  # the kept entries first, in list order
    table = slots.gather(1, order).to(torch.int32)
    rows = call.kv_cache.reshape(num_pages * page, 1, call.kv_cache.shape[2])  # (a view where the pages allow)
    return rows, table, keep.sum(1).to(torch.int32), len_bad | entry_bad | page_bad.any(1)

