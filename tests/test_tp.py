"""Tensor parallelism (attnops.hf.tp): transformers' own plan (from_pretrained with DistributedConfig, DTensor) over
2 ranks (gloo, on the CPU here; NCCL on GPUs) served through attnops.hf gives the same greedy tokens as 1 rank, for
64 steps of continuous batching (serving_model + paged_kv_cache) and for generate with a PagedCache: Llama loaded
from a checkpoint directory with tp_plan "auto", Qwen2 (q/k/v biases, a sliding-window layer) through
attnops.hf.tp.shard. Each rank keeps its heads' rows (and their biases) and o_proj's columns, and model_shape reads
this rank's heads from the config; counts that do not divide and plans that leave the attention whole are refused.

transformers' tensor-parallel load needs `accelerate` (its device-map check, on CPUs too): the 2-rank tests skip
without it."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("transformers")

import attnops.hf  # noqa: E402
from attnops.hf.tp import heads_per_rank, shard  # noqa: E402
from attnops.serving.generate import Generator  # noqa: E402
from conftest import build, make_config  # noqa: E402

# 8 query heads over 2 KV heads: each rank 4 over 1
SHAPE = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
             head_dim=32)
STEPS = 64


def full_model(family="llama"):
    torch.manual_seed(0)
    model = build(make_config(family, **SHAPE), attnops.hf.ATTN_IMPLEMENTATION)
    for name, p in model.named_parameters():  # decisive logits, so that greedy ties do not decide the test
        torch.nn.init.ones_(p) if "norm" in name else torch.nn.init.normal_(p, 0, 0.08)
    return model


@torch.no_grad()
def serve(model):
    """64 steps with requests joining (two waves) and leaving (different lengths)."""
    cache = attnops.hf.paged_kv_cache(model.config, 64, page_size=16, kv_format="fp32")
    gen = Generator(attnops.hf.serving_model(model), cache, max_batch=4, max_seq_len=160)
    prompts = torch.randint(0, SHAPE["vocab_size"], (6, 40), generator=torch.Generator().manual_seed(1)).tolist()
    for i in range(3):
        gen.add_request(i, prompts[i][: 10 + 9 * i], max_new_tokens=20 + 20 * i)
    for step in range(STEPS):
        if step == 8:
            for i in range(3, 6):
                gen.add_request(i, prompts[i][: 5 + 7 * i], max_new_tokens=30)
        gen.step()
    assert not gen.failed, gen.failed
    return {r.req_id: r.output for r in list(gen.finished.values()) + list(gen.running.values())}


@torch.no_grad()
def generate(model):
    """transformers' generate with a PagedCache: a batch of 2, the second row left-padded."""
    ids = torch.randint(1, SHAPE["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    cache = attnops.hf.PagedCache(model.config, max_cache_len=64, kv_format="fp32")
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=16, do_sample=False)
    return out[:, ids.shape[1]:].tolist()


def rank_main(rank, world, store, checkpoint, path, family):
    import transformers
    from transformers.distributed import DistributedConfig
    # a file store, not a TCP port: no port to pick and lose to another process between picking and binding
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        if checkpoint:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                checkpoint, attn_implementation=attnops.hf.ATTN_IMPLEMENTATION, dtype=torch.float32,
                distributed_config=DistributedConfig(tp_size=world, tp_plan="auto")).eval()
        else:
            whole = full_model(family)
            model = shard(whole, rank, world)
            check_blocks(model, whole, rank)
        shape = attnops.hf.model_shape(model.config)  # what the serving kit, the KV cache and PagedCache read
        assert (shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim) == (4, 1, 32)
        result = {"serve": serve(model), "generate": generate(model)}
        if rank == 0:
            torch.save(result, path)
        dist.barrier()  # no rank tears the group down while another still has collectives in flight
    finally:
        dist.destroy_process_group()


def check_blocks(model, whole, rank):
    """This rank's rows of q/k/v (and of their biases), columns of o_proj and down_proj, rows of up_proj."""
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    whole_attn, whole_mlp = whole.model.layers[0].self_attn, whole.model.layers[0].mlp
    q, kv, f = (slice(n * rank, n * (rank + 1)) for n in (128, 32, 256))  # 4 heads, 1 KV head, half the MLP
    for local, full in ((attn.q_proj.weight, whole_attn.q_proj.weight[q]),
                        (attn.k_proj.bias, whole_attn.k_proj.bias[kv]),
                        (attn.v_proj.weight, whole_attn.v_proj.weight[kv]),
                        (attn.o_proj.weight, whole_attn.o_proj.weight[:, q]),
                        (mlp.up_proj.weight, whole_mlp.up_proj.weight[f]),
                        (mlp.down_proj.weight, whole_mlp.down_proj.weight[:, f])):
        torch.testing.assert_close(local.to_local(), full, rtol=0, atol=0)


@pytest.mark.parametrize("family,loaded", [("llama", "from_pretrained"), ("qwen2", "shard")])
def test_tp2_greedy_tokens_equal_tp1(tmp_path, family, loaded):
    pytest.importorskip("accelerate", reason="transformers' tensor-parallel load needs accelerate")
    model = full_model(family)
    expected = {"serve": serve(model), "generate": generate(model)}
    checkpoint = ""
    if loaded == "from_pretrained":
        checkpoint = str(tmp_path / "checkpoint")
        model.save_pretrained(checkpoint)
    path = tmp_path / "tp2.pt"
    mp.spawn(rank_main, args=(2, str(tmp_path / "store"), checkpoint, str(path), family), nprocs=2, join=True)
    got = torch.load(path)
    assert sorted(got["serve"]) == sorted(expected["serve"]) == list(range(6))
    assert sum(len(t) for t in expected["serve"].values()) > 150
    tokens = {t for tokens in expected["serve"].values() for t in tokens}
    assert len(tokens) > 20, "the model repeats itself: a weak check"
    for req_id in expected["serve"]:
        assert got["serve"][req_id] == expected["serve"][req_id], f"request {req_id}"
    assert got["generate"] == expected["generate"]


def test_heads_per_rank_follows_the_plan_and_refuses_counts_that_do_not_divide():
    from transformers.distributed import DistributedConfig
    config = make_config("llama", **SHAPE)
    assert heads_per_rank(config, 8, 2) == (8, 2)  # no distributed config: the whole model
    config.distributed_config = DistributedConfig(tp_size=2)
    shape = attnops.hf.model_shape(config)
    assert (shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim) == (4, 1, 32)
    config.distributed_config = DistributedConfig(tp_size=2, tp_plan={})  # no rules: attention whole
    assert heads_per_rank(config, 8, 2) == (8, 2)
    config.distributed_config = DistributedConfig(tp_size=4)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        attnops.hf.model_shape(config)  # 2 KV heads over 4 ranks
    config.distributed_config = DistributedConfig(tp_size=2, tp_plan={"layers.*.self_attn.k_proj": "colwise_rep"})
    with pytest.raises(ValueError, match="colwise"):
        heads_per_rank(config, 8, 2)


def test_shard_refuses_counts_that_do_not_divide_and_models_it_cannot_split():
    with pytest.raises(ValueError, match="num_key_value_heads"):
        shard(full_model(), 0, 4)  # 2 KV heads over 4 ranks
    with pytest.raises(ValueError, match="num_attention_heads"):
        shard(full_model(), 0, 3)
    with pytest.raises(ValueError, match="rank"):
        shard(full_model(), 2, 2)
    with pytest.raises(ValueError, match="does not split the attention heads"):  # gpt-oss: experts, its plan
        shard(build(make_config("gpt-oss"), "eager"), 0, 2)                     # splits the embeddings only
    with pytest.raises(ValueError, match="no process group"):
        shard(full_model(), 0, 2)


def test_the_tp_demo_runs_under_torchrun():
    """The README's command, `torchrun --nproc-per-node 2 -m attnops.hf.tp_demo`, on the CPU: the tiny Llama
    sharded over 2 gloo ranks decodes and reports its tokens/s."""
    pytest.importorskip("accelerate", reason="transformers' tensor-parallel load needs accelerate")
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "attnops.hf.tp_demo", "--batch", "2", "--prompt-len", "8", "--steps", "4"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "TP=2 batch 2:" in done.stdout and "tokens/s" in done.stdout, done.stdout[-2000:]
