"""The CPU backend: binds the C++ kernels of csrc/cpu (paged_attention.cpp, reshape_and_cache.cpp).

The kernels are registered as internal ops, `torch.ops.attnops.cpu_paged_attention` and
`torch.ops.attnops.cpu_reshape_and_cache`, which take already-validated arguments (attnops/ops.py validates, then
dispatches here) and the device's error buffer (attnops.errors), where they record bad indices. They run on
at::parallel_for's threads (torch.get_num_threads()), with inner loops compiled for AVX-512, AVX2 and portable C++
and picked at run time.
"""
from __future__ import annotations

import torch

from .. import _C  # noqa: F401  (registers the C++ ops)
from .. import errors, formats
from .base import Backend, common_reasons

# What the kernels serve, as data (dispatch and `attnops.explain` read the reasons built from it).
DEVICES = ("cpu",)
Q_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # also key/value of reshape_and_cache
KV_FORMATS = ("fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2")
HEAD_DIMS = (32, 64, 128, 256)  # the inner loops take head_dim in whole 32-float blocks, up to 256
FP4_REASON = ("4-bit KV (nvfp4, mxfp4) is not implemented in the C++ CPU kernels; the reference backend "
              "serves it")


def _ops_built() -> bool:
    return hasattr(torch.ops.attnops, "cpu_paged_attention") and hasattr(torch.ops.attnops, "cpu_reshape_and_cache")


class CPUBackend(Backend):
    name = "cpu"

    @property
    def description(self) -> str:
        isa = self.isa() if _ops_built() else "not built"
        return ("C++ kernels (csrc/cpu): at::parallel_for over sequences x KV heads x KV splits, online softmax in "
                f"fp32, at::vec inner loops (running the {isa} copy of avx512/avx2/default); GQA groups share each "
                "K/V row")

    def __init__(self):
        self._attention = None
        self._cache_write = None

    def unavailable(self) -> list[str]:
        if not _ops_built():
            return ["attnops._C was built without the C++ CPU kernels (csrc/cpu)"]
        return []

    def supports(self, case) -> list[str]:
        reasons = common_reasons(case, devices=DEVICES, q_dtypes=Q_DTYPES, kv_formats=KV_FORMATS,
                                 head_dims=HEAD_DIMS)
        if formats.is_fp4(case.kv_format):
            reasons.append(FP4_REASON)
        return reasons

    def isa(self) -> str:
        """The instruction set of the inner loops in use: "avx512", "avx2" or "default" (portable)."""
        return torch.ops.attnops.cpu_kernel_isa()

    # The op overloads are looked up once (torch.ops attribute lookups cost microseconds per call).
    def _ops(self):
        if self._attention is None:
            self._attention = torch.ops.attnops.cpu_paged_attention.default
            self._cache_write = torch.ops.attnops.cpu_reshape_and_cache.default
        return self._attention, self._cache_write

    def paged_attention(self, call) -> None:
        attention, _ = self._ops()
        args = (call.q, call.k_cache, call.v_cache, call.block_table, call.seq_lens, call.cu_seqlens_q,
                float(call.scale), float(call.soft_cap), int(call.window_left), call.k_scale, call.v_scale,
                call.sinks, call.tree_mask, call.out, errors.buffer(call.q.device))
        if call.lse is None:
            attention(*args)
        else:  # the kernel writes each row's LSE from its online softmax's running max and sum
            attention(*args, call.lse)

    def reshape_and_cache(self, call) -> None:
        _, cache_write = self._ops()
        cache_write(call.key, call.value, call.k_cache, call.v_cache, call.slot_mapping, call.k_scale, call.v_scale,
                    errors.buffer(call.key.device))
