"""Tensor parallelism for the Llama model of attnops.serving.model, over torch.distributed (NCCL on GPUs, gloo on CPUs).

Each rank keeps 1/N of the heads and of the MLP: q/k/v and gate/up projections split by output rows (column
parallel), o_proj and down_proj by input columns (row parallel) followed by one all-reduce each, so every
decoder block costs two all-reduces (attention, MLP) and the embeddings, norms and lm_head are replicated. Each
rank's KV cache holds its own KV heads. The all-reduce is the functional collective, which torch.compile
traces without a graph break.

    torchrun --nproc-per-node 2 -m attnops.serving.tp --batch 32     # the demo's decode loop, TP over 2 GPUs
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import _functional_collectives as funcol

from .model import LlamaConfig, LlamaForCausalLM


class RowParallelLinear(nn.Linear):
    """A Linear holding a slice of the input features; the partial products of all ranks are summed."""

    def __init__(self, in_features, out_features, group=None):
        super().__init__(in_features, out_features, bias=False)
        self.group = group if group is not None else dist.group.WORLD

    def forward(self, x):
        return funcol.all_reduce(super().forward(x), "sum", self.group)


def local_config(config: LlamaConfig, world_size: int) -> LlamaConfig:
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        if getattr(config, name) % world_size:
            raise ValueError(f"tensor parallel over {world_size} ranks needs {name} ({getattr(config, name)}) to "
                             f"divide evenly")
    return dataclasses.replace(config, num_attention_heads=config.num_attention_heads // world_size,
                               num_key_value_heads=config.num_key_value_heads // world_size,
                               intermediate_size=config.intermediate_size // world_size, head_dim=config.head_dim)


def shard(model: LlamaForCausalLM, rank: int, world_size: int, group=None) -> LlamaForCausalLM:
    """This rank's share of `model` (the full model, on any device): a new LlamaForCausalLM on model's device."""
    config = local_config(model.config, world_size)
    device = model.lm_head.weight.device
    dtype = model.lm_head.weight.dtype
    with torch.device(device):
        local = LlamaForCausalLM(config).to(dtype)
    full = model.state_dict()

    def rows(weight):  # this rank's block of output rows
        return weight.chunk(world_size, dim=0)[rank]

    def cols(weight):  # this rank's block of input columns
        return weight.chunk(world_size, dim=1)[rank]

    state = {}
    for name, tensor in full.items():
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")):
            state[name] = rows(tensor)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            state[name] = cols(tensor)
        else:
            state[name] = tensor
    for layer in local.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.o_proj = RowParallelLinear(attn.o_proj.in_features, attn.o_proj.out_features, group).to(device, dtype)
        mlp.down_proj = RowParallelLinear(mlp.down_proj.in_features, mlp.down_proj.out_features, group).to(
            device, dtype)
    local.load_state_dict(state, strict=True)
    return local


def main(argv=None) -> None:
    """The demo's decode loop under torchrun: a random Llama-shaped model, greedy, tokens/s at each batch."""
    from .demo import GPU_CONFIG, CPU_CONFIG
    from .generate import Generator
    from .kv_cache import PagedKVCache

    parser = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m attnops.serving.tp")
    parser.add_argument("--batch", type=int, nargs="*", default=[32, 128])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--graphs", action="store_true")
    args = parser.parse_args(argv)
    on_gpu = torch.cuda.is_available()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on shared hosts
    dist.init_process_group("nccl" if on_gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{rank}") if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    config = GPU_CONFIG if on_gpu else CPU_CONFIG
    dtype = torch.bfloat16 if on_gpu else torch.float32
    torch.manual_seed(0)  # every rank builds the same full model, then keeps its share
    with torch.device(device):
        full = LlamaForCausalLM(config).to(dtype)
    for p in full.parameters():
        nn.init.normal_(p, 0, 0.02) if p.dim() > 1 else nn.init.ones_(p)
    model = shard(full, rank, world)
    del full
    for batch in args.batch:
        pages = batch * (-(-(args.prompt_len + args.steps) // 16)) + batch
        cache = PagedKVCache(config.num_hidden_layers, pages, 16, config.num_key_value_heads // world,
                             config.head_dim, kv_format="bf16" if on_gpu else "fp32", device=device)
        gen = Generator(model, cache, max_batch=batch, max_seq_len=args.prompt_len + args.steps + 1,
                        compile=args.compile, cuda_graphs=args.graphs)
        prompts = torch.randint(0, config.vocab_size, (batch, args.prompt_len),
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
