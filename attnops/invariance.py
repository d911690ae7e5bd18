"""Batch-invariant mode: inside `with attnops.batch_invariant():` (or with ATTNOPS_BATCH_INVARIANT=1 for the whole
process), a row's output and LSE are bitwise the same whatever else is in the call: the other sequences (count,
lengths, contents, order), the row's position in the batch, the block table's width, and the capture state, for a
fixed backend, device and build (docs/design.md, "Batch-invariant mode").

Why a mode and not the default: the fastest split plan for a call is a function of the whole batch (how many
programs fill the chip), and a different split is a different order of floating-point sums, so the last bits of a
row move with its neighbours. Inside the mode a backend reduces each sequence in an order fixed by its own length
(splits of a fixed key count, merged in a fixed order), or declines: dispatch takes only backends that declare
the case invariant (`Backend.invariance_reasons`), `attnops.explain` says which did not and why, and a pinned
backend that cannot be invariant is a ValueError saying so.

Like `use_backend`, the mode is thread- and task-local (a context variable); the variable is read at each call.
"""
from __future__ import annotations

import contextlib
import contextvars

from .env import environ_get

_mode: contextvars.ContextVar[bool | None] = contextvars.ContextVar("attnops_batch_invariant", default=None)


@contextlib.contextmanager
def batch_invariant(enabled: bool = True):
    """Batch-invariant mode for the ops called inside the block (enabled=False: the default mode, whatever
    ATTNOPS_BATCH_INVARIANT says)."""
    if not isinstance(enabled, bool):
        raise TypeError(f"attnops.batch_invariant: enabled must be a bool (got {type(enabled).__name__})")
    token = _mode.set(enabled)
    try:
        yield
    finally:
        _mode.reset(token)


def fixed_splits(capacity: int, chunk: int) -> tuple[int, int]:
    """(splits, keys a split) of a kernel in the mode: every sequence cut every `chunk` keys from its start, whatever
    the batch, the heads and the SMs, so a row's partial sums and their merge are fixed by its own length; the
    splits past it are empty (LSE -inf, weight 0 in the merge). At least two, so that every call takes the merge's
    path, whatever the table's width (`capacity`, in keys)."""
    return max(2, -(-capacity // chunk)), chunk


def chunk_setting(env: str, default: int, multiple: int) -> int:
    """A kernel's keys a split in the mode: `default`, or the environment variable `env`'s (a positive multiple of
    `multiple`, its tile; anything else is a ValueError naming `env`), to time another size. A fixed number for a
    process, so the mode's bits hold."""
    value = environ_get(env)
    if not value:
        return default
    if not value.isdigit() or int(value) < multiple or int(value) % multiple:
        raise ValueError(f"{env} must be a positive multiple of {multiple} (got {value!r})")
    return int(value)


def enabled() -> bool:
    """Whether the calls made now are in batch-invariant mode (the innermost batch_invariant block, else
    ATTNOPS_BATCH_INVARIANT=1)."""
    mode = _mode.get()
    if mode is None:
        return environ_get("ATTNOPS_BATCH_INVARIANT") not in (None, "", "0")
    return mode
