"""Tensor parallelism: the model sharded over 2 ranks (gloo, on the CPU here; NCCL on GPUs) gives the same greedy
tokens as 1 rank for 64 steps of continuous batching, and logits equal within fp32 rounding."""
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from attnops.serving.generate import Generator
from attnops.serving.kv_cache import PagedKVCache
from attnops.serving.model import LlamaConfig, LlamaForCausalLM
from attnops.serving.tp import shard

CONFIG = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                     num_attention_heads=8, num_key_value_heads=2)
STEPS = 64


def full_model():
    torch.manual_seed(0)
    model = LlamaForCausalLM(CONFIG)
    for p in model.parameters():  # a random model with decisive logits, so greedy ties do not decide the test
        torch.nn.init.normal_(p, 0, 0.08) if p.dim() > 1 else torch.nn.init.ones_(p)
    return model


@torch.no_grad()
def generate(model, num_kv_heads):
    """64 steps with requests joining (two waves) and leaving (different lengths)."""
    cache = PagedKVCache(CONFIG.num_hidden_layers, 64, 16, num_kv_heads, CONFIG.head_dim, kv_format="fp32")
    gen = Generator(model, cache, max_batch=4, max_seq_len=160)
    prompts = torch.randint(0, CONFIG.vocab_size, (6, 40), generator=torch.Generator().manual_seed(1)).tolist()
    for i in range(3):
        gen.add_request(i, prompts[i][: 10 + 9 * i], max_new_tokens=20 + 20 * i)
    for step in range(STEPS):
        if step == 8:
            for i in range(3, 6):
                gen.add_request(i, prompts[i][: 5 + 7 * i], max_new_tokens=30)
        gen.step()
    return {r.req_id: r.output for r in list(gen.finished.values()) + list(gen.running.values())}


def rank_main(rank, world, store, path):
    # a file store, not a TCP port: no port to pick and lose to another process between picking and binding
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        tokens = generate(shard(full_model(), rank, world), CONFIG.num_key_value_heads // world)
        if rank == 0:
            torch.save(tokens, path)
        dist.barrier()  # no rank tears the group down while another still has collectives in flight
    finally:
        dist.destroy_process_group()


def test_tp2_greedy_tokens_equal_tp1(tmp_path):
    expected = generate(full_model(), CONFIG.num_key_value_heads)
    path = tmp_path / "tp2.pt"
    mp.spawn(rank_main, args=(2, str(tmp_path / "store"), str(path)), nprocs=2, join=True)
    got = torch.load(path)
    assert sorted(got) == sorted(expected) == list(range(6))
    assert sum(len(t) for t in expected.values()) > 150
    for req_id in expected:
        assert got[req_id] == expected[req_id], f"request {req_id}"


def test_shard_splits_heads_and_mlp():
    local = shard(full_model(), 1, 2)
    attn = local.model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (4 * 32, 256) and attn.k_proj.weight.shape == (1 * 32, 256)
    assert attn.o_proj.weight.shape == (256, 4 * 32) and local.model.layers[0].mlp.down_proj.weight.shape == (256, 256)
    torch.testing.assert_close(attn.q_proj.weight, full_model().model.layers[0].self_attn.q_proj.weight[128:])
