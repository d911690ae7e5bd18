"""Serving benchmark: decode tokens/s of a Llama-architecture model through attnops, against transformers' own
best path on the same weights, at several batch sizes and context lengths, in one run.

    python -m attnops serve-bench --json benchmarks/results/h200-serve.json --plot benchmarks/results/h200-serve.png
    python -m attnops serve-bench --small --json /tmp/serve.json --plot /tmp/serve.png     # tiny, CPU
    python -m attnops serve-bench --contexts 8192 --json X.json --append --plot X.png      # a part of the grid

Modes (each a decode step of the whole batch: one new token per sequence, greedy, fed back):
  eager             attnops.serving.generate.DecodeStep, eager PyTorch
  compiled          the same step under torch.compile(fullgraph=True, dynamic=False)
  compiled+graphs   the compiled step captured by attnops.serving.graphs.DecodeGraphRunner (CUDA only; the same compiled
                    function as `compiled`, so one compilation per batch size serves both)
  transformers      transformers' LlamaForCausalLM on the same weights with a StaticCache and
                    torch.compile(mode="reduce-overhead", fullgraph=True) on the decode step (its documented fastest
                    path; "default" mode on the CPU, where there are no CUDA graphs)

Every sequence of the batch starts at `context` tokens already in the cache (their values do not change the work
a step does, so the cache is filled with random data rather than by a prefill) and decodes --steps tokens after
--warmup untimed ones (compilation, graph capture). attnops' time includes its host side (PagedKVCache.prepare
building the step's metadata, padding to the bucket), as a serving loop pays it; transformers' includes
its mask building. tokens/s = batch * steps / wall time (synchronized).
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

from .run import environment

from ..serving.generate import DecodeStep
from ..serving.graphs import DecodeGraphRunner
from ..serving.kv_cache import PagedKVCache
from ..serving.model import LlamaConfig, LlamaForCausalLM


# Llama-3.2-1B's shape (random weights)
GPU_MODEL = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
                 rope_theta=500000.0, tie_word_embeddings=True, max_position_embeddings=131072)
SMALL_MODEL = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                   max_position_embeddings=4096)
MODES = ("eager", "compiled", "compiled+graphs", "transformers")


def hf_model(args, device, dtype):
    import transformers
    if args.checkpoint:
        return transformers.LlamaForCausalLM.from_pretrained(args.checkpoint, dtype=dtype).to(device).eval()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**(SMALL_MODEL if args.small else GPU_MODEL), initializer_range=0.02)
    with torch.device(device):
        return transformers.LlamaForCausalLM(config).to(dtype).eval()


def attnops_model(hf) -> LlamaForCausalLM:
    """attnops' model with a copy of transformers' weights (the same parameter names)."""
    config = LlamaConfig.from_hf_dict(hf.config.to_dict())
    return LlamaForCausalLM.from_state_dict(config, hf.state_dict(), dtype=hf.dtype, device=hf.device)


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


@torch.no_grad()
def bench_attnops(model, modes, batch, context, args, device, kv_format):
    """Yields (mode, tokens/s, attention seconds per step or None, error or None) for each of attnops' `modes`
    (in MODES' order), on one cache: compiled+graphs captures the very step that compiled timed (one compilation
    serves both)."""
    c = model.config
    page_size = args.page_size
    total = context + len(modes) * (args.warmup + args.steps) + 1
    max_pages = -(-total // page_size)
    cache = PagedKVCache(c.num_hidden_layers, batch * max_pages, page_size, c.num_key_value_heads, c.head_dim,
                         kv_format=kv_format, device=device, shuffle_pages=True)
    for kv in cache.kv:
        kv.normal_() if kv.dtype.is_floating_point and kv.element_size() > 1 else None
    seq_ids = list(range(batch))
    for s in seq_ids:
        cache.allocate(s)
        cache.prepare([s], context, decode=False)  # `context` tokens "already in the cache"
    tokens = torch.randint(0, c.vocab_size, (batch,), device=device)
    step = None
    for mode in modes:
        if mode == "eager" or step is None:
            step = DecodeStep(model, cache, max_batch=batch, max_pages=max_pages, buckets=(batch,),
                              compile=mode != "eager")
        if mode == "compiled+graphs":
            step.graph_runner = DecodeGraphRunner(step.step_fn, cache, buckets=(batch,), max_pages=max_pages)

        def one():
            nonlocal tokens
            tokens = step(seq_ids, tokens).argmax(-1)

        try:
            elapsed = timed(one, device, args.warmup, args.steps)
            attention_s = attention_seconds_per_step(cache, seq_ids, c) if mode == "compiled+graphs" else None
            yield mode, batch * args.steps / elapsed, attention_s, None
        except Exception as e:  # record and go on: one failing mode must not lose the run
            yield mode, None, None, f"{type(e).__name__}: {e}"
        if mode == "eager":
            step = None
    del step, cache


def attention_seconds_per_step(cache, seq_ids, c) -> float:
    """GPU time of one decode step's attention: one layer's paged_attention on this cache and batch (one more
    token each, as the next step), replayed from a CUDA graph, times the number of layers."""
    from .run import graph_time_us
    meta = cache.prepare(seq_ids, 1)
    q = torch.randn(len(seq_ids), c.num_attention_heads, c.head_dim, device=cache.device, dtype=torch.bfloat16)
    args = cache.attention_args(0)

    def attention():
        torch.ops.attnops.paged_attention(q, block_table=meta.block_table, seq_lens=meta.seq_lens, **args)
    return graph_time_us(attention) * 1e-6 * c.num_hidden_layers


@torch.no_grad()
def bench_transformers(hf, batch, context, args, device) -> float:
    import inspect

    from transformers import StaticCache
    params = inspect.signature(hf.forward).parameters
    cache_arg = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.2x
    total = context + args.warmup + args.steps + 2
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
        if torch.is_tensor(getattr(layer, "cumulative_length", None)):  # transformers 5.2x counts on the device
            layer.cumulative_length.fill_(context)
    mode = "reduce-overhead" if device.type == "cuda" else "default"
    compiled = torch.compile(decode, mode=mode, fullgraph=True)

    def one():
        nonlocal token
        token = compiled(token, position).clone()  # reduce-overhead: outputs are overwritten by the next replay
        position.add_(1)

    elapsed = timed(one, device, args.warmup, args.steps)
    del compiled, cache
    return batch * args.steps / elapsed


def plot(result, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({r["context"] for r in result["records"]})
    fig, axes = plt.subplots(1, len(contexts), figsize=(6 * len(contexts), 4.5), squeeze=False)
    for ax, context in zip(axes[0], contexts):
        records = [r for r in result["records"] if r["context"] == context]
        batches = sorted({r["batch"] for r in records})
        modes = [m for m in MODES if any(r["mode"] == m for r in records)]
        width = 0.8 / max(len(modes), 1)
        for i, mode in enumerate(modes):
            values = [next((r["tokens_per_s"] or 0 for r in records if r["mode"] == mode and r["batch"] == b), 0)
                      for b in batches]
            ax.bar([j + i * width for j in range(len(batches))], values, width, label=mode)
        ax.set_xticks([j + width * (len(modes) - 1) / 2 for j in range(len(batches))], [str(b) for b in batches])
        ax.set_xlabel("batch")
        ax.set_ylabel("decode tokens/s")
        ax.set_yscale("log")
        ax.set_title(f"context {context}")
        ax.legend(fontsize=8)
    env = result["environment"]
    fig.suptitle(f"attnops serving: {result['model']} {result['dtype']} on {env.get('gpu') or env.get('cpu')} "
                 f"({env['commit'][:10]})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    if importlib.util.find_spec("transformers") is None and not {"-h", "--help"} & set(argv):
        raise SystemExit("python -m attnops serve-bench: needs transformers (its Llama builds the weights every mode "
                         "shares): pip install 'attnops[bench]'")
    parser = argparse.ArgumentParser(prog="python -m attnops serve-bench", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="tiny model and sizes (runs on the CPU in seconds)")
    parser.add_argument("--device", default=None, help="default: cuda if available (cpu with --small)")
    parser.add_argument("--batches", type=int, nargs="*", help="default: 1 32 128 (1 4 with --small)")
    parser.add_argument("--contexts", type=int, nargs="*", help="default: 1024 8192 (64 256 with --small)")
    parser.add_argument("--modes", nargs="*", choices=MODES, help="default: all that this machine can run")
    parser.add_argument("--kv-format", default=None, help="attnops' KV format (default: the model dtype)")
    parser.add_argument("--checkpoint", help="a Hugging Face Llama checkpoint (default: random, Llama-3.2-1B-shaped)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    parser.add_argument("--steps", type=int, default=None, help="timed decode steps (default 50; 8 with --small)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5; 2 with --small)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--append", action="store_true",
                        help="merge into the --json file's records (replacing equal mode/batch/context): a GPU "
                             "grid can be run in parts, each within one command's time limit")
    parser.add_argument("--plot", help="write a PNG here (matplotlib)")
    args = parser.parse_args(argv)

    device = torch.device(args.device or ("cpu" if args.small or not torch.cuda.is_available() else "cuda"))
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    kv_format = args.kv_format or {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    batches = args.batches or ([1, 4] if args.small else [1, 32, 128])
    contexts = args.contexts or ([64, 256] if args.small else [1024, 8192])
    args.steps = args.steps or (8 if args.small else 50)
    args.warmup = args.warmup or (2 if args.small else 5)
    modes = list(args.modes or MODES)
    if "compiled+graphs" in modes and device.type != "cuda":
        modes.remove("compiled+graphs")
        print("compiled+graphs: skipped (needs CUDA)")

    hf = hf_model(args, device, dtype)
    model = attnops_model(hf)
    c = model.config
    old_records = []
    if args.json and args.append and Path(args.json).exists():
        old_records = json.loads(Path(args.json).read_text())["records"]
    records = []

    def save() -> dict:
        """The result so far, written after every measurement: a run stopped by a time limit keeps its part."""
        key = lambda r: (r["mode"], r["batch"], r["context"])  # noqa: E731
        new_keys = {key(r) for r in records}
        result = dict(environment=environment(device), dtype=str(dtype).replace("torch.", ""), kv_format=kv_format,
                      model=f"{c.num_hidden_layers}L h{c.hidden_size} {c.num_attention_heads}/"
                            f"{c.num_key_value_heads} d{c.head_dim}", checkpoint=args.checkpoint, steps=args.steps,
                      warmup=args.warmup, page_size=args.page_size,
                      records=[r for r in old_records if key(r) not in new_keys] + records)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
        return result

    def record(mode, batch, context, tps, attention_s, error) -> None:
        row = dict(mode=mode, batch=batch, context=context, tokens_per_s=tps, error=error)
        if attention_s is not None:  # attention's share of the (graph-replayed) step time
            step_s = batch / tps
            row.update(step_ms=step_s * 1e3, attention_ms=attention_s * 1e3, attention_share=attention_s / step_s)
        records.append(row)
        shown = f"{tps:10.1f} tokens/s" if tps else f"failed: {error}"
        if attention_s is not None:
            shown += f"  (step {row['step_ms']:.2f} ms, attention {100 * row['attention_share']:.0f}%)"
        print(f"context {context:>6}  batch {batch:>4}  {mode:<16} {shown}", flush=True)
        save()

    ours = [m for m in MODES if m in modes and m != "transformers"]  # compiled before compiled+graphs
    for context in contexts:
        for batch in batches:
            torch._dynamo.reset()
            for mode, tps, attention_s, error in bench_attnops(model, ours, batch, context, args, device, kv_format):
                record(mode, batch, context, tps, attention_s, error)
            if "transformers" in modes:
                torch._dynamo.reset()
                try:
                    tps, error = bench_transformers(hf, batch, context, args, device), None
                except Exception as e:  # record and go on
                    tps, error = None, f"{type(e).__name__}: {e}"
                record("transformers", batch, context, tps, None, error)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()

    result = save()
    if args.plot:
        plot(result, args.plot)
    return result


if __name__ == "__main__":
    main()
