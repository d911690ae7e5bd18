"""The model families attnops serves through transformers' modeling code, each at the shape of a real model (random
weights: nothing is downloaded) and tiny (for the CPU), and loading a model by family name or checkpoint.

    model = attnops.hf.families.load("qwen2", device="cuda", dtype=torch.bfloat16)   # Qwen2.5-7B-shaped, random
    model = attnops.hf.families.load("/path/to/checkpoint", device="cuda", dtype=torch.bfloat16)
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .attention import ATTN_IMPLEMENTATION

TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=4096)


@dataclass(frozen=True)
class Family:
    model_type: str  # transformers' model_type
    real_name: str  # the model whose shape `real` is
    real: dict  # config fields of that model
    tiny: dict = field(default_factory=dict)  # fields over TINY: the family's attention features, small


FAMILIES = {
    "llama": Family("llama", "Llama-3.2-1B", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5, tie_word_embeddings=True,
        max_position_embeddings=131072,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=8192))),
    "qwen2": Family("qwen2", "Qwen2.5-7B", dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0))),
    "qwen3": Family("qwen3", "Qwen3-8B", dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, max_position_embeddings=40960,
        tie_word_embeddings=False, rope_parameters=dict(rope_type="default", rope_theta=1000000.0))),
    "mistral": Family("mistral", "Mistral-7B-v0.1", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, sliding_window=4096, max_position_embeddings=32768,
        tie_word_embeddings=False, rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
        tiny=dict(sliding_window=32)),
    "gemma2": Family("gemma2", "gemma-2-2b", dict(
        vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256, sliding_window=4096,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, rms_norm_eps=1e-6, max_position_embeddings=8192,
        tie_word_embeddings=True), tiny=dict(sliding_window=32, query_pre_attn_scalar=32)),
    "gpt-oss": Family("gpt_oss", "gpt-oss-20b", dict(
        vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
        max_position_embeddings=131072, tie_word_embeddings=False),
        tiny=dict(sliding_window=32, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=131072)),
}


def family_config(family: str, *, tiny: bool = False):
    """transformers' config of `family` at its real model's shape, or tiny."""
    import transformers
    if family not in FAMILIES:
        raise ValueError(f"attnops.hf: family must be one of {sorted(FAMILIES)} (got {family!r})")
    spec = FAMILIES[family]
    fields = {**TINY, **spec.tiny} if tiny else copy.deepcopy(spec.real)
    return transformers.AutoConfig.for_model(spec.model_type, **fields)


def describe(model_or_family: str, tiny: bool = False) -> str:
    """'random Qwen2.5-7B-shaped qwen2' for a family, the path otherwise."""
    if model_or_family in FAMILIES:
        spec = FAMILIES[model_or_family]
        return f"random {'tiny ' + model_or_family if tiny else spec.real_name + '-shaped ' + model_or_family}"
    return model_or_family


def load(model: str, *, device="cpu", dtype=torch.bfloat16, tiny: bool = False, seed: int = 0,
         attn_implementation: str = ATTN_IMPLEMENTATION):
    """A transformers causal LM in eval mode: `model` is a family name (random weights, at the real model's shape
    or tiny, made on `device` in `dtype`) or a checkpoint (a directory, or a name transformers resolves; every
    weight of its config must be in it)."""
    import transformers
    if model in FAMILIES:
        config = family_config(model, tiny=tiny)
        torch.manual_seed(seed)
        with torch.device(device):
            hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation,
                                                               dtype=dtype)
    else:
        # a hub name is namespace/name; anything else that is not a directory here is a mistake to say so
        if not Path(model).exists() and (model.count("/") != 1 or model.startswith(("/", ".", "~"))):
            raise ValueError(f"attnops.hf: model must be a family ({', '.join(FAMILIES)}) or a checkpoint (a "
                             f"directory or a hub name, namespace/name), got {model!r}: no such directory")
        hf, info = transformers.AutoModelForCausalLM.from_pretrained(
            model, attn_implementation=attn_implementation, dtype=dtype, output_loading_info=True)
        # transformers fills weights a checkpoint lacks with random ones (and warns): a model that does not match
        # its config is an error here, not a random model
        missing = sorted(info.get("missing_keys") or ())
        if missing:
            raise ValueError(f"attnops.hf: checkpoint {model} does not match its config: missing {missing}")
        hf = hf.to(device)
    return hf.eval().requires_grad_(False)
