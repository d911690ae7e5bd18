"""`python -m attnops demo`: a paged decode loop on a small random Llama-shaped model through attnops' ops.

Prefills a batch of random prompts, then decodes greedily, and prints which backend served each op and the
tokens/s. On a GPU it uses a Llama-3.2-1B-shaped model in bf16; on the CPU a tiny fp32 one.
"""
from __future__ import annotations

import time

import torch

from .dispatch import explain
from .kv_cache import PagedKVCache
from .model import LlamaConfig, LlamaForCausalLM

GPU_CONFIG = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8)
CPU_CONFIG = LlamaConfig()


def positions_of(cache: PagedKVCache, seq_ids, num_new) -> torch.Tensor:
    """Positions of each sequence's newest `num_new` tokens (the cache already counts them)."""
    pos = []
    for s, n in zip(seq_ids, num_new):
        end = cache.seq_len(s)
        pos.extend(range(end - n, end))
    return torch.tensor(pos, device=cache.device)


@torch.no_grad()
def run_demo(batch: int = 4, prompt_len: int = 32, steps: int = 32, device: str | None = None,
             kv_format: str | None = None, page_size: int = 16, seed: int = 0) -> dict:
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = device.type == "cuda"
    config = GPU_CONFIG if on_gpu else CPU_CONFIG
    dtype = torch.bfloat16 if on_gpu else torch.float32
    kv_format = kv_format or ("bf16" if on_gpu else "fp32")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype)
    for p in model.parameters():  # a random model with sane activations
        p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    pages_per_seq = -(-(prompt_len + steps) // page_size)
    cache = PagedKVCache(config.num_hidden_layers, batch * pages_per_seq + 1, page_size,
                         config.num_key_value_heads, config.head_dim, kv_format=kv_format, device=device,
                         shuffle_pages=True, seed=seed)
    seq_ids = list(range(batch))
    for s in seq_ids:
        cache.allocate(s)
    prompts = torch.randint(0, config.vocab_size, (batch * prompt_len,), device=device)

    meta = cache.prepare(seq_ids, prompt_len, decode=False)
    logits = model(prompts, positions_of(cache, seq_ids, [prompt_len] * batch), cache, meta)
    next_tokens = logits[meta.cu_seqlens_q[1:].long() - 1].argmax(-1)
    case = dict(device=str(device), q_dtype=dtype, kv_format=kv_format, head_dim=config.head_dim,
                page_size=page_size, num_q_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads)
    backends = {mode: explain(**case, decode=mode == "decode").chosen for mode in ("prefill", "decode")}

    generated = [next_tokens]
    if on_gpu:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        meta = cache.prepare(seq_ids)
        logits = model(next_tokens, positions_of(cache, seq_ids, [1] * batch), cache, meta)
        next_tokens = logits.argmax(-1)
        generated.append(next_tokens)
    if on_gpu:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return dict(device=str(device), model=config, kv_format=kv_format, backends=backends, batch=batch,
                steps=steps, tokens_per_s=batch * steps / elapsed, step_ms=elapsed / steps * 1e3,
                tokens=torch.stack(generated, 1).tolist())


def main(args) -> None:
    result = run_demo(batch=args.batch, prompt_len=args.prompt_len, steps=args.steps, device=args.device,
                      kv_format=args.kv_format)
    c = result["model"]
    print(f"attnops demo on {result['device']}: random Llama-shaped model, {c.num_hidden_layers} layers, hidden "
          f"{c.hidden_size}, heads {c.num_attention_heads}/{c.num_key_value_heads}, head_dim {c.head_dim}, "
          f"KV {result['kv_format']}")
    print(f"backend: prefill -> {result['backends']['prefill']}, decode -> {result['backends']['decode']}")
    print(f"batch {result['batch']}, {result['steps']} decode steps (eager): {result['tokens_per_s']:.1f} tokens/s, "
          f"{result['step_ms']:.2f} ms/step")
    print(f"first sequence's tokens: {result['tokens'][0][:16]}")
