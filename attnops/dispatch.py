"""The dispatch policy: which backend serves a case, decided from shapes, dtypes and flags only, and from the
CUDA-graph capture the call is in.

For each case the policy gives an ordered list of backend names: on a GPU, the order of the measured rule
(attnops/rules.py) fitted on that arch (or, for an arch with no table, on the nearest measured one); on the CPU,
STATIC_ORDER. Dispatch takes the first backend that is available and has no reason to decline. Inside a capture
that nobody re-plans (attnops.capture: plain torch.cuda.graph, torch.compile's cudagraph trees), backends that
plan on the host decline, since their replay would run a stale plan. A backend is pinned with
ATTNOPS_BACKEND=<name> or `with attnops.use_backend(name):`; a pinned backend that cannot serve a case is an
error naming why, never a silent fallback.
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

from . import capture, checks, checks_mla, formats, invariance, rules
from .backends import BACKENDS
from .backends.base import VERIFY_MAX_Q, AttentionCase, Backend, CacheWriteCase, MLACase, MLAWriteCase
from .env import device_arch, environ_get

# Order per device type where no rule was measured: the CPU, cache writes, and a GPU with no table at all.
STATIC_ORDER = {
    "cpu": ("cpu", "reference"),
    "cuda": ("flashinfer", "cuda", "triton", "reference"),
}

# Latent attention (MLA): on the CPU the C++ kernels, as for paged attention; on a GPU FlashInfer's MLA wrapper
# where it serves (R 512, P 64, bf16/fp16, outside captures nobody re-plans; Triton took 0.87-2.6x its time on the
# H100, docs/bench.md), then the CUDA backend's sm_90a decode (R 512, P 64, bf16: it serves inside captures, where
# FlashInfer is passed over, much faster than Triton at many heads: docs/bench.md), then Triton's kernels (fp8,
# sinks, trees, verify and extend, other R/P, other GPUs), the reference only behind them (a host loop: slow,
# and not CUDA-graph safe).
MLA_ORDER = {
    "cpu": ("cpu", "reference"),
    "cuda": ("flashinfer", "cuda", "triton", "reference"),
}

_pinned_backend: contextvars.ContextVar[str | None] = contextvars.ContextVar("attnops_backend", default=None)


@contextlib.contextmanager
def use_backend(name: str | None):
    """Pins backend `name` for the ops called inside the block (None: back to automatic choice)."""
    if name is not None and name not in BACKENDS:
        raise ValueError(f"attnops.use_backend: unknown backend {name!r}; known: {sorted(BACKENDS)}")
    token = _pinned_backend.set(name)
    _forget_steps()
    try:
        yield
    finally:
        _pinned_backend.reset(token)
        _forget_steps()


def _forget_steps() -> None:
    for backend in BACKENDS.values():
        backend.forget_steps()


def pinned_backend() -> str | None:
    """The backend pinned by use_backend or, failing that, ATTNOPS_BACKEND ('auto' or unset: none)."""
    name = _pinned_backend.get()
    if name is None:
        name = environ_get("ATTNOPS_BACKEND") or None
        if name == "auto":
            name = None
    return name


TABLES = Path(__file__).parent / "tables"


@functools.lru_cache(maxsize=None)
def arch_table(arch: tuple[int, int] | None) -> dict:
    """The measured table of a GPU arch (attnops/tables/sm_XY.json, written by `python -m attnops tune`): its
    "rule" (attnops/rules.py) and what it was fitted to; empty where none was measured."""
    if arch is None:
        return {}
    path = TABLES / f"sm_{arch[0]}{arch[1]}.json"
    return json.loads(path.read_text()) if path.exists() else {}


@functools.lru_cache(maxsize=None)
def rule_arch(arch: tuple[int, int] | None) -> tuple[int, int] | None:
    """The arch whose measured rule orders `arch`'s cases: its own, else the nearest measured one (the same major
    version first, then the closest below, then the closest above); None where nothing was measured."""
    if arch is None:
        return None
    measured = sorted(tuple(int(c) for c in (p.stem[3:-1], p.stem[-1])) for p in TABLES.glob("sm_*.json"))
    if not measured:
        return None
    return min(measured, key=lambda a: (a != arch, a[0] != arch[0], a > arch, abs(a[0] - arch[0]), abs(a[1] - arch[1])))


def table_keys(case: AttentionCase | MLACase) -> tuple[str, str]:
    """The table's rule and its timed formats for the case's op: latent attention has its own (other backends)."""
    return ("mla_rule", "mla_timed_formats") if isinstance(case, MLACase) else ("rule", "timed_formats")


def rule_leaf(case: AttentionCase | MLACase) -> tuple[dict, list[str], tuple[int, int]] | None:
    """(the leaf of the measured rule that orders `case`, the questions that led there, the arch it was measured
    on), or None where no rule applies (the CPU; no table; latent attention: a table without "mla_rule")."""
    if case.device_type != "cuda":
        return None
    arch = rule_arch(case.arch)
    rule = arch_table(arch).get(table_keys(case)[0]) if arch else None
    if not rule:
        return None
    leaf, path = rules.decide(rule, rules.features(case))
    return leaf, path, arch


def untimed(order, kv_format: str, table: dict, key: str = "timed_formats") -> list[str]:
    """The backends of `order` that the table timed (its record `key`) on no format of `kv_format`'s family while
    another backend of `order` was (its leaf, fitted on other formats, says nothing of them there); none for a
    table without the record."""
    timed = table.get(key)
    family = formats.family(kv_format)
    if not timed or not any(family in timed.get(n, ()) for n in order):
        return []
    return [n for n in order if family not in timed.get(n, ())]


def policy(case: AttentionCase | CacheWriteCase | MLACase | MLAWriteCase) -> tuple[str, ...]:
    """The backends to try for `case`, in order: the measured rule's order for attention on a GPU (latent
    attention: its own rule), the backends never timed on the case's format moved behind the timed ones (a backend
    that learns a format is not chosen before the table is refitted with its times), then the static order for the
    rest (latent attention: MLA_ORDER)."""
    if isinstance(case, MLAWriteCase):
        return MLA_ORDER.get(case.device_type, ("reference",))
    orders = MLA_ORDER if isinstance(case, MLACase) else STATIC_ORDER
    static = orders.get(case.device_type, ("reference",))
    decided = rule_leaf(case) if isinstance(case, (AttentionCase, MLACase)) else None
    measured = decided[0]["order"] if decided else []
    if decided:
        late = untimed(measured, case.kv_format, arch_table(decided[2]), table_keys(case)[1])
        measured = [n for n in measured if n not in late] + late
    return tuple(measured) + tuple(name for name in static if name not in measured)


def capture_reasons(backend: Backend, capture_state: str) -> list[str]:
    if backend.plans_on_host and capture_state == capture.FOREIGN:
        return ["inside a CUDA graph capture that nobody re-plans (plain torch.cuda.graph, torch.compile "
                "mode='reduce-overhead'): its host-made plan would replay stale once the lengths change; capture "
                "through attnops.serving.graphs.DecodeGraphRunner (or drive attnops.capture.capturing yourself), or use "
                "a plan-free backend (triton)"]
    return []


def reasons_against(backend: Backend, case, capture_state: str = capture.NONE, invariant: bool = False) -> list[str]:
    if isinstance(case, (MLACase, MLAWriteCase)) and not backend.serves_mla:
        return ["has no latent-attention (MLA) kernels"]
    reasons = backend.unavailable() + backend.supports(case) + capture_reasons(backend, capture_state)
    if invariant and isinstance(case, (AttentionCase, MLACase)):
        reasons += backend.invariance_reasons(case)
    return reasons


@dataclass
class Explanation:
    """Which backend serves a case, and why every other one was passed over."""

    case: AttentionCase | CacheWriteCase
    chosen: str | None
    rejected: dict[str, list[str]] = field(default_factory=dict)
    pinned: str | None = None
    capture_state: str = capture.NONE
    invariant: bool = False  # asked in batch-invariant mode (attnops.invariance)

    def __str__(self) -> str:
        lines = [f"case: {describe_case(self.case)}"]
        if self.capture_state != capture.NONE:
            lines.append(f"capture: {CAPTURE_WORDS[self.capture_state]}")
        if self.invariant:
            lines.append("mode: batch-invariant (attnops.batch_invariant): only backends that keep a row's bits "
                         "independent of the rest of the call")
        if self.pinned:
            how = f"pinned by {'use_backend' if _pinned_backend.get() else 'ATTNOPS_BACKEND'}"
        else:
            how = self.rule_text() or "auto: static order"
        lines.append(f"chosen: {self.chosen or 'none'} ({how})")
        for name, reasons in self.rejected.items():
            lines.append(f"  passed over {name}: {'; '.join(reasons)}")
        return "\n".join(lines)

    def rule_text(self) -> str | None:
        decided = rule_leaf(self.case) if isinstance(self.case, (AttentionCase, MLACase)) else None
        if decided is None:
            return None
        leaf, path, arch = decided
        where = f"sm_{arch[0]}{arch[1]}"
        if arch != self.case.arch:
            where += f", the nearest measured arch (none for sm_{self.case.arch[0]}{self.case.arch[1]})"
        late = untimed(leaf["order"], self.case.kv_format, arch_table(arch), table_keys(self.case)[1])
        text = (f"auto: rule measured on {where}, attnops/tables: {' and '.join(path) or 'every case'} -> "
                f"{rules.describe_leaf(leaf)}")
        if late:
            text += (f"; never timed on {formats.family(self.case.kv_format)}, so tried after the timed: "
                     f"{', '.join(late)}")
        return text


CAPTURE_WORDS = {capture.REPLANNED: "a CUDA graph whose driver re-plans before each replay (attnops.capture)",
                 capture.FOREIGN: "a CUDA graph nobody re-plans (plain torch.cuda.graph or torch.compile's "
                                  "cudagraph trees): host-planned backends are passed over"}


def describe_case(case) -> str:
    parts = []
    for f in fields(case):
        value = getattr(case, f.name)
        if isinstance(value, torch.dtype):
            value = str(value).replace("torch.", "")
        parts.append(f"{f.name}={value}")
    return ", ".join(parts)


def _explain_case(case, pinned: str | None, capture_state: str = capture.NONE, invariant: bool = False) -> Explanation:
    if pinned is not None and isinstance(case, (CacheWriteCase, MLAWriteCase)) and pinned in BACKENDS \
            and not BACKENDS[pinned].writes_cache:
        pinned = None  # a pinned attention-only backend (FlashInfer): cache writes go by the policy
    if pinned is not None:
        if pinned not in BACKENDS:
            raise ValueError(f"attnops: unknown backend {pinned!r} (ATTNOPS_BACKEND or use_backend); "
                             f"known: {sorted(BACKENDS)}")
        reasons = reasons_against(BACKENDS[pinned], case, capture_state, invariant)
        return Explanation(case, None if reasons else pinned, {pinned: reasons} if reasons else {}, pinned,
                           capture_state, invariant)
    explanation = Explanation(case, None, capture_state=capture_state, invariant=invariant)
    for name in policy(case):
        if name not in BACKENDS:
            explanation.rejected[name] = ["not built into this version of attnops"]
            continue
        reasons = reasons_against(BACKENDS[name], case, capture_state, invariant)
        if not reasons:
            explanation.chosen = name
            break
        explanation.rejected[name] = reasons
    return explanation


@functools.lru_cache(maxsize=4096)
def _select_cached(case, pinned: str | None, capture_state: str, invariant: bool = False) -> Backend:
    explanation = _explain_case(case, pinned, capture_state, invariant)
    if explanation.chosen is None:
        what = f"pinned backend {pinned!r} cannot serve" if pinned else "no backend can serve"
        raise ValueError(f"attnops: {what} this case.\n{explanation}")
    if explanation.chosen == "reference" and case.device_type != "cpu":
        warnings.warn(f"attnops: the reference backend (slow, not CUDA-graph safe) serves {describe_case(case)}.\n"
                      f"{explanation}", stacklevel=3)
    return BACKENDS[explanation.chosen]


def select_backend(case, device: torch.device | None = None) -> Backend:
    """The backend that serves `case` on `device` in the capture state the call is in there (raises ValueError
    listing every backend's reasons if none can)."""
    state = capture.capture_state(device) if device is not None else capture.NONE
    return _select_cached(case, pinned_backend(), state, invariance.enabled())


def explain(**kwargs) -> Explanation:
    """Which backend serves a case and why the others were passed over.

    Either the op's own arguments (`q=..., k_cache=..., v_cache=..., block_table=..., seq_lens=...` and any
    keyword of paged_attention; meta tensors are fine; `key=..., value=...` etc. for reshape_and_cache;
    `q_nope=...` for mla_attention and `kv_c=...` for mla_cache_write), or a
    case description: any fields of AttentionCase, the rest defaulting to a Llama-3-8B-like bf16 decode on the
    current device. `capture_state=` ("none", "replanned", "foreign": attnops.capture) asks about a call made in
    that state of CUDA-graph capture; by default, the state of the current stream."""
    pinned = pinned_backend()
    state = kwargs.pop("capture_state", None)
    if "q" in kwargs:
        defaults = dict(cu_seqlens_q=None, scale=None, soft_cap=0.0, window_left=-1, kv_format="auto",
                        k_scale=None, v_scale=None, sinks=None, tree_mask=None)
        case = checks.check_paged_attention(**{**defaults, **kwargs})
    elif "q_nope" in kwargs:  # latent attention (mla_attention's arguments)
        defaults = dict(cu_seqlens_q=None, kv_format="auto", kv_scale=None, sinks=None, tree_mask=None)
        case = checks_mla.check_mla_attention(**{**defaults, **kwargs})
    elif "kv_c" in kwargs:
        case = checks_mla.check_mla_cache_write(**{**dict(kv_format="auto", kv_scale=None), **kwargs})
    elif "key" in kwargs:
        defaults = dict(kv_format="auto", k_scale=None, v_scale=None, k_block_scale=None, v_block_scale=None)
        case = checks.check_reshape_and_cache(**{**defaults, **kwargs})
    else:
        case = describe_attention(**kwargs)
    if state is None:
        state = capture.capture_state(torch.device(case.device_type)) if case.device_type == "cuda" else capture.NONE
    elif state not in CAPTURE_WORDS and state != capture.NONE:
        raise ValueError(f"attnops.explain: capture_state must be one of {capture.NONE!r}, {capture.REPLANNED!r}, "
                         f"{capture.FOREIGN!r} (got {state!r})")
    return _explain_case(case, pinned, state, invariance.enabled())


def explain_case(case) -> Explanation:
    """explain() for a case already built (an AttentionCase, CacheWriteCase, MLACase...), outside any capture."""
    return _explain_case(case, pinned_backend(), invariant=invariance.enabled())


def describe_attention(device: str | None = None, **fields_) -> AttentionCase:
    """An AttentionCase from keywords, defaulting to 32/8/128 bf16 decode with a page size of 16."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    kv_format = fields_.pop("kv_format", "bf16")
    if kv_format not in formats.KV_FORMATS:
        raise ValueError(f"attnops.explain: kv_format must be one of {formats.KV_FORMATS} (got {kv_format!r})")
    scale_kind = formats.FORMATS[kv_format].default_scale_kind
    values = dict(device_type=device.type, arch=device_arch(device),
                  q_dtype=torch.float32 if device.type == "cpu" else torch.bfloat16, kv_format=kv_format,
                  head_dim=128, page_size=16, num_q_heads=32, num_kv_heads=8, decode=True, soft_cap=False,
                  sliding_window=False, scale_kind=scale_kind, batch=1, max_kv_len=4096, shape_class=None,
                  sinks=False, tree_mask=False, q_per_seq=None, aligned_kv=True)
    unknown = set(fields_) - set(values)
    if unknown:
        raise TypeError(f"attnops.explain: unknown case fields {sorted(unknown)}; known: {sorted(values)}")
    values.update(fields_)
    error = checks.head_dim_error(values["head_dim"], kv_format)  # a case no call could make
    if error:
        raise ValueError(f"attnops.explain: {error}")
    if values["shape_class"] is None:
        values["shape_class"] = "decode" if values["decode"] else "prefill"
    if values["q_per_seq"] is None:  # a verify of 4 tokens unless told
        values["q_per_seq"] = {"decode": 1, "verify": 4}.get(values["shape_class"], VERIFY_MAX_Q + 1)
    return AttentionCase(**values)
