"""DeepSeek-V2/V3/V3.2 and GLM-5 latent attention (MLA) through attnops.hf.mla: enable_mla and LatentCache.

Tiny random DeepSeek models (fp32, CPU) against the same weights under transformers' "eager" (which up-projects
the latents into full keys and values): prefill logits within 1e-4, greedy generate of a left-padded batch token
for token; the latent cache holds R + P values a token, and only the valid tokens; bad inputs are errors that name
the argument. The tiny config uses YaRN RoPE with mscale_all_dim, so the softmax scale is not (qk_nope + rope)^-0.5:
a path that ignored the module's own `scaling` could not pass. DeepSeek-V3.2's indexer picks 8 keys a query of the
17- and 11-token prompts (mla_attention's sparse form): a path that attended every key could not pass either.
"""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnops.hf  # noqa: E402
from attnops import formats  # noqa: E402
import test_hf  # noqa: E402
from attnops.hf import families  # noqa: E402

R, P, NOPE, V_HEAD, HEADS = 64, 16, 32, 32, 4  # kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim
# wide init (0.2) for clear gaps between the top logits, so that greedy choices are the model's; no eos
TINY = dict(vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=HEADS, num_key_value_heads=HEADS, q_lora_rank=64, kv_lora_rank=R,
            qk_nope_head_dim=NOPE, qk_rope_head_dim=P, v_head_dim=V_HEAD, n_routed_experts=4, num_experts_per_tok=2,
            n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=512, initializer_range=0.2,
            bos_token_id=None, eos_token_id=None, pad_token_id=0,
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128,
                                 beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0))
VARIANTS = {
    "v3": ("deepseek_v3", dict(n_group=1, topk_group=1)),  # q_lora (q_a_proj, q_b_proj), interleaved RoPE
    "v3-q_proj-rotate_half": ("deepseek_v3", dict(n_group=1, topk_group=1, q_lora_rank=None, rope_interleave=False)),
    "v2": ("deepseek_v2", {}),  # RoPE as complex frequencies
}
SPARSE = dict(n_group=1, topk_group=1, index_topk=8, index_n_heads=16, index_head_dim=32)
if hasattr(transformers, "DeepseekV32Config"):  # an indexer picks 8 keys a query: the sparse form
    VARIANTS["v32"] = ("deepseek_v32", SPARSE)
if hasattr(transformers, "GlmMoeDsaConfig"):  # GLM-5: V3.2's, its second layer sharing the first's picks
    VARIANTS["glm5"] = ("glm_moe_dsa", dict(SPARSE, num_hidden_layers=3, indexer_types=["full", "shared", "full"]))
PROMPTS = [list(range(40, 57)), [3, 17, 99, 5, 250, 7, 7, 8, 9, 10, 11]]  # 17 and 11 tokens: left padding
NEW_TOKENS = 8
_MODELS: dict = {}


def config(variant="v3", **overrides):
    model_type, extra = VARIANTS[variant]
    return transformers.AutoConfig.for_model(model_type, **{**TINY, **extra, **overrides})


def build(cfg, implementation="eager", state=None):
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=implementation)
    if state is not None:
        model.load_state_dict(state)
    return model.eval().requires_grad_(False)


def models(variant="v3"):
    """(transformers' eager model, the same weights through enable_mla), built once."""
    if variant not in _MODELS:
        torch.manual_seed(0)
        eager = build(config(variant))
        _MODELS[variant] = eager, attnops.hf.enable_mla(build(config(variant), state=eager.state_dict()))
    return _MODELS[variant]


cache_arg = test_hf.cache_arg


def left_padded(prompts=PROMPTS):
    return test_hf.left_padded(prompts)


def latent_cache(model, **kwargs):
    return attnops.hf.LatentCache(model.config, **{"max_cache_len": 64, **kwargs})


def max_error(out, ref) -> float:
    """max |out - ref|, relative to the reference logits' scale (their largest magnitude)."""
    return ((out - ref).abs().max() / ref.abs().max()).item()


@torch.no_grad()
def prefill(model, cache="default"):
    """Logits of a plain forward of the left-padded prompts: with generate's positions, and with transformers'
    default cache (a DynamicCache), none (use_cache=False) or the cache given."""
    ids, mask = left_padded()
    options = dict(attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    if cache is None:
        options["use_cache"] = False
    elif cache != "default":
        options[cache_arg(model)] = cache
    return model(ids, **options).logits


def generate(model, cache=None, **options):
    ids, mask = left_padded()
    extra = {} if cache is None else {cache_arg(model): cache}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, **extra, **options)
    return out[:, ids.shape[1]:].tolist()


def test_the_scale_is_yarns_not_the_head_dims():
    """What makes the comparisons below check the scale: the module's own (with YaRN's mscale) is not the default."""
    eager, ours = models()
    attention = ours.model.layers[0].self_attn
    assert attention.scaling > 1.2 * (NOPE + P) ** -0.5
    assert ours.config._attn_implementation == attnops.hf.ATTN_IMPLEMENTATION


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_logits_match_eager(variant):
    eager, ours = models(variant)
    reference = prefill(eager)
    valid = left_padded()[1].bool()
    for name, cache in (("DynamicCache", "default"), ("no cache", None), ("LatentCache", latent_cache(ours))):
        logits = prefill(ours, cache)
        err = max_error(logits[valid], reference[valid])
        assert err < 1e-4, f"{variant}, {name}: max error {err:.2e} of the logits' scale"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_generate_matches_eager_greedy(variant):
    """A left-padded batch of two prompts of different lengths, 8 new tokens each: the latent cache's incremental
    decoding (one query a row, cu_seqlens_q None) and transformers' default cache give eager's tokens."""
    eager, ours = models(variant)
    expected = generate(eager)
    assert len({t for row in expected for t in row}) > NEW_TOKENS, "the model repeats itself: a weak check"
    assert generate(ours, latent_cache(ours)) == expected
    assert generate(ours) == expected


@pytest.mark.skipif("v32" not in VARIANTS, reason="this transformers has no DeepSeek-V3.2")
def test_the_indexer_decides_what_deepseek_v32_attends():
    """What makes the v32 comparisons above check the sparse form: with every key picked, eager's logits move by
    far more than the 1e-4 those allow; and the latent cache keeps the indexer's keys of every column."""
    eager, ours = models("v32")
    dense = build(config("v32", index_topk=1000), state=eager.state_dict())
    valid = left_padded()[1].bool()
    assert max_error(prefill(dense)[valid], prefill(eager)[valid]) > 1e-2
    cache = latent_cache(ours)
    prefill(ours, cache)
    columns = left_padded()[0].shape[1]
    assert sorted(cache._indexer_keys) == [0, 1]
    assert tuple(cache._indexer_keys[0].shape) == (2, columns, SPARSE["index_head_dim"])
    cache.reset()
    assert not cache._indexer_keys


def test_latent_cache_holds_r_plus_p_values_a_token_and_only_the_valid_ones():
    _, ours = models()
    cache = latent_cache(ours, max_cache_len=40, page_size=8)
    generate(ours, cache)
    layers, pages_per_row = ours.config.num_hidden_layers, 5  # 40 tokens / 8
    assert cache.pages.shape == (layers, len(PROMPTS) * pages_per_row, 8, R + P)
    # fp32: (R + P) values a token and layer, where decompressed keys and values take HEADS x (NOPE + P + V_HEAD)
    # (4x as many here; DeepSeek-V3: 71x)
    assert cache.pages.nbytes == layers * len(PROMPTS) * 40 * (R + P) * 4
    assert cache.get_seq_length() == max(map(len, PROMPTS)) + NEW_TOKENS - 1  # columns, padding included

    # the rows are the latents transformers' cache gets from the same forward code, the valid tokens only, in
    # order from each row's first page; nothing past them is written
    ids, mask = left_padded()
    dynamic = transformers.DynamicCache(config=ours.config)
    with torch.no_grad():
        ours(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
             **{cache_arg(ours): dynamic})
    for layer in range(layers):
        kv_c, k_pe = dynamic.layers[layer].keys[:, 0], dynamic.layers[layer].values[:, 0]  # [B, L, R], [B, L, P]
        for b, prompt in enumerate(PROMPTS):
            rows = cache.pages[layer, b * pages_per_row:(b + 1) * pages_per_row].flatten(0, 1)  # the row's slots
            valid = mask[b].bool()
            expected = torch.cat((kv_c[b, valid], k_pe[b, valid]), -1)
            torch.testing.assert_close(rows[:len(prompt)], expected, rtol=1e-5, atol=1e-5)
            assert rows[len(prompt) + NEW_TOKENS - 1:].eq(0).all(), "written past the row's valid tokens"
            assert rows[len(prompt):len(prompt) + NEW_TOKENS - 1].ne(0).any(-1).all(), "a decoded token missing"


class Fp8RoundedCache(transformers.DynamicCache):
    """transformers' cache holding the latents rounded to fp8 e4m3 as an fp8 latent cache stores them (value /
    scale, saturated at 448): what a model with an fp8 latent cache computes, in fp32."""

    scale = 0.5

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        def rounded(x):
            return (x / self.scale).clamp(-448, 448).to(torch.float8_e4m3fn).to(x.dtype) * self.scale
        return super().update(rounded(key_states), rounded(value_states), layer_idx, *args, **kwargs)


def test_fp8_latent_cache_is_the_format_and_nothing_more():
    """kv_format fp8_e4m3: one byte a value, and the logits of the same model over fp8-rounded latents."""
    _, ours = models()
    fp8 = latent_cache(ours, kv_format="fp8_e4m3", kv_scale=Fp8RoundedCache.scale)
    logits, reference = prefill(ours, fp8), prefill(ours, Fp8RoundedCache())
    assert fp8.pages.dtype == torch.float8_e4m3fn and fp8.pages.element_size() == 1
    valid = left_padded()[1].bool()
    assert max_error(logits[valid], reference[valid]) < 1e-4
    assert max_error(logits[valid], prefill(ours)[valid]) > 1e-3  # the rounding shows
    assert len(generate(ours, latent_cache(ours, kv_format="fp8_e4m3"))[0]) == NEW_TOKENS


def test_families_load_enables_mla():
    model = families.load("deepseek_v3", tiny=True, dtype=torch.float32)
    assert model.config._attn_implementation == attnops.hf.ATTN_IMPLEMENTATION
    assert len(generate(model, latent_cache(model))[0]) == NEW_TOKENS
    eager = families.load("deepseek_v3", tiny=True, dtype=torch.float32, attn_implementation="eager")
    assert eager.config._attn_implementation == "eager"
    real = families.family_config("deepseek_v3")  # DeepSeek-V3's attention
    assert (real.hidden_size, real.num_attention_heads, real.q_lora_rank, real.kv_lora_rank, real.qk_nope_head_dim,
            real.qk_rope_head_dim, real.v_head_dim) == (7168, 128, 1536, 512, 128, 64, 128)
    assert "deepseek_v3" not in families.FAMILIES  # the generic path's families: it cannot serve latent attention
    # a family's first layers only (the serving benchmark's model where the whole one would not fit)
    assert families.family_config("deepseek_v2", layers=3).num_hidden_layers == 3
    assert families.load("deepseek_v2", tiny=True, dtype=torch.float32, layers=1).config.num_hidden_layers == 1
    with pytest.raises(ValueError, match="layers must be a positive int"):
        families.family_config("deepseek_v2", layers=0)


def test_bad_inputs():
    eager, ours = models()
    with pytest.raises(TypeError, match="enable_mla: model must have latent-attention layers"):
        attnops.hf.enable_mla(build(transformers.AutoConfig.for_model(
            "llama", vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)))
    with pytest.raises(ValueError, match="kv_lora_rank must be a multiple of 64"):
        attnops.hf.enable_mla(build(config(kv_lora_rank=48)))
    with pytest.raises(ValueError, match="LatentCache: config must be a latent-attention"):
        attnops.hf.LatentCache(transformers.AutoConfig.for_model("llama"), max_cache_len=8)
    for kwargs, match in ((dict(max_cache_len=0), "max_cache_len"), (dict(page_size=3), "page_size"),
                          (dict(kv_format="nvfp4"), "kv_format"), (dict(kv_scale=2.0), "kv_scale"),
                          (dict(kv_format="fp8_e4m3", kv_scale=-1.0), "kv_scale")):
        with pytest.raises(ValueError, match=match):
            latent_cache(ours, **kwargs)

    with pytest.raises(ValueError, match="enable_mla"):  # a latent cache in transformers' own attention
        prefill(eager, latent_cache(eager))
    with pytest.raises(TypeError, match="cache must be an attnops.hf.LatentCache"):  # per-head pages
        prefill(ours, attnops.hf.PagedCache(ours.config, max_cache_len=64))
    with pytest.raises(ValueError, match="over max_cache_len=8"):
        prefill(ours, latent_cache(ours, max_cache_len=8))
    cache = latent_cache(ours)
    prefill(ours, cache)
    with pytest.raises(ValueError, match="reset"):  # one batch a cache
        ours(torch.tensor([[1, 2, 3]]), **{cache_arg(ours): cache})
    with pytest.raises(ValueError, match="attention_mask must be a padding mask"):
        ours(torch.tensor([[1, 2, 3]]), attention_mask=torch.ones(1, 1, 3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="beam search|not supported"):
        generate(ours, latent_cache(ours), num_beams=2)
    dropout = attnops.hf.enable_mla(build(config(attention_dropout=0.1))).train()
    with pytest.raises(ValueError, match="dropout must be 0"):
        dropout(torch.tensor([[1, 2, 3]]))


# (step at which a request is queued, prompt, max_new_tokens): the decode batch runs at 1 and 2 rows, requests wait,
class DsRoundedCache(transformers.DynamicCache):
    """transformers' cache holding the latents as DeepSeek's fp8 layout ("fp8_ds_mla") stores them: each 128 latent
    values rounded to e4m3 over their own scale, the rotary values to bf16 (attnops.formats)."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):  # (kv_c [B, 1, S, R], k_pe)
        latent, rope = key_states.shape[-1], value_states.shape[-1]
        rows = formats.dequantize_latent_fp8(formats.quantize_latent_fp8(key_states, value_states), latent, rope,
                                             key_states.dtype)
        return super().update(rows[..., :latent], rows[..., latent:], layer_idx, *args, **kwargs)


def test_deepseeks_fp8_layout_is_the_format_and_nothing_more():
    """kv_format fp8_ds_mla (DeepSeek's 656-byte rows at R 512; here R 128): LatentCache and the serving loop's
    LatentKVCache hold uint8 rows of R + 4 R/128 + 2 P bytes, and the logits and each request's tokens are those of
    the same model over latents rounded as the layout rounds them (and not fp32's)."""
    torch.manual_seed(1)
    cfg = config(kv_lora_rank=128)
    ours = attnops.hf.enable_mla(build(cfg))
    with pytest.raises(ValueError, match="multiple of 128"):
        latent_cache(models()[1], kv_format="fp8_ds_mla")
    with pytest.raises(ValueError, match="kv_scale"):
        latent_cache(ours, kv_format="fp8_ds_mla", kv_scale=0.5)
    cache = latent_cache(ours, kv_format="fp8_ds_mla")
    logits, reference = prefill(ours, cache), prefill(ours, DsRoundedCache())
    assert cache.pages.dtype == torch.uint8 and cache.pages.shape[-1] == 128 + 4 + 2 * P
    valid = left_padded()[1].bool()
    assert max_error(logits[valid], reference[valid]) < 1e-4
    assert max_error(logits[valid], prefill(ours)[valid]) > 1e-3  # the rounding shows
    kv = attnops.hf.paged_kv_cache(ours.config, num_pages=4, page_size=8, kv_format="fp8_ds_mla")
    assert kv.kv[0].dtype == torch.uint8 and kv.kv[0].shape == (4, 8, 128 + 4 + 2 * P)
    served = serve(ours, kv_format="fp8_ds_mla")
    assert served == {i: test_hf.generate(ours, [prompt], cache=DsRoundedCache(), n=n)[0]
                      for i, (_, prompt, n) in enumerate(SCHEDULE)}


# finish and free pages later ones reuse; requests 2 and 3 start with the two full pages (of 8) of request 0's prompt,
# which they share (the Generator's prefix sharing) and do not prefill
LONG = list(range(40, 60))
SCHEDULE = [(0, LONG, 12), (0, PROMPTS[1], 6), (2, LONG[:16] + [1, 2], 8), (5, LONG[:16] + [7, 7, 7], 6),
            (9, [9, 8, 7, 6, 5, 4, 3], 8)]


def serve(model, **options):
    """SCHEDULE through attnops' serving loop (serving_model, a LatentKVCache, the Generator): each request's
    tokens."""
    return test_hf.serve(model, schedule=SCHEDULE, **options)


@pytest.mark.parametrize("variant", [v for v in ("v3", "v2", "v32", "glm5") if v in VARIANTS])
def test_generator_serves_deepseek_like_generate_and_compiles_without_graph_break(variant):
    """DeepSeek (and GLM-5) through attnops.hf.serving_model and the Generator (continuous batching, prefix sharing,
    its latent pages a LatentKVCache; V3.2's and GLM-5's indexer keys on the same pages): each request's greedy
    tokens are transformers' eager generate's of it alone; the same under torch.compile(fullgraph=True), one graph
    per bucket."""
    eager, ours = models(variant)
    expected = {i: test_hf.generate(eager, [prompt], n=n)[0] for i, (_, prompt, n) in enumerate(SCHEDULE)}
    test_hf.check_serves_like(ours, expected, SCHEDULE)


@pytest.mark.skipif("v32" not in VARIANTS, reason="this transformers has no DeepSeek-V3.2")
def test_a_sparse_model_needs_the_indexers_keys_in_its_cache():
    from attnops.serving.kv_cache import LatentKVCache
    _, ours = models("v32")
    cache = attnops.hf.paged_kv_cache(ours.config, 16, page_size=4, kv_format="fp32")
    assert cache.index_dim == SPARSE["index_head_dim"]
    assert tuple(cache.index_keys[0].shape) == (16, 4, SPARSE["index_head_dim"])
    keys = torch.randn(4, SPARSE["index_head_dim"])
    cache.write_index_keys(0, keys, torch.tensor([5, -1, 64, 6]))  # padding and a slot past the cache: not written
    assert torch.equal(cache.index_keys[0].flatten(0, 1)[[5, 6]], keys[[0, 3]])
    assert cache.index_keys[0].flatten(0, 1).abs().sum(-1).count_nonzero() == 2
    from attnops.serving.generate import Generator
    bare = LatentKVCache(cache.num_layers, 16, 4, R, P, kv_format="fp32")
    gen = Generator(attnops.hf.serving_model(ours), bare, max_batch=2, max_seq_len=48)
    gen.add_request(0, [5, 6, 7], 2)
    gen.step()  # (a request whose step fails is taken out, with the reason)
    assert "ValueError" in gen.failed[0] and "needs a LatentKVCache with its indexer's keys" in gen.failed[0]


def test_latent_kv_cache_holds_one_latent_row_a_token_and_names_bad_arguments():
    """paged_kv_cache of a DeepSeek config is a LatentKVCache: R + P values a token and layer, fp8 at one byte with
    its kv_scale; the serving loop's tokens with an fp8 cache are those of transformers' eager model over the same
    fp8-rounded latents (and not fp32's); bad arguments are errors naming them."""
    from attnops.serving.kv_cache import LatentKVCache
    _, ours = models()
    kv = attnops.hf.paged_kv_cache(ours.config, num_pages=4, page_size=8, kv_format="fp8_e4m3", kv_scale=0.5)
    assert isinstance(kv, LatentKVCache)
    assert kv.kv[0].shape == (4, 8, R + P) and kv.kv[0].dtype == torch.float8_e4m3fn
    assert kv.attention_args(1)["kv_cache"] is kv.kv[1] and kv.attention_args(0)["kv_scale"].item() == 0.5
    assert attnops.hf.model_shape(ours.config).latent_dim == R
    fp8 = serve(ours, kv_format="fp8_e4m3", kv_scale=Fp8RoundedCache.scale)
    assert fp8 == {i: test_hf.generate(ours, [prompt], cache=Fp8RoundedCache(), n=n)[0]
                   for i, (_, prompt, n) in enumerate(SCHEDULE)}
    assert fp8 != serve(ours)  # the rounding shows
    for kwargs, error, match in ((dict(kv_format="nvfp4"), ValueError, "kv_format"),
                                 (dict(latent_dim=48), ValueError, "latent_dim must be a multiple of 64"),
                                 (dict(rope_dim=8), ValueError, "rope_dim"),
                                 (dict(page_size=3), ValueError, "page_size"),
                                 (dict(num_layers=1.0), TypeError, "num_layers")):
        args = {**dict(num_layers=1, num_pages=2, page_size=8, latent_dim=64, rope_dim=16), **kwargs}
        with pytest.raises(error, match=match):
            LatentKVCache(args.pop("num_layers"), args.pop("num_pages"), args.pop("page_size"),
                          args.pop("latent_dim"), args.pop("rope_dim"), **args)
    llama = transformers.AutoConfig.for_model("llama", vocab_size=64, hidden_size=64, intermediate_size=64,
                                              num_hidden_layers=1, num_attention_heads=2)
    per_head = attnops.hf.paged_kv_cache(llama, num_pages=2, kv_format="fp32")  # keys and values a head
    per_head.allocate(0)
    with pytest.raises(TypeError, match="attnops_meta needs attnops_cache, the LatentKVCache"):
        attnops.hf.serving_model(ours)(torch.tensor([1, 2]), torch.tensor([0, 1]), per_head,
                                       per_head.prepare([0], [2]))


def test_demo_serves_deepseek_compiled_and_eager_with_the_same_tokens(capsys):
    """python -m attnops demo --model deepseek_v3: the serving kit on a latent cache, compiled and eager (fp32 on the
    CPU: identical tokens), naming the latent ops' backends."""
    from attnops import cli
    cli.main(["demo", "--model", "deepseek_v3", "--modes", "compiled", "eager", "--batch", "2", "--prompt-len", "8",
              "--steps", "4", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "random tiny deepseek_v3" in out and "latent rows of 64 + 16 (MLA)" in out, out
    assert "backend: prefill -> cpu, decode -> cpu, cache write -> cpu" in out, out
    assert "compiled and eager generated identical tokens" in out, out


@pytest.mark.skipif("v32" not in VARIANTS, reason="this transformers has no DeepSeek-V3.2")
@pytest.mark.parametrize("kv_format", ["fp32", "fp8_ds_mla"])
def test_demo_serves_deepseek_v32_through_the_sparse_form(capsys, kv_format):
    """python -m attnops demo --model deepseek_v32: the sparse form's backend named (the C++ kernels on the CPU),
    over the model's own dtype and DeepSeek's fp8 layout."""
    from attnops import cli
    cli.main(["demo", "--model", "deepseek_v32", "--modes", "eager", "--batch", "2", "--prompt-len", "12",
              "--steps", "3", "--device", "cpu", "--kv-format", kv_format])
    out = capsys.readouterr().out
    assert "random tiny deepseek_v32" in out and "latent rows of 128 + 16 (MLA)" in out, out
    assert f"KV {kv_format}" in out, out
    assert "backend: prefill -> cpu, decode -> cpu, cache write -> cpu" in out, out


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [v for v in ("v3", "v32") if v in VARIANTS])
def test_bf16_on_cuda_close_to_eager(variant):
    """bf16 on a GPU (mla_attention's Triton kernels; V3.2: its sparse form): prefill logits as near float32
    eager's as bf16 eager's are, and greedy decoding near eager's. Dense layers only: a routed expert picked
    differently by a rounding flips a token's logits in either bf16 model."""
    torch.manual_seed(0)
    cfg = config(variant, initializer_range=0.02, first_k_dense_replace=TINY["num_hidden_layers"])
    exact = build(cfg).to("cuda")
    eager = build(cfg, state=exact.state_dict()).to("cuda", torch.bfloat16)
    ours = attnops.hf.enable_mla(build(cfg, state=exact.state_dict())).to("cuda", torch.bfloat16)
    ids, mask = (t.cuda() for t in left_padded())
    valid = mask.bool()
    with torch.no_grad():
        reference = exact(ids, attention_mask=mask).logits[valid]
        eager_error = max_error(eager(ids, attention_mask=mask).logits.float()[valid], reference)
        logits = ours(ids, attention_mask=mask, **{cache_arg(ours): latent_cache(ours)}).logits.float()
        expected = eager.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
        out = ours.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                            **{cache_arg(ours): latent_cache(ours)})
    assert max_error(logits[valid], reference) < max(2 * eager_error, 1e-2), eager_error
    assert (out == expected).float().mean() >= 0.9


@pytest.mark.gpu
def test_graph_replayed_generator_gives_the_compiled_tokens_on_gpu():
    """bf16 on a GPU, requests joining and leaving: the CUDA-graph-replayed compiled step of the serving loop (latent
    attention in captures nobody re-plans: Triton's kernels) gives the tokens of the compiled step it captured, and
    those are eager's at 90% of the positions or more."""
    torch.manual_seed(0)
    cfg = config(initializer_range=0.02, first_k_dense_replace=TINY["num_hidden_layers"])
    model = attnops.hf.enable_mla(build(cfg)).to("cuda", torch.bfloat16)
    runs = {}
    for name, compile, graphs in (("eager", False, False), ("compiled", True, False), ("graphs", True, True)):
        torch._dynamo.reset()
        runs[name] = serve(model, compile=compile, kv_format="bf16", cuda_graphs=graphs)
    assert runs["graphs"] == runs["compiled"]
    same = sum(a == b for i in runs["eager"] for a, b in zip(runs["eager"][i], runs["compiled"][i]))
    assert same >= 0.9 * sum(map(len, runs["eager"].values()))

