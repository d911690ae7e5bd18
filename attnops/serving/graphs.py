"""CUDA graphs for decode loops: a step function captured once per batch-size bucket and replayed every token.

    runner = attnops.serving.graphs.DecodeGraphRunner(step, cache, buckets=(1, 8, 32, 128))
    logits = runner(token_ids, positions, meta)       # meta from cache.prepare(seq_ids): decode, B <= 128

`step(token_ids, positions, block_table, seq_lens, slot_mapping)` is the model's decode step (eager or
torch.compile'd): [B] tokens in, whatever out, calling attnops' ops with the metadata it is given. The runner
keeps static copies of those inputs per bucket (batching.StaticDecodeInputs: a batch padded up to its bucket,
padding rows with seq_len 0 and slot -1, so nothing is written and their output rows are 0), and before each replay does the host-side planning that
backends need (FlashInfer's plan()), once per step, not once per layer: during capture a backend registers a
re-planner with `attnops.capture.current_capture()`, and the runner calls each one before every replay.
"""
from __future__ import annotations

import torch

from ..capture import CaptureContext, capturing
from .batching import StaticDecodeInputs
from .kv_cache import BatchMetadata, PagedKVCache


class DecodeGraphRunner:
    """Captures `step` once per batch-size bucket in a CUDA graph and replays it for every decode step, padding
    the batch up to its bucket and re-planning host-planned backends (FlashInfer) before each replay; see the
    module's docstring for the step's signature."""

    def __init__(self, step, cache: PagedKVCache, buckets=(1, 2, 4, 8, 16, 32, 64, 128), max_pages: int | None = None,
                 inputs: StaticDecodeInputs | None = None):
        """`inputs`: the static inputs to capture over (a DecodeStep passes its own, so there is one set); by
        default the runner makes its own for `buckets` and `max_pages` (default: the cache's page count)."""
        if cache.device.type != "cuda":
            raise ValueError(f"DecodeGraphRunner: CUDA graphs need a CUDA cache (got {cache.device})")
        self.step, self.cache = step, cache
        self.inputs = inputs or StaticDecodeInputs(buckets, max_pages or cache.num_pages, cache.device,
                                                   owner="DecodeGraphRunner")
        self.buckets, self.max_pages = list(self.inputs.buckets), self.inputs.max_pages
        self.graphs: dict = {}  # bucket -> (graph, static output, context)
        self.pool = None  # one memory pool shared by all buckets' graphs
        # Replanners stage plans in host buffers that a stream-ordered copy then reads (FlashInfer's pinned
        # workspace): the next replan waits until that copy of the previous one has run on the stream. The host
        # still runs up to one step ahead of the GPU (no wait for the previous replay itself).
        self.replanned = None

    def bucket_for(self, batch: int) -> int:
        return self.inputs.bucket_for(batch)

    def _capture(self, bucket: int):
        static = self.inputs.pad(bucket)  # capture with every row padding: no cache writes, empty sequences
        ctx = CaptureContext(bucket, host_seq_lens=[0] * bucket)
        # warm up on a side stream (Triton compiles, backends create and plan their graph buffers)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), capturing(ctx):
            for _ in range(2):
                self.step(**static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with capturing(ctx), torch.cuda.graph(graph, pool=self.pool):
            out = self.step(**static)
        self.pool = graph.pool()
        self.graphs[bucket] = (graph, out, ctx)

    def __call__(self, token_ids: torch.Tensor, positions: torch.Tensor, meta: BatchMetadata):
        """Runs one decode step through the bucket's graph; returns the output's first B rows (a view of the
        graph's static output: read it before the next call)."""
        if meta.cu_seqlens_q is not None:
            raise ValueError("DecodeGraphRunner: decode steps only (meta.cu_seqlens_q must be None)")
        batch = meta.block_table.shape[0]
        bucket = self.inputs.bucket_for(batch)
        if bucket not in self.graphs:
            self._capture(bucket)
        graph, out, ctx = self.graphs[bucket]
        self.inputs.fill(token_ids, positions, meta)
        if ctx.replanners:  # host planning for this step's metadata, once for all layers
            host = meta.host_seq_lens if meta.host_seq_lens is not None else meta.seq_lens.tolist()
            ctx.host_seq_lens = list(host) + [0] * (bucket - batch)
            if self.replanned is not None:
                self.replanned.synchronize()
            ctx.replan()
            self.replanned = torch.cuda.Event()
            self.replanned.record()
        graph.replay()
        return out[:batch]
