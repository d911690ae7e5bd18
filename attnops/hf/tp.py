"""Tensor parallelism for a transformers decoder served through attnops, over torch.distributed (NCCL on GPUs, gloo
on CPUs).

Each rank keeps 1/N of the heads and of the MLP: q/k/v and gate/up projections split by output rows (column
parallel: a bias, such as Qwen2's on q/k/v, goes with its rows), o_proj and down_proj by input columns (row
parallel) followed by one all-reduce each (a bias of theirs is added once, after it), so every decoder layer costs
two all-reduces (attention, MLP) and the embeddings, norms and lm_head are replicated. The all-reduce is the
functional collective, which torch.compile traces without a graph break.

The model's config is made local too (heads, KV heads and intermediate size divided by N, head_dim written out), so
that what reads it sees this rank's share: serving_model's shape, paged_kv_cache (each rank's KV cache holds its
own KV heads), PagedCache. transformers' attention layers reshape q/k/v by head_dim (not by head counts) and keep
num_key_value_groups, a ratio that sharding leaves as it is; the attention function takes its head counts from
the tensors.

    model = attnops.hf.families.load("llama", device=f"cuda:{rank}", dtype=torch.bfloat16)  # the same on every rank
    attnops.hf.tp.shard(model, rank, world_size)                                            # in place
    gen = Generator(attnops.hf.serving_model(model), attnops.hf.paged_kv_cache(model.config, ...), ...)

    torchrun --nproc-per-node 2 -m attnops.hf.tp --batch 32     # the demo's decode loop, TP over 2 GPUs

Decoders whose layers hold self_attn.{q,k,v,o}_proj and mlp.{gate,up,down}_proj as Linear layers: Llama, Qwen2
(tests/test_tp.py: 2 ranks give 1 rank's greedy tokens), Qwen3, Mistral, Gemma-2. gpt-oss (experts, sinks) is
refused.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import _functional_collectives as funcol

COLUMN_PARALLEL = {"self_attn": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}
ROW_PARALLEL = {"self_attn": "o_proj", "mlp": "down_proj"}
SHARDED_COUNTS = ("num_attention_heads", "num_key_value_heads", "intermediate_size")


def _block(tensor: torch.Tensor, rank: int, world_size: int, dim: int) -> torch.Tensor:
    # a copy, so that the full tensor's storage can go
    return tensor.chunk(world_size, dim=dim)[rank].clone()


class RowParallelLinear(nn.Module):
    """A Linear holding this rank's block of the input features: the partial products of all ranks are summed
    (one all-reduce), then the bias, if any, is added once."""

    def __init__(self, linear: nn.Linear, rank: int, world_size: int, group=None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features // world_size, linear.out_features
        self.weight = nn.Parameter(_block(linear.weight.data, rank, world_size, 1),
                                   requires_grad=linear.weight.requires_grad)
        self.bias = linear.bias  # whole, on every rank
        self.group = group if group is not None else dist.group.WORLD

    def forward(self, x):
        out = funcol.all_reduce(nn.functional.linear(x, self.weight), "sum", self.group)
        return out if self.bias is None else out + self.bias


def _column_parallel(linear: nn.Linear, rank: int, world_size: int) -> None:
    """This rank's block of output rows, weight and bias, in place."""
    linear.weight = nn.Parameter(_block(linear.weight.data, rank, world_size, 0),
                                 requires_grad=linear.weight.requires_grad)
    if linear.bias is not None:
        linear.bias = nn.Parameter(_block(linear.bias.data, rank, world_size, 0),
                                   requires_grad=linear.bias.requires_grad)
    linear.out_features //= world_size


def text_config(model: nn.Module):
    config = model.config
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def local_counts(config, world_size: int) -> dict:
    """This rank's heads, KV heads and intermediate size, and head_dim (unchanged, written out); a ValueError
    names the first count that does not divide."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"attnops.hf.tp: world_size must be a positive int (got {world_size!r})")
    heads = config.num_attention_heads
    counts = dict(num_attention_heads=heads, num_key_value_heads=getattr(config, "num_key_value_heads", None) or heads,
                  intermediate_size=config.intermediate_size)
    for name, value in counts.items():
        if not isinstance(value, int) or value % world_size:
            raise ValueError(f"attnops.hf.tp: tensor parallel over {world_size} ranks needs config.{name} "
                             f"({value!r}) to divide evenly")
    local = {name: value // world_size for name, value in counts.items()}
    local["head_dim"] = getattr(config, "head_dim", None) or config.hidden_size // heads
    return local


def decoder_layers(model: nn.Module) -> list:
    """The layers of `model` with a self_attn and an mlp, each projection a Linear (a ValueError names what is
    missing)."""
    layers = [m for m in model.modules() if hasattr(m, "self_attn") and hasattr(m, "mlp")]
    if not layers:
        raise ValueError(f"attnops.hf.tp: {type(model).__name__} has no decoder layers with self_attn and mlp")
    for i, layer in enumerate(layers):
        for part, names in COLUMN_PARALLEL.items():
            for name in names + (ROW_PARALLEL[part],):
                if not isinstance(getattr(getattr(layer, part), name, None), nn.Linear):
                    raise ValueError(f"attnops.hf.tp: layer {i}'s {part}.{name} is not a Linear layer "
                                     f"({type(getattr(layer, part)).__name__}): tensor parallelism shards dense "
                                     f"decoders (Llama, Qwen2, Qwen3, Mistral, Gemma-2)")
    return layers


def shard(model: nn.Module, rank: int, world_size: int, group=None) -> nn.Module:
    """Keeps this rank's share of `model` (a transformers causal LM, the full model, the same on every rank), in
    place, and makes its config local (see the module's docstring); returns `model`. `group`: the process group
    of the all-reduces (default: the world, resolved now: call after init_process_group to run the model)."""
    config = text_config(model)
    local = local_counts(config, world_size)
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"attnops.hf.tp: rank must be an int in [0, {world_size}) (got {rank!r})")
    layers = decoder_layers(model)
    # the full model's rows, which the config's counts must describe
    full = {"q_proj": local["num_attention_heads"] * world_size * local["head_dim"],
            "k_proj": local["num_key_value_heads"] * world_size * local["head_dim"],
            "gate_proj": local["intermediate_size"] * world_size}
    for i, layer in enumerate(layers):  # every layer checked before any is changed
        for name, rows in full.items():
            part = layer.mlp if name == "gate_proj" else layer.self_attn
            if getattr(part, name).out_features != rows:
                raise ValueError(f"attnops.hf.tp: layer {i}'s {name} has {getattr(part, name).out_features} "
                                 f"outputs; the config says {rows}")
    for layer in layers:
        for part, names in COLUMN_PARALLEL.items():
            module = getattr(layer, part)
            for name in names:
                _column_parallel(getattr(module, name), rank, world_size)
            setattr(module, ROW_PARALLEL[part], RowParallelLinear(getattr(module, ROW_PARALLEL[part]), rank,
                                                                  world_size, group))
        if hasattr(layer.mlp, "intermediate_size"):  # (not read in forward; kept true)
            layer.mlp.intermediate_size = local["intermediate_size"]
    for name, value in local.items():
        setattr(config, name, value)
    return model


def main(argv=None) -> None:
    """The demo's decode loop under torchrun: a model (a family, random, or a checkpoint) sharded over the ranks,
    greedy, tokens/s at each batch."""
    from ..serving.generate import Generator
    from . import families, paged_kv_cache, serving_model

    parser = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m attnops.hf.tp")
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
    device = torch.device(f"cuda:{rank}") if on_gpu else torch.device("cpu")
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
