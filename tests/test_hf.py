"""transformers models through attnops (attnops.hf): attn_implementation="attnops", PagedCache, serving_model.

For tiny random configs of each family (fp32, CPU), against the same weights under transformers' "eager":
- a prefill and 32 decode steps of a left-padded batch: logits within 1e-4 relative, with the KV in a PagedCache
  and with none (a plain forward of the whole sequence);
- model.generate, unchanged, greedy and sampled, with a PagedCache: identical tokens;
- fp8 KV: the greedy token at each position (teacher-forced) that of the fp32 run on at least 90% of positions;
- attnops.serving.generate.Generator serving the model through serving_model (continuous batching, requests joining
  and leaving): each request's tokens are generate's for its prompt alone; the compiled decode step has no graph
  break (fullgraph=True), one graph per batch bucket.
Each family's special attention feature (sliding windows, soft cap, query_pre_attn_scalar, sinks) is checked to
change eager's logits, so that a function ignoring it could not pass.
"""
import copy
import inspect
import json
import sys

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing

transformers = pytest.importorskip("transformers")
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface  # noqa: E402

import attnops.hf  # noqa: E402
from attnops.serving.generate import Generator  # noqa: E402
from attnops.testing import relative_error  # noqa: E402
from conftest import HF_FAMILIES, build, make_config  # noqa: E402

FAMILIES = HF_FAMILIES  # the tiny config of each family: conftest.py
# what each family's eager logits must depend on: config changes that switch a feature off (or, for sinks, sinks
# of -inf)
FEATURES = {
    "qwen2": {"sliding window": dict(use_sliding_window=False, sliding_window=None)},
    "mistral": {"sliding window": dict(sliding_window=None)},
    "gemma2": {"sliding window": dict(sliding_window=4096), "soft cap": dict(attn_logit_softcapping=None),
               "query_pre_attn_scalar": dict(query_pre_attn_scalar=32)},
    "gpt-oss": {"sliding window": dict(sliding_window=4096), "sinks": "no sinks"},
    "phi3": {"sliding window": dict(sliding_window=None)},
}
# fp8 KV against fp32: weights at transformers' default init scale (0.02). At 0.2 a model this small and random
# is chaotic: fp8's rounding (2^-4 relative) moves its logits by 13%, and its top-2 gaps are 8% (median).
FP8_INIT = 0.02
PROMPTS = [list(range(40, 57)), [3, 17, 99, 5, 250, 7, 7, 8, 9, 10, 11], [200, 1, 2, 3, 4]]  # 17, 11, 5 tokens
STEPS = 32
_MODELS: dict = {}


def models(family, init=None):
    """(transformers' eager model, the same weights with attn_implementation="attnops"), built once."""
    key = family, init
    if key not in _MODELS:
        overrides = {} if init is None else dict(initializer_range=init)
        torch.manual_seed(0)
        eager = build(make_config(family, **overrides), "eager")
        _MODELS[key] = eager, build(make_config(family, **overrides), attnops.hf.ATTN_IMPLEMENTATION,
                                    eager.state_dict())
    return _MODELS[key]


def cache_arg(model):
    """The cache's keyword: transformers 5.2x renamed past_key_values to cache (the old name warns)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def left_padded(prompts):
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def paged(model, kv_format="fp32", max_cache_len=64):
    return attnops.hf.PagedCache(model.config, max_cache_len=max_cache_len, kv_format=kv_format)


@torch.no_grad()
def steps(model, cache, tokens=None, prompts=PROMPTS, n=STEPS):
    """A prefill of the left-padded prompts, then n decode steps, driven as generate drives the model (positions
    from the mask). Feeds `tokens` [B, n] if given, else its own greedy choices. Returns (prefill logits [B, S, V],
    each step's last-position logits [B, n + 1, V], the tokens fed [B, n])."""
    ids, mask = (t.to(model.device) for t in left_padded(prompts))
    arg = cache_arg(model)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(ids, attention_mask=mask, position_ids=positions, use_cache=True,
                **({} if cache is None else {arg: cache}))
    prefill, last, fed = out.logits, [out.logits[:, -1]], []
    for i in range(n):
        token = tokens[:, i] if tokens is not None else last[-1].argmax(-1)
        fed.append(token)
        mask = torch.cat((mask, torch.ones_like(mask[:, :1])), 1)
        positions = positions[:, -1:] + 1
        out = model(token[:, None], attention_mask=mask, position_ids=positions, use_cache=True,
                    **{arg: getattr(out, arg)})
        last.append(out.logits[:, -1])
    return prefill, torch.stack(last, 1), torch.stack(fed, 1)


def agreement(run, reference) -> float:
    """The share of positions (each valid prompt position, each decode step) where two runs of `steps` over the
    same tokens choose the same greedy token."""
    mask = left_padded(PROMPTS)[1].to(run[0].device)
    same = torch.cat(((run[0].argmax(-1) == reference[0].argmax(-1))[mask.bool()],
                      (run[1][:, 1:].argmax(-1) == reference[1][:, 1:].argmax(-1)).flatten()))
    return same.float().mean().item()


def generate(model, prompts=PROMPTS, cache=None, n=STEPS, **options):
    ids, mask = (t.to(model.device) for t in left_padded(prompts))
    extra = {} if cache is None else {cache_arg(model): cache}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, **extra, **options)
    return out[:, ids.shape[1]:].tolist()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_eager_prefill_and_32_decode_steps(family):
    eager, ours = models(family)
    ref_prefill, ref_steps, tokens = steps(eager, None)
    assert len(set(tokens.flatten().tolist())) > 10, "the model repeats itself: a weak check"
    _, mask = left_padded(PROMPTS)
    for name, cache in (("PagedCache", paged(ours)), ("no cache", None)):
        prefill, decoded, _ = steps(ours, cache, tokens)
        for b in range(len(PROMPTS)):
            valid = mask[b].bool()
            err = relative_error(prefill[b, valid], ref_prefill[b, valid])
            assert err < 1e-4, f"{name}: prefill of row {b}: relative error {err:.2e}"
            for i in range(STEPS + 1):
                err = relative_error(decoded[b, i], ref_steps[b, i])
                assert err < 1e-4, f"{name}: row {b}, step {i}: relative error {err:.2e}"
        assert torch.equal(decoded[:, :-1].argmax(-1), tokens), f"{name}: greedy choices differ from eager's"


@pytest.mark.parametrize("family", [f for f in FAMILIES if f in FEATURES])
def test_the_family_features_change_eager_logits(family):
    """The comparison above would catch an attention function that ignored a window, a cap or the scaling."""
    eager, _ = models(family)
    _, reference, tokens = steps(eager, None, n=12)
    for feature, off in FEATURES[family].items():
        state = eager.state_dict()
        if off == "no sinks":  # a sink of -inf takes no share of the softmax
            state = {k: torch.full_like(v, -torch.inf) if k.endswith(".sinks") else v for k, v in state.items()}
            off = {}
        without = build(make_config(family, **off), "eager", state)
        _, logits, _ = steps(without, None, tokens, n=12)
        assert relative_error(logits, reference) > 1e-2, f"{family}: {feature} does not change the logits"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_generate_unchanged_greedy_and_sampled(family):
    eager, ours = models(family)
    assert generate(ours, cache=paged(ours)) == generate(eager)
    sampled = {}
    for name, model, cache in (("eager", eager, None), ("attnops", ours, paged(ours))):
        torch.manual_seed(7)
        sampled[name] = generate(model, cache=cache, do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    assert sampled["attnops"] == sampled["eager"]


def eager_with_fp8_kv(module, query, key, value, attention_mask, **kwargs):
    """transformers' own eager attention of the module's family over keys and values rounded to fp8 e4m3 (scale
    1): what a model with an fp8 KV cache computes, in transformers' code."""
    eager = sys.modules[type(module).__module__].eager_attention_forward
    return eager(module, query, key.to(torch.float8_e4m3fn).to(key.dtype), value.to(torch.float8_e4m3fn).to(key.dtype),
                 attention_mask, **kwargs)


transformers.AttentionInterface.register("eager_fp8_kv", eager_with_fp8_kv)
AttentionMaskInterface.register("eager_fp8_kv", ALL_MASK_ATTENTION_FUNCTIONS["eager"])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fp8_kv_is_the_format_and_nothing_more(family):
    """attnops with an fp8 KV cache computes what transformers' eager attention computes over the same fp8-rounded
    keys and values: logits within 1e-4 over a prefill and 32 decode steps."""
    eager, ours = models(family, FP8_INIT)
    fp8_eager = build(make_config(family, initializer_range=FP8_INIT), "eager_fp8_kv", eager.state_dict())
    ref_prefill, ref_steps, tokens = steps(fp8_eager, None)
    prefill, decoded, _ = steps(ours, paged(ours, "fp8_e4m3"), tokens)
    _, mask = left_padded(PROMPTS)
    valid = mask.bool()
    assert relative_error(prefill[valid], ref_prefill[valid]) < 1e-4
    assert relative_error(decoded, ref_steps) < 1e-4


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fp8_kv_tokens_match_fp32_on_90_percent_of_positions(family):
    """Teacher-forced with the fp32 run's tokens, so that each position (every prompt position and 32 decode
    steps) is compared on the same history."""
    _, ours = models(family, FP8_INIT)
    reference = steps(ours, paged(ours))
    agree = agreement(steps(ours, paged(ours, "fp8_e4m3"), reference[2]), reference)
    assert agree >= 0.9, f"fp8 KV agrees with fp32 on {agree:.0%} of the positions"
    assert len(generate(ours, cache=paged(ours, "fp8_e4m3"))[0]) == STEPS


# the least share of positions whose greedy token a KV format keeps (teacher-forced, against fp32 KV)
FORMAT_AGREEMENT = {"bf16": 0.95, "fp16": 0.95, "fp8_e5m2": 0.8, "nvfp4": 0.7, "mxfp4": 0.7}


@pytest.mark.parametrize("kv_format", list(FORMAT_AGREEMENT))
def test_every_kv_format_serves_generate(kv_format):
    """Every other attnops KV format through generate and teacher-forced steps (Llama): the model stays on track
    (a broken format's tokens would be near random)."""
    _, ours = models("llama", FP8_INIT)
    reference = steps(ours, paged(ours), n=8)
    cache = paged(ours, kv_format)
    agree = agreement(steps(ours, cache, reference[2], n=8), reference)
    assert cache.kv.kv_format == kv_format
    assert agree >= FORMAT_AGREEMENT[kv_format], f"{kv_format} keeps {agree:.0%} of the greedy tokens"
    assert len(generate(ours, cache=paged(ours, kv_format), n=4)[0]) == 4


# (step at which a request is queued, prompt, max_new_tokens): with max_batch 2 the decode batch runs at 1 and 2
# rows, requests wait, finish and free pages that later ones reuse; requests 2 and 3 start with the two full pages
# (of 8) of the running request 0's prompt, which they share (the Generator's prefix sharing) and do not prefill
SCHEDULE = [(0, PROMPTS[0], 24), (0, PROMPTS[2], 6), (2, PROMPTS[0][:16] + [1, 2], 10),
            (5, PROMPTS[0][:16] + [7, 7, 7], 6), (9, [9, 8, 7, 6, 5, 4, 3], 10)]


@torch.no_grad()
def serve(model, compile=False, schedule=SCHEDULE, buckets=None, kv_format="fp32", cuda_graphs=False, stats=None,
          **cache_options):
    """`schedule` through attnops' serving loop (serving_model, the cache paged_kv_cache makes for the model, the
    Generator): each request's tokens."""
    kv = attnops.hf.paged_kv_cache(model.config, num_pages=16, page_size=8, kv_format=kv_format,
                                   device=model.device, **cache_options)
    gen = Generator(attnops.hf.serving_model(model), kv, max_batch=2, max_seq_len=48, compile=compile,
                    buckets=buckets, cuda_graphs=cuda_graphs)
    step = 0
    while step == 0 or gen.has_work():
        for i, (at, prompt, n) in enumerate(schedule):
            if at == step:
                gen.add_request(i, prompt, n)
        gen.step()
        step += 1
    if stats is not None:
        stats.update(gen.stats)
    return {i: gen.finished[i].output for i in range(len(schedule))}


def check_serves_like(model, expected: dict, schedule=SCHEDULE) -> None:
    """The serving loop gives `expected` (each request's tokens) for `schedule`, whose requests reuse two pages of
    another's prompt twice, eager and compiled (DecodeStep compiles with fullgraph=True: a graph break is an error),
    one graph per bucket used (1 and 2)."""
    stats = {}
    assert serve(model, schedule=schedule, stats=stats) == expected
    assert stats["prefix_tokens_reused"] == 32, stats  # two requests, two pages each
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    assert serve(model, schedule=schedule, compile={"backend": counter}) == expected
    assert counter.frame_count == 2, f"one graph per bucket used (1 and 2), got {counter.frame_count}"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_generator_serves_the_model_like_generate_and_compiles_without_graph_break(family):
    eager, ours = models(family)
    check_serves_like(ours, {i: generate(eager, [prompt], n=n)[0] for i, (_, prompt, n) in enumerate(SCHEDULE)})


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt-oss"])
def test_cascade_steps_serve_the_model_like_generate(family, monkeypatch):
    """Decode steps whose batch shares the first two pages read them once (cascade_attention, its threshold
    lowered to these tiny models): transformers' generate's tokens still; layers with a sliding window (Gemma-2,
    gpt-oss) read whole sequences, sinks (gpt-oss) join once."""
    import attnops.cascade
    monkeypatch.setattr(attnops.cascade, "CASCADE_MIN_SAVED_TOKENS", 1)
    eager, ours = models(family)
    expected = {i: generate(eager, [prompt], n=n)[0] for i, (_, prompt, n) in enumerate(SCHEDULE)}
    stats = {}
    assert serve(ours, stats=stats) == expected
    assert stats["cascade_steps"] > 0, stats


def test_inductor_compiled_decode_step_gives_eager_tokens():
    """Inductor's code for a transformers model's decode step (Gemma-2: windows and caps) gives eager's tokens
    (one bucket: one compilation)."""
    _, ours = models("gemma2")
    schedule = SCHEDULE[:2]
    expected = serve(ours, schedule=schedule, buckets=(2,))
    torch._dynamo.reset()
    assert serve(ours, compile=True, schedule=schedule, buckets=(2,)) == expected


# GPU: head_dim 64, which every GPU backend serves (FlashInfer builds 64/128/256)
GPU = dict(hidden_size=256, head_dim=64)


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(FAMILIES))
@torch.no_grad()
def test_bf16_on_gpu_logits_as_close_as_transformers_own(family):
    """bf16 weights and KV in a PagedCache on a GPU: logits (teacher-forced, a prefill and 32 decode steps) as close
    to the float32 model as transformers' own eager attention in bf16 is (bf16 rounding, not attnops, sets the
    error)."""
    torch.manual_seed(0)
    config = make_config(family, **GPU)
    reference = build(config, "eager").cuda()
    _, expected, tokens = steps(reference, None)
    theirs = build(config, "eager", reference.state_dict()).to("cuda", torch.bfloat16)
    ours = build(config, attnops.hf.ATTN_IMPLEMENTATION, reference.state_dict()).to("cuda", torch.bfloat16)
    hf_err = relative_error(steps(theirs, None, tokens)[1].float(), expected)
    err = relative_error(steps(ours, paged(ours, "bf16"), tokens)[1].float(), expected)
    assert err < max(2e-2, 2 * hf_err), (err, hf_err)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt-oss"])
@torch.no_grad()
def test_graph_replayed_generator_gives_the_compiled_tokens_on_gpu(family):
    """bf16, requests joining and leaving: the CUDA-graph-replayed compiled step (one graph per bucket) gives the
    tokens of the compiled step it captured."""
    torch.manual_seed(0)
    model = build(make_config(family, **GPU), attnops.hf.ATTN_IMPLEMENTATION).to("cuda", torch.bfloat16)
    runs = {}
    for name, graphs in (("compiled", False), ("graphs", True)):
        torch._dynamo.reset()
        runs[name] = serve(model, compile=True, kv_format="bf16", cuda_graphs=graphs)
    assert runs["graphs"] == runs["compiled"]


def test_errors_name_the_argument():
    eager, ours = models("llama")
    with pytest.raises(ValueError, match="attn_implementation='attnops'"):
        generate(eager, cache=paged(eager), n=2)
    with pytest.raises(ValueError, match="attn_implementation"):
        attnops.hf.serving_model(eager)
    with pytest.raises(ValueError, match="max_cache_len=20"):
        generate(ours, cache=paged(ours, max_cache_len=20), n=8)
    with pytest.raises(ValueError, match="kv_format"):
        paged(ours, "int8")
    with pytest.raises(ValueError, match="max_cache_len"):
        attnops.hf.PagedCache(ours.config, max_cache_len=0)
    cache = paged(ours)
    generate(ours, cache=cache, n=2)
    with pytest.raises(ValueError, match="reset"):
        generate(ours, [PROMPTS[0]], cache=cache, n=2)
    cache.reset()
    assert generate(ours, [PROMPTS[0]], cache=cache, n=4) == generate(eager, [PROMPTS[0]], n=4)
    bad = copy.deepcopy(ours.config)
    bad.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ValueError, match="layer_types"):
        attnops.hf.model_shape(bad)


def test_demo_serves_a_family(capsys):
    from attnops import cli
    cli.main(["demo", "--model", "qwen3", "--batch", "2", "--prompt-len", "8", "--steps", "4", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "random tiny qwen3 (transformers' modeling code)" in out and "tokens/s" in out, out
    with pytest.raises(SystemExit, match="--model: .*must be a family"):
        cli.main(["demo", "--model", "qwen9"])


def test_demo_serves_a_checkpoint_compiled_and_eager_with_the_same_tokens(capsys, tmp_path):
    """--checkpoint DIR is --model DIR; two modes print their agreement (fp32 on the CPU: identical tokens)."""
    from attnops import cli
    eager, _ = models("llama")
    eager.save_pretrained(tmp_path)
    cli.main(["demo", "--checkpoint", str(tmp_path), "--modes", "compiled", "eager", "--batch", "2", "--prompt-len",
              "8", "--steps", "4", "--device", "cpu"])
    out = capsys.readouterr().out
    assert f"{tmp_path} (transformers' modeling code), 2 layers, hidden 128, heads 4/2, head_dim 32" in out, out
    assert "compiled and eager generated identical tokens" in out, out
    with pytest.raises(SystemExit, match="give one"):
        cli.main(["demo", "--checkpoint", str(tmp_path), "--model", "llama"])
    with pytest.raises(SystemExit, match="--checkpoint: .*no such directory"):
        cli.main(["demo", "--checkpoint", str(tmp_path / "missing")])


def test_serve_bench_small_serves_a_family_and_its_transformers_baseline(tmp_path):
    """Gemma-2 at a context past its (tiny) sliding window: attnops' eager step through transformers' modeling
    code, and transformers' own static-cache path (sliding layers included)."""
    from attnops.bench import serve as serve_bench
    result = serve_bench.main(["--small", "--family", "gemma2", "--modes", "eager", "transformers", "--batches", "2",
                               "--contexts", "40", "--steps", "2", "--warmup", "1", "--json", str(tmp_path / "s.json"),
                               "--plot", str(tmp_path / "s.png")])
    rows = [(r["family"], r["model_code"], r["mode"], r["error"]) for r in result["records"]]
    assert rows == [("gemma2", "transformers", "eager", None), ("gemma2", "transformers", "transformers", None)], rows
    assert all(r["tokens_per_s"] > 0 for r in result["records"])
    assert json.loads((tmp_path / "s.json").read_text())["records"] == result["records"]
    assert (tmp_path / "s.png").stat().st_size > 1000


def test_serve_bench_profile_splits_a_step_by_kind_of_kernel():
    """--profile's breakdown: each kernel counted once, in the first category its name matches (kernel names as
    the H200 run shows them: attnops' Triton and FlashInfer kernels, cuBLAS/nvjet matmuls, torch.compile's fused
    kernels, copies), and the wall time no kernel covered as GPU idle, per step."""
    from attnops.bench.serve import kernel_category, step_breakdown
    names = {"paged_attention_kernel": "attention", "merge_splits_kernel": "attention",
             "void flashinfer::BatchDecodeWithPagedKVCacheKernel<...>": "attention",
             "pytorch_flash::flash_fwd_splitkv_kernel<...>": "attention",
             "reshape_and_cache_kernel": "KV cache write",
             "nvjet_tst_128x64_64x8_2x1_v_bz_TNT": "matmul", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n": "matmul",
             "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>": "matmul",
             "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0": "other kernels",
             "Memcpy HtoD (Pinned -> Device)": "copies"}
    for name, category in names.items():
        assert kernel_category(name) == category, name
    kernels = [("paged_attention_kernel", 30.0), ("nvjet_tst_128x64", 100.0), ("nvjet_tst_128x64", 50.0),
               ("triton_poi_fused_add_0", 10.0)] * 2  # two steps
    breakdown = step_breakdown(kernels, steps=2, wall_us=500.0)
    assert list(breakdown) == ["matmul", "attention", "other kernels", "GPU idle"]
    assert breakdown == pytest.approx({"matmul": 0.15, "attention": 0.03, "other kernels": 0.01, "GPU idle": 0.06})


@pytest.mark.gpu
def test_serve_bench_profile_on_gpu(tmp_path):
    """--profile on the GPU: every measured point has its breakdown, whose parts add up to about its step time.
    Page size 1 leaves no slack in attnops' cache: it must have room for the profiled steps too, as transformers'
    static cache must."""
    from attnops.bench import serve as serve_bench
    result = serve_bench.main(["--small", "--device", "cuda", "--family", "llama", "--modes", "compiled+graphs",
                               "transformers", "--batches", "2", "--contexts", "64", "--steps", "4", "--warmup", "2",
                               "--page-size", "1", "--profile", "--json", str(tmp_path / "s.json")])
    for r in result["records"]:
        assert r["error"] is None and r["profile_ms"], r
        step_ms = sum(r["profile_ms"].values())
        assert 0.3 * r["batch"] / r["tokens_per_s"] * 1e3 < step_ms < 3 * r["batch"] / r["tokens_per_s"] * 1e3, r
        assert r["mode"] == "transformers" or r["profile_ms"].get("attention", 0) > 0, r


def test_serve_bench_measures_transformers_continuous_batching_and_compares_with_the_faster_baseline():
    """transformers-cb: transformers' own continuous batching (generate_batch) on the same weights, timed over the
    steps every request decoded together; the summary compares attnops with the faster of transformers' paths."""
    from attnops.bench import serve as serve_bench
    result = serve_bench.main(["--small", "--family", "llama", "--modes", "transformers-cb", "--batches", "2",
                               "--contexts", "40", "--steps", "3", "--warmup", "1"])
    (row,) = result["records"]
    if row["error"] and "available memory 0" in row["error"]:  # transformers 5.17 sizes the cache from GPU memory
        pytest.skip(f"this transformers' continuous batching does not run on the CPU: {row['error']}")
    assert row["mode"] == "transformers-cb" and row["error"] is None and row["tokens_per_s"] > 0, row
    assert serve_bench.label(row) == "transformers (continuous batching)"
    point = dict(family="llama", batch=2, context=40, kv_format="bf16")
    records = [dict(point, model_code="transformers", mode="compiled+graphs", tokens_per_s=300.0),
               dict(point, model_code="transformers", mode="transformers", tokens_per_s=100.0),
               dict(point, model_code="transformers", mode="transformers-cb", tokens_per_s=150.0)]
    (line,) = serve_bench.summary(records)
    assert line["vs_transformers"] == pytest.approx(2.0)
