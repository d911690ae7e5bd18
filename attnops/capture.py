"""Which CUDA-graph capture an op call is in, and the hook through which the capture's driver keeps host-planned
kernels right on every replay.

A captured graph replays its kernels with the arguments they had at capture. A kernel planned on the host from
the step's lengths (FlashInfer's plan(): work split, page layout) therefore replays a stale plan once the lengths
change, unless something re-plans before each replay. attnops.serving.graphs.DecodeGraphRunner does (and an engine can do
the same): it opens a CaptureContext around warm-up and capture with `capturing(ctx)`; backends register
re-planners on it; before each replay the driver sets `ctx.host_seq_lens` and calls `ctx.replan()`.

A capture nobody re-plans (plain `torch.cuda.graph`, torch.compile's cudagraph trees, an engine's own) is
"foreign": dispatch then passes over backends that plan on the host (Backend.plans_on_host), and a pinned one is
an error at capture time.
"""
from __future__ import annotations

import contextlib
import contextvars
import sys
from dataclasses import dataclass, field

import torch

NONE, REPLANNED, FOREIGN = "none", "replanned", "foreign"


@dataclass
class CaptureContext:
    """What a backend may attach to one captured graph: functions to run on the host before each replay, and
    what they may read there without a device sync: the step's sequence lengths as host ints (padding rows 0)."""

    bucket: int
    replanners: list = field(default_factory=list)
    host_seq_lens: list = field(default_factory=list)

    def replan(self) -> None:
        for replan in self.replanners:
            replan()


_current: contextvars.ContextVar[CaptureContext | None] = contextvars.ContextVar("attnops_capture", default=None)


def current_capture() -> CaptureContext | None:
    """The graph being prepared (warm-up) or captured under `capturing(ctx)` on this thread, if any."""
    return _current.get()


@contextlib.contextmanager
def capturing(ctx: CaptureContext):
    """Marks the warm-up and capture of a graph whose driver calls ctx.replan() before every replay."""
    token = _current.set(ctx)
    try:
        yield
    finally:
        _current.reset(token)


def _cudagraph_trees_warming_up(device_index: int) -> bool:
    """Whether torch.compile's cudagraph trees (mode="reduce-overhead") are running a warm-up of a function on this
    device: that run allocates from the graph's private pool, and the function's next run is captured, so it must
    choose what the capture will. The warm-up runs on the tree manager's own stream, which tells it from an eager
    call made between two compiled ones."""
    trees = sys.modules.get("torch._inductor.cudagraph_trees")  # never imported here: only if torch.compile did
    if trees is None:
        return False
    container = getattr(trees.local, "tree_manager_containers", {}).get(device_index)
    manager = getattr(container, "tree_manager", None)
    if manager is None or not isinstance(getattr(manager, "current_node", None), trees.CUDAWarmupNode):
        return False
    stream = getattr(manager, "stream", None)
    return stream is not None and torch.cuda.current_stream(device_index).cuda_stream == stream.cuda_stream


def capture_state(device: torch.device) -> str:
    """NONE (eager), REPLANNED (inside `capturing(ctx)`: warm-up or capture of a graph whose driver re-plans), or
    FOREIGN (a stream capture, or a cudagraph-trees warm-up, that no one re-plans)."""
    if device.type != "cuda":
        return NONE
    if _current.get() is not None:
        return REPLANNED
    if torch.cuda.is_current_stream_capturing():
        return FOREIGN
    index = device.index if device.index is not None else torch.cuda.current_device()
    return FOREIGN if _cudagraph_trees_warming_up(index) else NONE
