"""The serving kit built on the op library: a paged KV cache, CUDA-graph decode steps, a Llama model through the
ops, continuous-batching generation, tensor parallelism and the demo. It imports the op library (attnops.ops,
attnops.formats, attnops.capture, attnops.dispatch); nothing in the op library imports it."""
from .kv_cache import BatchMetadata, PagedKVCache

__all__ = ["BatchMetadata", "PagedKVCache"]
