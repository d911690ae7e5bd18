"""The dispatch policy: which backend serves a case, decided from shapes, dtypes and flags only.

For each case the policy gives an ordered list of backend names (per device type; per GPU arch once a measured
table exists for it); dispatch takes the first backend that is available and has no reason to decline. A
backend is pinned with ATTNOPS_BACKEND=<name> or `with attnops.use_backend(name):`; a pinned backend that cannot
serve a case is an error naming why, never a silent fallback.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from . import checks, formats
from .backends import BACKENDS, flashinfer_replay
from .backends.base import AttentionCase, Backend, CacheWriteCase

# Static order per device type, fastest first, used where no measured table for the arch exists.
STATIC_ORDER = {
    "cpu": ("cpu", "reference"),
    "cuda": ("flashinfer", "triton", "reference"),
}

_pinned_backend: contextvars.ContextVar[str | None] = contextvars.ContextVar("attnops_backend", default=None)


@contextlib.contextmanager
def use_backend(name: str | None):
    """Pins backend `name` for the ops called inside the block (None: back to automatic choice)."""
    if name is not None and name not in BACKENDS:
        raise ValueError(f"attnops.use_backend: unknown backend {name!r}; known: {sorted(BACKENDS)}")
    token = _pinned_backend.set(name)
    flashinfer_replay.clear()  # replayed FlashInfer calls skip dispatch: none armed under the old pin may run
    try:
        yield
    finally:
        _pinned_backend.reset(token)
        flashinfer_replay.clear()


def pinned_backend() -> str | None:
    """The backend pinned by use_backend or, failing that, ATTNOPS_BACKEND ('auto' or unset: none)."""
    name = _pinned_backend.get()
    if name is None:
        name = checks.environ_get("ATTNOPS_BACKEND") or None
        if name == "auto":
            name = None
    return name


TABLES = Path(__file__).parent / "tables"


@functools.lru_cache(maxsize=None)
def arch_table(arch: tuple[int, int] | None) -> dict:
    """The measured order for a GPU arch (attnops/tables/sm_XY.json, written by `python -m attnops tune`):
    {"decode/bf16/none/g4/d128": ["triton", "flashinfer"], ...}; empty where none was measured."""
    if arch is None:
        return {}
    path = TABLES / f"sm_{arch[0]}{arch[1]}.json"
    return json.loads(path.read_text())["order"] if path.exists() else {}


def class_key(shape_class: str, kv_format: str, scale_kind: str, group: int, head_dim: int) -> str:
    """The key of a case's class in a measured table: shape class / KV format / scale kind / GQA group / head dim
    (how the kernels tile a call: one KV head's group of query heads is one tile's rows). Head shapes the tune
    grid did not measure fall to the static order: a coarser class (all bf16 decode) chose Triton for a 32/8/64
    model it had not measured, and the H200 served 21% fewer tokens/s at 128 x 8K than with FlashInfer
    (benchmarks/results/h200-serve-8k-coarse-class.json)."""
    return f"{shape_class}/{kv_format}/{scale_kind}/g{group}/d{head_dim}"


def table_key(case: AttentionCase) -> str | None:
    """The key of `case`'s class if its arch's measured table has it, else None."""
    key = class_key(case.shape_class, case.kv_format, case.scale_kind, case.num_q_heads // case.num_kv_heads,
                    case.head_dim)
    return key if key in arch_table(case.arch) else None


def policy(case: AttentionCase | CacheWriteCase) -> tuple[str, ...]:
    """The backends to try for `case`, in order: the arch's measured table where it has the case's class, then
    the static order for the rest."""
    static = STATIC_ORDER.get(case.device_type, ("reference",))
    key = table_key(case) if isinstance(case, AttentionCase) else None
    measured = arch_table(case.arch)[key] if key else []
    return tuple(measured) + tuple(name for name in static if name not in measured)


def reasons_against(backend: Backend, case) -> list[str]:
    return backend.unavailable() + backend.supports(case)


@dataclass
class Explanation:
    """Which backend serves a case, and why every other one was passed over."""

    case: AttentionCase | CacheWriteCase
    chosen: str | None
    rejected: dict[str, list[str]] = field(default_factory=dict)
    pinned: str | None = None

    def __str__(self) -> str:
        lines = [f"case: {describe_case(self.case)}"]
        if self.pinned:
            how = f"pinned by {'use_backend' if _pinned_backend.get() else 'ATTNOPS_BACKEND'}"
        else:
            key = table_key(self.case) if isinstance(self.case, AttentionCase) else None
            how = (f"auto: order measured on sm_{self.case.arch[0]}{self.case.arch[1]} for class {key} "
                   f"(attnops/tables)" if key else "auto: static order")
        lines.append(f"chosen: {self.chosen or 'none'} ({how})")
        for name, reasons in self.rejected.items():
            lines.append(f"  passed over {name}: {'; '.join(reasons)}")
        return "\n".join(lines)


def describe_case(case) -> str:
    parts = []
    for f in fields(case):
        value = getattr(case, f.name)
        if isinstance(value, torch.dtype):
            value = str(value).replace("torch.", "")
        parts.append(f"{f.name}={value}")
    return ", ".join(parts)


def _explain_case(case, pinned: str | None) -> Explanation:
    if pinned is not None and isinstance(case, CacheWriteCase) and pinned in BACKENDS \
            and not BACKENDS[pinned].writes_cache:
        pinned = None  # a pinned attention-only backend (FlashInfer): cache writes go by the policy
    if pinned is not None:
        if pinned not in BACKENDS:
            raise ValueError(f"attnops: unknown backend {pinned!r} (ATTNOPS_BACKEND or use_backend); "
                             f"known: {sorted(BACKENDS)}")
        reasons = reasons_against(BACKENDS[pinned], case)
        return Explanation(case, None if reasons else pinned, {pinned: reasons} if reasons else {}, pinned)
    explanation = Explanation(case, None)
    for name in policy(case):
        if name not in BACKENDS:
            explanation.rejected[name] = ["not built into this version of attnops"]
            continue
        reasons = reasons_against(BACKENDS[name], case)
        if not reasons:
            explanation.chosen = name
            break
        explanation.rejected[name] = reasons
    return explanation


@functools.lru_cache(maxsize=4096)
def _select_cached(case, pinned: str | None) -> Backend:
    explanation = _explain_case(case, pinned)
    if explanation.chosen is None:
        what = f"pinned backend {pinned!r} cannot serve" if pinned else "no backend can serve"
        raise ValueError(f"attnops: {what} this case.\n{explanation}")
    if explanation.chosen == "reference" and case.device_type != "cpu":
        warnings.warn(f"attnops: the reference backend (slow, not CUDA-graph safe) serves {describe_case(case)}.\n"
                      f"{explanation}", stacklevel=3)
    return BACKENDS[explanation.chosen]


def select_backend(case) -> Backend:
    """The backend that serves `case` (raises ValueError listing every backend's reasons if none can)."""
    return _select_cached(case, pinned_backend())


def explain(**kwargs) -> Explanation:
    """Which backend serves a case and why the others were passed over.

    Either the op's own arguments (`q=..., k_cache=..., v_cache=..., block_table=..., seq_lens=...` and any
    keyword of paged_attention; meta tensors are fine; `key=..., value=...` etc. for reshape_and_cache), or a
    case description: any fields of AttentionCase, the rest defaulting to a Llama-3-8B-like bf16 decode on the
    current device."""
    pinned = pinned_backend()
    if "q" in kwargs:
        defaults = dict(cu_seqlens_q=None, scale=None, soft_cap=0.0, window_left=-1, kv_format="auto",
                        k_scale=None, v_scale=None)
        case = checks.check_paged_attention(**{**defaults, **kwargs})
    elif "key" in kwargs:
        defaults = dict(kv_format="auto", k_scale=None, v_scale=None, k_block_scale=None, v_block_scale=None)
        case = checks.check_reshape_and_cache(**{**defaults, **kwargs})
    else:
        case = describe_attention(**kwargs)
    return _explain_case(case, pinned)


def describe_attention(device: str | None = None, **fields_) -> AttentionCase:
    """An AttentionCase from keywords, defaulting to 32/8/128 bf16 decode with a page size of 16."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    kv_format = fields_.pop("kv_format", "bf16")
    if kv_format not in formats.KV_FORMATS:
        raise ValueError(f"attnops.explain: kv_format must be one of {formats.KV_FORMATS} (got {kv_format!r})")
    scale_kind = "per_tensor" if formats.is_fp8(kv_format) else "block" if formats.is_fp4(kv_format) else "none"
    values = dict(device_type=device.type, arch=checks.device_arch(device),
                  q_dtype=torch.float32 if device.type == "cpu" else torch.bfloat16, kv_format=kv_format,
                  head_dim=128, page_size=16, num_q_heads=32, num_kv_heads=8, decode=True, soft_cap=False,
                  sliding_window=False, scale_kind=scale_kind)
    unknown = set(fields_) - set(values)
    if unknown:
        raise TypeError(f"attnops.explain: unknown case fields {sorted(unknown)}; known: {sorted(values)}")
    values.update(fields_)
    values.setdefault("shape_class", "decode" if values["decode"] else "prefill")
    return AttentionCase(**values)
