"""FlashInfer's CUDA kernels behind attnops' ops: paged decode (tensor-core and CUDA-core variants) and paged
prefill (fa2, and fa3 on sm_90) for extend / verify, bf16/fp16 KV and fp8 KV with a per-tensor scale.

FlashInfer splits each call into plan() (host work: it reads the page layout on the host) and run(). attnops
plans once per step, not once per layer: a plan is keyed on the step's metadata tensors themselves (identity
and in-place version of seq_lens, block_table and cu_seqlens_q, which every layer of a step shares) and on
the case, and it is never reused for other tensors or after they were written to. An eager plan syncs the host
once per step (FlashInfer reads the page layout on the host; ours is on the device). For CUDA graphs, the op
builds fixed-size buffers at capture and registers a re-planner that attnops.serving.graphs runs before every replay;
it takes the lengths from the host (CaptureContext.host_seq_lens) and builds the page indices on the device, so
replanning needs no sync and the host prepares step N+1 while the GPU runs step N.

fp8 scales stay tensors (no host read): k_scale is folded into q (q * k_scale, a [T, Hq, D] multiply) and
v_scale into the output, so a compiled graph neither syncs nor recompiles when scales change.

Bad indices (docs/design.md, "Bad indices"): FlashInfer's kernels read whatever pages the layout names, so the
layout is made safe on the device before plan() (bad lengths as 0, pages outside the cache as a good page of the
same sequence: for decode in one Triton launch, attnops/backends/pages.py; for the prefill kinds checked_pages'
torch ops) and the rows the contract makes NaN are set after run(), together with the decode rows of empty sequences, in
one launch, only on steps that have any (graphs: always). cu_seqlens_q, which FlashInfer's plan reads on the host,
is checked on the host at plan time.
"""
from __future__ import annotations

import functools
import logging

import torch

from .. import capture, errors, formats
from ..env import values_checked
from . import flashinfer_mla, flashinfer_replay
from .base import AttentionCase, Backend, CacheWriteCase, MLACase, MLAWriteCase, common_reasons
from .flashinfer_steps import (LN2, Q_DTYPES, checked_pages, fill_nan, host_page_metadata, page_metadata, same_step,
                               set_rows, step_key, workspace)

log = logging.getLogger("attnops.flashinfer")

HEAD_DIMS = (64, 128, 256)
KV_FORMATS = ("bf16", "fp16", "fp8_e4m3", "fp8_e5m2")


@functools.lru_cache(maxsize=1)
def _import_error() -> str | None:
    try:
        import flashinfer  # noqa: F401
    except Exception as e:  # not installed (an extra), or broken
        return f"flashinfer cannot be imported ({type(e).__name__}: {str(e)[:120]}); pip install 'attnops[flashinfer]'"
    return None


def fa3_serves(arch, q_dtype, kv_dtype) -> bool:
    """FlashInfer's fa3 prefill: sm_90 only, and no fp8 KV under a bf16/fp16 q (it has no mixed-type wgmma for
    that; FlashInfer 0.7's JIT build of the configuration fails with "No eligible GMMA operator"). fa2 converts
    K/V in registers and serves both."""
    return arch[0] == 9 and kv_dtype == q_dtype


def wrapper_kind(case: AttentionCase) -> str:
    """Which FlashInfer entry point serves a case, from its shape class and dtypes: verify blocks go to fa2 (several
    times faster than fa3 on 4-8 token blocks: docs/bench.md); long prefills to fa3 where it serves the types
    (fa3_serves), else fa2."""
    if case.shape_class == "decode":
        return "decode"
    return ("prefill-fa3" if case.shape_class == "prefill" and fa3_serves(case.arch, case.q_dtype,
                                                                          case.format.storage_dtype)
            else "prefill-fa2")


class _Plans:
    """The wrappers of one device and the step each one was last planned for."""

    def __init__(self, device: torch.device):
        self.device = device
        self.workspace = workspace(device)
        self.wrappers: dict = {}  # (kind, plan signature), or ("graph", graph id, ...) -> wrapper
        self.planned_for: dict = {}  # same key -> step key the wrapper's current plan belongs to
        # same key -> (bool [rows, 1, 1], values [rows, 1, 1] in q's dtype): the rows run()'s output is set in, to
        # NaN (bad indices) or 0 (decode rows of empty sequences, which FlashInfer leaves undefined); set at plan
        # time, in place (a captured graph holds them)
        self.row_fix: dict = {}
        self.fix_now: dict = {}  # same key -> row_fix[key] when run() must apply it (graphs: always), else None
        self.bad_cu: dict = {}  # same key -> cu_seqlens_q of the planned step is bad: every row NaN, no run()
        self.built: set = set()  # configurations already JIT-built (or loaded) in this process
        # decode key -> int32 device buffers (indptr [B + 1], indices [B * width], last_page_len [B]) the layout
        # kernel writes; a graph's are fixed (its wrapper copies indices into a buffer of B * width)
        self.decode_layout: dict = {}

    def make_wrapper(self, kind: str):
        import flashinfer

        if kind == "decode":
            return flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=True)
        return flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend=kind.split("-")[1])

    def wrapper_for(self, call, kind: str, graph) -> tuple:
        """(key, wrapper): the wrapper of the call's kind and signature, made on first use. Inside a graph capture,
        a decode wrapper of that graph, with fixed buffers sized for the captured batch, as CUDA graphs need."""
        case, q = call.case, call.q
        signature = (q.dtype, call.k_cache.dtype, case.num_q_heads, case.num_kv_heads, case.head_dim,
                     case.page_size, call.scale, call.soft_cap, call.window_left)
        if graph is None:
            key = (kind, signature)
            if key not in self.wrappers:
                self.wrappers[key] = self.make_wrapper(kind)
            return key, self.wrappers[key]
        if kind != "decode":
            raise RuntimeError("attnops.serving.graphs captures decode steps only (FlashInfer backend)")
        key = ("graph", id(graph), kind, signature)
        if key not in self.wrappers:
            import flashinfer
            batch = case.batch
            self.wrappers[key] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True,
                paged_kv_indptr_buffer=torch.empty(batch + 1, dtype=torch.int32, device=q.device),
                paged_kv_indices_buffer=torch.empty(call.block_table.numel(), dtype=torch.int32, device=q.device),
                paged_kv_last_page_len_buffer=torch.empty(batch, dtype=torch.int32, device=q.device))
        return key, self.wrappers[key]

    def note_build(self, kind: str, call) -> None:
        """Warns on the first use of a FlashInfer configuration in this process (it may JIT-build it now)."""
        build_key = (kind, call.q.dtype, call.k_cache.dtype, call.case.head_dim, call.soft_cap > 0,
                     call.window_left >= 0)
        if build_key not in self.built:
            log.warning("attnops: first use of FlashInfer %s for %s; FlashInfer may JIT-build it now (15-100 s, "
                        "once per machine; `python -m attnops warmup` does it ahead)", kind, build_key[1:])
            self.built.add(build_key)

    def decode_layout_for(self, key, batch: int, block_table: torch.Tensor, device: torch.device) -> tuple:
        """The device buffers (indptr, indices, last_page_len) of a decode wrapper's layout, made anew when the
        step's batch or table outgrows them (a graph's keep their size: the captured batch)."""
        layout = self.decode_layout.get(key)
        if layout is None or layout[1].shape[0] < block_table.numel() or layout[0].shape[0] != batch + 1:
            layout = self.decode_layout[key] = (
                torch.empty(batch + 1, dtype=torch.int32, device=device),
                torch.empty(max(block_table.numel(), 1), dtype=torch.int32, device=device),
                torch.empty(batch, dtype=torch.int32, device=device))
        return layout

    def row_fix_for(self, key, rows: int, dtype: torch.dtype, device: torch.device) -> tuple:
        """The (mask, values) buffers [rows, 1, 1] of the rows run()'s output is set in, made when the row count
        changes and otherwise reused in place (a captured graph holds them)."""
        fix = self.row_fix.get(key)
        if fix is None or fix[0].shape[0] != rows:
            fix = self.row_fix[key] = (torch.empty(rows, 1, 1, dtype=torch.bool, device=device),
                                       torch.empty(rows, 1, 1, dtype=dtype, device=device))
        return fix

    def plan_step(self, key, wrapper, kind: str, call, graph) -> None:
        """Plans `wrapper` for the call's step: checks cu_seqlens_q on the host (bad: bad_cu, no plan), lays out the
        pages on the device, plans, and sets which rows run()'s output must be set in (fix_now). A graph runs it
        again before every replay, from its static metadata."""
        flashinfer_replay.disarm(wrapper)  # a replay of the old plan must not run on the new one's buffers
        self.bad_cu[key] = False
        if call.cu_seqlens_q is not None:  # eager only (graphs capture decode): FlashInfer's plan syncs anyway
            bad_entry = errors.cu_seqlens_violation(call.cu_seqlens_q.tolist(), call.num_tokens)
            if bad_entry is not None:  # which rows are whose is undefined: every row NaN, FlashInfer not run
                errors.record(call.q.device, errors.CU_SEQLENS_Q, bad_entry)
                self.bad_cu[key] = True
                self.planned_for[key] = step_key(call.block_table, call.seq_lens, call.cu_seqlens_q)
                return
        rows = call.case.batch if kind == "decode" else call.num_tokens
        fix = self.row_fix_for(key, rows, call.q.dtype, call.q.device)
        mask, values = fix[0].view(-1), fix[1].view(-1)
        if kind == "decode":
            needs_fix = _plan_decode(wrapper, call, graph, self.decode_layout[key], mask, values)
        else:
            needs_fix = _plan_prefill(wrapper, call, mask, values)
        # eager steps with no row to set skip the launch after run()
        self.fix_now[key] = fix if needs_fix else None
        self.planned_for[key] = step_key(call.block_table, call.seq_lens, call.cu_seqlens_q)


@functools.lru_cache(maxsize=None)
def _plans(device: torch.device) -> _Plans:
    return _Plans(device)


def _plan_options(call) -> dict:
    """plan()'s keyword arguments common to decode and prefill"""
    return dict(q_data_type=call.q.dtype, kv_data_type=call.k_cache.dtype, sm_scale=call.scale,
                logits_soft_cap=call.soft_cap if call.soft_cap > 0 else None, window_left=call.window_left)


def _plan_decode(wrapper, call, graph, layout: tuple, mask, values) -> bool:
    """A decode plan: one launch (a Triton kernel) for the layout (into `layout`'s buffers), the rows to set and the
    records: the replan of a captured graph runs before every replay, so its host time is the serving loop's.
    Returns whether any row is to be set (a graph: always, its padding rows come and go)."""
    from .pages import decode_page_layout  # (imports triton: here, not when attnops is imported)
    case, page_size, num_pages = call.case, call.case.page_size, call.num_pages
    indptr, indices, last_page_len = layout
    decode_page_layout(call.block_table, call.seq_lens.contiguous(), page_size, num_pages, call.window_left, indptr,
                       indices, last_page_len, mask, values)
    if graph is not None:  # from the host's lengths: no sync
        indptr, last_page_len = host_page_metadata(graph.host_seq_lens, page_size, call.capacity if num_pages else 0)
        needs_fix = True
    else:  # (planning syncs anyway: one read for the pages in use and whether any row is set)
        nnz, needs_fix = torch.stack((indptr[-1], mask.any().to(torch.int32))).tolist()
        indices = indices[:nnz]
    wrapper.plan(indptr, indices, last_page_len, case.num_q_heads, case.num_kv_heads, case.head_dim, page_size,
                 **_plan_options(call))
    return needs_fix


def _plan_prefill(wrapper, call, mask, values) -> bool:
    """A prefill (fa2, fa3) plan of a safe layout (checked_pages' torch ops), and the rows to set NaN. Returns
    whether any is."""
    case = call.case
    lens, table, nan_rows = checked_pages(call.block_table, call.seq_lens, case.page_size, call.num_pages,
                                          call.window_left, call.cu_seqlens_q, call.num_tokens)
    indptr, indices, last_page_len = page_metadata(table, lens, case.page_size)
    wrapper.plan(call.cu_seqlens_q, indptr, indices, last_page_len, case.num_q_heads, case.num_kv_heads,
                 case.head_dim, case.page_size, causal=True, **_plan_options(call))
    mask.copy_(nan_rows)
    values.zero_().masked_fill_(nan_rows, float("nan"))
    return bool(mask.any())


class FlashInferBackend(Backend):
    name = "flashinfer"
    description = ("FlashInfer's CUDA kernels: tensor-core paged decode, fa2/fa3 paged prefill for verify and "
                   "extend; bf16/fp16 and fp8 (per-tensor scale) KV; latent attention (MLA) at R 512, P 64; "
                   "planned once per step")
    writes_cache = False
    plans_on_host = True
    serves_mla = True  # (flashinfer_mla.py: DeepSeek's latent rows, bf16/fp16)

    def forget_steps(self) -> None:
        flashinfer_replay.clear()  # replayed calls skip dispatch: none armed under an old pin may run

    def unavailable(self) -> list[str]:
        error = _import_error()
        reasons = [error] if error else []
        if not torch.cuda.is_available():
            reasons.append("no CUDA GPU")
        return reasons

    def invariance_reasons(self, case) -> list[str]:
        return ["FlashInfer's plan splits keys by the whole batch (its fixed-split option is not used by attnops)"]

    def supports(self, case) -> list[str]:
        if isinstance(case, (CacheWriteCase, MLAWriteCase)):
            return ["writes the cache through attnops' own kernels (FlashInfer has no fp8-scaled/4-bit cache write)"]
        if isinstance(case, MLACase):
            return flashinfer_mla.reasons(case)
        reasons = common_reasons(case, devices=("cuda",), q_dtypes=Q_DTYPES, kv_formats=KV_FORMATS,
                                 head_dims=HEAD_DIMS, archs=lambda arch: arch >= (8, 0), sinks=False,
                                 tree_mask=False)
        if case.scale_kind == "per_head":
            reasons.append("per-head fp8 scales: FlashInfer takes one scale per tensor")
        if formats.is_fp4(case.kv_format):
            reasons.append(f"{case.kv_format}: FlashInfer has no paged 4-bit KV on sm_90 and older")
        if case.q_dtype == torch.float16 and case.kv_format == "fp8_e5m2":
            reasons.append("fp8_e5m2 KV with fp16 q is not among FlashInfer's prebuilt type pairs")
        return reasons

    # ---------------------------------------------------------------------------------------------------------
    def _plan(self, call):
        """The wrapper planned for this step's metadata (planned now if this step has not been seen yet), the rows
        run()'s output must be set in (mask, values; or None), whether the step's cu_seqlens_q is bad (no run: all
        rows NaN), and whether it was planned now."""
        plans = _plans(call.q.device)
        kind = wrapper_kind(call.case)
        graph = capture.current_capture()
        key, wrapper = plans.wrapper_for(call, kind, graph)
        if same_step(plans.planned_for.get(key), call.block_table, call.seq_lens, call.cu_seqlens_q):
            return wrapper, plans.fix_now.get(key), plans.bad_cu.get(key), False
        if torch.cuda.is_current_stream_capturing():  # dispatch keeps foreign captures away; this is the backstop
            raise RuntimeError("attnops.paged_attention (flashinfer): no plan for this step inside a CUDA graph "
                               "capture; capture through attnops.serving.graphs, which plans before capture and replay")
        plans.note_build(kind, call)
        if kind == "decode":  # device buffers of the layout (graphs: fixed, sized for the captured batch)
            plans.decode_layout_for(key, call.case.batch, call.block_table, call.q.device)
        plan = functools.partial(plans.plan_step, key, wrapper, kind, call, graph)
        plan()
        if graph is not None:  # the runner re-plans from its static metadata before every replay
            graph.replanners.append(plan)
        return wrapper, plans.fix_now.get(key), plans.bad_cu.get(key), True

    def paged_attention(self, call) -> None:
        wrapper, row_fix, bad_cu, planned_now = self._plan(call)
        out, lse = call.out, call.lse
        if bad_cu:
            fill_nan(out, lse)
            return
        q, k_cache, v_cache = call.q, call.k_cache, call.v_cache
        # a tensor scale (fp8; per tensor: supports declines per head) is applied around run(), on the device; the
        # formats FlashInfer reads have it or no scale
        scale = call.format.scale
        if scale not in (formats.NO_SCALE, formats.TENSOR_SCALE):
            raise ValueError(f"FlashInfer backend: kv_format {call.kv_format} has {scale} scales, which it cannot "
                             f"apply")
        tensor_scaled = scale == formats.TENSOR_SCALE
        if tensor_scaled:
            q = q * call.k_scale.to(q.dtype)  # scores scale with k: fold k_scale into q, on the device (the LSE too)
        # the first call of an eager plan arms the C++ replay of the kernel call for the step's other calls: only
        # where run() is the whole call (no fp8 scaling or row masking around it, no LSE asked) and no check reads
        # the data
        if lse is not None:
            self._run_with_lse(wrapper, q, k_cache, v_cache, out, lse)
        elif (planned_now and not tensor_scaled and row_fix is None and capture.current_capture() is None
                and not values_checked() and flashinfer_replay.enabled()):
            flashinfer_replay.run_and_arm(wrapper, q, k_cache, v_cache, out)
        else:
            wrapper.run(q, (k_cache, v_cache), out=out)
        if tensor_scaled:
            out.mul_(call.v_scale.to(out.dtype))
        if row_fix is not None:
            set_rows(row_fix, out, lse)

    @staticmethod
    def _run_with_lse(wrapper, q, k_cache, v_cache, out, lse) -> None:
        """run() with return_lse (paged_attention_with_lse; never the C++ replay, which serves paged_attention
        only), its base-2 LSE turned into the contract's natural log."""
        lse_buffer = lse if lse.is_contiguous() else torch.empty(lse.shape, dtype=lse.dtype, device=lse.device)
        wrapper.run(q, (k_cache, v_cache), out=out, lse=lse_buffer, return_lse=True)
        lse_buffer.mul_(LN2)
        if lse_buffer is not lse:
            lse.copy_(lse_buffer)

    def reshape_and_cache(self, call) -> None:
        raise NotImplementedError("FlashInfer backend: cache writes go through attnops' own kernels")

    def mla_attention(self, call) -> None:
        flashinfer_mla.mla_attention(call)

    def mla_cache_write(self, call) -> None:
        raise NotImplementedError("FlashInfer backend: cache writes go through attnops' own kernels")
