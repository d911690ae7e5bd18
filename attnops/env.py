"""Environment and device helpers shared by every layer (checks, dispatch, backends, the CLI): reads that sit on
the op's hot path, so each is as cheap as it can be."""
from __future__ import annotations

import functools
import os

import torch


def environ_get(name: str) -> str | None:
    """os.environ.get(name) for the op's hot path: on POSIX, a lookup in os.environ's own bytes dict (which
    every os.environ write updates) without the key encoding that costs microseconds per read."""
    data = getattr(os.environ, "_data", None)
    if os.name != "posix" or data is None:
        return os.environ.get(name)
    value = data.get(name.encode())
    return None if value is None else value.decode()


def values_checked() -> bool:
    """Whether the checks that read tensor data run (ATTNOPS_CHECK=1): they sync the host, so they are opt-in."""
    return environ_get("ATTNOPS_CHECK") not in (None, "", "0")


@functools.lru_cache(maxsize=None)
def device_arch(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) compute capability of a CUDA device (cached: asking the driver costs microseconds)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    """The SM count of CUDA device `device_index` (cached: the split plans ask it every call)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count
