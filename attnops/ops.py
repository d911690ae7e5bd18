"""Registers the implementations and fakes of the ops whose schemas csrc/ops.cpp defines. The only module that
touches torch.library.

Each real impl validates (shapes and dtypes; data too under ATTNOPS_CHECK=1), picks a backend through dispatch,
and lets it write the output. In CUDA builds with FlashInfer's tvm-ffi, paged_attention's CUDA kernel is C++
(csrc/cuda/flashinfer_replay.cpp): it replays FlashInfer calls armed earlier in the step and hands every other call
to _run_paged_attention here. Each fake validates the same way and allocates, reading no data, so that
torch.compile reports bad input at trace time and traces the op without a graph break.
"""
from __future__ import annotations

import contextlib

import torch

try:
    from . import _C  # loads the schemas: TORCH_LIBRARY(attnops, m) in csrc/ops.cpp
except ImportError as e:  # a source folder named attnops on the path (the current directory, say), not the build
    import os
    raise ImportError(f"attnops: the package imported from {os.path.dirname(__file__)} has no compiled extension "
                      f"(attnops/_C): that folder is a source tree, not a built install. Run from another directory, "
                      f"or build it there: pip install --no-build-isolation -e <checkout> ({e})") from e
from .backends import flashinfer_replay
from .backends.reference import merge_attention_states_reference
from .checks import (attention_call, cache_write_call, check_merge_attention_states, check_outputs_apart,
                     check_paged_attention, check_paged_attention_values, check_reshape_and_cache,
                     check_reshape_and_cache_values)
from .checks_mla import (check_mla_attention, check_mla_attention_values, check_mla_cache_write,
                         check_mla_cache_write_values, mla_call, mla_write_call)
from .dispatch import select_backend
from .env import values_checked

DEVICES = ("cpu", "cuda")
# paged_attention's kernels: where the build has the C++ CUDA kernel, Python serves the CPU key (and the C++ kernel)
PAGED_ATTENTION_DEVICES = ("cpu",) if flashinfer_replay.built() else DEVICES
_NO_GUARD = contextlib.nullcontext()


def on_device(device: torch.device):
    """Kernels launch on their tensors' GPU, whichever GPU is current (Triton and FlashInfer launch on the
    current one): a device guard when the two differ, nothing otherwise (the common case costs no context)."""
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return _NO_GUARD


def _run_paged_attention(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale, soft_cap, window_left,
                         kv_format, k_scale, v_scale, sinks, tree_mask, out, lse=None, fresh_outputs=False) -> None:
    """paged_attention into `out`; paged_attention_with_lse with `lse` given. fresh_outputs: the op allocated
    them (no overlap to look for). (The C++ CUDA kernel hands calls here with these positional arguments.)"""
    call = attention_call(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale, soft_cap, window_left,
                          kv_format, k_scale, v_scale, sinks, tree_mask, out, lse)
    if not fresh_outputs:
        check_outputs_apart("paged_attention" if lse is None else "paged_attention_with_lse", dict(out=out, lse=lse),
                            dict(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, seq_lens=seq_lens,
                                 cu_seqlens_q=cu_seqlens_q, k_scale=k_scale, v_scale=v_scale, sinks=sinks,
                                 tree_mask=tree_mask))
    if values_checked():
        check_paged_attention_values(q, k_cache, block_table, seq_lens, cu_seqlens_q, k_scale, v_scale, tree_mask)
    backend = select_backend(call.case, q.device)
    with on_device(q.device):
        backend.paged_attention(call)


# torch.library.impl rather than register_kernel: register_kernel wraps each kernel in a dynamo-disable frame
# that costs microseconds per eager call; these kernels only ever run through the dispatcher (under torch.compile
# the fakes are traced and the compiled code calls the op), which the compile tests check frame by frame.
@torch.library.impl("attnops::paged_attention", PAGED_ATTENTION_DEVICES)
def _paged_attention(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q=None, *, scale=None, soft_cap=0.0,
                     window_left=-1, kv_format="auto", k_scale=None, v_scale=None, sinks=None, tree_mask=None):
    out = torch.empty_like(q)
    _run_paged_attention(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale, soft_cap, window_left,
                         kv_format, k_scale, v_scale, sinks, tree_mask, out, fresh_outputs=True)
    return out


@torch.library.register_fake("attnops::paged_attention")
def _paged_attention_fake(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q=None, *, scale=None,
                          soft_cap=0.0, window_left=-1, kv_format="auto", k_scale=None, v_scale=None, sinks=None,
                          tree_mask=None):
    check_paged_attention(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale, soft_cap, window_left,
                          kv_format, k_scale, v_scale, sinks, tree_mask)
    return torch.empty_like(q)


@torch.library.impl("attnops::paged_attention.out", PAGED_ATTENTION_DEVICES)
def _paged_attention_out(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q=None, *, scale=None,
                         soft_cap=0.0, window_left=-1, kv_format="auto", k_scale=None, v_scale=None, sinks=None,
                         tree_mask=None, out):
    _run_paged_attention(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale, soft_cap, window_left,
                         kv_format, k_scale, v_scale, sinks, tree_mask, out)


if flashinfer_replay.built():
    _C.set_paged_attention_python_impl(_run_paged_attention)


@torch.library.register_fake("attnops::paged_attention.out")
def _paged_attention_out_fake(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q=None, *, scale=None,
                              soft_cap=0.0, window_left=-1, kv_format="auto", k_scale=None, v_scale=None,
                              sinks=None, tree_mask=None, out):
    check_paged_attention(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale, soft_cap, window_left,
                          kv_format, k_scale, v_scale, sinks, tree_mask, out)


# paged_attention_with_lse: Python on both devices (the C++ CUDA kernel above replays FlashInfer calls of
# paged_attention only; this op's FlashInfer calls ask run() for the LSE).
def _lse_like(q):
    return q.new_empty(q.shape[:2], dtype=torch.float32)


@torch.library.impl("attnops::paged_attention_with_lse", DEVICES)
def _paged_attention_with_lse(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q=None, *, scale=None,
                              soft_cap=0.0, window_left=-1, kv_format="auto", k_scale=None, v_scale=None, sinks=None,
                              tree_mask=None):
    out, lse = torch.empty_like(q), _lse_like(q)
    _run_paged_attention(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale, soft_cap, window_left,
                         kv_format, k_scale, v_scale, sinks, tree_mask, out, lse, fresh_outputs=True)
    return out, lse


@torch.library.register_fake("attnops::paged_attention_with_lse")
def _paged_attention_with_lse_fake(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q=None, *, scale=None,
                                   soft_cap=0.0, window_left=-1, kv_format="auto", k_scale=None, v_scale=None,
                                   sinks=None, tree_mask=None):
    check_paged_attention(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale, soft_cap, window_left,
                          kv_format, k_scale, v_scale, sinks, tree_mask)
    return torch.empty_like(q), _lse_like(q)


@torch.library.impl("attnops::paged_attention_with_lse.out", DEVICES)
def _paged_attention_with_lse_out(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q=None, *, scale=None,
                                  soft_cap=0.0, window_left=-1, kv_format="auto", k_scale=None, v_scale=None,
                                  sinks=None, tree_mask=None, out, lse):
    _run_paged_attention(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale, soft_cap, window_left,
                         kv_format, k_scale, v_scale, sinks, tree_mask, out, lse)


@torch.library.register_fake("attnops::paged_attention_with_lse.out")
def _paged_attention_with_lse_out_fake(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q=None, *,
                                       scale=None, soft_cap=0.0, window_left=-1, kv_format="auto", k_scale=None,
                                       v_scale=None, sinks=None, tree_mask=None, out, lse):
    check_paged_attention(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale, soft_cap, window_left,
                          kv_format, k_scale, v_scale, sinks, tree_mask, out, lse)


@torch.library.impl("attnops::reshape_and_cache", DEVICES)
def _reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, *, kv_format="auto", k_scale=None, v_scale=None,
                       k_block_scale=None, v_block_scale=None):
    call = cache_write_call(key, value, k_cache, v_cache, slot_mapping, kv_format, k_scale, v_scale,
                            k_block_scale, v_block_scale)
    if values_checked():
        check_reshape_and_cache_values(k_cache, slot_mapping, k_scale, v_scale)
    with on_device(key.device):
        select_backend(call.case).reshape_and_cache(call)


@torch.library.register_fake("attnops::reshape_and_cache")
def _reshape_and_cache_fake(key, value, k_cache, v_cache, slot_mapping, *, kv_format="auto", k_scale=None,
                            v_scale=None, k_block_scale=None, v_block_scale=None):
    check_reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, kv_format, k_scale, v_scale,
                            k_block_scale, v_block_scale)


def _run_merge_attention_states(out_a, lse_a, out_b, lse_b, out, lse, fresh_outputs=False) -> None:
    check_merge_attention_states(out_a, lse_a, out_b, lse_b, out, lse)
    if not fresh_outputs:  # (out may be out_a or out_b, lse lse_a or lse_b: elementwise, each read before written)
        check_outputs_apart("merge_attention_states", dict(out=out, lse=lse),
                            dict(out_a=out_a, lse_a=lse_a, out_b=out_b, lse_b=lse_b),
                            may_be=(("out", "out_a"), ("out", "out_b"), ("lse", "lse_a"), ("lse", "lse_b")))
    if out_a.is_cuda and out_a.dtype != torch.float64:  # one Triton kernel; elsewhere (and float64) PyTorch
        from .backends.triton.merge_states import merge_states
        with on_device(out_a.device):
            merge_states(out_a, lse_a, out_b, lse_b, out, lse)
    else:
        merge_attention_states_reference(out_a, lse_a, out_b, lse_b, out, lse)


@torch.library.impl("attnops::merge_attention_states", DEVICES)
def _merge_attention_states(out_a, lse_a, out_b, lse_b):
    out, lse = torch.empty_like(out_a), torch.empty_like(lse_a)
    _run_merge_attention_states(out_a, lse_a, out_b, lse_b, out, lse, fresh_outputs=True)
    return out, lse


@torch.library.register_fake("attnops::merge_attention_states")
def _merge_attention_states_fake(out_a, lse_a, out_b, lse_b):
    check_merge_attention_states(out_a, lse_a, out_b, lse_b)
    return torch.empty_like(out_a), torch.empty_like(lse_a)


@torch.library.impl("attnops::merge_attention_states.out", DEVICES)
def _merge_attention_states_out(out_a, lse_a, out_b, lse_b, *, out, lse):
    _run_merge_attention_states(out_a, lse_a, out_b, lse_b, out, lse)


@torch.library.register_fake("attnops::merge_attention_states.out")
def _merge_attention_states_out_fake(out_a, lse_a, out_b, lse_b, *, out, lse):
    check_merge_attention_states(out_a, lse_a, out_b, lse_b, out, lse)


_EXPECTED = {"k_scale": "float32, 0-d or [num_kv_heads] for fp8", "v_scale": "float32, 0-d or [num_kv_heads] for fp8",
             "sinks": "float32 [num_q_heads]", "kv_scale": "float32, one element, for an fp8 latent cache"}


def _are_tensors(op: str, kv_format="auto", **tensors) -> None:
    """The wrappers' tensor arguments (None where optional) and kv_format: a TypeError naming the argument (the
    dispatcher's schema mismatch is a RuntimeError that names none). A Python number where a scale or sinks belong
    gets a message that says what to pass."""
    for name, t in tensors.items():
        if t is None or isinstance(t, torch.Tensor):
            continue
        if name in _EXPECTED:
            raise TypeError(f"attnops.{op}: {name} must be a tensor ({_EXPECTED[name]}), not "
                            f"{type(t).__name__}: pass torch.tensor({t!r}, device=...) once and reuse it (a tensor "
                            f"can change without recompiling a compiled graph)")
        raise TypeError(f"attnops.{op}: {name} must be a Tensor (got {type(t).__name__})")
    if not isinstance(kv_format, str):
        raise TypeError(f"attnops.{op}: kv_format must be a str such as 'auto' or 'fp8_e4m3' (got "
                        f"{type(kv_format).__name__})")


def _are_numbers(op: str, scale=None, soft_cap=0.0, window_left=-1) -> None:
    """scale (None: the default) and soft_cap numbers, window_left an int: a TypeError naming them."""
    for name, x, optional in (("scale", scale, True), ("soft_cap", soft_cap, False)):
        if not (x is None and optional) and (isinstance(x, bool) or not isinstance(x, (int, float))):
            raise TypeError(f"attnops.{op}: {name} must be a number (got {type(x).__name__})")
    if isinstance(window_left, bool) or not isinstance(window_left, int):
        raise TypeError(f"attnops.{op}: window_left must be an int (got {type(window_left).__name__})")


def paged_attention(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q=None, *, scale=None, soft_cap=0.0,
                    window_left=-1, kv_format="auto", k_scale=None, v_scale=None, sinks=None, tree_mask=None,
                    out=None):
    """`torch.ops.attnops.paged_attention`, or its `.out` overload when `out` is given (then returns `out`)."""
    _are_tensors("paged_attention", kv_format, k_scale=k_scale, v_scale=v_scale, sinks=sinks, q=q, k_cache=k_cache,
                 v_cache=v_cache, block_table=block_table, seq_lens=seq_lens, cu_seqlens_q=cu_seqlens_q,
                 tree_mask=tree_mask, out=out)
    _are_numbers("paged_attention", scale, soft_cap, window_left)
    if out is None:
        return torch.ops.attnops.paged_attention(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q,
                                                 scale=scale, soft_cap=soft_cap, window_left=window_left,
                                                 kv_format=kv_format, k_scale=k_scale, v_scale=v_scale,
                                                 sinks=sinks, tree_mask=tree_mask)
    torch.ops.attnops.paged_attention.out(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale=scale,
                                          soft_cap=soft_cap, window_left=window_left, kv_format=kv_format,
                                          k_scale=k_scale, v_scale=v_scale, sinks=sinks, tree_mask=tree_mask,
                                          out=out)
    return out


def paged_attention_with_lse(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q=None, *, scale=None,
                             soft_cap=0.0, window_left=-1, kv_format="auto", k_scale=None, v_scale=None, sinks=None,
                             tree_mask=None, out=None, lse=None):
    """`torch.ops.attnops.paged_attention_with_lse`: paged_attention's output and each row's log-sum-exp (float32
    [T, Hq], the natural log of its softmax denominator, sinks included; -inf for a row that sees no key, the
    sink's logit with sinks), for merge_attention_states. Returns (out, lse); with `out` and `lse` given, the
    `.out` overload writes them."""
    _are_tensors("paged_attention_with_lse", kv_format, k_scale=k_scale, v_scale=v_scale, sinks=sinks, q=q,
                 k_cache=k_cache, v_cache=v_cache, block_table=block_table, seq_lens=seq_lens,
                 cu_seqlens_q=cu_seqlens_q, tree_mask=tree_mask, out=out, lse=lse)
    _are_numbers("paged_attention_with_lse", scale, soft_cap, window_left)
    if out is None and lse is None:
        return torch.ops.attnops.paged_attention_with_lse(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q,
                                                          scale=scale, soft_cap=soft_cap, window_left=window_left,
                                                          kv_format=kv_format, k_scale=k_scale, v_scale=v_scale,
                                                          sinks=sinks, tree_mask=tree_mask)
    if out is None or lse is None:
        raise ValueError("attnops.paged_attention_with_lse: give both out and lse, or neither")
    torch.ops.attnops.paged_attention_with_lse.out(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q,
                                                   scale=scale, soft_cap=soft_cap, window_left=window_left,
                                                   kv_format=kv_format, k_scale=k_scale, v_scale=v_scale,
                                                   sinks=sinks, tree_mask=tree_mask, out=out, lse=lse)
    return out, lse


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, *, kv_format="auto", k_scale=None, v_scale=None,
                      k_block_scale=None, v_block_scale=None) -> None:
    """`torch.ops.attnops.reshape_and_cache`: writes key/value into the cache slots, quantizing on the way."""
    _are_tensors("reshape_and_cache", kv_format, k_scale=k_scale, v_scale=v_scale, key=key, value=value,
                 k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping, k_block_scale=k_block_scale,
                 v_block_scale=v_block_scale)
    torch.ops.attnops.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, kv_format=kv_format,
                                        k_scale=k_scale, v_scale=v_scale, k_block_scale=k_block_scale,
                                        v_block_scale=v_block_scale)


def merge_attention_states(out_a, lse_a, out_b, lse_b, *, out=None, lse=None):
    """`torch.ops.attnops.merge_attention_states`: the exact softmax merge of two partial attention results over
    disjoint key sets ([T, H, D] outputs, [T, H] natural-log LSEs, -inf for a side with no key). Returns
    (out, lse); with `out` and `lse` given, the `.out` overload writes them (`out` may be `out_a` or
    `out_b` itself, `lse` `lse_a` or `lse_b`)."""
    _are_tensors("merge_attention_states", out_a=out_a, lse_a=lse_a, out_b=out_b, lse_b=lse_b, out=out, lse=lse)
    if out is None and lse is None:
        return torch.ops.attnops.merge_attention_states(out_a, lse_a, out_b, lse_b)
    if out is None or lse is None:
        raise ValueError("attnops.merge_attention_states: give both out and lse, or neither")
    torch.ops.attnops.merge_attention_states.out(out_a, lse_a, out_b, lse_b, out=out, lse=lse)
    return out, lse


# --- latent attention (MLA): docs/design.md, "mla_attention" ----------------------------------------------------
def _run_mla_attention(q_nope, q_pe, kv_cache, block_table, seq_lens, cu_seqlens_q, scale, kv_format, kv_scale,
                       sinks, tree_mask, topk_indices, out, lse=None, fresh_outputs=False) -> None:
    call = mla_call(q_nope, q_pe, kv_cache, block_table, seq_lens, cu_seqlens_q, scale, kv_format, kv_scale, sinks,
                    tree_mask, out, lse, topk_indices)
    if not fresh_outputs:
        check_outputs_apart("mla_attention" if lse is None else "mla_attention_with_lse", dict(out=out, lse=lse),
                            dict(q_nope=q_nope, q_pe=q_pe, kv_cache=kv_cache, block_table=block_table,
                                 seq_lens=seq_lens, cu_seqlens_q=cu_seqlens_q, kv_scale=kv_scale, sinks=sinks,
                                 tree_mask=tree_mask, topk_indices=topk_indices))
    if values_checked():
        check_mla_attention_values(q_nope, kv_cache, block_table, seq_lens, cu_seqlens_q, kv_scale, tree_mask,
                                   topk_indices)
    backend = select_backend(call.case, q_nope.device)
    with on_device(q_nope.device):
        backend.mla_attention(call)


@torch.library.impl("attnops::mla_attention", DEVICES)
def _mla_attention(q_nope, q_pe, kv_cache, block_table, seq_lens, cu_seqlens_q=None, *, scale, kv_format="auto",
                   kv_scale=None, sinks=None, tree_mask=None, topk_indices=None):
    out = torch.empty_like(q_nope)
    _run_mla_attention(q_nope, q_pe, kv_cache, block_table, seq_lens, cu_seqlens_q, scale, kv_format, kv_scale, sinks,
                       tree_mask, topk_indices, out, fresh_outputs=True)
    return out


@torch.library.register_fake("attnops::mla_attention")
def _mla_attention_fake(q_nope, q_pe, kv_cache, block_table, seq_lens, cu_seqlens_q=None, *, scale,
                        kv_format="auto", kv_scale=None, sinks=None, tree_mask=None, topk_indices=None):
    check_mla_attention(q_nope, q_pe, kv_cache, block_table, seq_lens, cu_seqlens_q, scale, kv_format, kv_scale,
                        sinks, tree_mask, topk_indices=topk_indices)
    return torch.empty_like(q_nope)


@torch.library.impl("attnops::mla_attention.out", DEVICES)
def _mla_attention_out(q_nope, q_pe, kv_cache, block_table, seq_lens, cu_seqlens_q=None, *, scale, kv_format="auto",
                       kv_scale=None, sinks=None, tree_mask=None, topk_indices=None, out):
    _run_mla_attention(q_nope, q_pe, kv_cache, block_table, seq_lens, cu_seqlens_q, scale, kv_format, kv_scale, sinks,
                       tree_mask, topk_indices, out)


@torch.library.register_fake("attnops::mla_attention.out")
def _mla_attention_out_fake(q_nope, q_pe, kv_cache, block_table, seq_lens, cu_seqlens_q=None, *, scale,
                            kv_format="auto", kv_scale=None, sinks=None, tree_mask=None, topk_indices=None, out):
    check_mla_attention(q_nope, q_pe, kv_cache, block_table, seq_lens, cu_seqlens_q, scale, kv_format, kv_scale,
                        sinks, tree_mask, out, topk_indices=topk_indices)


@torch.library.impl("attnops::mla_attention_with_lse", DEVICES)
def _mla_attention_with_lse(q_nope, q_pe, kv_cache, block_table, seq_lens, cu_seqlens_q=None, *, scale,
                            kv_format="auto", kv_scale=None, sinks=None, tree_mask=None, topk_indices=None):
    out, lse = torch.empty_like(q_nope), _lse_like(q_nope)
    _run_mla_attention(q_nope, q_pe, kv_cache, block_table, seq_lens, cu_seqlens_q, scale, kv_format, kv_scale, sinks,
                       tree_mask, topk_indices, out, lse, fresh_outputs=True)
    return out, lse


@torch.library.register_fake("attnops::mla_attention_with_lse")
def _mla_attention_with_lse_fake(q_nope, q_pe, kv_cache, block_table, seq_lens, cu_seqlens_q=None, *, scale,
                                 kv_format="auto", kv_scale=None, sinks=None, tree_mask=None, topk_indices=None):
    check_mla_attention(q_nope, q_pe, kv_cache, block_table, seq_lens, cu_seqlens_q, scale, kv_format, kv_scale,
                        sinks, tree_mask, topk_indices=topk_indices)
    return torch.empty_like(q_nope), _lse_like(q_nope)


@torch.library.impl("attnops::mla_attention_with_lse.out", DEVICES)
def _mla_attention_with_lse_out(q_nope, q_pe, kv_cache, block_table, seq_lens, cu_seqlens_q=None, *, scale,
                                kv_format="auto", kv_scale=None, sinks=None, tree_mask=None, topk_indices=None, out,
                                lse):
    _run_mla_attention(q_nope, q_pe, kv_cache, block_table, seq_lens, cu_seqlens_q, scale, kv_format, kv_scale, sinks,
                       tree_mask, topk_indices, out, lse)


@torch.library.register_fake("attnops::mla_attention_with_lse.out")
def _mla_attention_with_lse_out_fake(q_nope, q_pe, kv_cache, block_table, seq_lens, cu_seqlens_q=None, *, scale,
                                     kv_format="auto", kv_scale=None, sinks=None, tree_mask=None, topk_indices=None,
                                     out, lse):
    check_mla_attention(q_nope, q_pe, kv_cache, block_table, seq_lens, cu_seqlens_q, scale, kv_format, kv_scale,
                        sinks, tree_mask, out, lse, topk_indices)


@torch.library.impl("attnops::mla_cache_write", DEVICES)
def _mla_cache_write(kv_c, k_pe, kv_cache, slot_mapping, *, kv_format="auto", kv_scale=None):
    call = mla_write_call(kv_c, k_pe, kv_cache, slot_mapping, kv_format, kv_scale)
    if values_checked():
        check_mla_cache_write_values(kv_cache, slot_mapping, kv_scale)
    with on_device(kv_c.device):
        select_backend(call.case).mla_cache_write(call)


@torch.library.register_fake("attnops::mla_cache_write")
def _mla_cache_write_fake(kv_c, k_pe, kv_cache, slot_mapping, *, kv_format="auto", kv_scale=None):
    check_mla_cache_write(kv_c, k_pe, kv_cache, slot_mapping, kv_format, kv_scale)


def mla_attention(q_nope, q_pe, kv_cache, block_table, seq_lens, cu_seqlens_q=None, *, scale, kv_format="auto",
                  kv_scale=None, sinks=None, tree_mask=None, topk_indices=None, out=None):
    """`torch.ops.attnops.mla_attention` (latent attention over a paged cache of [c, r] rows; docs/design.md), or
    its `.out` overload when `out` is given (then returns `out`). topk_indices (int32 [T, K]): the sparse form, each
    row attending only to the key positions it lists (-1: none), as DeepSeek-V3.2's indexer picks them."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):  # (required here: no default scale)
        raise TypeError(f"attnops.mla_attention: scale must be a number (got {type(scale).__name__})")
    _are_tensors("mla_attention", kv_format, kv_scale=kv_scale, sinks=sinks, q_nope=q_nope, q_pe=q_pe,
                 kv_cache=kv_cache, block_table=block_table, seq_lens=seq_lens, cu_seqlens_q=cu_seqlens_q,
                 tree_mask=tree_mask, topk_indices=topk_indices, out=out)
    args = dict(scale=scale, kv_format=kv_format, kv_scale=kv_scale, sinks=sinks, tree_mask=tree_mask,
                topk_indices=topk_indices)
    if out is None:
        return torch.ops.attnops.mla_attention(q_nope, q_pe, kv_cache, block_table, seq_lens, cu_seqlens_q, **args)
    torch.ops.attnops.mla_attention.out(q_nope, q_pe, kv_cache, block_table, seq_lens, cu_seqlens_q, **args, out=out)
    return out


def mla_cache_write(kv_c, k_pe, kv_cache, slot_mapping, *, kv_format="auto", kv_scale=None) -> None:
    """`torch.ops.attnops.mla_cache_write`: row slot_mapping[i] of the latent cache = [kv_c[i], k_pe[i]]."""
    _are_tensors("mla_cache_write", kv_format, kv_scale=kv_scale, kv_c=kv_c, k_pe=k_pe, kv_cache=kv_cache,
                 slot_mapping=slot_mapping)
    torch.ops.attnops.mla_cache_write(kv_c, k_pe, kv_cache, slot_mapping, kv_format=kv_format, kv_scale=kv_scale)
