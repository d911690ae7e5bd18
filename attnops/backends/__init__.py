"""The backends built into attnops, by name. Dispatch (attnops/dispatch.py) decides which one serves a case."""
from .base import AttentionCase, Backend, CacheWriteCase
from .reference import ReferenceBackend

BACKENDS: dict[str, Backend] = {b.name: b for b in (ReferenceBackend(),)}

__all__ = ["AttentionCase", "Backend", "BACKENDS", "CacheWriteCase"]
