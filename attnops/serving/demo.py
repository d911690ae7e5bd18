"""`python -m attnops demo`: continuous-batching generation (attnops.serving.generate) on a decoder whose attention
runs through attnops' ops.

The model is built by the command line (attnops.cli: a transformers decoder served through attnops.hf; by default
a random Llama-3.2-1B-shaped one in bf16 on a GPU, a tiny fp32 one on the CPU) and handed to `main`: this layer
takes any model of the serving interface, forward(token_ids, positions, cache, meta), and does not reach up to
attnops.hf. Prints which backend serves each op, and for each mode (on a GPU by default the recommended one,
torch.compile'd and CUDA-graph replayed, then eager beside it; on the CPU eager) the tokens/s of the decode steps
and the step time split into attention and the rest:

  attention = time inside the attnops ops (paged_attention + reshape_and_cache, all layers), read from
              torch.profiler over a few extra steps: CPU time of the op calls on the CPU, the op's CUDA kernel
              time on a GPU (kernels are attributed to the op that launched them);
  rest      = the measured (unprofiled) step time minus that: the linear layers, norms, RoPE, sampling, the
              host-side batch bookkeeping, and on a GPU any launch gaps.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time

import torch

from ..dispatch import explain
from .generate import Generator
from .kv_cache import LatentKVCache, PagedKVCache

ATTENTION_OPS = ("attnops::paged_attention", "attnops::reshape_and_cache", "attnops::mla_attention",
                 "attnops::mla_cache_write")
# A kernel replayed from a CUDA graph reaches the profiler with no op above it, so in that mode attention is the
# kernels of these names (substrings): attnops' Triton kernels and FlashInfer's (its C++ namespace).
ATTENTION_KERNELS = ("paged_attention_kernel", "merge_splits_kernel", "reshape_and_cache_kernel", "mla_attention_kernel",
                     "mla_merge_kernel", "mla_cache_write_kernel", "flashinfer::")
MODES = ("compiled+graphs", "compiled", "eager")


def default_modes(device: torch.device) -> tuple[str, ...]:
    """The recommended path first and eager beside it on a GPU; eager alone on the CPU (compiling a model there
    takes longer than the demo itself, and CUDA graphs need a GPU)."""
    return ("compiled+graphs", "eager") if device.type == "cuda" else ("eager",)


def op_backends(cache: PagedKVCache, config, dtype, batch: int, prompt_len: int,
                pages_per_seq: int) -> dict:
    """Which backend serves each op of the run, asked of dispatch with the run's own shapes: the prefill of
    `batch` prompts, and a decode step of the batch at the prompt's length. `config`: the model's shape (its
    num_attention_heads, num_key_value_heads, head_dim; a latent cache's: num_attention_heads)."""
    d, dev = config.head_dim, cache.device
    rows = batch * prompt_len
    table = torch.zeros(batch, pages_per_seq, dtype=torch.int32, device=dev)
    lens = torch.full((batch,), prompt_len, dtype=torch.int32, device=dev)
    cu = torch.arange(0, rows + 1, prompt_len, dtype=torch.int32, device=dev)
    if isinstance(cache, LatentKVCache):
        q_nope = torch.empty(rows, config.num_attention_heads, cache.latent_dim, dtype=dtype, device=dev)
        q_pe = torch.empty(rows, config.num_attention_heads, cache.rope_dim, dtype=dtype, device=dev)
        args = dict(scale=1.0, **cache.attention_args(0))
        # a sparse-attention model's (an indexer's keys beside the latents) attends with the sparse form
        listed = (lambda n: {}) if cache.index_keys is None else \
            (lambda n: dict(topk_indices=torch.full((n, 1), -1, dtype=torch.int32, device=dev)))
        return {
            "mla_cache_write": explain(kv_c=q_nope[:, 0], k_pe=q_pe[:, 0], slot_mapping=torch.zeros(
                rows, dtype=torch.int64, device=dev), **cache.write_args(0)).chosen,
            "mla_attention (prefill)": explain(q_nope=q_nope, q_pe=q_pe, block_table=table, seq_lens=lens,
                                               cu_seqlens_q=cu, **args, **listed(rows)).chosen,
            "mla_attention (decode)": explain(q_nope=q_nope[:batch], q_pe=q_pe[:batch], block_table=table,
                                              seq_lens=lens + 1, **args, **listed(batch)).chosen,
        }
    q = torch.empty(rows, config.num_attention_heads, d, dtype=dtype, device=dev)
    kv = torch.empty(rows, config.num_key_value_heads, d, dtype=dtype, device=dev)
    return {
        "reshape_and_cache": explain(key=kv, value=kv, slot_mapping=torch.zeros(rows, dtype=torch.int64, device=dev),
                                     **cache.write_args(0)).chosen,
        "paged_attention (prefill)": explain(q=q, block_table=table, seq_lens=lens, cu_seqlens_q=cu,
                                             **cache.attention_args(0)).chosen,
        "paged_attention (decode)": explain(q=q[:batch], block_table=table, seq_lens=lens + 1,
                                            **cache.attention_args(0)).chosen,
    }


@torch.no_grad()
def run_demo(model: torch.nn.Module, batch: int = 4, prompt_len: int = 32, steps: int = 32,
             device: str | None = None, kv_format: str | None = None, page_size: int = 16, seed: int = 0,
             mode: str = "eager", profile_steps: int = 4) -> dict:
    """One mode's run (see MODES) of `model`: a model of the serving interface, forward(token_ids, positions,
    cache, meta), with a `config` giving its shape (num_hidden_layers, num_attention_heads, num_key_value_heads,
    head_dim, hidden_size, vocab_size; attnops.hf.serving_model's has them), on `device`, in the run's dtype:
    bf16 on a GPU, fp32 on the CPU. A fresh cache each run: the model's `make_kv_cache(num_pages, ...)` where it
    has one (attnops.hf.serving_model's), else a PagedKVCache of the config's shape."""
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise TypeError(f"run_demo: model must be a torch.nn.Module of the serving interface with a config (e.g. "
                        f"attnops.hf.serving_model(...)), got {type(model).__name__}")
    if mode not in MODES:
        raise ValueError(f"run_demo: mode must be one of {MODES}, got {mode!r}")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = device.type == "cuda"
    if mode == "compiled+graphs" and not on_gpu:
        raise ValueError(f"run_demo: mode {mode!r} needs a CUDA device (CUDA graphs), got {device}")
    compile, graphs = mode != "eager", mode == "compiled+graphs"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    kv_format = kv_format or ("bf16" if on_gpu else "fp32")
    config = model.config

    warmup = 2  # the first decode steps compile (modes other than eager) and warm caches: not timed
    new_tokens = 1 + warmup + steps + profile_steps  # the prefill's token, then the decode steps
    max_seq_len = prompt_len + new_tokens
    pages_per_seq = -(-max_seq_len // page_size)
    layout = dict(page_size=page_size, kv_format=kv_format, device=device, shuffle_pages=True, seed=seed)
    if hasattr(model, "make_kv_cache"):  # the model makes its own (attnops.hf's: latent rows, per-layer shapes)
        cache = model.make_kv_cache(batch * pages_per_seq, **layout)
    else:
        cache = PagedKVCache(config.num_hidden_layers, batch * pages_per_seq, num_kv_heads=config.num_key_value_heads,
                             head_dim=config.head_dim, **layout)
    gen = Generator(model, cache, max_batch=batch, max_seq_len=max_seq_len, buckets=(batch,), compile=compile,
                    cuda_graphs=graphs, seed=seed)
    prompts = torch.randint(0, config.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(seed))
    for b in range(batch):
        gen.add_request(b, prompts[b].tolist(), new_tokens)

    def sync():
        if on_gpu:
            torch.cuda.synchronize(device)

    sync()
    start = time.perf_counter()
    gen.step()  # the batched prefill, then the first decode step (and compilation / graph capture)
    sync()
    first_step_s = time.perf_counter() - start
    for _ in range(warmup - 1):
        gen.step()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        gen.step()
    sync()
    step_s = (time.perf_counter() - start) / steps

    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_gpu else [])
    prof = torch.profiler.profile(activities=activities)
    with _native_stderr_silenced():
        prof.start()
    try:
        for _ in range(profile_steps):
            gen.step()
        sync()
    finally:
        with _native_stderr_silenced():
            prof.stop()
    if graphs:
        attention_us = sum(e.device_time_total for e in prof.key_averages()
                           if any(name in e.key for name in ATTENTION_KERNELS))
    else:
        attention_us = sum((e.device_time_total if on_gpu else e.cpu_time_total)
                           for e in prof.key_averages() if e.key in ATTENTION_OPS)
    attention_s = attention_us * 1e-6 / profile_steps
    assert not gen.has_work() or all(len(r.output) == new_tokens for r in gen.running.values())

    backends = op_backends(cache, config, dtype, batch, prompt_len, pages_per_seq)
    return dict(device=str(device), model=config, dtype=dtype, kv_format=kv_format, mode=mode,
                backends=backends, batch=batch, prompt_len=prompt_len, steps=steps, first_step_s=first_step_s,
                step_ms=step_s * 1e3, tokens_per_s=batch / step_s,
                attention_ms=min(attention_s, step_s) * 1e3, rest_ms=max(step_s - attention_s, 0.0) * 1e3,
                tokens=[gen.finished[b].output for b in range(batch)] if not gen.has_work() else None)


@contextlib.contextmanager
def _native_stderr_silenced():
    """The profiler's native start and stop write trace lines ("USDT: ... profiler_start") straight to file
    descriptor 2; the demo keeps them out of its output (only around those two calls)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def main(args, model: torch.nn.Module, description: str) -> None:
    """`model`: the model to serve, built by the caller (see run_demo) on args.device; `description`: what to call
    it."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    modes = args.modes or default_modes(device)
    if "compiled+graphs" in modes and device.type != "cuda":
        sys.exit(f"demo: mode compiled+graphs needs a CUDA device (CUDA graphs); this run is on {device}: "
                 f"use --modes eager or compiled")
    results = []
    for i, mode in enumerate(modes):
        if mode != "eager":
            print(f"[{mode}] the first step compiles the model{' and captures a CUDA graph' if 'graphs' in mode else ''}"
                  f" (and on first use builds kernels: FlashInfer JIT, Triton; `python -m attnops warmup` does that "
                  f"ahead of time): up to a few minutes", flush=True)
        result = run_demo(model, batch=args.batch, prompt_len=args.prompt_len, steps=args.steps, device=str(device),
                          kv_format=args.kv_format, mode=mode)
        if i == 0:
            c = result["model"]
            latent = getattr(c, "latent_dim", 0)
            heads = (f"heads {c.num_attention_heads}, latent rows of {latent} + {c.rope_dim} (MLA)" if latent else
                     f"heads {c.num_attention_heads}/{c.num_key_value_heads}, head_dim {c.head_dim}")
            print(f"attnops demo on {result['device']}: {description}, {c.num_hidden_layers} layers, hidden "
                  f"{c.hidden_size}, {heads}, {str(result['dtype']).replace('torch.', '')}, KV {result['kv_format']}")
            b = result["backends"]
            op, write = ("mla_attention", "mla_cache_write") if latent else ("paged_attention", "reshape_and_cache")
            print(f"backend: prefill -> {b[f'{op} (prefill)']}, decode -> {b[f'{op} (decode)']}, "
                  f"cache write -> {b[write]}")
        label = {"compiled+graphs": "torch.compile'd + CUDA graphs (recommended)", "compiled": "torch.compile'd",
                 "eager": "eager"}[mode]
        print(f"batch {result['batch']}, prompt {result['prompt_len']}, {result['steps']} decode steps, {label}: "
              f"{result['tokens_per_s']:.1f} tokens/s, {result['step_ms']:.2f} ms/step "
              f"(prefill + first step {result['first_step_s']:.2f} s)")
        share = result["attention_ms"] / result["step_ms"] * 100 if result["step_ms"] else 0.0
        print(f"  step time: attention {result['attention_ms']:.2f} ms ({share:.0f}%), rest {result['rest_ms']:.2f} ms")
        results.append(result)
    print(f"(attention = time inside the attnops ops per step, from torch.profiler "
          f"{'CUDA kernel time' if device.type == 'cuda' else 'CPU time'}; rest = step time - that)")
    if len(results) > 1 and results[0]["tokens"] and results[-1]["tokens"]:
        a, b = results[0]["tokens"], results[-1]["tokens"]
        # positions up to each sequence's first difference: after one, the sequences see different inputs
        same = sum(next((i for i, (x, y) in enumerate(zip(sa, sb)) if x != y), len(sa)) for sa, sb in zip(a, b))
        total = sum(len(sa) for sa in a)
        if same == total:
            print(f"{results[0]['mode']} and {results[-1]['mode']} generated identical tokens ({total})")
        else:
            print(f"{results[0]['mode']} and {results[-1]['mode']} generated the same tokens at {same} of {total} "
                  f"positions, up to each sequence's first difference (compiled and eager kernels round "
                  f"differently; where a random model's two top logits are close, the sequences part ways)")
    if results[0]["tokens"]:
        print(f"first sequence's tokens: {results[0]['tokens'][0][:16]}")
