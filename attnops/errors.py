"""Where the ops record, on the device and without a host sync, that a call saw a bad index.

Each device has one int32 buffer of len(ARGUMENTS) entries, allocated once and never moved, so that a CUDA graph
can hold its address: entry i is the lowest position at which argument ARGUMENTS[i] was seen bad since the last
`take_errors()` (NONE: never). The kernels write it with atomic min (Triton), the host-side backends (reference,
C++ CPU kernels, FlashInfer's page metadata) with the same min. Positions:
- block_table, seq_lens: the sequence b;
- cu_seqlens_q: the first entry i at which cu_seqlens_q stops being non-decreasing from 0 to num_tokens;
- slot_mapping: the token t;
- prefix_len, prefix_table (cascade_attention's shared prefix): 0 for a length outside its table, the entry i for
  a page index outside the cache;
- topk_indices (mla_attention's sparse form): the query row t that listed a position outside its sequence.

What counts as bad, and what the op returns then, is docs/design.md's "Bad indices".
"""
from __future__ import annotations

import threading

import torch

ARGUMENTS = ("block_table", "seq_lens", "cu_seqlens_q", "slot_mapping", "prefix_len", "prefix_table", "topk_indices")
BLOCK_TABLE, SEQ_LENS, CU_SEQLENS_Q, SLOT_MAPPING, PREFIX_LEN, PREFIX_TABLE, TOPK_INDICES = range(len(ARGUMENTS))
NONE = 2 ** 31 - 1  # no error: the identity of min

_buffers: dict[torch.device, torch.Tensor] = {}
_lock = threading.Lock()


def cu_seqlens_violation(starts: list[int], num_tokens: int) -> int | None:
    """The first entry at which cu_seqlens_q (as host ints) stops running non-decreasing from 0 to num_tokens, or
    None if it does not: the position recorded for it."""
    for i, start in enumerate(starts):
        if (start > num_tokens or (i == 0 and start != 0) or (i > 0 and start < starts[i - 1])
                or (i == len(starts) - 1 and start != num_tokens)):
            return i
    return None


def _key(device: torch.device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _allocate(device: torch.device, numel: int, dtype: torch.dtype, value: int) -> torch.Tensor:
    if device.type != "cuda":
        return torch.full((numel,), value, dtype=dtype, device=device)
    # The buffer must outlive every CUDA graph, so it must not come from a graph's private pool, whose memory the
    # graph recycles. A capture sends the allocations made on its stream there: allocate on a stream of our own.
    if torch.cuda.is_current_stream_capturing():
        side = torch.cuda.Stream(device)
        with torch.cuda.stream(side):
            buffer = torch.full((numel,), value, dtype=dtype, device=device)
        side.synchronize()  # a wait on an event from outside a capture cannot enter the graph: wait on the host
        return buffer
    # torch.compile's cudagraph-trees warm-up sends every allocation of its thread there: allocate on another thread
    made: list[torch.Tensor] = []

    def allocate() -> None:
        made.append(torch.full((numel,), value, dtype=dtype, device=device))
        torch.cuda.current_stream(device).synchronize()

    worker = threading.Thread(target=allocate, name="attnops-error-buffer")
    worker.start()
    worker.join()
    if not made:
        raise RuntimeError(f"could not allocate attnops' error buffer on {device}")
    return made[0]


def buffer(device: torch.device) -> torch.Tensor:
    """The device's error buffer (allocated on first use, then fixed: a CUDA graph holds its address)."""
    key = _key(device)
    found = _buffers.get(key)
    if found is None:
        with _lock:
            found = _buffers.get(key)
            if found is None:
                found = _buffers[key] = _allocate(key, len(ARGUMENTS), torch.int32, NONE)
    return found


def record(device: torch.device, argument: int, position) -> None:
    """Records from the host that `argument` was bad at `position` (an int, or a 0-d/1-element int tensor on the
    device, which is then read by a device op: no sync)."""
    entry = buffer(device)[argument:argument + 1]
    if isinstance(position, torch.Tensor):
        torch.minimum(entry, position.reshape(1).to(torch.int32), out=entry)
    elif entry.device.type == "cpu":
        entry[0] = min(int(entry[0]), int(position))
    else:
        entry.clamp_(max=int(position))


def take_errors(device=None) -> dict[str, int]:
    """The arguments seen bad since the last call, each with the lowest position it was bad at
    ({"block_table": 3}: sequence 3 had a page index outside the cache), and clears them. Syncs the device.

    device: a device, or None for every device an op has run on (positions are then the lowest over them)."""
    keys = [_key(device)] if device is not None else list(_buffers)
    found: dict[str, int] = {}
    for key in keys:
        buf = _buffers.get(key)
        if buf is None:
            continue
        values = buf.clone()  # read and clear in stream order: a later kernel's record is kept for the next call
        buf.fill_(NONE)
        for name, value in zip(ARGUMENTS, values.tolist()):
            if value != NONE:
                found[name] = min(value, found.get(name, NONE))
    return found
