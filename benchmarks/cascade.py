"""Cascade decode against plain paged decode of the same batch: requests that share a long prefix.

    python benchmarks/cascade.py                                   # 64 x (32K shared + 1K own), bf16 and fp8 (GPU)
    python benchmarks/cascade.py --sweep --json cascade.json --plot cascade.png

A PagedKVCache (one layer) holds the prefix once: every request forks its pages and adds its own tokens (written by
reshape_and_cache, quantized for fp8), so both calls read the same cache through the same block tables, the
plain decode every page of every sequence, cascade_attention the shared pages once. Times are CUDA-graph medians
(ten calls a graph, as `python -m attnops bench` times the op): plain decode the faster of a plain capture
(dispatch passes over host-planned FlashInfer there) and a re-planned one (as attnops' decode graphs run it);
cascade in a plain capture, as a layer of a served step runs it (the prefix pass's inputs made once a step, by
PagedKVCache.cascade_split) and as one call alone (made in the call: a few small kernels more). The outputs are
compared (bf16 tolerance) before timing. --sweep adds batches and prefix lengths around the first case (where
cascade stops paying: attnops.cascade.cascade_pays).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import attnops  # noqa: E402
from attnops.bench.run import environment, graph_time_us, hbm_tbps  # noqa: E402
from attnops.cascade import cascade_attention, cascade_pays  # noqa: E402
from attnops.testing import relative_error  # noqa: E402


def build(batch, prefix, own, kv_format, heads, page_size=16, device="cuda", seed=0):
    hq, hkv, d = heads
    gen = torch.Generator(device).manual_seed(seed)
    scale = {"k_scale": 0.5, "v_scale": 0.5} if kv_format.startswith("fp8") else {}
    total_pages = -(-prefix // page_size) + batch * (-(-own // page_size) + 1) + 4
    cache = attnops.PagedKVCache(1, total_pages, page_size, hkv, d, kv_format=kv_format, device=device,
                                 shuffle_pages=True, **scale)

    def write(seq_ids, n):
        meta = cache.prepare(seq_ids, n, decode=False)
        rows = meta.slot_mapping.shape[0]
        kv = torch.randn(2, rows, hkv, d, generator=gen, device=device, dtype=torch.bfloat16)
        attnops.reshape_and_cache(kv[0], kv[1], slot_mapping=meta.slot_mapping, **cache.write_args(0))

    cache.allocate("prefix")
    if prefix:
        write(["prefix"], prefix)
    ids = list(range(batch))
    for i in ids:
        cache.fork("prefix", i) if prefix else cache.allocate(i)
    if own > 1:
        write(ids, own - 1)
    meta = cache.prepare(ids, 1, decode=True)  # this step's token: its K/V written like the others
    write_step = torch.randn(2, batch, hkv, d, generator=gen, device=device, dtype=torch.bfloat16)
    attnops.reshape_and_cache(write_step[0], write_step[1], slot_mapping=meta.slot_mapping, **cache.write_args(0))
    q = torch.randn(batch, hq, d, generator=gen, device=device, dtype=torch.bfloat16)
    return cache, meta, q


def measure(batch, prefix, own, kv_format, heads, rep_ms):
    cache, meta, q = build(batch, prefix, own, kv_format, heads)
    args = cache.attention_args(0)
    split = cache.cascade_split(meta)
    plain_args = dict(block_table=meta.block_table, seq_lens=meta.seq_lens, **args)

    def plain():
        return torch.ops.attnops.paged_attention(q, **plain_args)

    prefix_inputs = split.prefix
    prefix_table = prefix_inputs.block_table[0, :split.prefix_tokens // cache.page_size].contiguous()
    prefix_len = torch.tensor([split.prefix_tokens], dtype=torch.int32, device=q.device)

    def cascade_call():  # one call alone: the prefix pass's inputs made from the prefix's pages and length
        return cascade_attention(q, prefix_table=prefix_table, prefix_len=prefix_len, block_table=split.block_table,
                                 seq_lens=split.seq_lens, **args)

    def cascade_layer():  # a layer of a served step: the prefix pass's inputs made once a step (cascade_split)
        return cascade_attention(q, prefix_table=None, prefix_len=None, block_table=split.block_table,
                                 seq_lens=split.seq_lens, prefix=prefix_inputs, **args)

    error = max(relative_error(cascade_call(), plain()), relative_error(cascade_layer(), plain()))
    if not error < 2e-2:
        raise AssertionError(f"cascade differs from plain decode: relative error {error:.2e}")
    cascade_us = graph_time_us(cascade_layer, rep_ms)
    cascade_call_us = graph_time_us(cascade_call, rep_ms)
    plain_us = min(graph_time_us(plain, rep_ms), graph_time_us(plain, rep_ms, host_seq_lens=meta.host_seq_lens))
    # the two passes alone: where cascade's time goes (the rest is the merge)
    prefix_us = graph_time_us(lambda: attnops.paged_attention_with_lse(
        q, block_table=prefix_inputs.block_table, seq_lens=prefix_inputs.seq_lens,
        cu_seqlens_q=prefix_inputs.cu_seqlens_q, tree_mask=prefix_inputs.tree_mask, **args), rep_ms)
    suffix_us = graph_time_us(lambda: attnops.paged_attention_with_lse(q, block_table=split.block_table,
                                                                       seq_lens=split.seq_lens, **args), rep_ms)
    hq, hkv, d = heads
    token_bytes = 2 * hkv * d * (2 if kv_format == "bf16" else 1)
    return dict(batch=batch, prefix=prefix, own=own, kv_format=kv_format, heads=list(heads),
                plain_us=plain_us, cascade_us=cascade_us, speedup=plain_us / cascade_us, rel_error=error,
                cascade_call_us=cascade_call_us,
                prefix_pass_us=prefix_us, suffix_pass_us=suffix_us,
                prefix_pass_tflops=4 * batch * hq * d * prefix / prefix_us / 1e6,
                pages_in_use=cache.pages_in_use, pages_unshared=batch * (-(-(prefix + own) // cache.page_size)),
                tokens_held=cache.pages_in_use * cache.page_size,
                plain_tbps=batch * (prefix + own) * token_bytes / plain_us / 1e6,
                cascade_pays=cascade_pays(batch, split.prefix_tokens), hbm_tbps=hbm_tbps("cuda"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prefix", type=int, default=32768, help="shared prefix tokens")
    parser.add_argument("--own", type=int, default=1024, help="each request's own tokens, this step's included")
    parser.add_argument("--formats", nargs="+", default=["bf16", "fp8_e4m3"])
    parser.add_argument("--heads", default="32/8/128", help="q heads / kv heads / head dim")
    parser.add_argument("--sweep", action="store_true", help="also batches 4, 16 and prefixes 1K, 4K")
    parser.add_argument("--rep-ms", type=int, default=100)
    parser.add_argument("--json", help="write the rows and the environment here")
    parser.add_argument("--plot", help="write a PNG of the speedups here")
    opts = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (the CPU path is tested in tests/test_cascade.py)")
    heads = tuple(int(x) for x in opts.heads.split("/"))
    points = [(opts.batch, opts.prefix, opts.own)]
    if opts.sweep:
        points += [(b, p, opts.own) for b in (4, 16, opts.batch) for p in (1024, 4096, opts.prefix)
                   if (b, p, opts.own) not in points]
    rows = []
    print(f"{'format':9} {'batch':>5} {'prefix':>6} {'own':>5} {'plain us':>9} {'cascade us':>10} {'speedup':>8} "
          f"{'one call':>9} {'prefix pass':>11} {'suffix pass':>11} {'tokens held':>11} {'unshared':>9}", flush=True)
    for fmt in opts.formats:
        for batch, prefix, own in points:
            r = measure(batch, prefix, own, fmt, heads, opts.rep_ms)
            rows.append(r)
            print(f"{fmt:9} {batch:5} {prefix:6} {own:5} {r['plain_us']:9.1f} {r['cascade_us']:10.1f} "
                  f"{r['speedup']:7.2f}x {r['cascade_call_us']:9.1f} {r['prefix_pass_us']:11.1f} "
                  f"{r['suffix_pass_us']:11.1f} "
                  f"{r['tokens_held']:11} {r['pages_unshared'] * 16:9}", flush=True)
    if opts.json:
        Path(opts.json).write_text(json.dumps(dict(environment=environment(torch.device("cuda")), rows=rows),
                                              indent=1))
    if opts.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(9, 4))
        labels = [f"{r['kv_format']}\n{r['batch']}x({r['prefix'] // 1024}K+{r['own'] // 1024 or r['own']})"
                  for r in rows]
        ax.bar(range(len(rows)), [r["speedup"] for r in rows], color=["C0" if r["kv_format"] == "bf16" else "C1"
                                                                       for r in rows])
        ax.axhline(4, color="k", ls="--", lw=1, label="bar: 4x (64 x 32K+1K)")
        ax.axhline(1, color="gray", lw=1)
        ax.set_xticks(range(len(rows)), labels, fontsize=7)
        ax.set_ylabel("plain decode time / cascade time")
        ax.set_title(f"cascade decode vs plain paged decode, heads {opts.heads}, {torch.cuda.get_device_name()}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(opts.plot, dpi=120)


if __name__ == "__main__":
    main()
