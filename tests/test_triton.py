"""The Triton backend against the float64 reference.

CPU (CI): every kernel under TRITON_INTERPRET=1 (tests/conftest.py sets it when there is no GPU) on small random
ragged cases: decode, verify, prefill and extend; fp16/fp32 q; fp16/fp32/fp8 (per tensor, per head)/nvfp4/mxfp4
caches; windows, soft cap, GQA/MQA, page sizes 1/16/64, lengths 0 and 1; reshape_and_cache bit-exact for every
format. Quantized caches are compared with the reference fed the same stored cache, so the test checks the
kernel, not the format. Outputs are poisoned (NaN) before each run.

GPU (marked gpu): the same plus bf16, 300+ seeded random cases per kernel, a decode on a
cache of more than 2^31 elements, CUDA-graph capture and replay with new lengths, and the memory test (the extra
device memory of a call does not depend on the cache size).
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import random
import warnings

import pytest
import torch
import triton
import triton.language as tl

import attnops
from attnops import formats
from attnops.backends import BACKENDS
from attnops.backends.reference import paged_attention_reference, reshape_and_cache_reference
from attnops.backends.triton.common import FMT_CODE, WAVE_PROGRAM_KEYS, wave_chunk
from attnops.backends.triton.kernel import TL_DTYPE as _TL_DTYPE, _dequant_fp4, _fp4_scale, fp4_fold
from attnops.testing import extra_call_memory, random_paged_inputs, relative_error

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.skipif(not CUDA and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="no GPU and not under the Triton interpreter")
# fp32 q: the kernel uses input_precision="ieee" for fp32 dots (no tf32), so 1e-5 holds on the GPU too.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def run_triton_attention(args, **options):
    """The op, pinned to the Triton backend, with a poisoned out= buffer; returns the output."""
    out = torch.full_like(args["q"], float("nan"))
    with attnops.use_backend("triton"):
        attnops.paged_attention(**args, **options, out=out)
    return out


@pytest.fixture
def full_tiles_32_bit(monkeypatch):
    """FULL_TILES and OFFSETS_32 forced on through ATTNOPS_TRITON_TUNABLES (the heuristic's only for the GPU's
    16-token verify tile): tiles that end by their split's last key loaded without masks, element offsets in int32
    where the caches allow; with several splits a sequence."""
    from attnops.backends.triton.heuristics import forced_tunables
    monkeypatch.setenv("ATTNOPS_TRITON_TUNABLES", "FULL_TILES=1, OFFSETS_32=1, MAX_SPLITS=3, CHUNK=96")
    forced_tunables.cache_clear()
    yield
    monkeypatch.undo()
    forced_tunables.cache_clear()


def check_attention(args, tolerance=None, **options):
    out = run_triton_attention(args, **options)
    ref = paged_attention_reference(**args, **options, compute_dtype=torch.float64)
    assert not out.isnan().any(), "NaN in the output"
    tolerance = tolerance or TOLERANCE[args["q"].dtype]
    err = relative_error(out, ref)
    assert err < tolerance, f"relative error {err:.3g} >= {tolerance}"
    # rows of empty sequences (and of sequences whose rows see nothing) are exactly 0
    if args["cu_seqlens_q"] is None:
        empty = args["seq_lens"] == 0
        assert (out[empty] == 0).all()
    return err


# ----------------------------------------------------------------------------------------------------------------
# CPU (interpreter) and GPU: small cases

F32, F16 = torch.float32, torch.float16
# (name, random_paged_inputs arguments, options). Small on purpose: each runs in the interpreter on CI's 2 cores.
# Lengths up to ~300 with the interpreter's CHUNK of 128 keys make several splits, so the merge kernel runs too.
CASES = [
    ("decode-fp32-page16-gqa2", dict(kv_lens=[37, 0, 300, 1], page_size=16), {}),
    ("decode-fp32-page1-mqa", dict(kv_lens=[9, 1, 0, 70], page_size=1, num_q_heads=4, num_kv_heads=1), {}),
    ("decode-fp16-page64-mha", dict(kv_lens=[130, 2, 64], page_size=64, num_q_heads=2, num_kv_heads=2,
                                    kv_format="fp16", q_dtype=F16), {}),
    ("decode-fp16-group3-d32", dict(kv_lens=[50, 200], head_dim=32, num_q_heads=6, num_kv_heads=2,
                                    kv_format="fp16", q_dtype=F16), {}),
    ("decode-fp32-window-softcap", dict(kv_lens=[300, 5, 0, 129], page_size=16),
     dict(window_left=40, soft_cap=4.0, scale=0.3)),
    ("decode-fp32-window0", dict(kv_lens=[70, 1], page_size=1), dict(window_left=0)),
    ("decode-fp8e4m3-per-tensor-fp32q", dict(kv_lens=[260, 0, 3], kv_format="fp8_e4m3"), {}),
    ("decode-fp8e4m3-per-head-fp16q", dict(kv_lens=[100, 33], kv_format="fp8_e4m3", scale_kind="per_head",
                                           q_dtype=F16, page_size=64), {}),
    ("decode-fp8e5m2-per-head-window", dict(kv_lens=[180, 1], kv_format="fp8_e5m2", scale_kind="per_head"),
     dict(window_left=25)),
    ("decode-nvfp4-fp32q", dict(kv_lens=[140, 0, 17], kv_format="nvfp4"), {}),
    ("decode-mxfp4-fp16q-page1", dict(kv_lens=[40, 3], kv_format="mxfp4", q_dtype=F16, page_size=1), {}),
    ("decode-nvfp4-softcap-mqa", dict(kv_lens=[90, 200], kv_format="nvfp4", num_q_heads=4, num_kv_heads=1,
                                      q_dtype=F16), dict(soft_cap=3.0)),
    ("verify4-fp32-gqa2", dict(kv_lens=[64, 150, 4], q_lens=[4, 4, 4]), {}),
    ("verify-mixed-fp16-page1", dict(kv_lens=[20, 9, 0], q_lens=[3, 9, 0], page_size=1, kv_format="fp16",
                                     q_dtype=F16), {}),
    ("verify-fp8-per-head", dict(kv_lens=[70, 200], q_lens=[8, 2], kv_format="fp8_e4m3",
                                 scale_kind="per_head"), {}),
    ("prefill-fp32", dict(kv_lens=[45, 1, 0, 80], q_lens=[45, 1, 0, 80]), {}),
    ("prefill-fp16-window-softcap", dict(kv_lens=[90, 33], q_lens=[90, 33], kv_format="fp16", q_dtype=F16),
     dict(window_left=10, soft_cap=5.0)),
    ("extend-fp32-page64", dict(kv_lens=[200, 70], q_lens=[30, 1], page_size=64), {}),
    ("extend-mxfp4-mqa", dict(kv_lens=[60, 130], q_lens=[7, 20], kv_format="mxfp4", num_q_heads=4,
                              num_kv_heads=1), dict(window_left=50)),
    ("extend-nvfp4-fp16q", dict(kv_lens=[50, 64], q_lens=[12, 5], kv_format="nvfp4", q_dtype=F16), {}),
    ("extend-fp8e5m2-per-tensor", dict(kv_lens=[100, 40], q_lens=[16, 40], kv_format="fp8_e5m2"), {}),
]


@pytest.mark.parametrize("forced", [False, True], ids=["heuristic", "full-tiles-32-bit"])
@pytest.mark.parametrize("name,inputs,options", CASES, ids=[c[0] for c in CASES])
def test_attention_small(name, inputs, options, forced, request):
    """Also with FULL_TILES and OFFSETS_32 forced on (the full_tiles_32_bit fixture: several splits a sequence,
    each with full tiles, the last of a sequence partial)."""
    if forced:
        request.getfixturevalue("full_tiles_32_bit")
    args = random_paged_inputs(**inputs, device=DEVICE, seed=len(name))
    check_attention(args, **options)


@pytest.mark.parametrize("max_splits,chunk", [(1, 1000), (3, 64), (8, 100)])
def test_attention_split_counts(max_splits, chunk):
    """The direct-write path (one split, CHUNK not a BLOCK_N multiple as when it is the table's capacity), a split
    count that does not divide the ranges evenly, and a CHUNK that leaves trailing splits empty."""
    from attnops.backends.triton.launch import launch
    args = random_paged_inputs([300, 0, 77, 1], device=DEVICE, seed=11)
    out = torch.full_like(args["q"], float("nan"))
    launch(args["q"], args["k_cache"], args["v_cache"], args["block_table"], args["seq_lens"], None,
           scale=0.125, soft_cap=0.0, window_left=-1, kv_format="fp32", k_scale=None, v_scale=None, out=out,
           config=dict(MAX_SPLITS=max_splits, CHUNK=chunk, BLOCK_N=32))
    ref = paged_attention_reference(**args, scale=0.125)
    assert relative_error(out, ref) < 1e-5


@pytest.mark.parametrize("heads_inner", [True, False])
@pytest.mark.parametrize("q_lens", [None, [5, 0, 17, 1]], ids=["decode", "extend"])
def test_grid_orders(q_lens, heads_inner):
    """Both grid orders (KV heads fastest along axis 0, or on axis 1) give every (query block, head, split) its
    program: GQA, ragged lengths with an empty sequence, several splits."""
    from attnops.backends.triton.launch import launch
    args = random_paged_inputs([300, 0, 77, 130], q_lens, num_q_heads=12, num_kv_heads=3, device=DEVICE, seed=5)
    out = torch.full_like(args["q"], float("nan"))
    launch(args["q"], args["k_cache"], args["v_cache"], args["block_table"], args["seq_lens"], args["cu_seqlens_q"],
           scale=0.125, soft_cap=0.0, window_left=-1, kv_format="fp32", k_scale=None, v_scale=None, out=out,
           config=dict(HEADS_INNER=heads_inner, MAX_SPLITS=4, CHUNK=64, BLOCK_N=32))
    ref = paged_attention_reference(**args, scale=0.125)
    assert relative_error(out, ref) < 1e-5


MERGE_CASES = [("fp32", None, {}), ("nvfp4", None, dict(window_left=90)), ("fp16", [5, 0, 17, 1], {}),
               ("mxfp4", [3, 0, 9, 2], dict(soft_cap=4.0))]


@pytest.mark.parametrize("kv_format,q_lens,options", MERGE_CASES,
                         ids=[f"{c[0]}-{'extend' if c[1] else 'decode'}" for c in MERGE_CASES])
def test_splits_merged_by_lse(kv_format, q_lens, options):
    """Five splits a block merged by the merge kernel: ragged lengths with an empty sequence, a window that leaves
    whole splits with no key (LSE -inf), 4-bit tiles (partials written as even/odd columns)."""
    from attnops.backends.triton import launch as tlaunch
    q_dtype = F32 if kv_format in ("fp32", "mxfp4") else F16
    args = random_paged_inputs([300, 0, 77, 130], q_lens, num_q_heads=12, num_kv_heads=3, kv_format=kv_format,
                               q_dtype=q_dtype, device=DEVICE, seed=9)
    out = torch.full_like(args["q"], float("nan"))
    tlaunch.launch(args["q"], args["k_cache"], args["v_cache"], args["block_table"], args["seq_lens"],
                  args["cu_seqlens_q"], scale=0.125, soft_cap=options.get("soft_cap", 0.0),
                  window_left=options.get("window_left", -1), kv_format=kv_format, k_scale=args.get("k_scale"),
                  v_scale=args.get("v_scale"), out=out, config=dict(MAX_SPLITS=5, CHUNK=64, BLOCK_N=32))
    ref = paged_attention_reference(**args, scale=0.125, **options, compute_dtype=torch.float64)
    assert not out.isnan().any(), "a row no program wrote"
    assert relative_error(out, ref) < TOLERANCE[q_dtype]


def test_merge_over_several_split_tiles():
    """More splits than the merge kernel reads at once (4096 // D = 16 at D=256): its loop over tiles of splits,
    the last one partial, with a window that empties the first splits (LSE -inf)."""
    from attnops.backends.triton import launch as tlaunch
    args = random_paged_inputs([700, 0, 650], num_q_heads=2, num_kv_heads=1, head_dim=256, kv_format="fp32",
                               device=DEVICE, seed=4)
    for window_left in (-1, 200):
        out = torch.full_like(args["q"], float("nan"))
        tlaunch.launch(args["q"], args["k_cache"], args["v_cache"], args["block_table"], args["seq_lens"], None,
                      scale=0.0625, soft_cap=0.0, window_left=window_left, kv_format="fp32", k_scale=None,
                      v_scale=None, out=out, config=dict(MAX_SPLITS=21, CHUNK=32, BLOCK_N=32))
        ref = paged_attention_reference(**args, scale=0.0625, window_left=window_left, compute_dtype=torch.float64)
        assert relative_error(out, ref) < 1e-5, window_left


@triton.jit
def _wave_chunk_of(seq_lens_ptr, out_ptr, num_seqs, capacity, wave_splits, LOG_MIN_CHUNK: tl.constexpr):
    tl.store(out_ptr, wave_chunk(seq_lens_ptr, num_seqs, capacity, wave_splits, LOG_MIN_CHUNK, WAVE_PROGRAM_KEYS))


def wave_chunk_expected(lens, capacity, wave_splits, min_chunk):
    """common.wave_chunk's choice, written out (its estimate times wave_splits, in integers as the kernel's): of
    min_chunk << 0..15, the first of least estimated keys a program reads."""
    lens = [n if 0 <= n <= capacity else 0 for n in lens]
    chunks = [min_chunk << k for k in range(16)]
    past_longest = min(c for c in chunks if c >= max(lens))  # (the first candidate no sequence is longer than)
    best = None
    for chunk in chunks:
        splits = sum(-(-n // chunk) for n in lens)
        last = min(chunk, past_longest) * wave_splits
        keys = (last if splits <= wave_splits else sum(lens) + last) + int(WAVE_PROGRAM_KEYS) * splits
        if best is None or keys < best[0]:
            best = keys, chunk
    return best[1]


WAVE_CASES = {  # (lengths, capacity, splits a wave holds) -> expected keys a split
    "uniform 32 x 8192, 8 KV heads on 132 SMs: one split each": ([8192] * 32, 8192, 3 * 132 // 8, 8192),
    "31 x 512 + 8192: the long one cut in 512s": ([512] * 31 + [8192], 8192, 3 * 132 // 8, 512),
    "128 x 4096: two waves of halves": ([4096] * 128, 4096, 3 * 132 // 8, 2048),
    "bad lengths count as none": ([-5, 10 ** 6, 8192, 0], 8192, 4, 2048),
    "no keys at all": ([0, 0], 8192, 4, 512),
}


@pytest.mark.parametrize("case", WAVE_CASES)
def test_wave_chunk(case):
    """The device's split size from the call's lengths (WAVE_PLAN) against the same rule in Python: the H100's
    cases, bad lengths, and random batches longer than its loop's block of 64 sequences."""
    lens, capacity, wave_splits, expected = WAVE_CASES[case]
    assert wave_chunk_expected(lens, capacity, wave_splits, 512) == expected
    cases = [(lens, capacity, wave_splits)]
    rng = random.Random(len(case))
    for _ in range(3):
        batch = rng.choice([1, 63, 64, 65, 150])
        cases.append(([rng.randint(-2, 9000) for _ in range(batch)], 8192, rng.randint(1, 400)))
    for lens, capacity, wave_splits in cases:
        got = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        _wave_chunk_of[(1,)](torch.tensor(lens, dtype=torch.int32, device=DEVICE), got, len(lens), capacity,
                             wave_splits, LOG_MIN_CHUNK=9)
        assert got.item() == wave_chunk_expected(lens, capacity, wave_splits, 512), (lens, wave_splits)


WAVE_PLAN_CASES = [("fp32", [300, 0, 77, 130], {}), ("fp16", [1000, 3, 3, 3, 3, 3], dict(window_left=200)),
                   ("fp8_e4m3", [257, 0, 640], dict(sinks=True)), ("nvfp4", [450, 90], dict(lse=True))]


@pytest.mark.parametrize("kv_format,kv_lens,options", WAVE_PLAN_CASES, ids=[c[0] for c in WAVE_PLAN_CASES])
def test_wave_plan_against_the_reference(kv_format, kv_lens, options):
    """Decode with the split size chosen on the device from the lengths (WAVE_PLAN forced; off by default): ragged
    batches with an empty sequence, a long one among short ones (cut into more splits than the shapes' plan
    gives), a window, sinks, each row's LSE from the merge kernel; every format's tiles."""
    from attnops.backends.triton import launch as tlaunch
    q_dtype = F32 if kv_format == "fp32" else F16
    args = random_paged_inputs(kv_lens, num_q_heads=6, num_kv_heads=3, kv_format=kv_format, q_dtype=q_dtype,
                               device=DEVICE, seed=len(kv_lens))
    sinks = torch.randn(6, device=DEVICE) if options.get("sinks") else None
    lse = torch.full((len(kv_lens), 6), float("nan"), device=DEVICE) if options.get("lse") else None
    out = torch.full_like(args["q"], float("nan"))
    window_left = options.get("window_left", -1)
    tlaunch.launch(args["q"], args["k_cache"], args["v_cache"], args["block_table"], args["seq_lens"], None,
                   scale=0.125, soft_cap=0.0, window_left=window_left, kv_format=kv_format,
                   k_scale=args.get("k_scale"), v_scale=args.get("v_scale"), out=out, lse=lse, sinks=sinks,
                   config=dict(WAVE_PLAN=3))
    ref, ref_lse = paged_attention_reference(**args, scale=0.125, window_left=window_left, sinks=sinks,
                                             return_lse=True, compute_dtype=torch.float64)
    assert not out.isnan().any(), "a row no program wrote"
    assert relative_error(out, ref) < TOLERANCE[q_dtype]
    if lse is not None:
        assert torch.allclose(lse.double(), ref_lse, atol=1e-3)


def test_wave_plan_applies_to_decode_outside_batch_invariant_mode_only():
    """WAVE_PLAN's chunk depends on the other sequences' lengths: verify and prefill keep the shapes' plan, and so does
    batch-invariant mode (where a row's splits must not depend on its batch); where it applies, MAX_SPLITS covers
    the table in the shortest splits it may choose."""
    from attnops.backends.triton.heuristics import wave_plan
    from attnops.cases import AttentionCase
    case = AttentionCase(device_type="cpu", arch=None, q_dtype=F16, kv_format="fp16", head_dim=64, page_size=16,
                         num_q_heads=8, num_kv_heads=2, decode=True, soft_cap=False, sliding_window=False,
                         scale_kind="none", batch=4, max_kv_len=4096)
    cfg = dict(WAVE_PLAN=3, MAX_SPLITS=2, CHUNK=2048, BLOCK_N=128)
    assert wave_plan(cfg, case, 4, on_gpu=True)["MAX_SPLITS"] == 4096 // 512
    assert wave_plan(cfg, case, 4, on_gpu=False)["MAX_SPLITS"] == 4096 // 256
    assert wave_plan(dict(cfg, WAVE_PLAN=0), case, 4, on_gpu=True)["MAX_SPLITS"] == 2
    verify = dataclasses.replace(case, decode=False, shape_class="verify", q_per_seq=4)
    assert wave_plan(cfg, verify, 16, on_gpu=True)["WAVE_PLAN"] == 0
    with attnops.batch_invariant():
        assert wave_plan(cfg, case, 4, on_gpu=True) == dict(cfg, WAVE_PLAN=0)


def test_fill_waves_plans_two_full_waves_where_one_would_overrun(monkeypatch):
    """FILL_WAVES: where a decode plan's programs overrun one wave of the chip (3 programs an SM) by at most half a
    wave, splits short enough to fill two; elsewhere, and for tiles, formats and modes it was not made for, the
    plan as it was. Shapes only: the same for any lengths. On by default for fp8 caches and 16-bit ones at 128
    columns (16-bit at 64 measured slower)."""
    from attnops.backends.triton import heuristics as theur
    from attnops.cases import AttentionCase
    monkeypatch.setattr(theur, "_num_sms", lambda device: 132)
    monkeypatch.setattr(theur, "_capability", lambda device: 9)
    monkeypatch.setattr(theur, "_shared_memory_per_block", lambda device: 227 * 1024)
    gpu_device = torch.device("cuda")

    def plan(batch, capacity, kv_heads=8, kv_format="bf16", head_dim=128, fill=1, q_heads=32, default=False):
        case = AttentionCase.of_shapes(device_type="cuda", arch=(9, 0), q_dtype=torch.bfloat16, kv_format=kv_format,
                                       head_dim=head_dim, page_size=16, num_q_heads=q_heads, num_kv_heads=kv_heads,
                                       batch=batch, num_tokens=batch, max_kv_len=capacity, decode=True)
        cfg = theur.heuristic_config(case, batch, gpu_device)
        return cfg if default else theur.fill_waves(dict(cfg, FILL_WAVES=fill), case, batch, gpu_device)

    theur.heuristic_config.cache_clear()
    try:
        before = plan(32, 8192, fill=0)
        assert (before["CHUNK"], before["MAX_SPLITS"]) == (4096, 2)  # 512 programs: 1.29 waves of 396
        after = plan(32, 8192)
        assert (after["CHUNK"], after["MAX_SPLITS"]) == (2816, 3)  # 768 programs: 1.94 waves
        assert plan(32, 8192, kv_format="fp8_e4m3")["CHUNK"] == 2816
        assert plan(32, 8192, head_dim=96)["CHUNK"] == 2816  # 128's tile
        long = plan(16, 65536, kv_heads=2, q_heads=16)  # 16 splits of 4096: 512 programs
        assert (long["CHUNK"], long["MAX_SPLITS"]) == (2816, 24)  # 768
        # within one wave, past one and a half, or many waves: unchanged
        for batch, capacity, kv_heads in ((32, 8192, 4), (128, 4096, 8), (64, 2048, 8), (1, 32768, 8)):
            unchanged = plan(batch, capacity, kv_heads=kv_heads)
            assert unchanged == dict(plan(batch, capacity, kv_heads=kv_heads, fill=0), FILL_WAVES=1)
        for other in (dict(kv_format="nvfp4"), dict(head_dim=256)):
            assert plan(32, 8192, **other)["FILL_WAVES"] == 0
        with attnops.batch_invariant():
            assert plan(32, 8192)["FILL_WAVES"] == 0
            assert not plan(32, 8192, default=True)["FILL_WAVES"]
        # the default: fp8 at every head dim up to 128, 16-bit at 128 columns (96 pads to them), not at 64
        for kv_format, head_dim, on in (("bf16", 128, True), ("fp16", 96, True), ("bf16", 64, False),
                                        ("fp8_e4m3", 64, True), ("fp8_e5m2", 128, True), ("nvfp4", 128, False)):
            assert bool(plan(32, 8192, kv_format=kv_format, head_dim=head_dim, default=True)["FILL_WAVES"]) == on
        verify = AttentionCase.of_shapes(device_type="cuda", arch=(9, 0), q_dtype=torch.bfloat16, kv_format="bf16",
                                         head_dim=128, page_size=16, num_q_heads=64, num_kv_heads=8, batch=32,
                                         num_tokens=64, max_kv_len=8192, decode=False)
        assert not theur.heuristic_config(verify, 64, gpu_device)["FILL_WAVES"]  # a 16-row verify tile: not timed
        # a split plan asked for runs as asked, unless FILL_WAVES is asked for too; WAVE_PLAN takes it off
        from attnops.backends.triton import launch as tlaunch
        monkeypatch.setattr(tlaunch, "_capability", lambda device: 9)
        case = AttentionCase.of_shapes(device_type="cuda", arch=(9, 0), q_dtype=torch.bfloat16, kv_format="bf16",
                                       head_dim=128, page_size=16, num_q_heads=32, num_kv_heads=8, batch=32,
                                       num_tokens=32, max_kv_len=8192, decode=True)
        assert tlaunch._tunables(case, 32, gpu_device, None)[1]["FILL_WAVES"]
        assert not tlaunch._tunables(case, 32, gpu_device, dict(CHUNK=4096))[1]["FILL_WAVES"]
        assert tlaunch._tunables(case, 32, gpu_device, dict(CHUNK=4096, FILL_WAVES=1))[1]["FILL_WAVES"]
        waves = dict(theur.heuristic_config(case, 32, gpu_device), WAVE_PLAN=3)
        assert theur.fill_waves(waves, case, 32, gpu_device)["FILL_WAVES"] == 0
    finally:
        theur.heuristic_config.cache_clear()


@pytest.mark.parametrize("kv_format", ["fp16", "fp8_e4m3"])
def test_splits_of_any_multiple_of_the_tile_against_the_reference(kv_format):
    """Splits whose length is a multiple of the key tile but no power of two (FILL_WAVES' plans, e.g. 2816 keys on
    the GPU): ragged lengths, some longer than the splits allow (the device lengthens them), LSE from the merge."""
    from attnops.backends.triton import launch as tlaunch
    kv_lens = [700, 0, 191, 1000, 64, 577]
    args = random_paged_inputs(kv_lens, num_q_heads=8, num_kv_heads=2, kv_format=kv_format, q_dtype=F16,
                               device=DEVICE, seed=7)
    lse = torch.full((len(kv_lens), 8), float("nan"), device=DEVICE)
    out = torch.full_like(args["q"], float("nan"))
    tlaunch.launch(args["q"], args["k_cache"], args["v_cache"], args["block_table"], args["seq_lens"], None,
                   scale=0.125, soft_cap=0.0, window_left=-1, kv_format=kv_format, k_scale=args.get("k_scale"),
                   v_scale=args.get("v_scale"), out=out, lse=lse, config=dict(BLOCK_N=64, CHUNK=192, MAX_SPLITS=4))
    ref, ref_lse = paged_attention_reference(**args, scale=0.125, return_lse=True, compute_dtype=torch.float64)
    assert not out.isnan().any(), "a row no program wrote"
    assert relative_error(out, ref) < TOLERANCE[F16]
    assert torch.allclose(lse.double(), ref_lse, atol=1e-3)


@pytest.mark.parametrize("kv_format,q_lens,q_dtype", [("nvfp4", None, F16), ("mxfp4", [5, 9], F32),
                                                      ("nvfp4", [3, 1], F32)])
def test_fp4_scales_loaded_per_value(kv_format, q_lens, q_dtype):
    """The SCALE_BCAST=False variant (one cached load per value instead of one per block scale repeated in
    registers, the default) gives the same answer."""
    from attnops.backends.triton.launch import launch
    args = random_paged_inputs([77, 40], q_lens, kv_format=kv_format, q_dtype=q_dtype, device=DEVICE, seed=2)
    out = torch.full_like(args["q"], float("nan"))
    launch(args["q"], args["k_cache"], args["v_cache"], args["block_table"], args["seq_lens"], args["cu_seqlens_q"],
           scale=0.125, soft_cap=0.0, window_left=-1, kv_format=kv_format, k_scale=args["k_scale"],
           v_scale=args["v_scale"], out=out, config=dict(SCALE_BCAST=False, BLOCK_N=32))
    ref = paged_attention_reference(**args, scale=0.125, compute_dtype=torch.float64)
    assert relative_error(out, ref) < TOLERANCE[q_dtype]


def prefill_case(kv_format, q_dtype):
    """A prefill of 8 sequences of 4096 tokens, 32/8/128, on an sm_90 GPU."""
    from attnops.cases import AttentionCase
    return AttentionCase.of_shapes(device_type="cuda", arch=(9, 0), q_dtype=q_dtype, kv_format=kv_format,
                                   head_dim=128, page_size=16, num_q_heads=32, num_kv_heads=8, batch=8,
                                   num_tokens=8 * 4096, max_kv_len=4096, decode=False)


def test_prefill_pipeline_depth_follows_shared_memory(monkeypatch):
    """GPU tile choice, from device properties alone: 128-key prefill tiles of a 16-bit cache take 3 stages only
    where a block may use 227 KB of shared memory (what the H200 measured), 2 elsewhere and for fp8 caches."""
    from attnops.backends.triton import heuristics as theur
    monkeypatch.setattr(theur, "_num_sms", lambda device: 132)
    monkeypatch.setattr(theur, "_capability", lambda device: 9)
    stages = {}
    for shared, kv_format in itertools.product((232448, 166912), ("bf16", "fp8_e4m3")):
        monkeypatch.setattr(theur, "_shared_memory_per_block", lambda device, shared=shared: shared)
        theur.heuristic_config.cache_clear()
        config = theur.heuristic_config(prefill_case(kv_format, torch.bfloat16), 8 * 4096, torch.device("cuda"))
        assert (config["BLOCK_N"], config["BLOCK_Q"], config["num_warps"]) == (128, 32, 8)
        stages[shared, kv_format] = config["num_stages"]
        # fp32 q (fp32 dots): 128 x 128 tiles take 256+ KB of shared memory at any depth; 64-key tiles
        config = theur.heuristic_config(prefill_case(kv_format, torch.float32), 8 * 4096, torch.device("cuda"))
        assert config["BLOCK_N"] == 64
    theur.heuristic_config.cache_clear()
    assert stages == {(232448, "bf16"): 3, (232448, "fp8_e4m3"): 2, (166912, "bf16"): 2, (166912, "fp8_e4m3"): 2}


def test_short_verify_blocks_of_16_bit_caches_take_the_64_row_tile(monkeypatch):
    """GPU tile choice: verify blocks of 4 or 8 draft tokens x a group of 4 of a bf16 or fp16 cache at D=128 run in
    the 64-row verify tile, rows padded, one split a sequence at 32 x 4096; batches too few to fill the SMs unsplit,
    fp8, fp32 q, other head dims and groups, 64-row blocks and batch-invariant mode keep their tiles."""
    from attnops.backends.triton import heuristics as theur
    from attnops.cases import AttentionCase
    monkeypatch.setattr(theur, "_num_sms", lambda device: 132)
    monkeypatch.setattr(theur, "_capability", lambda device: 9)
    monkeypatch.setattr(theur, "_shared_memory_per_block", lambda device: 227 * 1024)

    def config(tokens, kv_heads=8, kv_format="bf16", head_dim=128, invariant=False, batch=32, q_dtype=torch.bfloat16):
        case = AttentionCase.of_shapes(device_type="cuda", arch=(9, 0), q_dtype=q_dtype, kv_format=kv_format,
                                       head_dim=head_dim, page_size=16, num_q_heads=32, num_kv_heads=kv_heads,
                                       batch=batch, num_tokens=batch * tokens, max_kv_len=4096, decode=False)
        with attnops.batch_invariant(invariant):
            return theur.heuristic_config(case, batch * tokens, torch.device("cuda"))

    theur.heuristic_config.cache_clear()
    try:
        for tokens in (4, 8):
            chosen = config(tokens)
            assert (chosen["BLOCK_Q"], chosen["BLOCK_N"], chosen["num_warps"]) == (16, 64, 4)
            assert chosen["FULL_TILES"] and chosen["OFFSETS_32"] and chosen["MAX_SPLITS"] == 1
        assert config(8, kv_format="fp16")["BLOCK_Q"] == 16
        assert config(8, kv_format="fp8_e4m3")["BLOCK_Q"] == 8
        assert config(8, q_dtype=torch.float32)["BLOCK_Q"] == 8  # fp32 dots
        assert config(8, head_dim=64)["BLOCK_Q"] == 8
        assert config(2)["BLOCK_Q"] == 2  # 8 rows: not widened
        assert config(4, kv_heads=4)["BLOCK_Q"] == 4  # a group of 8
        assert config(16)["BLOCK_Q"] == 16  # 64 rows already
        assert config(8, batch=17)["BLOCK_Q"] == 16  # 17 x 8 blocks fill 132 SMs
        assert config(8, batch=16)["BLOCK_Q"] == 8  # 16 x 8 do not: they split, as before
        assert config(8, invariant=True) == config(1, invariant=True)  # the mode's fixed tile
    finally:
        theur.heuristic_config.cache_clear()


def test_decode_tiles_of_wide_heads(monkeypatch):
    """GPU decode tiles by head dim (what the H100 measured): 512 columns (head dims 320-512) take 32 keys in 8 warps
    with a 16-bit or fp8 cache (16 in 4 for 4-bit caches and verify blocks); head dim 256 with a 16-bit cache 64
    keys in 8 warps where q has the cache's dtype (so do head dims padded to 256; others 32 in 4), and its 64-row
    query tiles 4 warps on sm_90; fp8 at 256 columns is capped at 128 registers (168 elsewhere, none for bf16)."""
    from attnops.backends.triton import heuristics as theur
    from attnops.cases import AttentionCase
    monkeypatch.setattr(theur, "_num_sms", lambda device: 132)
    monkeypatch.setattr(theur, "_capability", lambda device: 9)
    monkeypatch.setattr(theur, "_shared_memory_per_block", lambda device: 232448)
    theur.heuristic_config.cache_clear()

    def tile(head_dim, kv_format, q_len=1, q_dtype=None):
        q_dtype = q_dtype or (torch.float16 if kv_format == "fp16" else torch.bfloat16)
        case = AttentionCase.of_shapes(device_type="cuda", arch=(9, 0), q_dtype=q_dtype, kv_format=kv_format,
                                       head_dim=head_dim, page_size=16, num_q_heads=32, num_kv_heads=8, batch=32,
                                       num_tokens=32 * q_len, max_kv_len=8192, decode=q_len == 1)
        config = theur.heuristic_config(case, 32 * q_len, torch.device("cuda"))
        return config["BLOCK_N"], config["num_warps"], config["maxnreg"]
    try:
        assert tile(512, "bf16") == tile(320, "bf16") == (32, 8, None)
        assert tile(512, "fp8_e4m3") == (32, 8, 168)
        assert tile(512, "nvfp4") == (16, 4, None) and tile(512, "bf16", q_len=4) == (16, 4, None)
        assert tile(256, "fp8_e4m3") == (32, 4, 128) and tile(256, "bf16") == tile(256, "fp16") == (64, 8, None)
        assert tile(256, "fp16", q_dtype=torch.bfloat16) == tile(256, "bf16", q_dtype=torch.float32) == (32, 4, None)
        assert tile(192, "bf16") == tile(160, "bf16") == (64, 8, None)  # padded to 256 (two tiles)
        assert tile(256, "bf16", q_len=4) == tile(256, "nvfp4") == (32, 4, None)
        # 64-row tiles (16 tokens x a group of 4): 4 warps at head dim 256 with a 16-bit cache, else 8
        assert tile(256, "bf16", q_len=64) == (32, 4, None) and tile(192, "bf16", q_len=64) == (32, 8, None)
        assert tile(512, "bf16", q_len=64) == (16, 8, None) and tile(256, "fp8_e4m3", q_len=64)[1] == 8
        monkeypatch.setattr(theur, "_capability", lambda device: 8)  # no warpgroup MMAs: 4 warps would spill
        theur.heuristic_config.cache_clear()
        assert tile(256, "bf16", q_len=64) == (32, 8, None) and tile(256, "bf16") == (64, 8, None)
        assert tile(128, "fp8_e4m3") == (128, 4, 168) and tile(128, "bf16") == (128, 4, None)
    finally:
        theur.heuristic_config.cache_clear()


def test_a_tile_too_large_for_the_gpu_steps_down(monkeypatch):
    """A tile that does not fit the GPU (Triton raises OutOfResources when it loads the kernel, before anything
    runs, as on GPUs with less shared memory than the heuristic was measured on) is stepped down (stages, then
    keys per tile) with a warning, the answer is right, and the shape's cached choice keeps the tile that fit.
    The limit is simulated around the real kernel: here a tile needs BLOCK_N x num_stages <= 64."""
    from triton.runtime.errors import OutOfResources
    from attnops.backends.triton import heuristics as theur, launch as tlaunch
    kernel = tlaunch.paged_attention_kernel
    tried = []

    class LimitedKernel:
        def __getitem__(self, grid):
            def run(*args, BLOCK_N, num_stages, **kwargs):
                tried.append((BLOCK_N, num_stages))
                if BLOCK_N * num_stages > 64:
                    raise OutOfResources(BLOCK_N * num_stages * 1024, 64 * 1024, "shared memory")
                return kernel[grid](*args, BLOCK_N=BLOCK_N, num_stages=num_stages, **kwargs)
            return run

    monkeypatch.setattr(tlaunch, "paged_attention_kernel", LimitedKernel())
    theur.heuristic_config.cache_clear()
    args = random_paged_inputs([300, 0, 77], [9, 0, 4], device=DEVICE, seed=4)
    for call in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = run_triton_attention(args)
        messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        if call == 0:  # one warning, saying from what to what
            assert len(messages) == 1 and "64 keys in 3 stages" in messages[0] and "32 keys in 2 stages" in \
                messages[0], messages
        else:
            assert not messages, messages
        assert relative_error(out, paged_attention_reference(**args, compute_dtype=torch.float64)) < 1e-5
    # the interpreter's tile (64 keys, 3 stages), then 2 stages, then 32 keys; the second call starts there
    assert tried == [(64, 3), (64, 2), (32, 2), (32, 2)]
    theur.heuristic_config.cache_clear()


def test_strided_metadata_and_out():
    """A block table and seq_lens that are strided views, and an out= whose last dimension is strided."""
    args = random_paged_inputs([50, 0, 17], q_lens=[5, 0, 2], device=DEVICE, seed=8)
    args["block_table"] = args["block_table"].t().contiguous().t()  # column-major
    args["seq_lens"] = torch.stack((args["seq_lens"], args["seq_lens"]), 1)[:, 0]
    base = torch.full((*args["q"].shape[:2], 2 * args["q"].shape[2]), float("nan"), device=DEVICE)
    out = base[..., ::2]
    with attnops.use_backend("triton"):
        attnops.paged_attention(**args, out=out)
    assert relative_error(out, paged_attention_reference(**args, compute_dtype=torch.float64)) < 1e-5
    assert base[..., 1::2].isnan().all()  # nothing written between the strided elements


def test_separate_k_and_v_scale_kinds():
    """fp8 with a per-head k_scale and a per-tensor v_scale (scale strides differ: 1 and 0)."""
    args = random_paged_inputs([90, 31], kv_format="fp8_e4m3", scale_kind="per_head", device=DEVICE, seed=5)
    args["v_scale"] = torch.tensor(0.7, device=DEVICE)
    check_attention(args)


@triton.jit
def _fp4_dequant_kernel(c_ptr, s_ptr, even_ptr, odd_ptr, FMT: tl.constexpr, DOT_DTYPE: tl.constexpr,
                        FP4_ASM: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    scale = _fp4_scale(tl.load(s_ptr + offs), FMT, DOT_DTYPE)
    even, odd = _dequant_fp4(tl.load(c_ptr + offs), scale, FMT, DOT_DTYPE, FP4_ASM)
    tl.store(even_ptr + offs, even.to(tl.float32) / fp4_fold(FMT, DOT_DTYPE))
    tl.store(odd_ptr + offs, odd.to(tl.float32) / fp4_fold(FMT, DOT_DTYPE))


@pytest.mark.parametrize("fmt,dot_dtype,asm", [
    ("nvfp4", F16, False), ("nvfp4", F32, False), ("mxfp4", F16, False), ("mxfp4", F32, False),
    pytest.param("nvfp4", F16, True, marks=pytest.mark.gpu), pytest.param("mxfp4", F16, True, marks=pytest.mark.gpu),
    pytest.param("mxfp4", torch.bfloat16, False, marks=pytest.mark.gpu),
    pytest.param("mxfp4", torch.bfloat16, True, marks=pytest.mark.gpu)])
@pytest.mark.filterwarnings("ignore:overflow encountered")
def test_fp4_dequant_is_exact(fmt, dot_dtype, asm):
    """The kernels' 4-bit decode (the same helpers, each dot dtype's path) equals value x scale rounded once to the
    dot dtype, for every packed byte (both nibbles) and every non-NaN scale: mxfp4's e8m0 from 2^-127 (a
    subnormal) to 2^127, where products overflow fp16 and bf16 to inf and zeros stay 0."""
    scales = torch.arange(255, dtype=torch.uint8) if fmt == "mxfp4" else \
        torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)  # e4m3fn NaN: 0x7F, 0xFF
    packed = torch.arange(256, dtype=torch.uint8).repeat_interleave(len(scales))
    scales = scales.repeat(256)
    n = len(packed)  # a multiple of 256
    even, odd = (torch.empty(n, dtype=torch.float32, device=DEVICE) for _ in range(2))
    _fp4_dequant_kernel[(n // 256,)](packed.to(DEVICE), scales.to(DEVICE), even, odd, FMT=FMT_CODE[fmt],
                                      DOT_DTYPE=_TL_DTYPE[dot_dtype], FP4_ASM=asm, BLOCK=256)
    scale = scales.view(torch.float8_e4m3fn).double() if fmt == "nvfp4" else torch.exp2(scales.double() - 127)
    values = formats.unpack_fp4(packed[:, None]).double()  # [n, 2]: the low nibble, then the high one
    for got, value in ((even, values[:, 0]), (odd, values[:, 1])):
        expected = (value * scale).to(dot_dtype).float()
        assert torch.equal(got.cpu(), expected), (got.cpu() != expected).nonzero()[:5]


# ----------------------------------------------------------------------------------------------------------------
# reshape_and_cache: bit-exact with the reference, every format

def cache_write_inputs(fmt, scale_kind, *, num_tokens=9, num_kv_heads=2, head_dim=64, page_size=4, num_pages=6,
                       src_dtype=torch.float32, seed=0, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * 2
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    # edge values: an all-zero block, values to saturate, exact e2m1 ties (x / scale = 0.75, 1.75, ...),
    # fp8 subnormals and values that round up into the next binade
    # (each where the shape has room: the GPU sweep draws 1..200 tokens and 1, 2 or 8 heads; all finite in fp16:
    # -6e4 saturates e4m3 and e5m2 alike)
    key[0, 0, :32] = 0
    if num_tokens > 1:
        key[1, 0] *= 1e3
    if num_tokens > 2:
        value[2, 0, :16] = torch.tensor([6.0, 0.75, 1.75, 3.5, 0.25, 1.25, 2.5, 5.0, -0.75, -6, 0, 1, 2, 3, 4, -1.75])
    if num_tokens > 3 and num_kv_heads > 1:
        value[3, 1, :8] = torch.tensor([2 ** -8, 2 ** -10 * 1.5, 1.9614, -7.8315, 2 ** -17, 3e-3, 447.9, -6e4])
    slots = torch.randperm(num_pages * page_size, generator=gen)[:num_tokens].long()
    slots[num_tokens // 2] = -1  # padding: skipped
    stored_dim = formats.stored_head_dim(fmt, head_dim)
    storage = formats.FORMATS[fmt].storage_dtype
    shape = (num_pages, 2, page_size, num_kv_heads, stored_dim)
    kv = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    kv = kv.view(storage) if storage.itemsize == 1 else torch.randn(shape, generator=gen).to(storage)
    kwargs = dict(kv_format=fmt if formats.is_fp4(fmt) else "auto")
    block_scales = None
    if formats.is_fp8(fmt):
        n = num_kv_heads if scale_kind == "per_head" else 1
        kwargs.update(k_scale=(torch.rand(n, generator=gen) + 0.05).reshape(() if n == 1 else (n,)).to(device),
                      v_scale=(torch.rand(n, generator=gen) + 0.05).reshape(() if n == 1 else (n,)).to(device))
    if formats.is_fp4(fmt):
        block_scales = torch.randint(0, 256, (*shape[:4], head_dim // formats.FORMATS[fmt].block), generator=gen,
                                     dtype=torch.uint8).view(formats.FORMATS[fmt].scale_dtype).to(device)
    return (key.to(src_dtype).to(device), value.to(src_dtype).to(device), kv.to(device), slots.to(device),
            block_scales, kwargs)


def assert_cache_write_exact(fmt, scale_kind, **kw):
    key, value, kv, slots, block_scales, kwargs = cache_write_inputs(fmt, scale_kind, **kw)
    kv_ref = kv.clone()
    bs_ref = None if block_scales is None else block_scales.clone()
    with attnops.use_backend("triton"):
        attnops.reshape_and_cache(key, value, kv[:, 0], kv[:, 1], slots, **kwargs,
                                  **({} if block_scales is None else dict(k_block_scale=block_scales[:, 0],
                                                                          v_block_scale=block_scales[:, 1])))
    reshape_and_cache_reference(key, value, kv_ref[:, 0], kv_ref[:, 1], slots, **kwargs,
                                **({} if bs_ref is None else dict(k_block_scale=bs_ref[:, 0],
                                                                  v_block_scale=bs_ref[:, 1])))
    as_bytes = lambda t: t.view(torch.uint8) if t.dtype.itemsize == 1 else t  # noqa: E731
    mismatch = (as_bytes(kv) != as_bytes(kv_ref)).sum().item()
    assert mismatch == 0, f"{mismatch} cache elements differ from the reference"
    if block_scales is not None:
        assert torch.equal(block_scales.view(torch.uint8), bs_ref.view(torch.uint8)), "block scales differ"


@pytest.mark.parametrize("fmt,scale_kind", [("fp32", None), ("fp16", None), ("fp8_e4m3", "per_tensor"),
                                            ("fp8_e4m3", "per_head"), ("fp8_e5m2", "per_tensor"),
                                            ("fp8_e5m2", "per_head"), ("nvfp4", None), ("mxfp4", None)])
def test_reshape_and_cache_bit_exact(fmt, scale_kind):
    assert_cache_write_exact(fmt, scale_kind, **(dict(page_size=1, num_pages=12) if fmt == "nvfp4" else {}))


def test_reshape_and_cache_fp16_source_page16():
    assert_cache_write_exact("nvfp4", None, src_dtype=torch.float16, page_size=16, num_pages=2, head_dim=32)
    assert_cache_write_exact("fp8_e4m3", "per_head", src_dtype=torch.float16, page_size=16, num_pages=2)


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("fmt,scale_kind", [("fp8_e4m3", "per_tensor"), ("fp8_e5m2", "per_head"), ("nvfp4", None),
                                            ("mxfp4", None), ("fp16", None)])
def test_reshape_and_cache_of_nan_and_inf_bit_exact(fmt, scale_kind, src_dtype):
    """Random keys and values with NaN, +Inf and -Inf injected (a NaN of either sign; whole blocks of Inf too) are
    stored as attnops.formats stores them, bit for bit: fp8 NaN stays NaN and Inf saturates; a 4-bit block holding
    a NaN or an Inf gets formats.py's scale (nvfp4 NaN / 448; mxfp4 0 / 254) and codes."""
    gen = torch.Generator().manual_seed(7)
    key, value, kv, slots, block_scales, kwargs = cache_write_inputs(fmt, scale_kind, num_tokens=12, num_pages=6,
                                                                     src_dtype=torch.float32, seed=5, device="cpu")
    for x in (key, value):
        for special in (float("nan"), -float("nan"), float("inf"), -float("inf")):
            x[torch.rand(x.shape, generator=gen) < 0.02] = special
        x[4, 0, :16] = float("inf")  # a whole nvfp4 block
        x[5, 1, 32:64] = -float("nan")  # a whole mxfp4 block
    key, value = key.to(src_dtype).to(DEVICE), value.to(src_dtype).to(DEVICE)
    kv, slots = kv.to(DEVICE), slots.to(DEVICE)
    kv_ref = kv.clone()
    bs_ref = None if block_scales is None else block_scales.clone()
    extra = lambda b: {} if b is None else dict(k_block_scale=b[:, 0], v_block_scale=b[:, 1])  # noqa: E731
    with attnops.use_backend("triton"):
        attnops.reshape_and_cache(key, value, kv[:, 0], kv[:, 1], slots, **kwargs, **extra(block_scales))
    reshape_and_cache_reference(key, value, kv_ref[:, 0], kv_ref[:, 1], slots, **kwargs, **extra(bs_ref))
    as_bits = lambda t: t.view(torch.uint8) if t.dtype.itemsize == 1 else t.view(torch.int16)  # noqa: E731
    if fmt == "fp16":  # the NaN payload of an fp32 -> fp16 conversion is the device's: NaN for NaN
        same = (as_bits(kv) == as_bits(kv_ref)) | (kv.isnan() & kv_ref.isnan())
    else:
        same = as_bits(kv) == as_bits(kv_ref)
    assert same.all(), f"{(~same).sum().item()} cache elements differ from attnops.formats"
    if block_scales is not None:
        assert torch.equal(block_scales.view(torch.uint8), bs_ref.view(torch.uint8)), "block scales differ"


BAD_INDEX_CASES = {
    # name: (q_lens, corruption of the arguments, options, expected NaN rows (by token), expected record)
    "decode page": (None, lambda a: a["block_table"].__setitem__((2, 1), -1), {}, [2], {"block_table": 2}),
    "decode page past the cache": (None, lambda a: a["block_table"].__setitem__((0, 0), 10 ** 9), {}, [0],
                                   {"block_table": 0}),
    "decode page before the window": (None, lambda a: a["block_table"].__setitem__((2, 0), -7),
                                      dict(window_left=40), [], {}),
    "decode length": (None, lambda a: a["seq_lens"].__setitem__(1, 10 ** 6), {}, [1], {"seq_lens": 1}),
    # sequence 2's 20 queries sit at 280..299; page 18 holds keys 288..303: the queries from 288 on see it
    "extend page seen by the last rows": ([3, 2, 20], lambda a: a["block_table"].__setitem__((2, 18), -1), {},
                                          list(range(13, 25)), {"block_table": 2}),
    # page 16 holds keys 256..271; a query at p sees p - window_left..p
    "extend page behind every window": ([3, 2, 20], lambda a: a["block_table"].__setitem__((2, 16), 10 ** 6),
                                        dict(window_left=5), [], {}),
    "extend page behind some windows": ([3, 2, 20], lambda a: a["block_table"].__setitem__((2, 16), 10 ** 6),
                                        dict(window_left=15), list(range(5, 12)), {"block_table": 2}),
    "extend negative length": ([3, 2, 20], lambda a: a["seq_lens"].__setitem__(0, -4), {}, [0, 1, 2],
                               {"seq_lens": 0}),
    "extend cu past the rows": ([3, 2, 20], lambda a: a["cu_seqlens_q"].__setitem__(2, 40), {}, list(range(25)),
                                {"cu_seqlens_q": 2}),
    "extend cu decreasing": ([3, 2, 20], lambda a: a["cu_seqlens_q"].__setitem__(1, 6), {}, list(range(25)),
                             {"cu_seqlens_q": 2}),
}


@pytest.mark.parametrize("forced", [False, True], ids=["heuristic", "full-tiles-32-bit"])
@pytest.mark.parametrize("name", BAD_INDEX_CASES)
def test_bad_indices_give_nan_rows_and_are_recorded(name, forced, request):
    """docs/design.md, "Bad indices": Triton reads nothing out of range, makes NaN exactly the rows the rules say,
    the other rows exact, and records the argument; one page of 16 keys is 4 tiles' worth of splits here. Also
    with FULL_TILES and OFFSETS_32 forced on."""
    if forced:
        request.getfixturevalue("full_tiles_32_bit")
    q_lens, corrupt, options, nan_rows, record = BAD_INDEX_CASES[name]
    args = random_paged_inputs([130, 37, 300], q_lens, num_q_heads=4, num_kv_heads=2, page_size=16, device=DEVICE,
                               seed=len(name))
    corrupt(args)
    attnops.take_errors()
    out = run_triton_attention(args, **options)
    assert attnops.take_errors() == record
    rows = out.isnan().any(-1).any(-1)
    assert rows.nonzero().flatten().tolist() == nan_rows and out[nan_rows].isnan().all()
    if "cu" not in name:
        good = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
        good["block_table"][(good["block_table"] < 0) | (good["block_table"] >= args["k_cache"].shape[0])] = 0
        good["seq_lens"].clamp_(0, good["block_table"].shape[1] * 16)
        ref = paged_attention_reference(**good, **options)
        torch.testing.assert_close(out[~rows], ref[~rows], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", [n for n in BAD_INDEX_CASES if n.startswith("decode")] + ["decode, no pages"])
def test_bad_decode_pages_with_the_pages_checked_before_the_loop(name):
    """PAGE_CLAMP off (a tunable, on for decode by default: pages clamped into the cache in the loop, checked after
    it): decode checks its pages before the loop; the rows, the record and the other rows as with the default. A
    cache of no pages reads nothing."""
    from attnops.backends.triton.launch import launch
    args = random_paged_inputs([130, 37, 300], num_q_heads=4, num_kv_heads=2, page_size=16, device=DEVICE,
                               seed=len(name))
    if name == "decode, no pages":
        options, nan_rows, record = {}, [0, 1, 2], {"block_table": 0}
        args["k_cache"], args["v_cache"] = args["k_cache"][:0], args["v_cache"][:0]
    else:
        _, corrupt, options, nan_rows, record = BAD_INDEX_CASES[name]
        corrupt(args)
    attnops.take_errors()
    out = torch.full_like(args["q"], 7.0)
    launch(args["q"], args["k_cache"], args["v_cache"], args["block_table"], args["seq_lens"], None,
           scale=0.125, soft_cap=0.0, window_left=options.get("window_left", -1), kv_format="fp32", k_scale=None,
           v_scale=None, out=out, config=dict(PAGE_CLAMP=False, MAX_SPLITS=4, CHUNK=64, BLOCK_N=32))
    assert attnops.take_errors() == record
    rows = out.isnan().any(-1).any(-1)
    assert rows.nonzero().flatten().tolist() == nan_rows and out[nan_rows].isnan().all()
    if nan_rows != [0, 1, 2]:
        good = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
        good["block_table"][(good["block_table"] < 0) | (good["block_table"] >= args["k_cache"].shape[0])] = 0
        good["seq_lens"].clamp_(0, good["block_table"].shape[1] * 16)
        ref = paged_attention_reference(**good, scale=0.125, **options)
        torch.testing.assert_close(out[~rows], ref[~rows], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_format", ["fp16", "fp8_e4m3", "nvfp4"])
def test_tree_verify_with_full_tiles_and_32_bit_offsets(full_tiles_32_bit, kv_format):
    """Draft trees (the key loop's third part: the query block's tiles, tree-masked) after the full and partial
    tiles, ragged, one sequence's block shorter than the mask's width."""
    from attnops.bench.grid import tree_parents
    from attnops.serving.spec import tree_mask_from_parents
    q_lens = [7, 4, 7]
    args = random_paged_inputs([200, 9, 333], q_lens, num_q_heads=4, num_kv_heads=2, kv_format=kv_format,
                               q_dtype=F16, device=DEVICE, seed=3)
    args["tree_mask"] = tree_mask_from_parents([tree_parents(n, 2) for n in q_lens], width=8, device=DEVICE)
    check_attention(args)


def test_forced_tunables_are_checked(monkeypatch):
    """ATTNOPS_TRITON_TUNABLES: integers for known tunables; anything else is a ValueError naming the variable."""
    from attnops.backends.triton.heuristics import forced_tunables
    for text, want in (("", {}), ("FULL_TILES=1,OFFSETS_32=0", dict(FULL_TILES=1, OFFSETS_32=0))):
        monkeypatch.setenv("ATTNOPS_TRITON_TUNABLES", text)
        forced_tunables.cache_clear()
        assert forced_tunables() == want
    for text in ("FULL_TILE=1", "FULL_TILES", "FULL_TILES=yes"):
        monkeypatch.setenv("ATTNOPS_TRITON_TUNABLES", text)
        forced_tunables.cache_clear()
        with pytest.raises(ValueError, match="ATTNOPS_TRITON_TUNABLES"):
            forced_tunables()
    monkeypatch.delenv("ATTNOPS_TRITON_TUNABLES")
    forced_tunables.cache_clear()


def test_32_bit_offsets_only_where_every_offset_fits():
    """OFFSETS_32 forced on is compiled in only where the caches' largest element offset fits int32: a cache over
    2^31 elements (a meta tensor: shapes and strides, no memory) keeps int64."""
    from attnops.backends.triton.heuristics import heuristic_config, kernel_constexprs
    from attnops.backends.triton.launch import _largest_offset
    from attnops.cases import AttentionCase
    big = torch.empty((2 ** 31) // (16 * 8 * 128) + 1, 16, 8, 128, device="meta")
    assert _largest_offset(big) >= 2 ** 31 and _largest_offset(big[:4]) < 2 ** 31
    assert _largest_offset(big[:0]) == 0
    case = AttentionCase.of_shapes(device_type="cpu", arch=None, q_dtype=torch.bfloat16, kv_format="bf16",
                                   head_dim=128, page_size=16, num_q_heads=32, num_kv_heads=8, batch=2, num_tokens=2,
                                   max_kv_len=1024, decode=True)
    cfg = dict(heuristic_config(case, 2, torch.device("cpu")), OFFSETS_32=True)
    assert kernel_constexprs(cfg, case, on_gpu=False, offsets_fit_32=True)[0]["OFFSETS_32"]
    assert not kernel_constexprs(cfg, case, on_gpu=False, offsets_fit_32=False)[0]["OFFSETS_32"]


def test_write_then_read_roundtrip():
    """reshape_and_cache then paged_attention, both Triton, through a PagedKVCache (fused K/V layout, random page
    order): a prefill of two sequences, then a decode step on them."""
    cache = attnops.PagedKVCache(1, num_pages=12, page_size=16, num_kv_heads=2, head_dim=64, kv_format="nvfp4",
                                 device=DEVICE, shuffle_pages=True)
    gen = torch.Generator().manual_seed(3)
    for seq_id in ("a", "b"):
        cache.allocate(seq_id)
    for new_tokens in ([20, 33], [1, 1]):
        meta = cache.prepare(["a", "b"], new_tokens)
        key, value = (torch.randn(meta.num_tokens, 2, 64, generator=gen).to(DEVICE) for _ in range(2))
        with attnops.use_backend("triton"):
            attnops.reshape_and_cache(key, value, slot_mapping=meta.slot_mapping, **cache.write_args(0))
        q = torch.randn(meta.num_tokens, 4, 64, generator=gen).to(DEVICE)
        check_attention(dict(q=q, block_table=meta.block_table, seq_lens=meta.seq_lens,
                             cu_seqlens_q=meta.cu_seqlens_q, **cache.attention_args(0)))


# ----------------------------------------------------------------------------------------------------------------
# the backend as dispatch sees it

def test_backend_declines_with_reasons(monkeypatch):
    from attnops.dispatch import describe_attention
    backend = BACKENDS["triton"]
    assert backend.unavailable() == []
    monkeypatch.setenv("ATTNOPS_TRITON_PADDED_HEADS", "0")
    case = describe_attention(device="cpu", head_dim=96, q_dtype=torch.bfloat16, kv_format="nvfp4",
                              scale_kind="block")
    if not CUDA:
        assert any("bf16" in r for r in backend.supports(case))
    on_gpu = type(case)(**{**case.__dict__, "device_type": "cuda", "arch": (9, 0)})
    assert any("head_dim 96 (in 128's padded tile): turned off on a GPU" in r for r in backend.supports(on_gpu))
    assert backend.supports(describe_attention(device=DEVICE, q_dtype=torch.float16, kv_format="nvfp4",
                                               decode=False, soft_cap=True, sliding_window=True,
                                               scale_kind="block")) == []


def test_explain_pinned_triton():
    with attnops.use_backend("triton"):
        explanation = attnops.explain(device=DEVICE, q_dtype=torch.float16, kv_format="fp8_e4m3")
    assert explanation.chosen == "triton"


def test_kernels_compile_for_sm90():
    """A few kernel variants through Triton's real compiler for sm_90 (no GPU needed; a subprocess, since the
    interpreter is on in this one): catches what the interpreter accepts and the compiler refuses."""
    import subprocess
    import sys
    code = """
from triton.backends.compiler import GPUTarget
from attnops.backends.triton import compile_check as cc
target = GPUTarget("cuda", 90, 32)
variants = list(cc.attention_variants(quick=True))
picked = [variants[0], variants[1]]  # bf16 decode, extend
picked += [v for v in variants if v["fmt"] == "nvfp4" and not v["decode"]][:1]
picked += [v for v in variants if v["fmt"] == "mxfp4" and not v["scale_bcast"]][:1]  # per-value scales
picked += [v for v in variants if v.get("fp8_v_pairs")][:1] + [v for v in variants if v.get("heads_inner")][:1]
picked += [v for v in variants if v.get("tree")][:1]  # sinks and a tree mask
picked += [v for v in variants if v.get("lse") and v["sinks"]][:1]  # each row's LSE, from the merge kernel too
# a padded tile (head dim 96 in 128's) and the widest (512), prefill-sized
picked += [v for v in variants if v.get("valid_dim") == 96][:1]
picked += [v for v in variants if v.get("valid_dim") == 512 and not v["decode"]][:1]
picked += [v for v in variants if v.get("valid_dim") == 96 and v["fmt"] in ("nvfp4", "mxfp4")][:2]  # 4-bit padded
# two tiles (HEAD_PARTS): 96 as 64 + 32 in bf16, decode and verify; 80 of fp8 pairs, its second tile as bytes
picked += [v for v in variants if v.get("dim_b")][:3]
assert len(picked) == 15 and {v["fmt"] for v in picked[-3:]} == {"bf16", "fp8_e4m3"}
# columns past the head dim read as copies of the first ones (PAD_WRAP): 96 in bf16, decode
picked += [v for v in variants if v.get("pad_wrap") and v["decode"]][:1]
assert len(picked) == 16 and picked[-1]["valid_dim"] == 96
# decode's split size from the call's lengths (WAVE_PLAN), bf16 and fp8
picked += [v for v in variants if v.get("wave_plan")][:2]
assert len(picked) == 18 and {v["fmt"] for v in picked[-2:]} == {"bf16", "fp8_e4m3"}
for v in picked:
    compiled, _ = cc.compile_attention(v, target)
    if v is picked[0]:  # --sass's reading of the SASS: the decode loop, with its mma, inside the kernel
        prof = cc.sass_profile(compiled.asm["cubin"])
        assert prof["ops"]["HMMA"] > 0 and 100 < prof["loop"] < prof["instructions"], prof
        assert prof["registers"] > 0, prof
# --sass at a head shape of its own (--heads): the heuristic's tile for it, its loop counted a K/V value at D = 64
cc.print_sass(["fp8_e4m3"], "bf16", target, 132, 232448, {}, "decode 128 x 4096", (32, 8, 64))
# its resident programs an SM: registers (168 a thread: 3 programs of 4 warps), shared memory (74 KB: 3), both
assert [cc.programs_per_sm(r, 4, s, 232448) for r, s in ((168, 0), (128, 0), (128, 74240), (255, 8192))] == [3, 4, 3, 2]
cc.compile_cache_write("nvfp4", "bf16", 64, target)
cc.compile_cache_write("fp8_e4m3", "fp32", 128, target)
cc.compile_cache_write("fp8_e4m3", "bf16", 128, target, valid_dim=96)
cc.compile_cache_write("mxfp4", "bf16", 128, target, valid_dim=96)
cc.compile_page_layout(True, target)
cc.compile_merge_states("bf16", target)
# latent attention at DeepSeek's shape, bf16 and fp8, split (with sinks and the LSE) and a verify with a tree mask
cc.compile_mla("bf16", "auto", 16, 512, 64, target, tokens=1, sinks=True)
cc.compile_mla("bf16", "fp8_e4m3", 128, 512, 64, target, tokens=128, decode=False, tree=True)
cc.compile_mla("bf16", "auto", 16, 512, 64, target, tokens=32, capacity=2048, topk=True)  # the sparse form
cc.compile_mla("bf16", "fp8_ds_mla", 16, 512, 64, target, tokens=1)  # DeepSeek's fp8 layout
cc.compile_mla("bf16", "fp8_ds_mla", 128, 512, 64, target, tokens=64, capacity=2048, topk=True)
# the heuristic's own prefill tiles for fp32 and bf16 q fit sm_90's 227 KB of shared memory as chosen
for label, q_dtype, fmt, constexprs, options in cc.heuristic_configurations(90, 132, 232448, quick=True):
    if label.startswith("chunk") and fmt == "bf16" and q_dtype in ("fp32", "bf16"):  # prefill-sized tiles
        shared = cc.compile_one(cc.paged_attention_kernel, cc.attention_types(fmt, q_dtype), constexprs, target,
                                **options).metadata.shared
        assert shared <= 232448, (label, shared)
        print("fits:", label, shared)
print("compiled")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-3000:]
    assert result.stdout.count("fits:") == 2, result.stdout
    sass = next(line for line in result.stdout.splitlines() if line.startswith("decode 128 x 4096, 32/8/64"))
    assert "fp8_e4m3 (bf16 q): BLOCK_Q 1, BLOCK_N 128" in sass and "instructions a thread a step" in sass, sass


# ----------------------------------------------------------------------------------------------------------------
# GPU only

gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("forced", [False, True], ids=["heuristic", "full-tiles-32-bit"])
@pytest.mark.parametrize("name,inputs,options", CASES, ids=[c[0] for c in CASES])
def test_attention_small_bf16(name, inputs, options, forced, request):
    if forced:
        request.getfixturevalue("full_tiles_32_bit")
    inputs = dict(inputs, q_dtype=torch.bfloat16)
    if inputs.get("kv_format", "fp32") in ("fp32", "fp16"):
        inputs["kv_format"] = "bf16"
    args = random_paged_inputs(**inputs, device=DEVICE, seed=len(name) + 1)
    check_attention(args, **options)


@gpu
@pytest.mark.parametrize("kv_format", ["bf16", "fp16"])
@pytest.mark.parametrize("group", [4, 8])
def test_short_verify_blocks_in_the_64_row_tile(kv_format, group):
    """Verify blocks of 4-8 draft tokens at D=128 in the 64-row tile (group 4: rows padded to 16 tokens; group 8: 8):
    ragged batches of 1-8 draft tokens, sequences shorter than their blocks, a draft tree, against the float64
    reference; 36 sequences x 8 KV heads, enough blocks to take the padded tile on any GPU of up to 288 SMs."""
    from attnops.backends.triton import heuristics
    from attnops.bench.grid import tree_parents
    from attnops.cases import AttentionCase
    from attnops.serving.spec import tree_mask_from_parents
    q_lens = [8, 1, 4, 8, 5, 2] * 6
    kv_lens = [4096, 3, 700, 8, 2049, 129] * 6
    q_dtype = torch.bfloat16 if kv_format == "bf16" else F16
    case = AttentionCase.of_shapes(device_type="cuda", arch=torch.cuda.get_device_capability(), q_dtype=q_dtype,
                                   kv_format=kv_format, head_dim=128, page_size=16, num_q_heads=8 * group,
                                   num_kv_heads=8, batch=len(kv_lens), num_tokens=sum(q_lens), max_kv_len=4096,
                                   decode=False)
    chosen = heuristics.heuristic_config(case, sum(q_lens), torch.device(DEVICE))
    # (4.7 tokens a sequence on average: blocks of 8, 32 rows at a group of 4, widened; 64 at a group of 8 already)
    assert chosen["BLOCK_Q"] == (16 if group == 4 and heuristics._num_sms(torch.device(DEVICE)) <= 288 else 8)
    for tree in (False, True):
        args = random_paged_inputs(kv_lens, q_lens, num_q_heads=8 * group, num_kv_heads=8, head_dim=128,
                                   kv_format=kv_format, q_dtype=q_dtype, device=DEVICE, seed=group + tree)
        if tree:
            args["tree_mask"] = tree_mask_from_parents([tree_parents(n, 2) for n in q_lens], width=8, device=DEVICE)
        check_attention(args)


@gpu
@pytest.mark.parametrize("kv_format", ["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [256, 192])
def test_tiles_of_256_columns_on_the_gpu(kv_format, head_dim):
    """Tiles of 256 columns with a 16-bit cache on the GPU: decode in 64-key tiles of 8 warps (splits, a window, a
    sink, soft cap; 192 in two tiles), prefill and chunked extend in 64-row tiles (4 warps at head dim 256 on sm_90),
    on random ragged batches against the float64 reference; and decode replayed in a CUDA graph the user captured,
    with new lengths."""
    from attnops.backends.triton import heuristics
    from attnops.cases import AttentionCase
    q_dtype = torch.bfloat16 if kv_format == "bf16" else F16
    rng = random.Random(head_dim)
    for q_lens in (None, [40, 1, 23, 64]):
        kv_lens = [rng.randint(1, 9000), 1, rng.randint(1, 700), rng.randint(64, 5000)]
        if q_lens:
            kv_lens = [max(k, q) for k, q in zip(kv_lens, q_lens)]
        num_tokens = sum(q_lens or [1] * 4)
        case = AttentionCase.of_shapes(device_type="cuda", arch=torch.cuda.get_device_capability(), q_dtype=q_dtype,
                                       kv_format=kv_format, head_dim=head_dim, page_size=16, num_q_heads=8,
                                       num_kv_heads=2, batch=4, num_tokens=num_tokens, max_kv_len=max(kv_lens),
                                       decode=q_lens is None)
        chosen = heuristics.heuristic_config(case, num_tokens, torch.device(DEVICE))
        hopper = torch.cuda.get_device_capability()[0] == 9
        expected = (64, 8) if q_lens is None else (32, 4 if head_dim == 256 and hopper else 8)
        assert (chosen["BLOCK_N"], chosen["num_warps"]) == expected, chosen
        args = random_paged_inputs(kv_lens, q_lens, num_q_heads=8, num_kv_heads=2, head_dim=head_dim,
                                   kv_format=kv_format, q_dtype=q_dtype, device=DEVICE, seed=head_dim + len(kv_format))
        check_attention(args)
        check_attention(args, window_left=500, soft_cap=30.0, sinks=torch.randn(8, device=DEVICE))
    # built with every table row's pages (8192 keys each), replayed with any lengths up to that
    decode = random_paged_inputs([8192] * 4, None, num_q_heads=8, num_kv_heads=2, head_dim=head_dim,
                                 kv_format=kv_format, q_dtype=q_dtype, device=DEVICE, seed=3)
    graph, static = torch.cuda.CUDAGraph(), torch.empty_like(decode["q"])
    with attnops.use_backend("triton"):
        attnops.paged_attention(**decode, out=static)  # (compiles outside the capture)
        with torch.cuda.graph(graph):
            attnops.paged_attention(**decode, out=static)
    for lens in ([1, 8192, 4000, 17], [8192] * 4, [0, 0, 1, 2]):
        decode["seq_lens"].copy_(torch.tensor(lens, dtype=decode["seq_lens"].dtype))
        decode["q"].normal_()
        graph.replay()
        ref = paged_attention_reference(**decode, compute_dtype=torch.float64)
        assert relative_error(static, ref) < TOLERANCE[q_dtype], lens


NUM_FAMILIES = 32  # structural combinations per sweep: each compiles once, the 320 cases vary data within them
# Each sweep runs as SWEEP_PARTS tests (pytest-xdist spreads them over processes: compiles dominate); together
# they draw every one of the 320 cases, in the same seeded order whatever the split.
SWEEP_PARTS = 4


def sweep_cases(rng_seed: int, part: int, make_family, make_case):
    """The (index, case) pairs of one part of a 320-case sweep: all families and cases are drawn in order from
    one seeded generator (so the set does not depend on SWEEP_PARTS), this part keeps the families
    part, part + SWEEP_PARTS, ..."""
    rng = random.Random(rng_seed)
    families = [make_family(rng) for _ in range(NUM_FAMILIES)]
    for i in range(320):
        case = make_case(rng, families[i % NUM_FAMILIES])
        if (i % NUM_FAMILIES) % SWEEP_PARTS == part:
            yield i, case


def random_family(rng: random.Random) -> dict:
    """The structure of a case (what Triton compiles for): page size, head dim, GQA ratio, format, q dtype, and
    whether a window / soft cap is on."""
    num_kv_heads, group = rng.choice([(1, 1), (2, 1), (4, 1), (1, 4), (2, 4), (8, 4), (1, 16), (2, 3), (4, 8)])
    return dict(page_size=rng.choice([1, 2, 4, 8, 16, 32, 64, 128, 256]), head_dim=rng.choice([32, 64, 128, 256]),
                num_q_heads=num_kv_heads * group, num_kv_heads=num_kv_heads,
                kv_format=rng.choice(["bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2", "nvfp4", "mxfp4"]),
                q_dtype=rng.choice([torch.bfloat16, torch.float16, torch.float32]),
                scale_kind=rng.choice(["per_tensor", "per_head"]), window=rng.random() < 0.3,
                soft_cap=rng.random() < 0.3)


def random_case(rng: random.Random, family: dict, multi_token: bool):
    """One random case of the GPU sweep within `family`: ragged lengths incl. 0 and 1, query lengths (verify,
    chunked prefill, prefill), window size, soft cap value, scale."""
    batch = rng.randint(1, 8)
    kv_lens = [rng.choice([0, 1, rng.randint(2, 64), rng.randint(65, 3000), int(10 ** rng.uniform(0, 3.5))])
               for _ in range(batch)]
    q_lens = None
    if multi_token:
        kind = rng.choice(["verify", "chunk", "prefill"])
        q_lens = [min(n, rng.randint(1, 16) if kind == "verify" else rng.randint(0, 300) if kind == "chunk"
                      else n) for n in kv_lens]
    options = {}
    if family["window"]:
        options["window_left"] = rng.choice([0, 1, 15, 100, 1000])
    if family["soft_cap"]:
        options["soft_cap"] = rng.choice([1.0, 5.0, 30.0])
    if rng.random() < 0.2:
        options["scale"] = rng.uniform(0.02, 0.5)
    inputs = {k: v for k, v in family.items() if k not in ("window", "soft_cap")}
    inputs.update(kv_lens=kv_lens, q_lens=q_lens)
    return inputs, options


@gpu
@pytest.mark.parametrize("part", range(SWEEP_PARTS))
@pytest.mark.parametrize("multi_token", [False, True], ids=["decode", "extend"])
def test_random_sweep(multi_token, part):
    """320 seeded random cases per kernel (over the SWEEP_PARTS parts), all within tolerance; failures are
    collected and listed together."""
    failures, count = [], 0
    for i, (inputs, options) in sweep_cases(1234 + multi_token, part, random_family,
                                            lambda rng, family: random_case(rng, family, multi_token)):
        args = random_paged_inputs(**inputs, device=DEVICE, seed=i)
        count += 1
        try:
            check_attention(args, **options)
        except AssertionError as e:
            failures.append(f"case {i}: {inputs} {options}: {e}")
    assert count == 320 // SWEEP_PARTS
    assert not failures, f"{len(failures)} of {count} failed:\n" + "\n".join(failures[:20])


def random_write_family(rng: random.Random) -> dict:
    return dict(fmt=rng.choice(["bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2", "nvfp4", "mxfp4"]),
                head_dim=rng.choice([32, 64, 128, 256]), page_size=rng.choice([1, 16, 64, 256]),
                src_dtype=rng.choice([torch.bfloat16, torch.float16, torch.float32]),
                scale_kind=rng.choice(["per_tensor", "per_head"]))


def random_write_case(rng: random.Random, family: dict):
    family = dict(family)
    fmt, scale_kind = family.pop("fmt"), family.pop("scale_kind")
    kw = dict(family, num_tokens=rng.randint(1, 200), num_kv_heads=rng.choice([1, 2, 8]))
    kw["num_pages"] = -(-kw["num_tokens"] // kw["page_size"]) + 2
    return fmt, scale_kind, kw


@gpu
@pytest.mark.parametrize("part", range(SWEEP_PARTS))
def test_random_sweep_reshape_and_cache(part):
    failures, count = [], 0
    for i, (fmt, scale_kind, kw) in sweep_cases(99, part, random_write_family, random_write_case):
        count += 1
        try:
            assert_cache_write_exact(fmt, scale_kind, **kw, seed=i)
        except AssertionError as e:
            failures.append(f"case {i}: {fmt} {kw}: {e}")
    assert count == 320 // SWEEP_PARTS
    assert not failures, f"{len(failures)} of {count} failed:\n" + "\n".join(failures[:20])


@gpu
@pytest.mark.parametrize("forced", [False, True], ids=["heuristic", "offsets-32-forced"])
@pytest.mark.parametrize("kv_format", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("query_len", [1, 16], ids=["decode", "verify16"])
def test_attention_on_cache_over_2_31_elements(kv_format, forced, query_len, request):
    """Pages past element 2^31 (int32 address arithmetic would wrap): the sequence's pages are the last ones. With
    OFFSETS_32 on (forced, or the heuristic's for the 16-token verify tile), launch keeps int64 for such a
    cache."""
    if forced:
        request.getfixturevalue("full_tiles_32_bit")
    page_size, num_kv_heads, head_dim = 16, 8, 128
    per_page = 2 * page_size * num_kv_heads * head_dim
    num_pages = (2 ** 31) // per_page + 4096  # > 2^31 elements in the fused [num_pages, 2, ...] tensor
    dtype = torch.bfloat16 if kv_format == "bf16" else torch.float8_e4m3fn
    kv = torch.empty((num_pages, 2, page_size, num_kv_heads, head_dim), dtype=dtype, device="cuda")
    assert kv.numel() > 2 ** 31
    lens = [1000, 4000]
    pages_needed = [-(-n // page_size) for n in lens]
    used = torch.arange(num_pages - sum(pages_needed), num_pages, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    values = torch.randn((len(used), 2, page_size, num_kv_heads, head_dim), device="cuda", generator=gen).to(dtype)
    if dtype.itemsize == 1:  # index_put through bytes: no fp8 kernel needed
        kv.view(torch.uint8)[used] = values.view(torch.uint8)
    else:
        kv[used] = values
    table = torch.full((2, max(pages_needed)), -1, dtype=torch.int32, device="cuda")
    table[0, :pages_needed[0]] = used[:pages_needed[0]].int()
    table[1, :pages_needed[1]] = used[pages_needed[0]:].int().flip(0)
    cu_seqlens_q = (None if query_len == 1 else
                    torch.tensor([0, query_len, 2 * query_len], dtype=torch.int32, device="cuda"))
    args = dict(q=torch.randn(2 * query_len, 32, head_dim, device="cuda", generator=gen).bfloat16(),
                k_cache=kv[:, 0], v_cache=kv[:, 1], block_table=table,
                seq_lens=torch.tensor(lens, dtype=torch.int32, device="cuda"), cu_seqlens_q=cu_seqlens_q,
                kv_format="auto")
    if kv_format != "bf16":
        args.update(k_scale=torch.tensor(0.5, device="cuda"), v_scale=torch.tensor(0.8, device="cuda"))
    check_attention(args)
    del kv


@gpu
@pytest.mark.parametrize("kv_format", ["bf16", "fp8_e4m3", "nvfp4", "mxfp4"])
def test_call_memory_independent_of_cache_size(kv_format):
    """The extra device memory a call allocates (max_memory_allocated around it) is the same for a 1 GB and a
    40 GB cache: no workspace sized by the pool (no dequantized copy)."""
    page_size, num_kv_heads, head_dim, batch, max_pages = 16, 8, 128, 32, 256
    stored = formats.stored_head_dim(kv_format, head_dim)
    dtype = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}.get(kv_format, torch.uint8)
    bytes_per_page = 2 * page_size * num_kv_heads * stored * dtype.itemsize
    extra = {}
    for gigabytes in (1, 40):
        num_pages = gigabytes * 2 ** 30 // bytes_per_page
        kv = torch.zeros((num_pages, 2, page_size, num_kv_heads, stored), dtype=torch.uint8 if dtype.itemsize == 1
                         else dtype, device="cuda")
        kv = kv.view(dtype) if dtype.itemsize == 1 else kv
        args = dict(q=torch.randn(batch, 32, head_dim, device="cuda").bfloat16(), k_cache=kv[:, 0], v_cache=kv[:, 1],
                    block_table=torch.randint(0, num_pages, (batch, max_pages), dtype=torch.int32, device="cuda"),
                    seq_lens=torch.full((batch,), max_pages * page_size, dtype=torch.int32, device="cuda"),
                    kv_format=kv_format if formats.is_fp4(kv_format) else "auto")
        block_scales = None
        if formats.is_fp8(kv_format):
            args.update(k_scale=torch.tensor(1.0, device="cuda"), v_scale=torch.tensor(1.0, device="cuda"))
        elif formats.is_fp4(kv_format):
            block_scales = torch.zeros((num_pages, 2, page_size, num_kv_heads, head_dim // formats.FORMATS[kv_format].block),
                                       dtype=torch.uint8, device="cuda").view(formats.FORMATS[kv_format].scale_dtype)
            args.update(k_scale=block_scales[:, 0], v_scale=block_scales[:, 1])
        out = torch.empty_like(args["q"])
        with attnops.use_backend("triton"):
            extra[gigabytes] = extra_call_memory(lambda: attnops.paged_attention(**args, out=out))
        del kv, block_scales, args
        torch.cuda.empty_cache()
    assert extra[1] == extra[40], f"extra memory per call: {extra}"
    assert extra[40] < 64 * 2 ** 20  # workspace: batch x heads x splits x head_dim, far below the cache


@gpu
@pytest.mark.parametrize("kv_format", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("q_lens", [None, [4, 4, 30]], ids=["decode", "extend"])
def test_fp4_inline_ptx_decode(q_lens, kv_format):
    """FP4_ASM (the inline-PTX nibble decode, GPU only) against the reference, bf16 q (nvfp4: fp16 dots, mxfp4:
    bf16 dots)."""
    from attnops.backends.triton.launch import launch
    args = random_paged_inputs([300, 17, 1000], q_lens, kv_format=kv_format, q_dtype=torch.bfloat16, num_q_heads=8,
                               num_kv_heads=2, head_dim=128, device=DEVICE, seed=4)
    out = torch.full_like(args["q"], float("nan"))
    launch(args["q"], args["k_cache"], args["v_cache"], args["block_table"], args["seq_lens"], args["cu_seqlens_q"],
           scale=128 ** -0.5, soft_cap=0.0, window_left=-1, kv_format=kv_format, k_scale=args["k_scale"],
           v_scale=args["v_scale"], out=out, config=dict(FP4_ASM=True))
    ref = paged_attention_reference(**args, compute_dtype=torch.float64)
    assert relative_error(out, ref) < 1e-2


@gpu
@pytest.mark.parametrize("kv_format,scale_kind", [("fp8_e4m3", "per_tensor"), ("fp8_e5m2", "per_head"),
                                                  ("nvfp4", None), ("mxfp4", None)])
@pytest.mark.parametrize("q_lens", [None, [4, 4, 30]], ids=["decode", "extend"])
def test_v_dequantized_before_the_dot_layout(q_lens, kv_format, scale_kind):
    """V_DEQUANT_FIRST (V converted in its load's layout, kept there by a multiply by an inline-PTX 1.0; GPU only):
    same answers as the reference."""
    from attnops.backends.triton.launch import launch
    args = random_paged_inputs([300, 17, 1000], q_lens, kv_format=kv_format, scale_kind=scale_kind or "per_tensor",
                               q_dtype=torch.bfloat16, num_q_heads=8, num_kv_heads=2, head_dim=128, device=DEVICE,
                               seed=6)
    ref = paged_attention_reference(**args, compute_dtype=torch.float64)
    out = torch.full_like(args["q"], float("nan"))
    launch(args["q"], args["k_cache"], args["v_cache"], args["block_table"], args["seq_lens"], args["cu_seqlens_q"],
           scale=128 ** -0.5, soft_cap=0.0, window_left=-1, kv_format=kv_format, k_scale=args["k_scale"],
           v_scale=args["v_scale"], out=out, config=dict(V_DEQUANT_FIRST=True))
    assert relative_error(out, ref) < 1e-2


@pytest.mark.parametrize("pairs", [dict(FP8_V_PAIRS=True), dict(FP8_K_PAIRS=True),
                                   dict(FP8_V_PAIRS=True, FP8_K_PAIRS=True)], ids=["v", "k", "kv"])
@pytest.mark.parametrize("kv_format,scale_kind", [("fp8_e4m3", "per_tensor"), ("fp8_e5m2", "per_head")])
@pytest.mark.parametrize("q_lens,window,soft_cap", [(None, -1, 0.0), ([4, 1, 0, 30], 40, 30.0)],
                         ids=["decode", "extend-window-softcap"])
@pytest.mark.parametrize("q_dtype", [F16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
def test_fp8_read_as_byte_pairs(q_lens, window, soft_cap, kv_format, scale_kind, pairs, q_dtype):
    """FP8_V_PAIRS / FP8_K_PAIRS (fp8 V / K read as 16-bit words, split into even and odd elements: on the GPU by
    inline PTX, under the interpreter by casts) give the reference's answers, output columns in place, decode and
    extend."""
    from attnops.backends.triton.launch import launch
    args = random_paged_inputs([300, 17, 0, 1], q_lens, kv_format=kv_format, scale_kind=scale_kind,
                               q_dtype=q_dtype, num_q_heads=8, num_kv_heads=2, head_dim=64, device=DEVICE, seed=9)
    ref = paged_attention_reference(**args, window_left=window, soft_cap=soft_cap, compute_dtype=torch.float64)
    out = torch.full_like(args["q"], float("nan"))
    launch(args["q"], args["k_cache"], args["v_cache"], args["block_table"], args["seq_lens"], args["cu_seqlens_q"],
           scale=64 ** -0.5, soft_cap=soft_cap, window_left=window, kv_format=kv_format, k_scale=args["k_scale"],
           v_scale=args["v_scale"], out=out, config=pairs)
    assert relative_error(out, ref) < 1e-2


@pytest.mark.parametrize("q_dtype", [F16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
def test_fp8_pairs_on_a_cache_at_an_odd_address(q_dtype):
    """A cache view that starts at an odd byte cannot be read as 16-bit words: launch() falls back to bytes (on the
    GPU a word load there would be a misaligned-address fault), with the reference's answers."""
    from attnops.backends.triton.launch import launch
    args = random_paged_inputs([300, 17, 1], None, kv_format="fp8_e4m3", q_dtype=q_dtype, num_q_heads=8,
                               num_kv_heads=2, head_dim=64, device=DEVICE, seed=4)
    for name in ("k_cache", "v_cache"):
        cache = args[name]
        buffer = torch.empty(cache.numel() + 1, dtype=torch.uint8, device=DEVICE)
        shifted = buffer[1:].view(cache.dtype).view(cache.shape)
        shifted.copy_(cache)
        assert shifted.data_ptr() % 2 == 1
        args[name] = shifted
    ref = paged_attention_reference(**args, compute_dtype=torch.float64)
    out = torch.full_like(args["q"], float("nan"))
    launch(args["q"], args["k_cache"], args["v_cache"], args["block_table"], args["seq_lens"], None,
           scale=64 ** -0.5, soft_cap=0.0, window_left=-1, kv_format="fp8_e4m3", k_scale=args["k_scale"],
           v_scale=args["v_scale"], out=out, config=dict(FP8_V_PAIRS=True, FP8_K_PAIRS=True))
    assert relative_error(out, ref) < 1e-2


@gpu
@pytest.mark.parametrize("q_lens", [None, [4, 1, 0, 30]], ids=["decode", "extend"])
def test_merge_as_programmatic_dependent_launch(q_lens):
    """PDL (the merge kernel launched as a programmatic dependent of the attention kernel; the heuristic's choice
    on sm_90+): right answers with many splits, 20 times on new data eagerly, then replayed in a CUDA graph (a
    missing griddepcontrol.wait shows as rows merged from stale partials)."""
    from attnops.backends.triton.launch import launch
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90+")
    args = random_paged_inputs([20000, 1, 0, 9000], q_lens, num_q_heads=32, num_kv_heads=8, head_dim=128,
                               kv_format="bf16", q_dtype=torch.bfloat16, device="cuda", seed=3)
    out = torch.empty_like(args["q"])
    run = lambda: launch(args["q"], args["k_cache"], args["v_cache"], args["block_table"], args["seq_lens"],  # noqa
                         args["cu_seqlens_q"], scale=128 ** -0.5, soft_cap=0.0, window_left=-1, kv_format="bf16",
                         k_scale=None, v_scale=None, out=out, config=dict(PDL=True, MAX_SPLITS=32, CHUNK=512))
    errors = []
    for _ in range(20):
        args["q"].normal_()
        out.fill_(float("nan"))
        run()
        errors.append(relative_error(out, paged_attention_reference(**args, compute_dtype=torch.float64)))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for _ in range(5):
        args["q"].normal_()
        out.fill_(float("nan"))
        graph.replay()
        errors.append(relative_error(out, paged_attention_reference(**args, compute_dtype=torch.float64)))
    assert all(e < 1e-2 for e in errors), errors  # NaN fails too


# (tunables forced, KV format, sequences, the table's keys a sequence): the shapes' plan; WAVE_PLAN; FILL_WAVES where
# it shortens the splits on a 132-SM GPU (32 sequences x 8 KV heads x 8192 keys)
CAPTURE_PLANS = [("WAVE_PLAN=0", "bf16", 4, 3000), ("WAVE_PLAN=3", "bf16", 4, 3000),
                 ("FILL_WAVES=1", "bf16", 32, 8192), ("FILL_WAVES=1", "fp8_e4m3", 32, 8192)]


@gpu
@pytest.mark.parametrize("tunables,kv_format,batch,capacity", CAPTURE_PLANS,
                         ids=["shapes_plan", "wave_plan", "fill_waves", "fill_waves_fp8"])
def test_cuda_graph_capture_and_replay_with_new_lengths(tunables, kv_format, batch, capacity, monkeypatch, request):
    """Captured once, replayed with new seq_lens and block tables: the split count is decided on the device (and
    with WAVE_PLAN forced, the split size too, from each replay's lengths; FILL_WAVES' splits are fixed by the
    table's capacity)."""
    from attnops.backends.triton.heuristics import forced_tunables
    monkeypatch.setenv("ATTNOPS_TRITON_TUNABLES", tunables)
    forced_tunables.cache_clear()
    request.addfinalizer(forced_tunables.cache_clear)
    # built for `capacity` keys each (every table row has its pages), replayed with any lengths up to that
    args = random_paged_inputs([capacity] * batch, num_q_heads=32, num_kv_heads=8, head_dim=128, kv_format=kv_format,
                               q_dtype=torch.bfloat16, device="cuda", seed=0)
    out = torch.empty_like(args["q"])
    run = lambda: attnops.paged_attention(**args, out=out)  # noqa: E731
    with attnops.use_backend("triton"):
        run()  # compile outside the capture
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
    rng, tolerance = random.Random(batch), 2e-2 if kv_format == "fp8_e4m3" else 1e-2
    for lens in ([rng.randint(0, capacity) for _ in range(batch)], [capacity] * batch, [0] * (batch - 1) + [5],
                 [1] * (batch - 1) + [capacity]):
        args["seq_lens"].copy_(torch.tensor(lens, dtype=torch.int32))
        args["q"].normal_()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = paged_attention_reference(**args, compute_dtype=torch.float64)
        assert relative_error(out, ref) < tolerance, (tunables, lens[:4])
