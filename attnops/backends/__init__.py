"""The backends built into attnops, by name. Dispatch (attnops/dispatch.py) decides which one serves a case."""
from .base import AttentionCase, Backend, CacheWriteCase
from .cpu import CPUBackend
from .cuda import CudaBackend
from .flashinfer import FlashInferBackend
from .reference import ReferenceBackend
from .triton import TritonBackend

BACKENDS: dict[str, Backend] = {b.name: b for b in (CPUBackend(), CudaBackend(), FlashInferBackend(), ReferenceBackend(),
                                                    TritonBackend())}

__all__ = ["AttentionCase", "Backend", "BACKENDS", "CacheWriteCase"]
