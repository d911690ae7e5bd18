"""Latent attention over DeepSeek's fp8 cache layout (kv_format "fp8_ds_mla"): a row of R e4m3 bytes, a float32
scale a 128 of them, and the rotary part in bf16 (656 bytes for R = 512, P = 64). The layout against a byte-level
reading of it, the write of every backend against attnops.formats' bit for bit, the attention of every backend that
serves it against the float64 reference on random ragged batches, the checks, dispatch, opcheck, compile, the
caches of attnops.serving and attnops.hf, and on the GPU the Triton kernel in bf16, captured and compiled.
(The random batches of tests/test_mla.py draw this format too.)"""
from __future__ import annotations

import random
import struct

import pytest
import torch

import attnops
from attnops import formats
from attnops.backends.reference import mla_attention_reference, mla_cache_write_reference
from attnops.testing import relative_error
from test_mla import (DS_LSE_ATOL, GPU, check_cpu, check_launch, check_reduce_overhead, check_user_graph_replays,
                      dense_mla, mla_inputs)

FMT = "fp8_ds_mla"


def test_the_layout_is_deepseeks_byte_for_byte():
    """Bytes [0, 512) the e4m3 values, [512, 528) four little-endian float32 scales (amax / 448 of their 128
    values), [528, 656) the rotary values as bf16; the values read back as stored x scale."""
    gen = torch.Generator().manual_seed(0)
    kv_c = torch.randn(3, 512, generator=gen) * torch.tensor([0.01, 1.0, 30.0, 0.0]).repeat_interleave(128)
    k_pe = torch.randn(3, 64, generator=gen)
    rows = formats.quantize_latent_fp8(kv_c, k_pe)
    assert rows.dtype == torch.uint8 and rows.shape == (3, 656) == (3, formats.latent_fp8_row_bytes(512, 64))
    for i in range(3):
        raw = bytes(rows[i].tolist())
        scales = struct.unpack("<4f", raw[512:528])
        for t in range(4):
            amax = kv_c[i, 128 * t:128 * (t + 1)].abs().max().item()
            assert scales[t] == pytest.approx(max(amax, 1e-4) / 448, rel=1e-6)
            stored = torch.frombuffer(bytearray(raw[128 * t:128 * (t + 1)]), dtype=torch.float8_e4m3fn).double()
            assert (stored.abs().max() <= 448).item()
            values = stored * scales[t]
            # e4m3 keeps 4 significant bits: each value within half a step of its own size
            assert torch.allclose(values, kv_c[i, 128 * t:128 * (t + 1)].double(), rtol=2 ** -4, atol=1e-12)
        rope = torch.frombuffer(bytearray(raw[528:656]), dtype=torch.bfloat16)
        assert torch.equal(rope, k_pe[i].to(torch.bfloat16))
    back = formats.dequantize_latent_fp8(rows, 512, 64, torch.float64)
    assert back.shape == (3, 576) and (back[:, 384:512] == 0).all()  # (an all-zero tile reads back 0)


def test_a_tile_with_nan_or_inf_reads_back_nan_and_only_that_tile():
    kv_c, k_pe = torch.randn(2, 256), torch.randn(2, 16)
    kv_c[0, 3], kv_c[1, 200] = float("nan"), float("inf")
    back = formats.dequantize_latent_fp8(formats.quantize_latent_fp8(kv_c, k_pe), 256, 16)
    assert back[0, :128].isnan().all() and not back[0, 128:].isnan().any()
    assert back[1, 128:256].isnan().all() and not back[1, :128].isnan().any()


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cache_write_is_formats_bit_for_bit(backend, dtype):
    """Every backend's mla_cache_write of fp8_ds_mla rows equals attnops.formats' quantization byte for byte
    (NaN, infinity, huge, tiny and zero tiles among them); padding and bad slots write nothing (a bad one is
    recorded); a strided cache is written in place."""
    if backend == "triton" and (dtype == torch.bfloat16 or GPU):
        pytest.skip("the interpreter's run (no bf16 there); the GPU's is test_gpu_cache_write_and_attention")
    gen = torch.Generator().manual_seed(1)
    kv_c, k_pe = torch.randn(9, 256, generator=gen) * 5, torch.randn(9, 32, generator=gen) * 5
    kv_c[0, 7], kv_c[1, 130], k_pe[2, 3] = float("nan"), float("inf"), float("nan")
    kv_c[3, :128] = 0.0
    kv_c[4, 128:] *= 1e-7
    k_pe[5] *= 1e30
    kv_c, k_pe = kv_c.to(dtype), k_pe.to(dtype)
    row = formats.latent_fp8_row_bytes(256, 32)
    slots = torch.tensor([0, 5, 9, 14, -1, 17, 99, 2, 3])
    attnops.take_errors()
    for cache in (torch.zeros(5, 4, row, dtype=torch.uint8), torch.zeros(10, 4, row, dtype=torch.uint8)[::2]):
        expected = torch.zeros(cache.shape, dtype=torch.uint8)
        mla_cache_write_reference(kv_c, k_pe, expected, slots, kv_format=FMT)
        with attnops.use_backend(backend):
            torch.ops.attnops.mla_cache_write(kv_c, k_pe, cache, slots, kv_format=FMT)
        assert attnops.take_errors() == {"slot_mapping": 6}
        assert torch.equal(cache, expected)
        keep = slots[(slots >= 0) & (slots < 20)]
        want = formats.quantize_latent_fp8(kv_c, k_pe)[(slots >= 0) & (slots < 20)]
        assert torch.equal(expected.flatten(0, 1)[keep], want)
        assert expected.flatten(0, 1)[[1, 4]].eq(0).all()  # slots no token names stay untouched


CASES = [  # kv_lens, q_lens, heads, latent, rope, page_size
    ([5, 0, 40, 17], None, 16, 128, 16, 4),
    ([33, 1, 70], None, 3, 256, 32, 16),
    ([9, 30, 3], [3, 5, 3], 20, 384, 48, 8),
    ([2, 9], [5, 3], 8, 128, 64, 1),  # more queries than keys: the first rows see nothing
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_reference_matches_an_independent_dense_computation(case):
    kv_lens, q_lens, heads, latent, rope, page = CASES[case]
    args = mla_inputs(kv_lens, q_lens, heads=heads, latent=latent, rope=rope, page_size=page, dtype=torch.float32,
                      kv_format=FMT, seed=case)
    sinks = torch.randn(heads)
    got = mla_attention_reference(**args, sinks=sinks)
    values = formats.dequantize_latent_fp8(args["kv_cache"], latent, rope, torch.float64)
    dense = dense_mla(**{**args, "kv_cache": values, "kv_format": "auto"}, sinks=sinks)
    assert relative_error(got, dense) < 1e-6


def random_batch(rng: random.Random, cpu: bool, dtypes=(torch.float32, torch.float16)) -> tuple[dict, torch.dtype]:
    """A random ragged batch over an fp8_ds_mla cache (cpu: up to 128 heads and R 512) in one of `dtypes` (cpu: bf16
    too)."""
    batch = rng.randint(1, 4)
    decode = rng.random() < 0.4
    kv_lens = [rng.choice([0, 1, rng.randint(2, 90)]) for _ in range(batch)]
    q_lens = None if decode else [rng.randint(0, min(n, 6)) if n else rng.randint(0, 2) for n in kv_lens]
    heads = rng.choice([1, 4, 16, 20] + [128] * cpu)
    latent = rng.choice([128, 256] + [512] * cpu)
    dtype = rng.choice(list(dtypes) + [torch.bfloat16] * cpu)
    args = mla_inputs(kv_lens, q_lens, heads=heads, latent=latent, rope=rng.choice([16, 64]),
                      page_size=rng.choice([1, 4, 16]), dtype=dtype, kv_format=FMT, seed=rng.randrange(1 << 30))
    if rng.random() < 0.4:
        args["sinks"] = torch.randn(heads) * 2
    if q_lens is not None and sum(q_lens) and rng.random() < 0.5:
        args["tree_mask"] = torch.rand(sum(q_lens), max(q_lens) + 1) < 0.5
    return args, dtype


@pytest.mark.parametrize("seed", range(3))
def test_cpu_matches_the_float64_reference_on_random_batches(seed):
    rng = random.Random(seed)
    for i in range(8):
        args, dtype = random_batch(rng, cpu=True)
        check_cpu(args, f"case {i}: {dtype}")


@pytest.mark.skipif(GPU, reason="the interpreter's run; the GPU's is test_gpu_triton_matches_the_reference")
@pytest.mark.parametrize("seed", range(2))
def test_triton_matches_the_reference_in_the_interpreter(seed):
    rng = random.Random(100 + seed)
    for _ in range(5):
        args, dtype = random_batch(rng, cpu=False)
        check_launch(args, dict(config=rng.choice([None, dict(CHUNK=16, BLOCK_N=16)])), "cpu", dtype,
                     DS_LSE_ATOL[dtype])


@pytest.mark.skipif(GPU, reason="the interpreter's run; the GPU's is test_gpu_triton_matches_the_reference")
@pytest.mark.parametrize("latent", [384, 512])
def test_triton_wide_latents_in_the_interpreter(latent):
    """R 384 (a tile of 512 columns, the last 128 past R: no scale of theirs read) and 512, beside the random
    batches' 128 and 256."""
    for dtype in (torch.float16, torch.float32):
        args = mla_inputs([70, 1, 33], [1, 1, 3], heads=16, latent=latent, rope=16, page_size=16, dtype=dtype,
                          kv_format=FMT, seed=latent)
        check_launch(args, dict(config=dict(CHUNK=32, BLOCK_N=16)), "cpu", dtype, DS_LSE_ATOL[dtype])


@pytest.mark.parametrize("backend", ["cpu", "triton", "reference"])
def test_the_sparse_form_reads_the_layout_too(backend):
    """topk_indices over an fp8_ds_mla cache: listing every key is the dense form."""
    if backend == "triton" and GPU:
        pytest.skip("the interpreter's run")
    args = mla_inputs([37, 12], [3, 2], heads=4, latent=128, rope=16, page_size=4, dtype=torch.float16,
                      kv_format=FMT, seed=5)
    rows = [36 - 2, 35, 36, 10, 11]  # each query row's position
    listed = torch.tensor([[p for p in range(40) if p <= r] + [-1] * (40 - r - 1) for r in rows], dtype=torch.int32)
    with attnops.use_backend(backend):
        sparse = torch.ops.attnops.mla_attention(**args, topk_indices=listed)
    dense = mla_attention_reference(**args)
    assert relative_error(sparse, dense) < 2e-3


BAD = {
    "float cache": (TypeError, "uint8", lambda a: dict(a, kv_cache=a["kv_cache"].float())),
    "row width": (ValueError, "R + 4 R/128 + 2 P", lambda a: dict(a, kv_cache=a["kv_cache"][..., :-2])),
    "R not a multiple of 128": (ValueError, "multiple of 128", lambda a: dict(
        a, q_nope=torch.randn(5, 4, 192).half(), kv_cache=torch.zeros(9, 4, 192 + 6 + 32, dtype=torch.uint8))),
    "a scale": (ValueError, "kv_scale", lambda a: dict(a, kv_scale=torch.ones(1))),
    "rows off 4-byte boundaries": (ValueError, "4-byte", lambda a: dict(
        a, kv_cache=torch.zeros(9 * 4 * 164 + 1, dtype=torch.uint8)[1:].view(9, 4, 164))),
    "auto on a uint8 cache": (TypeError, "fp8_ds_mla", lambda a: dict(a, kv_format="auto")),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_input_is_named_before_any_kernel_runs(name):
    error, words, change = BAD[name]
    args = change(mla_inputs([10, 7], [3, 2], heads=4, latent=128, rope=16, kv_format=FMT))
    for mode in ("eager", "fake"):
        with pytest.raises(error, match="kv_cache|kv_scale|R "):
            if mode == "eager":
                torch.ops.attnops.mla_attention(**args)
            else:
                from torch._subclasses.fake_tensor import FakeTensorMode
                with FakeTensorMode(allow_non_fake_inputs=True):
                    torch.ops.attnops.mla_attention(**args)
        with pytest.raises(error, match=words.replace("+", r"\+")):
            torch.ops.attnops.mla_attention(**args)


def test_dispatch_names_who_serves_it():
    """On the CPU the C++ kernels; on a GPU cuda and Triton at any head count (which of cuda's forms:
    tests/test_cuda_mla.py), flashinfer declining it by name, and the measured rule gives an order."""
    from attnops.backends import BACKENDS
    from attnops.cases import MLACase
    from attnops.dispatch import policy, reasons_against
    args = mla_inputs([10, 7], None, heads=4, latent=128, rope=16, kv_format=FMT)
    assert attnops.explain(**args).chosen == "cpu"
    case = MLACase(device_type="cuda", arch=(9, 0), q_dtype=torch.bfloat16, kv_format=FMT, latent_dim=512,
                   rope_dim=64, num_heads=16, page_size=64, decode=True)
    assert "triton" in policy(case)
    assert any(FMT in r for r in reasons_against(BACKENDS["flashinfer"], case))
    wide = MLACase(**{**case.__dict__, "num_heads": 128})
    for name in ("cuda", "triton"):
        assert not any(FMT in r for c in (case, wide) for r in reasons_against(BACKENDS[name], c)), name


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_opcheck(backend):
    args = mla_inputs([10, 7], [3, 2], heads=4, latent=128, rope=16, kv_format=FMT)
    pos = (args["q_nope"], args["q_pe"], args["kv_cache"], args["block_table"], args["seq_lens"])
    kwargs = dict(cu_seqlens_q=args["cu_seqlens_q"], scale=args["scale"], kv_format=FMT)
    with attnops.use_backend(backend):
        torch.library.opcheck(torch.ops.attnops.mla_attention.default, pos, kwargs)
        torch.library.opcheck(torch.ops.attnops.mla_attention_with_lse.default, pos, kwargs)
        cache = torch.zeros(4, 4, formats.latent_fp8_row_bytes(128, 16), dtype=torch.uint8)
        torch.library.opcheck(torch.ops.attnops.mla_cache_write.default,
                              (torch.randn(3, 128), torch.randn(3, 16), cache, torch.tensor([0, 5, -1])),
                              dict(kv_format=FMT))


def test_compiles_fullgraph():
    args = mla_inputs([10, 7], None, heads=4, latent=128, rope=16, kv_format=FMT)
    torch._dynamo.reset()

    def step(q_nope, q_pe, kv_cache, block_table, seq_lens, kv_c, k_pe, slots):
        torch.ops.attnops.mla_cache_write(kv_c, k_pe, kv_cache, slots, kv_format=FMT)
        return torch.ops.attnops.mla_attention(q_nope, q_pe, kv_cache, block_table, seq_lens, scale=0.13,
                                               kv_format=FMT) * 2

    new = (torch.randn(2, 128).half(), torch.randn(2, 16).half(), torch.tensor([0, 1]))
    expected_cache = args["kv_cache"].clone()
    mla_cache_write_reference(*new[:2], expected_cache, new[2], kv_format=FMT)
    got = torch.compile(step, fullgraph=True)(args["q_nope"], args["q_pe"], args["kv_cache"], args["block_table"],
                                              args["seq_lens"], *new)
    assert torch.equal(args["kv_cache"], expected_cache)
    assert relative_error(got, 2 * mla_attention_reference(**args)) < 2e-3


def test_latent_kv_cache_keeps_the_layout():
    """attnops.serving's LatentKVCache in fp8_ds_mla: uint8 rows of the layout's width, the ops' arguments name it,
    and the write and attention through them are the reference's."""
    from attnops.serving.kv_cache import LatentKVCache
    with pytest.raises(ValueError, match="multiple of 128"):
        LatentKVCache(1, 4, 4, 64, 16, kv_format=FMT)
    cache = LatentKVCache(2, 6, 4, 256, 32, kv_format=FMT, index_dim=16)
    assert cache.kv[1].dtype == torch.uint8 and cache.kv[1].shape == (6, 4, 256 + 8 + 64)
    assert cache.index_keys[0].dtype == torch.bfloat16
    args = cache.attention_args(1)
    assert args["kv_format"] == FMT and "kv_scale" not in args
    kv_c, k_pe = torch.randn(5, 256), torch.randn(5, 32)
    slots = torch.tensor([0, 1, 2, 7, 8])
    torch.ops.attnops.mla_cache_write(kv_c, k_pe, slot_mapping=slots, **cache.write_args(1))
    assert torch.equal(cache.kv[1].flatten(0, 1)[slots], formats.quantize_latent_fp8(kv_c, k_pe))


@pytest.mark.gpu
def test_gpu_triton_matches_the_reference():
    rng = random.Random(7)
    for _ in range(12):
        args, dtype = random_batch(rng, cpu=False, dtypes=(torch.bfloat16, torch.float16))  # (fp32: tf32 products)
        args = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
        check_launch(args, dict(config=rng.choice([None, dict(CHUNK=64, BLOCK_N=32)])), "cuda", dtype,
                     DS_LSE_ATOL[dtype])
    for heads in (16, 128):  # DeepSeek's shapes, bf16, through the op
        args = mla_inputs([3000, 17, 1200], None, heads=heads, latent=512, rope=64, page_size=64,
                          dtype=torch.bfloat16, kv_format=FMT, device="cuda", seed=heads)
        with attnops.use_backend("triton"):
            got = torch.ops.attnops.mla_attention(**args)
        assert relative_error(got, mla_attention_reference(**args)) < 1e-2, heads


@pytest.mark.gpu
def test_gpu_triton_on_random_batches_with_its_plan_and_forced_splits():
    rng = random.Random(9)
    for _ in range(6):
        args, dtype = random_batch(rng, cpu=False, dtypes=(torch.bfloat16, torch.float16))
        args = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
        check_launch(args, dict(config=rng.choice([None, dict(CHUNK=64, BLOCK_N=32)])), "cuda", dtype,
                     DS_LSE_ATOL[dtype])


@pytest.mark.gpu
def test_gpu_cache_write_and_attention():
    gen = torch.Generator().manual_seed(3)
    kv_c, k_pe = torch.randn(64, 512, generator=gen) * 4, torch.randn(64, 64, generator=gen)
    kv_c[0, 0], kv_c[1, 300] = float("nan"), float("inf")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        cache = torch.zeros(8, 16, 656, dtype=torch.uint8, device="cuda")
        slots = torch.randperm(128, generator=gen)[:64]
        slots[5] = -1
        with attnops.use_backend("triton"):
            torch.ops.attnops.mla_cache_write(kv_c.to(dtype).cuda(), k_pe.to(dtype).cuda(), cache, slots.cuda(),
                                              kv_format=FMT)
        expected = torch.zeros(8, 16, 656, dtype=torch.uint8)
        mla_cache_write_reference(kv_c.to(dtype), k_pe.to(dtype), expected, slots, kv_format=FMT)
        assert torch.equal(cache.cpu(), expected), dtype


@pytest.mark.gpu
def test_gpu_a_user_cuda_graph_replays_new_lengths_and_tables():
    check_user_graph_replays("triton", mla_inputs([300, 40, 1000], None, heads=16, latent=512, rope=64, page_size=16,
                                                  dtype=torch.bfloat16, kv_format=FMT, device="cuda"))


@pytest.mark.gpu
def test_gpu_compiled_with_cuda_graphs():
    check_reduce_overhead("triton", mla_inputs([300, 40], [3, 2], heads=16, latent=512, rope=64, page_size=16,
                                               dtype=torch.bfloat16, kv_format=FMT, device="cuda"))
