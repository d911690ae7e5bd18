"""Tensor parallelism for a transformers decoder served through attnops: transformers' own plan (the model's
`base_model_tp_plan`, applied by `from_pretrained(..., distributed_config=DistributedConfig(tp_size=N))` with
DTensor), over torch.distributed (NCCL on GPUs, gloo on CPUs). attnops adds no sharding of its own.

    # under torchrun, every rank:
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="attnops",
                                                 distributed_config=DistributedConfig(tp_size=world_size))
    # or a model built whole on every rank (the same weights), e.g. attnops.hf.families.load(...):
    model = attnops.hf.tp.shard(model, rank, world_size)                   # a new model; `model` is left whole
    gen = Generator(attnops.hf.serving_model(model), attnops.hf.paged_kv_cache(model.config, ...), ...)

    torchrun --nproc-per-node 2 -m attnops.hf.tp_demo --batch 32     # the demo's decode loop, TP over 2 GPUs

What transformers does (Llama, Qwen2, Qwen3, Mistral, Gemma-2's plan): q/k/v and gate/up split by output rows
(colwise; a bias goes with its rows), o_proj and down_proj by input columns (rowwise: one all-reduce each, a bias
added once after it), the input embeddings by vocabulary rows (an all-reduce), lm_head by vocabulary rows with the
logits gathered; norms replicated. Under no_grad (attnops' serving loop, generate) the Linear layers run on their
local shards, so the attention function gets this rank's heads as plain tensors and takes its head counts from
them; torch.compile(fullgraph=True) traces the step, all-reduces included, without a graph break.

The config is left as transformers leaves it (the whole model's counts, and `config.distributed_config`);
`heads_per_rank` reads this rank's heads from it, and `attnops.hf.model_shape` (so serving_model, paged_kv_cache,
PagedCache) uses it: each rank's KV cache holds its own KV heads.

transformers needs `accelerate` installed for any tensor-parallel load (its device-map check), on CPUs too.
"""
from __future__ import annotations

import copy
import os

import torch.distributed as dist
from torch import nn

# the projections whose output rows are the attention's keys, fused or not (as transformers' own
# get_kv_heads_per_rank, which sizes its StaticCache under tensor parallelism, reads them)
KEY_PROJECTIONS = ("k_proj", "qkv_proj", "query_key_value")


def _text_config(config):
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def _tp_size(config) -> int:
    return getattr(getattr(config, "distributed_config", None), "tp_size", None) or 1


def _plan(config) -> dict:
    """The tensor-parallel plan of `config`'s model as the config tells it: the model's own (base_model_tp_plan,
    of the text config and of the whole), with a dict `distributed_config.tp_plan` over it (`{}`: no rules)."""
    override = getattr(getattr(config, "distributed_config", None), "tp_plan", None)
    if isinstance(override, dict) and not override:
        return {}
    plan = {}
    for part in {id(c): c for c in (_text_config(config), config)}.values():
        plan.update(getattr(part, "base_model_tp_plan", None) or {})
    if isinstance(override, dict):
        plan.update(override)
    return plan


def heads_per_rank(config, heads: int, kv_heads: int, tp_size: int | None = None) -> tuple[int, int]:
    """This rank's query and KV heads of a model with `heads` and `kv_heads` under transformers' tensor
    parallelism over `tp_size` ranks (default: `config.distributed_config.tp_size`, which from_pretrained sets; 1
    without it): divided when the plan splits the key projection by rows ("colwise"), whole when it leaves the
    attention replicated (gpt-oss's plan splits only the embeddings). A ValueError names a count that does not
    divide, or a style on the key projection that attnops does not read."""
    tp_size = _tp_size(config) if tp_size is None else tp_size
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"attnops.hf.tp: the tensor-parallel size must be a positive int (got {tp_size!r})")
    if tp_size == 1:
        return heads, kv_heads
    styles = {style for key, style in _plan(config).items() if key.rsplit(".", 1)[-1] in KEY_PROJECTIONS}
    if not styles:
        return heads, kv_heads
    if styles != {"colwise"}:
        raise ValueError(f"attnops.hf.tp: the tensor-parallel plan splits the key projection as {sorted(styles)}; "
                         f"attnops reads heads per rank under 'colwise' only")
    for name, value in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if value % tp_size:
            raise ValueError(f"attnops.hf.tp: tensor parallel over {tp_size} ranks needs config.{name} ({value}) "
                             f"to divide evenly (each rank keeps whole heads)")
    return heads // tp_size, kv_heads // tp_size


def _heads(config) -> tuple[int, int]:
    text = _text_config(config)
    heads = text.num_attention_heads
    return heads, getattr(text, "num_key_value_heads", None) or heads


def shard(model: nn.Module, rank: int, world_size: int) -> nn.Module:
    """This rank's share of `model` (a transformers causal LM, whole and the same on every rank) under
    transformers' tensor-parallel plan: a new model, loaded by from_pretrained from `model`'s config and weights
    with DistributedConfig(tp_size=world_size), in eval mode; `model` is left whole. torch.distributed must be
    initialized with `world_size` ranks, this one `rank`. On GPUs transformers places the shard on
    cuda:LOCAL_RANK (torchrun sets it); it must be `model`'s device."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"attnops.hf.tp: world_size must be a positive int (got {world_size!r})")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"attnops.hf.tp: rank must be an int in [0, {world_size}) (got {rank!r})")
    config = model.config
    heads, kv_heads = _heads(config)
    if heads_per_rank(config, heads, kv_heads, world_size) == (heads, kv_heads) and world_size > 1:
        raise ValueError(f"attnops.hf.tp: {type(model).__name__}'s tensor-parallel plan does not split the "
                         f"attention heads (plan: {_plan(config) or 'none'}): tensor parallelism serves dense "
                         f"decoders (Llama, Qwen2, Qwen3, Mistral, Gemma-2)")
    if not dist.is_initialized() or (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
        found = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else "no process group"
        raise ValueError(f"attnops.hf.tp: shard(model, {rank}, {world_size}) needs torch.distributed initialized "
                         f"with world size {world_size}, this process rank {rank} (found {found})")
    from transformers.distributed import DistributedConfig
    config = copy.deepcopy(config)  # from_pretrained writes the distributed config into the one it is given
    sharded = type(model).from_pretrained(
        None, config=config, state_dict=model.state_dict(), dtype=model.dtype,
        attn_implementation=getattr(config, "_attn_implementation", None),
        distributed_config=DistributedConfig(tp_size=world_size))
    if sharded.device != model.device:
        raise ValueError(f"attnops.hf.tp: transformers placed rank {rank}'s shard on {sharded.device}, the model "
                         f"is on {model.device} (on GPUs it uses cuda:LOCAL_RANK; LOCAL_RANK="
                         f"{os.environ.get('LOCAL_RANK')})")
    return sharded.eval().requires_grad_(False)
