"""Tensor parallelism (attnops.hf.tp): a transformers decoder sharded over 2 ranks (gloo, on the CPU here; NCCL on
GPUs) and served through attnops.hf gives the same greedy tokens as 1 rank for 64 steps of continuous batching
(Llama; Qwen2, whose q/k/v have biases). Sharding keeps each rank's rows and columns, makes the config local, and
refuses counts that do not divide."""
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("transformers")

import attnops.hf  # noqa: E402
from attnops.hf.tp import RowParallelLinear, shard  # noqa: E402
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
def generate(model):
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
    return {r.req_id: r.output for r in list(gen.finished.values()) + list(gen.running.values())}


def rank_main(rank, world, store, path, family):
    # a file store, not a TCP port: no port to pick and lose to another process between picking and binding
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        model = shard(full_model(family), rank, world)
        assert model.config.num_key_value_heads == SHAPE["num_key_value_heads"] // world
        tokens = generate(model)
        if rank == 0:
            torch.save(tokens, path)
        dist.barrier()  # no rank tears the group down while another still has collectives in flight
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tp2_greedy_tokens_equal_tp1(tmp_path, family):
    expected = generate(full_model(family))
    path = tmp_path / "tp2.pt"
    mp.spawn(rank_main, args=(2, str(tmp_path / "store"), str(path), family), nprocs=2, join=True)
    got = torch.load(path)
    assert sorted(got) == sorted(expected) == list(range(6))
    assert sum(len(t) for t in expected.values()) > 150
    assert len({t for tokens in expected.values() for t in tokens}) > 20, "the model repeats itself: a weak check"
    for req_id in expected:
        assert got[req_id] == expected[req_id], f"request {req_id}"


def test_shard_splits_heads_mlp_and_biases_and_makes_the_config_local():
    full = full_model("qwen2")
    local = shard(full_model("qwen2"), 1, 2)
    attn, mlp = local.model.layers[0].self_attn, local.model.layers[0].mlp
    whole_attn, whole_mlp = full.model.layers[0].self_attn, full.model.layers[0].mlp
    assert attn.q_proj.weight.shape == (4 * 32, 256) and attn.k_proj.weight.shape == (1 * 32, 256)
    assert attn.q_proj.bias.shape == (4 * 32,) and attn.v_proj.bias.shape == (32,)
    assert isinstance(attn.o_proj, RowParallelLinear) and attn.o_proj.weight.shape == (256, 4 * 32)
    assert isinstance(mlp.down_proj, RowParallelLinear) and mlp.down_proj.weight.shape == (256, 256)
    assert mlp.gate_proj.weight.shape == mlp.up_proj.weight.shape == (256, 256)
    # rank 1's block: the second half of the rows (column parallel) and of the columns (row parallel)
    torch.testing.assert_close(attn.q_proj.weight, whole_attn.q_proj.weight[128:], rtol=0, atol=0)
    torch.testing.assert_close(attn.k_proj.bias, whole_attn.k_proj.bias[32:], rtol=0, atol=0)
    torch.testing.assert_close(attn.o_proj.weight, whole_attn.o_proj.weight[:, 128:], rtol=0, atol=0)
    torch.testing.assert_close(mlp.up_proj.weight, whole_mlp.up_proj.weight[256:], rtol=0, atol=0)
    torch.testing.assert_close(mlp.down_proj.weight, whole_mlp.down_proj.weight[:, 256:], rtol=0, atol=0)
    shape = attnops.hf.model_shape(local.config)  # what the serving kit and the KV cache read
    assert (shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim) == (4, 1, 32)
    assert local.config.intermediate_size == 256 and local.config.hidden_size == 256


def test_shard_refuses_counts_that_do_not_divide_and_models_it_cannot_split():
    with pytest.raises(ValueError, match="num_key_value_heads"):
        shard(full_model(), 0, 4)  # 2 KV heads over 4 ranks
    with pytest.raises(ValueError, match="intermediate_size"):
        shard(build(make_config("llama", **{**SHAPE, "intermediate_size": 257}), "eager"), 0, 2)
    with pytest.raises(ValueError, match="rank"):
        shard(full_model(), 2, 2)
    with pytest.raises(ValueError, match=r"mlp\.gate_proj"):  # gpt-oss: experts, not a dense MLP
        shard(build(make_config("gpt-oss"), "eager"), 0, 2)
    model = full_model()
    with pytest.raises(ValueError, match="num_attention_heads"):
        shard(model, 0, 3)
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (256, 256), "a refused shard changed the model"
