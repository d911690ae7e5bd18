"""CUDA graphs for decode loops: a step function captured once per batch-size bucket and replayed every token.

    runner = attnops.graphs.DecodeGraphRunner(step, cache, buckets=(1, 8, 32, 128))
    logits = runner(token_ids, positions, meta)       # meta from cache.prepare(seq_ids): decode, B <= 128

`step(token_ids, positions, block_table, seq_lens, slot_mapping)` is the model's decode step (eager or
torch.compile'd): [B] tokens in, whatever out, calling attnops' ops with the metadata it is given. The runner
keeps static copies of those inputs per bucket, pads a batch up to its bucket (padding rows have seq_len 0 and
slot -1: nothing is written, their output rows are 0), and before each replay does the host-side planning that
backends need (FlashInfer's plan()), once per step, not once per layer: during capture a backend registers a
re-planner with `attnops.capture.current_capture()`, and the runner calls each one before every replay.
"""
from __future__ import annotations

import torch

from .capture import CaptureContext, capturing, current_capture  # noqa: F401  (current_capture: re-exported)
from .kv_cache import BatchMetadata, PagedKVCache


class DecodeGraphRunner:
    def __init__(self, step, cache: PagedKVCache, buckets=(1, 2, 4, 8, 16, 32, 64, 128), max_pages: int | None = None):
        if cache.device.type != "cuda":
            raise ValueError(f"DecodeGraphRunner: CUDA graphs need a CUDA cache (got {cache.device})")
        self.step, self.cache = step, cache
        self.buckets = sorted(buckets)
        self.max_pages = max_pages or cache.num_pages
        self.graphs: dict = {}  # bucket -> (graph, static inputs, static output, context)
        self.pool = None  # one memory pool shared by all buckets' graphs
        # Replanners stage plans in host buffers that a stream-ordered copy then reads (FlashInfer's pinned
        # workspace): the next replan waits until that copy of the previous one has run on the stream. The host
        # still runs up to one step ahead of the GPU (no wait for the previous replay itself).
        self.replanned = None

    def bucket_for(self, batch: int) -> int:
        for b in self.buckets:
            if b >= batch:
                return b
        raise ValueError(f"DecodeGraphRunner: batch {batch} exceeds the largest bucket {self.buckets[-1]}")

    def _static_inputs(self, bucket: int) -> dict:
        device = self.cache.device
        return dict(token_ids=torch.zeros(bucket, dtype=torch.long, device=device),
                    positions=torch.zeros(bucket, dtype=torch.long, device=device),
                    block_table=torch.full((bucket, self.max_pages), -1, dtype=torch.int32, device=device),
                    seq_lens=torch.zeros(bucket, dtype=torch.int32, device=device),
                    slot_mapping=torch.full((bucket,), -1, dtype=torch.int64, device=device))

    def _capture(self, bucket: int):
        static = self._static_inputs(bucket)
        ctx = CaptureContext(bucket, host_seq_lens=[0] * bucket)
        # warm up on a side stream (Triton compiles, backends create and plan their graph buffers), all rows
        # padding: no cache writes, empty sequences
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
        self.graphs[bucket] = (graph, static, out, ctx)

    def __call__(self, token_ids: torch.Tensor, positions: torch.Tensor, meta: BatchMetadata):
        """Runs one decode step through the bucket's graph; returns the output's first B rows (a view of the
        graph's static output: read it before the next call)."""
        if meta.cu_seqlens_q is not None:
            raise ValueError("DecodeGraphRunner: decode steps only (meta.cu_seqlens_q must be None)")
        batch, width = meta.block_table.shape
        if width > self.max_pages:
            raise ValueError(f"DecodeGraphRunner: block_table has {width} pages per row, above max_pages "
                             f"{self.max_pages}")
        bucket = self.bucket_for(batch)
        if bucket not in self.graphs:
            self._capture(bucket)
        graph, static, out, ctx = self.graphs[bucket]
        static["token_ids"][:batch].copy_(token_ids)
        static["token_ids"][batch:].zero_()
        static["positions"][:batch].copy_(positions)
        static["positions"][batch:].zero_()
        static["block_table"].fill_(-1)
        static["block_table"][:batch, :width].copy_(meta.block_table)
        static["seq_lens"].zero_()
        static["seq_lens"][:batch].copy_(meta.seq_lens)
        static["slot_mapping"].fill_(-1)
        static["slot_mapping"][:batch].copy_(meta.slot_mapping)
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
