"""Models whose attention layers differ, through attn_implementation="attnops": Gemma-4 (transformers' gemma4_text:
sliding layers of head dim 256, full ones of 512 with fewer KV heads and values that are their keys' projection,
attention_k_eq_v) and Gemma-3n (gemma3n_text); in both the last num_kv_shared_layers layers compute no keys and read
those of the last earlier layer of their type. Tiny random models (fp32, CPU) against the same weights under
transformers' "eager": prefill and 32 decode steps of a left-padded batch within 1e-4 through a PagedCache, generate
token for token, and attnops' serving loop (serving_model, the Generator: continuous batching, prefix sharing,
compile) token for token with generate of each request alone.
"""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnops.hf  # noqa: E402
from attnops.serving.kv_cache import PagedKVCache  # noqa: E402
from attnops.testing import relative_error  # noqa: E402
from test_hf import cache_arg, check_serves_like, generate, left_padded, steps  # noqa: E402

SLIDING, FULL = 256, 512  # Gemma-4's head dims
# six layers: sliding, full, sliding, full (these two hold the keys the last two read), sliding, full (KV-shared)
LAYERS = dict(num_hidden_layers=6, layer_types=["sliding_attention", "full_attention"] * 3, num_kv_shared_layers=2)
COMMON = dict(vocab_size=256, vocab_size_per_layer_input=256, hidden_size=128, intermediate_size=256,
              num_attention_heads=4, num_key_value_heads=2, hidden_size_per_layer_input=16, sliding_window=8,
              max_position_embeddings=512, initializer_range=0.02, final_logit_softcapping=30.0, bos_token_id=None,
              eos_token_id=None, pad_token_id=0, **LAYERS)
CONFIGS = {
    "gemma4": ("gemma4_text", dict(head_dim=SLIDING, global_head_dim=FULL, num_global_key_value_heads=1,
                                   attention_k_eq_v=True)),
    "gemma3n": ("gemma3n_text", dict(head_dim=32, laurel_rank=8, altup_num_inputs=2,
                                     activation_sparsity_pattern=[0.0] * 6)),
}
PROMPTS = [list(range(40, 57)), [3, 17, 99, 5, 250, 7, 7, 8, 9, 10, 11], [200, 1, 2, 3, 4]]
_MODELS: dict = {}


def models(name):
    """(transformers' eager model, the same weights with attn_implementation="attnops"), built once."""
    model_type, fields = CONFIGS[name]
    if model_type not in transformers.CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type}")
    if name not in _MODELS:
        config = transformers.AutoConfig.for_model(model_type, **COMMON, **fields)
        torch.manual_seed(0)
        eager = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager")
        ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                             attn_implementation=attnops.hf.ATTN_IMPLEMENTATION)
        ours.load_state_dict(eager.state_dict())
        _MODELS[name] = eager.eval(), ours.eval()
    return _MODELS[name]


def test_the_shape_has_each_layers_heads_and_head_dim_and_the_shared_layers():
    _, ours = models("gemma4")
    shape = attnops.hf.model_shape(ours.config)
    assert shape.layer_head_dims == (SLIDING, FULL) * 3 and shape.layer_kv_heads == (2, 1) * 3
    assert shape.shared_layers == ((4, 2), (5, 3))  # the last sliding and full layers before the shared ones
    assert [ours.model.layers[i].self_attn.is_kv_shared_layer for i in range(6)] == [False] * 4 + [True] * 2
    kv = attnops.hf.paged_kv_cache(ours.config, num_pages=2, kv_format="fp32")
    assert [tuple(t.shape[-2:]) for t in kv.kv] == [(2, SLIDING), (1, FULL)] * 3
    assert kv.kv[4] is kv.kv[2] and kv.kv[5] is kv.kv[3]  # read, never written, by the shared layers


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_eager_prefill_and_32_decode_steps(name):
    eager, ours = models(name)
    ref_prefill, ref_steps, tokens = steps(eager, None, prompts=PROMPTS)
    prefill, decoded, _ = steps(ours, attnops.hf.PagedCache(ours.config, max_cache_len=64, kv_format="fp32"),
                                tokens, prompts=PROMPTS)
    valid = left_padded(PROMPTS)[1].bool()
    assert relative_error(prefill[valid], ref_prefill[valid]) < 1e-4
    assert relative_error(decoded, ref_steps) < 1e-4
    ids, mask = left_padded(PROMPTS)
    with torch.no_grad():  # no cache: each layer pages the keys it is given into a scratch cache
        plain = ours(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), use_cache=False)
    assert relative_error(plain.logits[valid], ref_prefill[valid]) < 1e-4


@pytest.mark.parametrize("name", list(CONFIGS))
def test_generate_matches_eager_greedy(name):
    eager, ours = models(name)
    ids, mask = left_padded(PROMPTS)
    with torch.no_grad():
        expected = eager.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
        out = ours.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, **{
            cache_arg(ours): attnops.hf.PagedCache(ours.config, max_cache_len=64, kv_format="fp32")})
    assert len(set(expected[:, ids.shape[1]:].flatten().tolist())) > 6, "the model repeats itself: a weak check"
    assert out.tolist() == expected.tolist()


SCHEDULE = [(0, PROMPTS[0], 16), (0, PROMPTS[2], 6), (2, PROMPTS[0][:16] + [1, 2], 8),
            (5, PROMPTS[0][:16] + [7, 7, 7], 6), (9, [9, 8, 7, 6, 5, 4, 3], 8)]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_generator_serves_it_like_generate_and_compiles_without_graph_break(name):
    eager, ours = models(name)
    check_serves_like(ours, {i: generate(eager, [prompt], n=n)[0] for i, (_, prompt, n) in enumerate(SCHEDULE)},
                      SCHEDULE)


def test_a_cache_without_the_shared_layers_is_an_error():
    _, ours = models("gemma4")
    shape = attnops.hf.model_shape(ours.config)
    kv = PagedKVCache(6, 4, 8, list(shape.layer_kv_heads), list(shape.layer_head_dims),
                                               kv_format="fp32")  # (no shared_layers)
    kv.allocate(0)
    with pytest.raises(ValueError, match="layer 4 reads an earlier layer's keys"):
        attnops.hf.serving_model(ours)(torch.tensor([1, 2]), torch.tensor([0, 1]), kv, kv.prepare([0], [2]))
