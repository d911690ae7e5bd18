"""The CPU backend: binds the C++ kernels of csrc/cpu (paged_attention.cpp, mla_attention.cpp,
reshape_and_cache.cpp).

The kernels are registered as internal ops, `torch.ops.attnops.cpu_paged_attention`,
`torch.ops.attnops.cpu_reshape_and_cache`, and for latent attention (MLA) `cpu_mla_attention` and
`cpu_mla_cache_write`, which take already-validated arguments (attnops/ops.py validates, then dispatches here) and
the device's error buffer (attnops.errors), where they record bad indices. They run on at::parallel_for's threads
(torch.get_num_threads()), with inner loops compiled for AVX-512, AVX2 and portable C++ and picked at run time;
latent attention runs paged attention's, as multi-query attention over the latent rows.
"""
from __future__ import annotations

import torch

from .. import _C  # noqa: F401  (registers the C++ ops)
from .. import checks, errors, invariance
from .base import Backend, CacheWriteCase, MLACase, MLAWriteCase, common_reasons

# What the kernels serve, as data (dispatch and `attnops.explain` read the reasons built from it).
DEVICES = ("cpu",)
Q_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # also key/value of reshape_and_cache
KV_FORMATS = ("fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "nvfp4", "mxfp4")
# every head dim the ops take (16, 32, ..., 512): the inner loops take a row in whole vectors of 8 or 16 floats
HEAD_DIMS = checks.HEAD_DIMS
# 4-bit caches are read (a chunk of rows dequantized at a time), not written
WRITE_KV_FORMATS = ("fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2")
FP4_WRITE_REASON = ("4-bit cache writes (nvfp4, mxfp4) are not implemented in the C++ CPU kernels; the reference "
                    "backend writes them")


# the kernels loop over a sequence's keys in order, for a block of query rows at once; the sparse form's rows each
# list their own keys
SPARSE_REASON = "the sparse form (topk_indices): the reference backend serves it on the CPU"

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
        if isinstance(case, (MLACase, MLAWriteCase)):  # (checks_mla bounds the latent formats and shapes)
            reasons = common_reasons(case, devices=DEVICES, q_dtypes=Q_DTYPES, kv_formats=KV_FORMATS)
            if getattr(case, "topk", 0):
                reasons.append(SPARSE_REASON)
            return reasons
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
        attention(call.q_nope, call.q_pe, call.kv_cache, call.block_table, call.seq_lens, call.cu_seqlens_q,
                  call.scale, call.kv_scale, call.sinks, call.tree_mask, call.out, errors.buffer(call.q_nope.device),
                  call.lse, invariance.enabled())

    def mla_cache_write(self, call) -> None:
        cache_write = self._ops()[3]
        cache_write(call.kv_c, call.k_pe, call.kv_cache, call.slot_mapping, call.kv_scale,
                    errors.buffer(call.kv_c.device))
