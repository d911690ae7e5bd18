"""Arms the C++ replay of FlashInfer calls (csrc/cuda/flashinfer_replay.cpp), which takes FlashInfer's run() and
attnops' own Python out of repeated eager calls.

FlashInfer's wrapper.run() spends most of its time in Python, checking and assembling the arguments of one tvm-ffi
function (its JIT-built "paged_run"), and attnops' op adds its own validation and dispatch: together several times
the kernel's own time on short decode steps (docs/bench.md has the numbers). Within one plan (one step: attnops
plans once per step) every layer's call passes that function the same arguments but q, the layer's caches and out.
So on the first call of a plan the backend runs wrapper.run() once while recording the call it makes into the
tvm-ffi function, and hands the record to the op's C++ CUDA kernel, which replays it, with the next call's tensors
swapped in, for every later call of the same signature in the step (the conditions are in the C++ file).

A record is only armed when every one of its arguments is accounted for: q, k_cache, v_cache and out themselves
(by identity), tensors the wrapper owns (its plan's buffers, which stay fixed until it re-plans) or FlashInfer
caches for the process, tvm-ffi objects (the plan info), and plain numbers. Anything else (a tensor FlashInfer made
for this call, say, in some other version) leaves the calls in Python. ATTNOPS_FLASHINFER_REPLAY=0 turns the
replay off.
"""
from __future__ import annotations

import functools
import logging
import os

import torch

from .. import _C

log = logging.getLogger("attnops.flashinfer")

# argument kinds of csrc/cuda/flashinfer_replay.cpp's arm()
_NONE, _INT, _BOOL, _FLOAT, _OBJECT = 0, 1, 2, 3, 5
_Q, _K_CACHE, _V_CACHE, _OUT = 10, 11, 12, 13


def built() -> bool:
    """Whether this build of attnops has the C++ CUDA kernel (a CUDA torch and tvm-ffi's headers at build time)."""
    return bool(getattr(_C, "has_flashinfer_replay", False))


def enabled() -> bool:
    return built() and os.environ.get("ATTNOPS_FLASHINFER_REPLAY", "1") != "0" and _loaded()


@functools.lru_cache(maxsize=1)
def _loaded() -> bool:
    try:
        from tvm_ffi import libinfo
        error = _C.flashinfer_replay_load(libinfo.find_libtvm_ffi())
    except Exception as e:  # tvm_ffi missing or moved
        error = f"{type(e).__name__}: {e}"
    if error:
        log.warning("attnops: FlashInfer calls stay in Python (cannot load tvm-ffi's C API: %s)", error)
    return not error


def disarm(wrapper) -> None:
    """Before `wrapper` is planned again: its replay (if any) would run with the new plan's buffers."""
    if built():
        _C.flashinfer_replay_disarm(id(wrapper))


def clear() -> None:
    """Drops every replay: dispatch calls it when the pinned backend changes (replayed calls skip dispatch)."""
    if built():
        _C.flashinfer_replay_clear()


def stats() -> dict:
    """Armed entries, and since the process started: replayed calls (hits), calls that went to Python (misses),
    failed replays (errors; after one, every call goes to Python)."""
    return dict(_C.flashinfer_replay_stats()) if built() else dict(armed=0, hits=0, misses=0, errors=0)


def _kernel_cell(wrapper):
    """The closure cell that holds the tvm-ffi function wrapper.run() calls: FlashInfer's module wraps it in a
    Python function (paged_run, whose free variable paged_run_func it is). None where FlashInfer is laid out
    otherwise."""
    function = getattr(getattr(wrapper, "_cached_module", None), "paged_run", None)
    code = getattr(function, "__code__", None)
    if code is None or "paged_run_func" not in code.co_freevars:
        return None
    cell = function.__closure__[code.co_freevars.index("paged_run_func")]
    return cell if hasattr(cell.cell_contents, "__chandle__") else None


def run_and_arm(wrapper, q, k_cache, v_cache, out) -> None:
    """wrapper.run(q, (k_cache, v_cache), out=out), recording the kernel call it makes and arming its replay for
    the op call in progress. Any surprise in the record leaves the replay unarmed (logged at debug level)."""
    cell = _kernel_cell(wrapper)
    if cell is None:
        log.debug("attnops: FlashInfer replay not armed: no tvm-ffi paged_run function under wrapper.run()")
        wrapper.run(q, (k_cache, v_cache), out=out)
        return
    kernel = cell.cell_contents
    calls = []

    def record(*args):
        calls.append(args)
        return kernel(*args)

    cell.cell_contents = record
    try:
        wrapper.run(q, (k_cache, v_cache), out=out)
    finally:
        cell.cell_contents = kernel
    reason = _arm(wrapper, kernel, calls, q, k_cache, v_cache, out)
    if reason:
        log.debug("attnops: FlashInfer replay not armed: %s", reason)


def _arm(wrapper, kernel, calls, q, k_cache, v_cache, out) -> str | None:
    if len(calls) != 1:
        return f"wrapper.run() made {len(calls)} kernel calls"
    slots = {id(q): _Q, id(k_cache): _K_CACHE, id(v_cache): _V_CACHE, id(out): _OUT}
    if len(slots) != 4:
        return "q, k_cache, v_cache and out are not four distinct tensors"
    owned = {id(value) for value in vars(wrapper).values() if isinstance(value, torch.Tensor)}
    import flashinfer.utils  # its process-wide buffers (the alibi slopes, passed even when unused) are fixed too
    owned |= {id(value) for value in getattr(flashinfer.utils, "_cache_buf", {}).values()
              if isinstance(value, torch.Tensor)}
    import tvm_ffi
    kinds, ints, floats, objects, converted = [], [], [], [], []
    for position, arg in enumerate(calls[0]):
        if arg is None:
            kinds.append(_NONE)
        elif isinstance(arg, bool):
            kinds.append(_BOOL)
            ints.append(int(arg))
        elif isinstance(arg, int):
            kinds.append(_INT)
            ints.append(arg)
        elif isinstance(arg, float):
            kinds.append(_FLOAT)
            floats.append(arg)
        elif isinstance(arg, torch.Tensor):
            if id(arg) in slots:
                kinds.append(slots[id(arg)])
            elif id(arg) in owned:  # as an ffi.Tensor, which every tensor parameter takes (Optional ones need it)
                converted.append(tvm_ffi.from_dlpack(arg))
                kinds.append(_OBJECT)
                objects.append(converted[-1].__chandle__())
            else:
                return f"argument {position} is a tensor the wrapper does not own"
        elif isinstance(arg, (list, tuple)) and all(isinstance(v, int) for v in arg):
            converted.append(tvm_ffi.convert(list(arg)))  # what tvm-ffi builds from the list on every call
            kinds.append(_OBJECT)
            objects.append(converted[-1].__chandle__())
        elif hasattr(arg, "__chandle__"):
            kinds.append(_OBJECT)
            objects.append(arg.__chandle__())
        else:
            return f"argument {position} is a {type(arg).__name__}"
    if sorted(k for k in kinds if k >= _Q) != [_Q, _K_CACHE, _V_CACHE, _OUT]:
        return "the kernel call does not take q, k_cache, v_cache and out once each"
    _C.flashinfer_replay_arm(id(wrapper), kernel.__chandle__(), kinds, ints, floats, objects)  # holds `converted`
    return None
