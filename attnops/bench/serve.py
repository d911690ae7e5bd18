"""Serving benchmark: decode tokens/s of a decoder served through attnops, against transformers' own best path on
the same weights, at several batch sizes and context lengths, in one run.

    python -m attnops serve-bench --family llama qwen2 --kv-formats bf16 fp8_e4m3 \\
        --modes compiled+graphs transformers --json benchmarks/results/h200-serve-hf.json --plot ...png
    python -m attnops serve-bench --small --family llama gemma2 --json /tmp/serve.json --plot /tmp/serve.png  # CPU
    python -m attnops serve-bench --contexts 8192 --json X.json --append --plot X.png     # a part of the grid

The model (--family: random weights at a real model's shape, see attnops.hf.families; or --checkpoint) runs
through attnops in the modes below, in transformers' modeling code with attn_implementation="attnops"
(attnops.hf.serving_model), and through transformers' own paths on the same weights. Modes (each a decode step of
the whole batch: one new token per sequence, greedy, fed back):
  eager             attnops.serving.generate.DecodeStep, eager PyTorch
  compiled          the same step under torch.compile(fullgraph=True, dynamic=False)
  compiled+graphs   the compiled step captured by attnops.serving.graphs.DecodeGraphRunner (CUDA only; the same
                    compiled function as `compiled`, so one compilation per batch size serves both)
  transformers      transformers' own model and attention ("sdpa", or "eager" for the families that do not support
                    it) with a StaticCache and torch.compile(mode="reduce-overhead", fullgraph=True) on the decode step
                    (its documented fastest path; "default" mode on the CPU, where there are no CUDA graphs)
  transformers-cb   transformers' continuous batching (generate_batch: its own paged cache and "paged|" attention,
                    CUDA graphs on the GPU): the batch's prompts of `context` tokens, then tokens/s over the steps
                    every request decoded together, from its per-token timestamps (prefill not counted)

Every sequence of the batch starts at `context` tokens already in the cache (their values do not change the work
a step does, so the cache is filled with random data rather than by a prefill) and decodes --steps tokens after
--warmup untimed ones (compilation, graph capture). attnops' time includes its host side (PagedKVCache.prepare
building the step's metadata, padding to the bucket), as a serving loop pays it; transformers' includes
its mask building. tokens/s = batch * steps / wall time (synchronized). One attnops cache and one compiled step
per KV format serve every batch and context (a block table as wide as the longest context, as a server's is): one
compilation per batch size.

Records carry model_code "transformers" (the modeling code attnops' modes ran); result files from before
attnops/serving/model.py was retired also hold its records, model_code "attnops" (or none, the oldest): they are
read, plotted and merged as before, and left out of the summary.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import inspect
import json
import re
import sys
import time
from pathlib import Path

import torch

from .run import environment

from ..serving.generate import DecodeStep
from ..serving.graphs import DecodeGraphRunner
from ..serving.kv_cache import LatentKVCache
from . import require_matplotlib

MODES = ("eager", "compiled", "compiled+graphs", "transformers", "transformers-cb")
BASELINES = ("transformers", "transformers-cb")
ATTNOPS_MODES = MODES[:3]


def load_model(family, args, device, dtype):
    """transformers' model (attn_implementation "attnops") of a family, random at its real shape (tiny with
    --small), or of --checkpoint."""
    from ..hf import families
    return families.load(args.checkpoint or family, device=device, dtype=dtype, tiny=args.small, layers=args.layers)


def checkpoint_family(path) -> str:
    from ..hf.families import FAMILIES
    if not (Path(path) / "config.json").is_file():
        raise SystemExit(f"python -m attnops serve-bench: --checkpoint {path}: no config.json there (a checkpoint "
                         f"directory, as save_pretrained writes it)")
    model_type = json.loads((Path(path) / "config.json").read_text()).get("model_type")
    family = next((name for name, spec in FAMILIES.items() if spec.model_type == model_type), None)
    if family is None:
        raise SystemExit(f"python -m attnops serve-bench: --checkpoint's model_type {model_type!r} is not one of the "
                         f"families ({', '.join(FAMILIES)})")
    return family


def steps_a_point(args) -> int:
    """The decode steps one mode runs at one point: warmup, timed, and --profile's."""
    return args.warmup + args.steps + (PROFILE_STEPS + 1 if args.profile else 0)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(step, device, warmup, steps) -> float:
    for _ in range(warmup):
        step()
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    return time.perf_counter() - start


# The first pattern a GPU kernel's name matches names its share of a step in --profile (the rest: norms, rotary,
# activations, sampling and the other fused elementwise kernels torch.compile makes)
KERNEL_CATEGORIES = (
    ("attention", re.compile(r"paged_attention|merge_splits|merge_attention|page_layout|flashinfer|BatchDecode|"
                             r"BatchPrefill|xqa|attention|attn|sdpa|flash_fwd|fmha", re.IGNORECASE)),
    ("KV cache write", re.compile(r"reshape_and_cache|cache_write|index_copy|index_put|scatter", re.IGNORECASE)),
    ("matmul", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|matmul|splitKreduce|gemv", re.IGNORECASE)),
    ("copies", re.compile(r"^Memcpy|^Memset")),
)


def kernel_category(name: str) -> str:
    return next((category for category, pattern in KERNEL_CATEGORIES if pattern.search(name)), "other kernels")


def step_breakdown(kernels: list, steps: int, wall_us: float) -> dict:
    """Milliseconds a step by category, from (kernel name, GPU microseconds) over `steps` steps that took
    `wall_us`: each category's kernel time, and `GPU idle`, the wall time no kernel ran (launch gaps, host work
    the GPU waited for; kernels that overlap would make it an underestimate)."""
    shares = {}
    for name, us in kernels:
        category = kernel_category(name)
        shares[category] = shares.get(category, 0.0) + us
    busy = sum(shares.values())
    result = {category: us / steps / 1e3 for category, us in sorted(shares.items(), key=lambda kv: -kv[1])}
    result["GPU idle"] = max(wall_us - busy, 0.0) / steps / 1e3
    return result


PROFILE_STEPS = 10  # --profile's steps a point, after one untimed: every cache a point uses has room for them


def profile_steps(step, device, steps: int = PROFILE_STEPS) -> dict | None:
    """--profile: step_breakdown of `steps` more calls of `step`, under torch.profiler (CUDA only: None elsewhere).
    The profiler's own cost shows in `GPU idle`."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - start) * 1e6
    kernels = [(e.name, e.time_range.elapsed_us()) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA]
    return step_breakdown(kernels, steps, wall_us)


def shown_profile(breakdown: dict) -> str:
    return ", ".join(f"{category} {ms:.2f}" for category, ms in breakdown.items()) + " ms a step"


class AttnopsRunner:
    """One model and KV format: one cache sized for the largest batch and context, one eager and one
    compiled DecodeStep over every batch bucket, and the compiled step's CUDA graphs, shared by every point."""

    def __init__(self, model, kv_format, modes, batches, contexts, args, device):
        c = model.config
        self.model, self.modes, self.args, self.device, self.config = model, modes, args, device, c
        per_point = len(modes) * (steps_a_point(args) + 1) + 1  # (+1: attention_seconds_per_step's token)
        self.max_pages = -(-(max(contexts) + per_point) // args.page_size)
        # (the model's own cache: latent rows for latent attention, each layer at its own shape)
        self.cache = model.make_kv_cache(max(batches) * self.max_pages, page_size=args.page_size,
                                         kv_format=kv_format, device=device, shuffle_pages=True)
        for kv in self.cache.kv:
            kv.normal_() if kv.dtype.is_floating_point and kv.element_size() > 1 else None
        self.buckets = tuple(sorted(set(batches)))
        self.steps: dict = {}  # compiled or not -> DecodeStep
        self.graphs = None  # the compiled step's DecodeGraphRunner, over the same static inputs

    def step(self, mode) -> DecodeStep:
        compiled = mode != "eager"
        if compiled not in self.steps:
            self.steps[compiled] = DecodeStep(self.model, self.cache, max_batch=self.buckets[-1],
                                              max_pages=self.max_pages, buckets=self.buckets, compile=compiled)
        step = self.steps[compiled]
        if mode == "compiled+graphs" and self.graphs is None:
            self.graphs = DecodeGraphRunner(step.step_fn, self.cache, inputs=step.buffers)
        step.graph_runner = self.graphs if mode == "compiled+graphs" else None
        return step

    @torch.no_grad()
    def point(self, batch, context):
        """Yields (mode, tokens/s, attention seconds per step or None, error or None, extra fields) for each
        mode (extra: --profile's step breakdown)."""
        seq_ids = [("point", b) for b in range(batch)]
        for s in seq_ids:
            self.cache.allocate(s)
            self.cache.prepare([s], context, decode=False)  # `context` tokens "already in the cache"
        tokens = torch.randint(0, self.config.vocab_size, (batch,), device=self.device)
        try:
            for mode in self.modes:
                step = self.step(mode)

                def one():
                    nonlocal tokens
                    tokens = step(seq_ids, tokens).argmax(-1)

                try:
                    elapsed = timed(one, self.device, self.args.warmup, self.args.steps)
                    attention_s = (attention_seconds_per_step(self.cache, seq_ids, self.config)
                                   if mode == "compiled+graphs" else None)
                    extra = {}
                    if self.args.profile and (breakdown := profile_steps(one, self.device)):
                        extra["profile_ms"] = breakdown
                    yield mode, batch * self.args.steps / elapsed, attention_s, None, extra
                except Exception as e:  # record and go on: one failing mode must not lose the run
                    yield mode, None, None, f"{type(e).__name__}: {e}", {}
        finally:
            for s in seq_ids:
                self.cache.free(s)


def attention_seconds_per_step(cache, seq_ids, c) -> float:
    """GPU time of one decode step's attention: one layer's paged_attention (mla_attention for a latent cache) on
    this cache and batch (one more token each, as the next step; no window, cap or sinks), replayed from a CUDA
    graph, times the number of layers."""
    from .run import graph_time_us
    meta = cache.prepare(seq_ids, 1)
    args = cache.attention_args(0)
    if isinstance(cache, LatentKVCache):
        q_nope, q_pe = (torch.randn(len(seq_ids), c.num_attention_heads, d, device=cache.device, dtype=torch.bfloat16)
                        for d in (cache.latent_dim, cache.rope_dim))

        def attention():
            torch.ops.attnops.mla_attention(q_nope, q_pe, block_table=meta.block_table, seq_lens=meta.seq_lens,
                                            scale=0.1, **args)
        return graph_time_us(attention) * 1e-6 * c.num_hidden_layers
    q = torch.randn(len(seq_ids), c.num_attention_heads, c.head_dim, device=cache.device, dtype=torch.bfloat16)

    def attention():
        torch.ops.attnops.paged_attention(q, block_table=meta.block_table, seq_lens=meta.seq_lens, **args)
    return graph_time_us(attention) * 1e-6 * c.num_hidden_layers


def transformers_attention(hf) -> str:
    """transformers' fastest general attention the model supports: sdpa, else eager (Gemma-2's soft cap and
    gpt-oss's sinks are not in sdpa)."""
    return "sdpa" if getattr(type(hf), "_supports_sdpa", False) else "eager"


@torch.no_grad()
def bench_transformers(hf, batch, context, args, device) -> tuple:
    """(tokens/s, --profile's step breakdown or None)"""
    from transformers import StaticCache
    params = inspect.signature(hf.forward).parameters
    cache_arg = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.2x
    total = context + steps_a_point(args) + 2
    cache = StaticCache(config=hf.config, max_cache_len=total)
    token = torch.randint(0, hf.config.vocab_size, (batch, 1), device=device,
                          generator=torch.Generator(device).manual_seed(0))
    position = torch.full((1,), context, dtype=torch.long, device=device)

    def decode(token, position):
        extra = {"cache_position": position} if "cache_position" in params else {}
        logits = hf(token, position_ids=position.expand(token.shape[0], 1), use_cache=True, return_dict=False,
                    **{cache_arg: cache}, **extra)[0]
        return logits[:, -1].argmax(-1, keepdim=True)

    # An eager call first: the static cache allocates its tensors lazily, on its first update (compiling that call
    # would compile twice). Then random contents and `context` tokens counted as cached, as for attnops.
    decode(token, position - 1)
    for layer in cache.layers:
        layer.keys.normal_()
        layer.values.normal_()
        if torch.is_tensor(getattr(layer, "cumulative_length", None)):  # the length on the device
            layer.cumulative_length.fill_(context)
        if hasattr(layer, "cumulative_length_int"):  # and a sliding-window layer's on the host
            layer.cumulative_length_int = context
    mode = "reduce-overhead" if device.type == "cuda" else "default"
    compiled = torch.compile(decode, mode=mode, fullgraph=True)

    def one():
        nonlocal token
        token = compiled(token, position).clone()  # reduce-overhead: outputs are overwritten by the next replay
        position.add_(1)

    elapsed = timed(one, device, args.warmup, args.steps)
    breakdown = profile_steps(one, device) if args.profile else None
    del compiled, cache
    return batch * args.steps / elapsed, breakdown


@torch.no_grad()
def bench_transformers_cb(hf, batch, context, args, device) -> tuple:
    """(tokens/s, None): transformers' continuous batching on `batch` prompts of `context` random tokens, each
    generating tokens greedily; tokens/s from the last request's first token to the first request's last one,
    over the tokens generated in between (the steps every request decoded together). The prompts' prefill takes
    batch x context / max_batch_tokens steps, during which the first requests already decode: each request
    generates that many tokens more than warmup + steps + 1, so that all of them still decode together after."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    max_batch_tokens = max(2048, batch)
    prefill_steps = -(-batch * context // max_batch_tokens)
    new = args.warmup + args.steps + 1 + 2 * prefill_steps  # (2x: a step may mix prefill chunks and decodes)
    page = 256
    # Room for every request with a quarter spare: the scheduler admits no new prompt while fewer than its safety
    # margin of the blocks are free (15% by default), which with a cache sized to the batch made the last prompts
    # wait for the first requests to finish; the margin is also set to 0 where the config has it.
    needed = batch * -(-(context + new + 1) // page)
    sizes = dict(num_blocks=needed + needed // 4 + 8, max_batch_tokens=max_batch_tokens,
                 max_requests_per_batch=batch, use_cuda_graph=device.type == "cuda")
    # the page size is `block_size` in transformers 5.17, `page_size` from 5.2x
    named = set(inspect.signature(ContinuousBatchingConfig).parameters)
    sizes["page_size" if "page_size" in named else "block_size"] = page
    if "safety_margin" in named:
        sizes["safety_margin"] = 0.0
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, hf.config.vocab_size, (context,), generator=gen).tolist() for _ in range(batch)]
    config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    outputs = hf.generate_batch(prompts, generation_config=config, record_timestamps=True, progress_bar=False,
                                continuous_batching_config=ContinuousBatchingConfig(**sizes))
    stamps = [o.timestamps for o in outputs.values()]
    if len(stamps) != batch or any(not s or len(s) < 2 for s in stamps):
        raise RuntimeError(f"generate_batch returned {len(stamps)} of {batch} requests with timestamps")
    start, end = max(s[0] for s in stamps), min(s[-1] for s in stamps)
    if end <= start:
        raise RuntimeError("no step in which every request decoded (the requests did not run together)")
    tokens = sum(sum(1 for t in s if start < t <= end) for s in stamps)
    if tokens < batch * args.steps // 2:
        raise RuntimeError(f"only {tokens} tokens were generated while all {batch} requests decoded together "
                           f"(fewer than half of {batch} x {args.steps} steps)")
    return tokens / (end - start), None


def label(record) -> str:
    if record["mode"] == "transformers-cb":
        return "transformers (continuous batching)"
    if record["mode"] == "transformers":
        return f"transformers ({record.get('attention', 'sdpa')}, static cache)"
    code = " model.py" if record.get("model_code") == "attnops" else ""  # an older file's record
    kv_format = f" {record['kv_format']}" if record.get("kv_format") else ""  # (none in the oldest files)
    return f"{record['mode']}{code}{kv_format}"


def plot(result, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = result["records"]
    families = list(dict.fromkeys(r.get("family", "llama") for r in records))
    contexts = sorted({r["context"] for r in records})
    # one order and one colour per series in every panel: attnops' series first, then transformers'
    names = sorted(dict.fromkeys(label(r) for r in records), key=lambda n: (n.startswith("transformers"), n))
    colours = {name: f"C{i % 10}" for i, name in enumerate(names)}
    fig, axes = plt.subplots(len(families), len(contexts), figsize=(7 * len(contexts), 4.5 * len(families)),
                             squeeze=False)
    for row, family in zip(axes, families):
        for ax, context in zip(row, contexts):
            chosen = [r for r in records if r.get("family", "llama") == family and r["context"] == context]
            batches = sorted({r["batch"] for r in chosen})
            series = [name for name in names if any(label(r) == name for r in chosen)]
            width = 0.8 / max(len(series), 1)
            for i, name in enumerate(series):
                values = [next((r["tokens_per_s"] or 0 for r in chosen if label(r) == name and r["batch"] == b), 0)
                          for b in batches]
                ax.bar([j + i * width for j in range(len(batches))], values, width, label=name, color=colours[name])
            ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(batches))], [str(b) for b in batches])
            ax.set_xlabel("batch")
            ax.set_ylabel("decode tokens/s")
            ax.set_yscale("log")
            model = result.get("models", {}).get(family, family)
            ax.set_title(f"{family} ({model}), context {context}", fontsize=9)
            ax.legend(fontsize=7)
    env = result["environment"]
    fig.suptitle(f"attnops serving, {result['dtype']} weights, on {env.get('gpu') or env.get('cpu')} "
                 f"({env['commit'][:10]})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summary(records) -> list:
    """Per point: attnops' modes (transformers' modeling code) against transformers' own fastest path measured there
    (static cache + compile, or continuous batching), as a ratio of tokens/s."""
    def tps(**match):
        return next((r["tokens_per_s"] for r in records if all(r.get(k) == v for k, v in match.items())
                     and r["tokens_per_s"]), None)
    lines = []
    for r in records:
        if r["mode"] in BASELINES + ("eager",) or r.get("model_code") != "transformers" or not r["tokens_per_s"]:
            continue
        point = dict(family=r["family"], batch=r["batch"], context=r["context"])
        baseline = max((t for t in (tps(mode=m, **point) for m in BASELINES) if t), default=None)
        line = dict(**point, mode=r["mode"], kv_format=r["kv_format"], tokens_per_s=r["tokens_per_s"])
        if baseline:
            line["vs_transformers"] = r["tokens_per_s"] / baseline
        lines.append(line)
    return lines


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    has_transformers = importlib.util.find_spec("transformers") is not None
    if not has_transformers and not {"-h", "--help"} & set(argv):
        raise SystemExit("python -m attnops serve-bench: needs transformers (the models and the baseline): "
                         "pip install 'attnops[bench]'")
    parser = argparse.ArgumentParser(prog="python -m attnops serve-bench", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    if has_transformers:
        from ..hf.families import FAMILIES, MLA_FAMILIES
        every = {**FAMILIES, **MLA_FAMILIES}
        families = list(every)
        shapes = ", ".join(f"{name}: {spec.real_name}" for name, spec in every.items())
    else:  # only --help gets here: it still answers
        families, shapes = None, "see attnops.hf.families"
    parser.add_argument("--small", action="store_true", help="tiny models and sizes (runs on the CPU in seconds)")
    parser.add_argument("--device", default=None, help="default: cuda if available (cpu with --small)")
    parser.add_argument("--family", nargs="+", choices=families, default=None,
                        help=f"model families, random weights at a real model's shape ({shapes}; tiny with "
                             "--small). Default: llama")
    parser.add_argument("--checkpoint", help="a checkpoint directory instead (its family read from config.json)")
    parser.add_argument("--layers", type=int, default=None,
                        help="a family's first N layers only (default: all of the real model's): for a model whose "
                             "weights and transformers' static cache would not fit at the largest point")
    parser.add_argument("--batches", type=int, nargs="*", help="default: 1 32 128 (1 4 with --small)")
    parser.add_argument("--contexts", type=int, nargs="*", help="default: 1024 8192 (64 256 with --small)")
    parser.add_argument("--modes", nargs="*", choices=MODES,
                        help="default: all that this machine can run (transformers-cb: on the GPU)")
    parser.add_argument("--kv-formats", "--kv-format", nargs="+", default=None,
                        help="attnops' KV formats, each its own run of attnops' modes (default: the model dtype's)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    parser.add_argument("--steps", type=int, default=None, help="timed decode steps (default 50; 8 with --small)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5; 2 with --small)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--append", action="store_true",
                        help="merge into the --json file's records (replacing equal family/code/format/mode/batch/"
                             "context): a GPU grid can be run in parts, each within one command's time limit")
    parser.add_argument("--plot", help="write a PNG here (matplotlib)")
    parser.add_argument("--profile", action="store_true",
                        help="also profile 10 more steps of each point (CUDA): the step's milliseconds by kind of "
                             "kernel (attention, KV cache write, matmul, copies, other kernels) and the time the "
                             "GPU was idle, printed and in the JSON (profile_ms)")
    args = parser.parse_args(argv)
    require_matplotlib(args.plot)

    from ..hf import disable_mla, model_shape, serving_model

    device = torch.device(args.device or ("cpu" if args.small or not torch.cuda.is_available() else "cuda"))
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    dtype_name = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    if args.layers is not None and (args.layers < 1 or args.checkpoint):
        raise SystemExit("python -m attnops serve-bench: --layers must be at least 1, and is for --family only")
    if args.checkpoint:
        family = checkpoint_family(args.checkpoint)
        if args.family not in (None, [family]):
            raise SystemExit(f"python -m attnops serve-bench: --checkpoint is a {family} model; --family says "
                             f"{args.family}")
        chosen_families = [family]
    else:
        chosen_families = args.family or ["llama"]
    kv_formats = args.kv_formats or [dtype_name]
    from ..formats import KV_FORMATS
    for kv_format in kv_formats:
        if kv_format not in KV_FORMATS:
            raise SystemExit(f"python -m attnops serve-bench: --kv-formats: {kv_format!r} is not one of {KV_FORMATS}")
    batches = args.batches or ([1, 4] if args.small else [1, 32, 128])
    contexts = args.contexts or ([64, 256] if args.small else [1024, 8192])
    args.steps = args.steps or (8 if args.small else 50)
    args.warmup = args.warmup or (2 if args.small else 5)
    modes = list(args.modes or MODES)
    if "compiled+graphs" in modes and device.type != "cuda":
        modes.remove("compiled+graphs")
        print("compiled+graphs: skipped (needs CUDA)")
    if args.modes is None and device.type != "cuda":  # (it runs on the CPU when asked for, slowly)
        modes.remove("transformers-cb")
    ours = [m for m in ATTNOPS_MODES if m in modes]  # compiled before compiled+graphs

    old_records, models = [], {}
    if args.json and args.append and Path(args.json).exists():
        old = json.loads(Path(args.json).read_text())
        old_records, models = old["records"], dict(old.get("models", {}))  # (the shapes of the families kept)
    records = []

    def key(r):
        return (r.get("family", "llama"), r.get("model_code", "attnops"), r.get("kv_format"), r["mode"], r["batch"],
                r["context"])

    def save() -> dict:
        """The result so far, written after every measurement: a run stopped by a time limit keeps its part."""
        new_keys = {key(r) for r in records}
        merged = [r for r in old_records if key(r) not in new_keys] + records
        result = dict(environment=environment(device), dtype=dtype_name, models=models,
                      checkpoint=args.checkpoint, steps=args.steps, warmup=args.warmup, page_size=args.page_size,
                      records=merged, summary=summary(merged))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
        return result

    def record(family, code, kv_format, mode, batch, context, tps, attention_s, error, **extra) -> None:
        row = dict(family=family, model_code=code, kv_format=kv_format, mode=mode, batch=batch, context=context,
                   tokens_per_s=tps, error=error, **extra)
        if attention_s is not None:  # attention's share of the (graph-replayed) step time
            step_s = batch / tps
            row.update(step_ms=step_s * 1e3, attention_ms=attention_s * 1e3, attention_share=attention_s / step_s)
        records.append(row)
        shown = f"{tps:10.1f} tokens/s" if tps else f"failed: {error}"
        if attention_s is not None:
            shown += f"  (step {row['step_ms']:.2f} ms, attention {100 * row['attention_share']:.0f}%)"
        print(f"{family:<8} context {context:>6}  batch {batch:>4}  {label(row):<34} {shown}", flush=True)
        if row.get("profile_ms"):
            print(f"{'':<8} profile: {shown_profile(row['profile_ms'])}", flush=True)
        save()

    for family in chosen_families:
        torch._dynamo.reset()
        hf = load_model(family, args, device, dtype)
        shape = model_shape(hf.config)
        models[family] = (f"{shape.num_hidden_layers}L h{shape.hidden_size} {shape.num_attention_heads}/"
                          + (f"latent {shape.latent_dim}+{shape.rope_dim}" if shape.latent_dim else
                             f"{shape.num_key_value_heads} d{shape.head_dim}"))
        if ours:
            model = serving_model(hf)
            for kv_format in kv_formats:
                torch._dynamo.reset()  # a fresh compile cache per model and format: no recompilation limit
                try:
                    runner = AttnopsRunner(model, kv_format, ours, batches, contexts, args, device)
                except Exception as e:  # the cache for the largest point does not fit: record, go on
                    runner = None
                    failed = f"{type(e).__name__} making the cache for batch {max(batches)} x context " \
                             f"{max(contexts)}: {e}"
                for context in contexts:
                    for batch in batches:
                        points = runner.point(batch, context) if runner else ((m, None, None, failed, {})
                                                                              for m in ours)
                        for mode, tps, attention_s, error, extra in points:
                            record(family, "transformers", kv_format, mode, batch, context, tps, attention_s,
                                   error, **extra)
                del runner
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            del model
        torch._dynamo.reset()  # lets attnops' caches and graphs go before transformers' caches are made
        for mode, bench in (("transformers", bench_transformers), ("transformers-cb", bench_transformers_cb)):
            if mode not in modes:
                continue
            attention = transformers_attention(hf)
            disable_mla(hf)  # (a latent-attention model: transformers' own forward again)
            hf.set_attn_implementation(attention)
            for context in contexts:
                for batch in batches:
                    torch._dynamo.reset()
                    extra = {}
                    try:
                        (tps, breakdown), error = bench(hf, batch, context, args, device), None
                        if breakdown:
                            extra["profile_ms"] = breakdown
                    except Exception as e:  # record and go on
                        tps, error = None, f"{type(e).__name__}: {e}"
                    record(family, "transformers", dtype_name, mode, batch, context, tps, None, error,
                           attention=attention, **extra)
                    gc.collect()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
        del hf
        gc.collect()
        if args.plot and records:
            plot(save(), args.plot)

    result = save()
    for line in result["summary"]:
        if "vs_transformers" in line:
            print(f"{line['family']:<8} context {line['context']:>6}  batch {line['batch']:>4}  {line['mode']} "
                  f"{line['kv_format']}: vs_transformers {line['vs_transformers']:.2f}x")
    if args.plot:
        plot(result, args.plot)
    return result


if __name__ == "__main__":
    main()
