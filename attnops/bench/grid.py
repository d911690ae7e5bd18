"""The shape grid of docs/bench.md: Llama-3-8B-like heads (32/8/128), bf16 q, page size 16,
unless a case says otherwise. A small CPU grid for CI and CPU users."""
from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field


@dataclass
class Case:
    name: str
    group: str
    kv_lens: list
    q_lens: list | None = None  # None: decode (one query token per sequence)
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    kv_format: str = "bf16"
    scale_kind: str = "per_tensor"
    page_size: int = 16
    sinks: bool = False  # a random per-head sink logit
    tree: int = 0  # > 0: each query block is a complete draft tree of this branching (tree_mask), else causal
    tags: list = field(default_factory=list)
    # latent attention (mla_attention) where latent_dim > 0: one row of latent_dim + rope_dim values a token, shared
    # by num_q_heads query heads (num_kv_heads 1, head_dim latent_dim: the MQA it is)
    latent_dim: int = 0
    rope_dim: int = 0

    @property
    def latent(self) -> bool:
        return self.latent_dim > 0

    @property
    def kind(self) -> str:
        if self.q_lens is None:
            return "decode"
        return "prefill" if max(self.q_lens) >= 1024 else "verify"

    def describe(self) -> dict:
        d = asdict(self)
        d.update(kind=self.kind, batch=len(self.kv_lens), kv_tokens=sum(self.kv_lens),
                 q_tokens=len(self.kv_lens) if self.q_lens is None else sum(self.q_lens),
                 max_kv_len=-(-max(self.kv_lens) // self.page_size) * self.page_size)
        del d["kv_lens"], d["q_lens"]
        return d


def ragged_lengths(n: int, seed: int, low: int = 256, high: int = 65536) -> list:
    """Log-uniform lengths in [low, high] (agents with wildly different contexts)."""
    rng = random.Random(seed)
    return [int(math.exp(rng.uniform(math.log(low), math.log(high)))) for _ in range(n)]


DECODE_SHAPES = {
    "decode-small": [(1, 32768), (4, 8192)],
    "decode-mid": [(32, 4096), (64, 2048)],
    "decode-large": [(128, 4096), (256, 8192), (64, 32768)],
}
FORMAT_VARIANTS = [("fp8_e4m3", "per_tensor"), ("fp8_e4m3", "per_head"), ("nvfp4", "per_tensor"),
                   ("mxfp4", "per_tensor")]
HEAD_VARIANTS = [(32, 32, 128), (64, 8, 128), (32, 4, 256), (16, 1, 64)]


def gpu_grid() -> list:
    cases = []
    decode = [(group, b, n) for group, shapes in DECODE_SHAPES.items() for b, n in shapes]
    for group, b, n in decode:
        cases.append(Case(f"{group}/{b}x{n}", group, [n] * b))
    for b in (64, 256):
        cases.append(Case(f"decode-ragged/{b}", "decode-ragged", ragged_lengths(b, seed=b)))
    decode_cases = list(cases)
    for q in (4, 8):
        cases.append(Case(f"verify/32x4096/q{q}", "verify", [4096] * 32, [q] * 32))
    cases.append(Case("verify/32x4096/q1", "verify", [4096] * 32, [1] * 32, tags=["verify-baseline"]))
    cases.append(Case("prefill/8x4096", "prefill", [4096] * 8, [4096] * 8))
    cases.append(Case("prefill/chunked-2048-on-46000", "prefill", [46000 + 2048], [2048]))
    for fmt, scale_kind in FORMAT_VARIANTS:
        label = fmt if fmt != "fp8_e4m3" else f"fp8_e4m3-{scale_kind.replace('_', '-')}"
        for c in decode_cases:
            cases.append(Case(f"{c.name}/{label}", "formats", c.kv_lens, kv_format=fmt, scale_kind=scale_kind))
    for hq, hkv, d in HEAD_VARIANTS:
        for _, b, n in [x for x in decode if x[0] == "decode-large"]:
            cases.append(Case(f"heads-{hq}-{hkv}-{d}/{b}x{n}", "heads", [n] * b, num_q_heads=hq, num_kv_heads=hkv,
                              head_dim=d))
    return cases


# Head shapes people serve (num_q_heads, num_kv_heads, head_dim): the models grid the dispatch rule is fitted to
MODEL_HEADS = {
    "llama-3.2-1b": (32, 8, 64), "llama-3-8b": (32, 8, 128), "llama-3-70b": (64, 8, 128),
    "qwen2.5-7b": (28, 4, 128), "gpt-oss": (64, 8, 64), "mha-7b": (32, 32, 128), "gemma-2-2b": (8, 4, 256),
    "mqa": (16, 1, 128), "qwen3-14b": (40, 8, 128), "gemma-2-9b": (16, 8, 256),
}
MODEL_DECODE = [(1, 32768), (32, 8192), (128, 2048), (128, 4096)]
MODEL_FORMATS = [("bf16", "none"), ("fp8_e4m3", "per_tensor"), ("fp8_e4m3", "per_head"), ("nvfp4", "block"),
                 ("mxfp4", "block")]
TWO_BACKEND_FORMATS = ("bf16", "fp8_e4m3/per_tensor")  # where both FlashInfer and Triton serve on sm_90
VERIFY_FORMATS = TWO_BACKEND_FORMATS + ("nvfp4", "mxfp4")  # verify: also 4-bit (the cuda backend and Triton)


# Latent attention: DeepSeek-V3's 128 query heads (R 512, P 64) as tensor-parallel shards of 8-128 heads, pages of
# 64 tokens (FlashMLA's and the DeepSeek serving stacks')
MLA_MODELS = {"deepseek-v3": (128, 512, 64)}
MLA_SHARDS = (1, 2, 4, 8, 16)
MLA_FORMATS = ("bf16", "fp8_e4m3", "fp8_ds_mla")  # (DeepSeek's fp8 layout: not FlashInfer's)


def mla_cases(group: str) -> list:
    """MLA_MODELS' shards x MLA_FORMATS: decode at MODEL_DECODE, a ragged batch of 64, and verify of 2 tokens (a
    multi-token-prediction step) on 32 x 4096."""
    cases = []
    for model, (heads, latent, rope) in MLA_MODELS.items():
        for tp in MLA_SHARDS:
            shape = dict(num_q_heads=heads // tp, num_kv_heads=1, head_dim=latent, latent_dim=latent,
                         rope_dim=rope, page_size=64)
            for fmt in MLA_FORMATS:
                shapes = [(f"{b}x{n}", [n] * b, None) for b, n in MODEL_DECODE]
                shapes += [("ragged64", ragged_lengths(64, seed=64), None), ("verify32x4096q2", [4096] * 32, [2] * 32)]
                for name, kv_lens, q_lens in shapes:
                    cases.append(Case(f"{model}-tp{tp}-{heads // tp}-{latent}-{rope}/{fmt}/{name}", group, kv_lens,
                                      q_lens, kv_format=fmt, **shape))
    return cases


# The latent-attention grid: R 512 / P 64 at 16 heads (a shard of 128: the latent bytes bound it) and 128 (the whole
# model: the tensor cores bound it), bf16 and fp8, decode and multi-token verify
MLA_GRID_HEADS = (16, 128)
MLA_GRID_DECODE = [(1, 32768), (64, 8192), (128, 4096)]
MLA_GRID_VERIFY = (2, 4)  # query tokens a sequence, on 32 x 4096


def mla_grid() -> list:
    """MLA_GRID_HEADS x MLA_FORMATS: decode at MLA_GRID_DECODE and a ragged batch of 64, verify of
    MLA_GRID_VERIFY tokens on 32 x 4096."""
    cases = []
    for heads in MLA_GRID_HEADS:
        shape = dict(num_q_heads=heads, num_kv_heads=1, head_dim=512, latent_dim=512, rope_dim=64, page_size=64)
        for fmt in MLA_FORMATS:
            shapes = [(f"{b}x{n}", [n] * b, None) for b, n in MLA_GRID_DECODE]
            shapes += [("ragged64", ragged_lengths(64, seed=64), None)]
            shapes += [(f"verify32x4096q{q}", [4096] * 32, [q] * 32) for q in MLA_GRID_VERIFY]
            for name, kv_lens, q_lens in shapes:
                cases.append(Case(f"mla-{heads}-512-64/{fmt}/{name}", "mla", kv_lens, q_lens, kv_format=fmt,
                                  **shape))
    return cases


def models_grid() -> list:
    """Every head shape of MODEL_HEADS x every KV format and scale kind: decode at MODEL_DECODE and a ragged
    batch of 64; also verify (4 and 8 tokens) for the formats two backends serve it in, and prefill and a chunked
    extend for bf16 and fp8. Then latent attention (mla_cases)."""
    cases = []
    for model, (hq, hkv, d) in MODEL_HEADS.items():
        heads = dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
        for fmt, scale_kind in MODEL_FORMATS:
            label = fmt if scale_kind in ("none", "block") else f"{fmt}/{scale_kind}"
            fmt_args = dict(kv_format=fmt, scale_kind="per_tensor" if scale_kind in ("none", "block") else scale_kind)
            shapes = [(f"{b}x{n}", [n] * b, None) for b, n in MODEL_DECODE]
            shapes.append(("ragged64", ragged_lengths(64, seed=64), None))
            if label in VERIFY_FORMATS:
                shapes += [(f"verify32x4096q{q}", [4096] * 32, [q] * 32) for q in (4, 8)]
            if label in TWO_BACKEND_FORMATS:
                shapes += [("prefill4x4096", [4096] * 4, [4096] * 4),
                           ("extend2048on16384", [16384 + 2048], [2048])]
            for shape, kv_lens, q_lens in shapes:
                cases.append(Case(f"{model}-{hq}-{hkv}-{d}/{label}/{shape}", "models", kv_lens, q_lens, **heads,
                                  **fmt_args))
    return cases + mla_cases("models")


# Head shapes and batches the models grid does not have: how the fitted rule does on what it never saw
UNSEEN_HEADS = {"qwen2.5-3b": (16, 2, 128), "qwen2.5-0.5b": (14, 2, 64), "qwen2-1.5b": (12, 2, 128),
                "gemma-3-27b": (32, 16, 128), "yi-34b": (56, 8, 128)}
UNSEEN_DECODE = [(8, 16384), (64, 1024), (16, 4096), (256, 2048)]


def models_unseen_grid() -> list:
    """UNSEEN_HEADS x (bf16, fp8 per tensor) x decode at UNSEEN_DECODE and a ragged 32, verify 6 tokens on 16 x 2048,
    and 1024 new tokens on 8192: a check of the dispatch rule on cases it was not fitted to."""
    cases = []
    for model, (hq, hkv, d) in UNSEEN_HEADS.items():
        heads = dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
        for fmt in ("bf16", "fp8_e4m3"):
            label = fmt if fmt == "bf16" else f"{fmt}/per_tensor"
            shapes = [(f"{b}x{n}", [n] * b, None) for b, n in UNSEEN_DECODE]
            shapes += [("ragged32", ragged_lengths(32, seed=7), None), ("verify16x2048q6", [2048] * 16, [6] * 16),
                       ("extend1024on8192", [8192 + 1024], [1024])]
            for shape, kv_lens, q_lens in shapes:
                cases.append(Case(f"{model}-{hq}-{hkv}-{d}/{label}/{shape}", "models-unseen", kv_lens, q_lens,
                                  **heads, kv_format=fmt))
    return cases


def tree_parents(n: int, branching: int) -> list:
    """A complete draft tree of n tokens in breadth-first order: token i's parent is (i - 1) // branching."""
    return [-1] + [(i - 1) // branching for i in range(1, n)]


def spec_grid() -> list:
    """Sinks and draft trees against the same batch without them: decode with and without sinks (llama-3-8b and
    gpt-oss heads, bf16 and fp8), and verify of 16- and 64-token trees of branching 2-4 next to a decode step and
    a causal verify of the same batch."""
    cases = []
    for model in ("llama-3-8b", "gpt-oss"):
        hq, hkv, d = MODEL_HEADS[model]
        heads = dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
        for fmt in ("bf16", "fp8_e4m3"):
            for b, n in ((1, 32768), (32, 4096), (128, 4096)):
                for sinks in (False, True):
                    cases.append(Case(f"{model}-{hq}-{hkv}-{d}/{fmt}/decode{b}x{n}{'/sinks' if sinks else ''}",
                                      "spec-sinks", [n] * b, **heads, kv_format=fmt, sinks=sinks))
    for fmt in ("bf16", "fp8_e4m3"):
        base = f"llama-3-8b-32-8-128/{fmt}/32x4096"
        cases.append(Case(f"{base}/decode", "spec-tree", [4096] * 32, kv_format=fmt))
        for q in (16, 64):
            cases.append(Case(f"{base}/causal-q{q}", "spec-tree", [4096] * 32, [q] * 32, kv_format=fmt))
            for branching in (2, 3, 4):
                cases.append(Case(f"{base}/tree-q{q}-b{branching}", "spec-tree", [4096] * 32, [q] * 32,
                                  kv_format=fmt, tree=branching))
    return cases


def cpu_grid() -> list:
    """For CI and CPU users: small, fp32 and bf16 (and a 4-bit decode), the CPU backend against gather + SDPA."""
    cases = []
    for fmt in ("fp32", "bf16"):
        cases += [Case(f"cpu-decode/4x512/{fmt}", "cpu-decode", [512] * 4, kv_format=fmt),
                  Case(f"cpu-decode/1x2048/{fmt}", "cpu-decode", [2048], kv_format=fmt),
                  Case(f"cpu-verify/2x512/q4/{fmt}", "cpu-verify", [512] * 2, [4] * 2, kv_format=fmt)]
    cases += [Case(f"cpu-decode/4x512/{fmt}", "cpu-decode", [512] * 4, kv_format=fmt) for fmt in ("nvfp4", "mxfp4")]
    cases = [Case(c.name, c.group, c.kv_lens, c.q_lens, num_q_heads=8, num_kv_heads=2, head_dim=64,
                  kv_format=c.kv_format) for c in cases]
    latent = dict(num_q_heads=16, num_kv_heads=1, head_dim=128, latent_dim=128, rope_dim=32, page_size=64)
    return cases + [Case(f"cpu-mla-decode/4x512/{fmt}", "cpu-mla", [512] * 4, kv_format=fmt, **latent)
                    for fmt in ("fp32", "fp8_e4m3", "fp8_ds_mla")] + \
        [Case("cpu-mla-verify/2x512/q2/fp32", "cpu-mla", [512] * 2, [2] * 2, kv_format="fp32", **latent)]


def cpu_bar_grid() -> list:
    """The CPU backend's own bar (docs/bench.md): 8 x 2048 and 1 x 16384 decode, 32/8/128, fp32 and bf16."""
    return [Case(f"cpu-decode/{b}x{n}/{fmt}", "cpu-decode", [n] * b, kv_format=fmt)
            for fmt in ("fp32", "bf16") for b, n in ((8, 2048), (1, 16384))]


# 4-bit KV against bf16 at the same shapes (the 4-bit bar: FlashInfer's bf16 decode in the same run)
FP4_HEADS = [(32, 8, 128), (32, 8, 64), (64, 8, 128)]
FP4_DECODE = [(128, 4096), (256, 8192), (64, 32768)]


def fp4_grid() -> list:
    """bf16, nvfp4 and mxfp4 decode at FP4_DECODE and a ragged batch of 64 for each of FP4_HEADS; 4-token verify
    next to its decode (32 x 4096, 32/8/128)."""
    cases = []
    for hq, hkv, d in FP4_HEADS:
        heads = dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
        shapes = [(f"{b}x{n}", [n] * b) for b, n in FP4_DECODE] + [("ragged64", ragged_lengths(64, seed=64))]
        for fmt in ("bf16", "nvfp4", "mxfp4"):
            for shape, kv_lens in shapes:
                cases.append(Case(f"fp4/{hq}-{hkv}-{d}/{shape}/{fmt}", "fp4", kv_lens, kv_format=fmt, **heads))
    for fmt in ("nvfp4", "mxfp4"):
        cases.append(Case(f"fp4-verify/32x4096/q1/{fmt}", "fp4-verify", [4096] * 32, kv_format=fmt))
        cases.append(Case(f"fp4-verify/32x4096/q4/{fmt}", "fp4-verify", [4096] * 32, [4] * 32, kv_format=fmt))
    return cases


# Head dims between the powers of two (Phi-2's 80, Phi-3's 96, 160, 192) and the widest (512) against 128 and 256,
# 32/8 heads: their decode's bytes/s against 128's (docs/bench.md, "Every head dim")
HEAD_DIM_SIZES = (80, 96, 128, 160, 192, 256, 512)
HEAD_DIM_DECODE = [(32, 8192), (128, 4096)]


def head_dims_grid() -> list:
    """Decode at HEAD_DIM_DECODE for each of HEAD_DIM_SIZES (32/8 heads), bf16 and fp8 e4m3 per tensor."""
    cases = []
    for d in HEAD_DIM_SIZES:
        for fmt in ("bf16", "fp8_e4m3"):
            for b, n in HEAD_DIM_DECODE:
                cases.append(Case(f"head-dim/32-8-{d}/{fmt}/{b}x{n}", "head-dims", [n] * b, head_dim=d,
                                  kv_format=fmt))
    return cases


GRIDS = {"gpu": gpu_grid, "models": models_grid, "models-unseen": models_unseen_grid, "spec": spec_grid,
         "fp4": fp4_grid, "head-dims": head_dims_grid, "mla": mla_grid, "cpu": cpu_grid, "cpu-bar": cpu_bar_grid}
