"""The demo's decode loop under tensor parallelism (attnops.hf.tp): a model sharded over the ranks by transformers'
plan, served through attnops.hf's serving kit, tokens/s at each batch.

    torchrun --nproc-per-node 2 -m attnops.hf.tp_demo --batch 32 128     # NCCL on GPUs, gloo on CPUs

A module of its own, above the sharding helpers: it reads the model families and the serving kit, which read
attnops.hf.tp.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from ..serving.generate import Generator
from . import families
from .serving import paged_kv_cache, serving_model
from .tp import shard


def main(argv=None) -> None:
    """The demo's decode loop under torchrun: a model (a family, random, or a checkpoint) sharded over the ranks by
    transformers' plan, greedy, tokens/s at each batch."""
    parser = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m attnops.hf.tp_demo")
    parser.add_argument("--model", default="llama",
                        help="a family (random weights at its real model's shape on GPUs, tiny on CPUs; default "
                             "llama: Llama-3.2-1B) or a checkpoint directory")
    parser.add_argument("--batch", type=int, nargs="*", default=[32, 128], help="batch sizes (default 32 128)")
    parser.add_argument("--prompt-len", type=int, default=128, help="tokens of each random prompt (default 128)")
    parser.add_argument("--steps", type=int, default=64, help="tokens generated per sequence (default 64)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the decode step")
    parser.add_argument("--graphs", action="store_true", help="replay the compiled step from CUDA graphs")
    args = parser.parse_args(argv)
    on_gpu = torch.cuda.is_available()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on shared hosts
    dist.init_process_group("nccl" if on_gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}") if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    tiny = not on_gpu and args.model in families.FAMILIES
    # every rank builds the same full model (the same seed), then keeps its share
    hf = shard(families.load(args.model, device=device, dtype=dtype, tiny=tiny, seed=0), rank, world)
    model = serving_model(hf)
    for batch in args.batch:
        pages = batch * (-(-(args.prompt_len + args.steps) // 16)) + batch
        cache = paged_kv_cache(hf.config, pages, page_size=16, kv_format="bf16" if on_gpu else "fp32", device=device)
        gen = Generator(model, cache, max_batch=batch, max_seq_len=args.prompt_len + args.steps + 1,
                        compile=args.compile, cuda_graphs=args.graphs)
        prompts = torch.randint(0, model.config.vocab_size, (batch, args.prompt_len),
                                generator=torch.Generator().manual_seed(1))
        for i in range(batch):
            gen.add_request(i, prompts[i].tolist(), args.steps)
        gen.step()  # prefill and the first decode step: compiles, captures, warms up
        done_before = sum(len(r.output) for r in gen.running.values())
        if on_gpu:
            torch.cuda.synchronize()
        start, steps = time.perf_counter(), 0
        while gen.has_work():
            gen.step()
            steps += 1
        if on_gpu:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        tokens = sum(len(r.output) for r in gen.finished.values()) - done_before
        if rank == 0:
            print(f"TP={world} batch {batch}: {tokens / elapsed:.1f} tokens/s ({elapsed / steps * 1e3:.2f} ms/step)")
        del gen, cache
    dist.barrier()  # no rank tears the group down while another still has collectives in flight
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
