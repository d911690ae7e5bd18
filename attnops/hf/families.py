"""The model families attnops serves through transformers' modeling code, each at the shape of a real model (random
weights: nothing is downloaded) and tiny (for the CPU), and loading a model by family name or checkpoint.

    model = attnops.hf.families.load("qwen2", device="cuda", dtype=torch.bfloat16)   # Qwen2.5-7B-shaped, random
    model = attnops.hf.families.load("/path/to/checkpoint", device="cuda", dtype=torch.bfloat16)

FAMILIES are served by attn_implementation "attnops" and a PagedCache or the serving kit (what the demo,
serve-bench and the generic tests run on every one of them). MLA_FAMILIES (DeepSeek's latent attention) are
served only through attnops.hf.mla (enable_mla and a LatentCache), so they are kept apart: `load` builds them with
enable_mla applied, and nothing that walks FAMILIES meets a model the generic path cannot serve.
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
    # head dim 96 (3072 / 32 heads), between powers of two; Phi-3-mini-4k slides over 2047 keys in every layer
    "phi3": Family("phi3", "Phi-3-mini-4k-instruct", dict(
        vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, head_dim=96, rms_norm_eps=1e-5, sliding_window=2047, max_position_embeddings=4096,
        tie_word_embeddings=False, rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
        # (transformers' default pad and eos ids, 32000, are past the tiny vocabulary)
        tiny=dict(sliding_window=32, head_dim=96, pad_token_id=0, eos_token_id=None)),
    "gpt-oss": Family("gpt_oss", "gpt-oss-20b", dict(
        vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
        max_position_embeddings=131072, tie_word_embeddings=False),
        tiny=dict(sliding_window=32, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=131072)),
}

# Latent attention (attnops.hf.mla). `real` is DeepSeek-V3's attention exactly (and its YaRN RoPE: the scale's
# mscale) with 4 of its 61 layers and 8 of its 256 routed experts: the whole 671B model is absurd to build with
# random weights, and every layer's attention is the same. About 4.2B parameters (8.4 GB in bf16), most of them the
# vocabulary's and the experts'.
MLA_FAMILIES = {
    # DeepSeek-V2-Lite whole (27 layers, 64 routed experts: 15.7B parameters, 31 GB in bf16); q_proj, no q LoRA
    "deepseek_v2": Family("deepseek_v2", "DeepSeek-V2-Lite", dict(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, first_k_dense_replace=1, num_attention_heads=16, num_key_value_heads=16,
        q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2, n_group=1, topk_group=1,
        topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.0, rms_norm_eps=1e-6,
        max_position_embeddings=163840, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
                             beta_fast=32.0, beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707)),
        tiny=dict(num_key_value_heads=4, head_dim=16, q_lora_rank=None, kv_lora_rank=64, qk_nope_head_dim=32,
                  qk_rope_head_dim=16, v_head_dim=32, moe_intermediate_size=64, n_routed_experts=4,
                  num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1, first_k_dense_replace=1)),
    "deepseek_v3": Family("deepseek_v3", "DeepSeek-V3 (4 of 61 layers, 8 of 256 routed experts)", dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=4,
        first_k_dense_replace=1, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=8,
        num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5,
        rms_norm_eps=1e-6, max_position_embeddings=163840, tie_word_embeddings=False, rope_interleave=True,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
                             beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)),
        # one dense layer then one MoE layer of 4 small experts; every head its own KV head (eager's repeat_kv);
        # head_dim is the rotary dims' (TINY's 32 would size RoPE's tables)
        tiny=dict(num_key_value_heads=4, head_dim=16, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
                  qk_rope_head_dim=16, v_head_dim=32, moe_intermediate_size=64, n_routed_experts=4,
                  num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1, first_k_dense_replace=1)),
    # DeepSeek-V3.2: V3's attention with an indexer picking 2048 keys a query (the sparse form); tiny: 8 of 16
    # heads' picks, and a latent of 128 (DeepSeek's fp8 layout, --kv-format fp8_ds_mla, takes multiples of 128)
    "deepseek_v32": Family("deepseek_v32", "DeepSeek-V3.2 (4 of 61 layers, 8 of 256 routed experts)", dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=4,
        first_k_dense_replace=1, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=8,
        num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5,
        rms_norm_eps=1e-6, max_position_embeddings=163840, tie_word_embeddings=False, index_topk=2048,
        index_n_heads=64, index_head_dim=128,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
                             beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)),
        tiny=dict(num_key_value_heads=4, head_dim=16, q_lora_rank=64, kv_lora_rank=128, qk_nope_head_dim=32,
                  qk_rope_head_dim=16, v_head_dim=32, moe_intermediate_size=64, n_routed_experts=4,
                  num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
                  index_topk=8, index_n_heads=16, index_head_dim=32)),
}


def _spec(family: str) -> Family:
    spec = FAMILIES.get(family) or MLA_FAMILIES.get(family)
    if spec is None:
        raise ValueError(f"attnops.hf: family must be one of {sorted(FAMILIES) + sorted(MLA_FAMILIES)} (got "
                         f"{family!r})")
    return spec


def family_config(family: str, *, tiny: bool = False, layers: int | None = None):
    """transformers' config of `family` (of FAMILIES or MLA_FAMILIES) at its real model's shape, or tiny; with
    `layers`, its first that many layers only (a model whose weights and cache would not fit otherwise)."""
    import transformers
    spec = _spec(family)
    fields = {**TINY, **spec.tiny} if tiny else copy.deepcopy(spec.real)
    if layers is not None:
        if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
            raise ValueError(f"attnops.hf: layers must be a positive int (got {layers!r})")
        fields["num_hidden_layers"] = layers
    return transformers.AutoConfig.for_model(spec.model_type, **fields)


def describe(model_or_family: str, tiny: bool = False) -> str:
    """'random Qwen2.5-7B-shaped qwen2' for a family, the path otherwise."""
    if model_or_family in FAMILIES or model_or_family in MLA_FAMILIES:
        spec = _spec(model_or_family)
        return f"random {'tiny ' + model_or_family if tiny else spec.real_name + '-shaped ' + model_or_family}"
    return model_or_family


def load(model: str, *, device="cpu", dtype=torch.bfloat16, tiny: bool = False, seed: int = 0,
         attn_implementation: str = ATTN_IMPLEMENTATION, layers: int | None = None):
    """A transformers causal LM in eval mode: `model` is a family name (random weights, at the real model's shape
    or tiny, made on `device` in `dtype`) or a checkpoint (a directory, or a name transformers resolves; every
    weight of its config must be in it; `layers` is for families only). A latent-attention model (MLA_FAMILIES, a
    DeepSeek-V2/V3 checkpoint) with attn_implementation "attnops" comes through attnops.hf.mla.enable_mla: serve it
    with a LatentCache."""
    import transformers
    from .mla import enable_mla, has_latent_attention
    if model in FAMILIES or model in MLA_FAMILIES:
        config = family_config(model, tiny=tiny, layers=layers)
        torch.manual_seed(seed)
        with torch.device(device):
            hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation,
                                                               dtype=dtype)
    else:
        if layers is not None:
            raise ValueError(f"attnops.hf: layers is for a family's random model, not a checkpoint ({model})")
        # a hub name is namespace/name; anything else that is not a directory here is a mistake to say so
        if not Path(model).exists() and (model.count("/") != 1 or model.startswith(("/", ".", "~"))):
            raise ValueError(f"attnops.hf: model must be a family ({', '.join([*FAMILIES, *MLA_FAMILIES])}) or a "
                             f"checkpoint (a directory or a hub name, namespace/name), got {model!r}: no such "
                             f"directory")
        hf, info = transformers.AutoModelForCausalLM.from_pretrained(
            model, attn_implementation=attn_implementation, dtype=dtype, output_loading_info=True)
        # transformers fills weights a checkpoint lacks with random ones (and warns): a model that does not match
        # its config is an error here, not a random model
        missing = sorted(info.get("missing_keys") or ())
        if missing:
            raise ValueError(f"attnops.hf: checkpoint {model} does not match its config: missing {missing}")
        hf = hf.to(device)
    if attn_implementation == ATTN_IMPLEMENTATION and has_latent_attention(hf):
        enable_mla(hf)
    return hf.eval().requires_grad_(False)
