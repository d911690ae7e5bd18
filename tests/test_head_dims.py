"""Every head dim the ops take, a multiple of 16 from 16 to 512 (Phi-2's 80, Phi-3's 96, 192, 512 ...), on the
reference, the C++ CPU kernels and Triton's padded tiles (its interpreter here; the GPU run is marked gpu):
- random ragged batches (decode and extend, GQA groups, windows, soft caps, sinks) through the cpu and reference
  backends against the float64 reference, every KV format each serves whose scale block divides the head dim, output
  and LSE; long sequences whose keys the CPU kernels split over threads;
- each instruction-set copy of the CPU inner loops at head dims whose rows are an odd number of vectors (80, 48);
- reshape_and_cache: bit-exact against attnops.formats' quantization, and the stored values read back;
- merge_attention_states (the CPU path, and the GPU's Triton kernel under the interpreter) and cascade_attention;
- head dims that are not served (72, 528; mxfp4 at 80) are ValueErrors naming head_dim (and kv_format);
- on a GPU, auto dispatch of head dim 96 takes Triton's padded tile (flashinfer and cuda decline it, saying why),
  the reference when the padded tiles are switched off.
A tiny random Phi-3 (head dim 96) through attnops.hf is one of tests/test_hf.py's families (attnops.hf.families).
"""
from __future__ import annotations

import itertools
import random
import textwrap

import pytest
import torch

import attnops
from attnops import dispatch, formats
from attnops.backends import BACKENDS, cpu, reference
from attnops.backends.reference import merge_attention_states_reference, paged_attention_reference
from attnops.cases import AttentionCase
from attnops.checks import HEAD_DIMS
from attnops.testing import random_paged_inputs, relative_error
from conftest import ISA_PARAMS, run_with_cpu_isa
from test_cascade import shared_case

TESTED_HEAD_DIMS = [16, 48, 80, 96, 112, 160, 192, 320, 512]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
# q's dtype for each format: the cache's own for the plain formats, a mix for the scaled ones
Q_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8_e4m3": torch.float32,
           "fp8_e5m2": torch.float16, "nvfp4": torch.float32, "mxfp4": torch.bfloat16}
BACKEND_NAMES = [name for name in ("cpu", "reference") if not BACKENDS[name].unavailable()]
# Triton's kernels under its interpreter (no GPU): padded tiles (a head dim between powers of two in the next one's
# tile, columns past it masked) and 512; formats the interpreter runs (not bf16) and that the tiles serve (the
# 4-bit ones at powers of two only)
TRITON_INTERPRETED = not torch.cuda.is_available() and not BACKENDS["triton"].unavailable()
TRITON_HEAD_DIMS = {48: ["fp16", "fp8_e4m3", "nvfp4"], 80: ["fp32", "fp8_e5m2", "nvfp4"], 96: ["fp16", "fp32", "mxfp4"],
                    160: ["fp8_e4m3", "fp16", "mxfp4"], 512: ["fp16", "nvfp4"]}


def served_formats(backend: str, head_dim: int, writes: bool = False) -> list[str]:
    """The KV formats `backend` declares (for cache writes: those it writes), those whose scale block divides
    `head_dim` (mxfp4's 32 values do not divide 80)."""
    declared = {"cpu": cpu.WRITE_KV_FORMATS if writes else cpu.KV_FORMATS, "reference": reference.KV_FORMATS}[backend]
    return [f for f in declared if head_dim % (formats.FORMATS[f].block or 1) == 0]


def random_case(rng: random.Random, head_dim: int, kv_format: str, mode: str, q_dtype=None) -> tuple[dict, dict]:
    """(paged_attention's tensors, its options) of a random ragged batch: 1-4 sequences with an empty or one-token
    one among them at times, 1-2 KV heads of groups 1-8. q_dtype: the format's usual one (Q_DTYPE) if None."""
    batch = rng.randint(1, 4)
    kv_lens = [rng.choice([0, 1, rng.randint(2, 80), rng.randint(2, 80)]) for _ in range(batch)]
    q_lens = None if mode == "decode" else [rng.randint(1, n) if n else 0 for n in kv_lens]
    num_kv_heads, group = rng.choice([1, 2]), rng.choice([1, 2, 4, 8])
    args = random_paged_inputs(kv_lens, q_lens, num_q_heads=num_kv_heads * group, num_kv_heads=num_kv_heads,
                               head_dim=head_dim, page_size=rng.choice([1, 4, 16, 64]), kv_format=kv_format,
                               q_dtype=q_dtype or Q_DTYPE[kv_format], scale_kind=rng.choice(["per_tensor", "per_head"]),
                               seed=rng.randrange(1 << 30))
    options = dict(window_left=rng.choice([-1, -1, rng.randint(0, 20)]), soft_cap=rng.choice([0.0, 0.0, 15.0]))
    if rng.random() < 0.3:
        options["sinks"] = torch.randn(num_kv_heads * group) * 2
    return args, options


def check_against_reference(backend: str, args: dict, options: dict) -> float:
    """The op with `backend` pinned (outputs poisoned first) against the float64 reference fed the same stored
    cache: output and LSE. Returns the output's relative error."""
    q = args["q"]
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)
    lse = torch.full(q.shape[:2], float("nan"))
    with attnops.use_backend(backend):
        attnops.paged_attention_with_lse(**args, **options, out=out, lse=lse)
    ref, ref_lse = paged_attention_reference(**{**args, "q": q.double()}, **options, return_lse=True)
    assert not out.isnan().any()
    torch.testing.assert_close(lse, ref_lse.float(), rtol=1e-4, atol=1e-4)
    if not ref.any():  # no rows, or every row sees no key
        assert (out == 0).all()
        return 0.0
    err = relative_error(out, ref)
    assert err < TOLERANCE[q.dtype], f"relative error {err:.3g}"
    return err


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("head_dim", TESTED_HEAD_DIMS)
def test_random_batches_match_the_reference(backend, head_dim):
    rng = random.Random(f"{backend}:{head_dim}")
    for kv_format in served_formats(backend, head_dim):
        for mode in ("decode", "extend"):
            args, options = random_case(rng, head_dim, kv_format, mode)
            try:
                check_against_reference(backend, args, options)
            except AssertionError as e:
                raise AssertionError(f"{kv_format} {mode} lens={args['seq_lens'].tolist()} "
                                     f"heads={args['q'].shape[1]}/{args['k_cache'].shape[2]} {options}: {e}") from None


@pytest.fixture
def head_parts(request, monkeypatch):
    """Triton's kernels with a head dim between powers of two in two tiles (HEAD_PARTS forced on every call) if
    the parameter is "two-tiles", else in one padded tile (forced off: the heuristic takes two tiles for decode at
    160 and 192), its columns past the head dim masked, or read as copies of its first ones ("wrapped": PAD_WRAP).
    Yields whether two tiles run."""
    from attnops.backends.triton import heuristics
    forced = {"one-tile": "HEAD_PARTS=0", "two-tiles": "HEAD_PARTS=1", "wrapped": "HEAD_PARTS=0,PAD_WRAP=1"}
    monkeypatch.setenv("ATTNOPS_TRITON_TUNABLES", forced[request.param])
    heuristics.forced_tunables.cache_clear()
    yield request.param == "two-tiles"
    heuristics.forced_tunables.cache_clear()


def test_head_parts_widths():
    """Two tiles: the power of two below the head dim, then the rest as a power of two of at least 32 columns (64
    for 4-bit), only where both are narrower than the one padded tile."""
    pytest.importorskip("triton")
    from attnops.backends.triton.heuristics import head_parts
    assert [head_parts(d, "bf16") for d in (48, 80, 96, 112, 160, 192, 320, 128, 512)] == [0, 32, 32, 0, 32, 64, 64,
                                                                                             0, 0]
    assert [head_parts(d, "fp8_e4m3") for d in (80, 96, 160)] == [32, 32, 32]
    assert [head_parts(d, "nvfp4") for d in (80, 96, 160, 192)] == [0, 0, 64, 64]


@pytest.mark.skipif(not TRITON_INTERPRETED, reason="the interpreter's run (no GPU); the GPU's: gpu_round.sh")
@pytest.mark.parametrize("head_parts", ["one-tile", "two-tiles"], indirect=True)
@pytest.mark.parametrize("head_dim", list(TRITON_HEAD_DIMS))
def test_triton_padded_tiles_match_the_reference(head_dim, head_parts):
    """Random ragged batches (decode and extend, windows, soft caps, sinks, LSE) through Triton's kernels in
    padded tiles (or two tiles, with HEAD_PARTS), against the float64 reference; long sequences split and merged."""
    from attnops.backends.triton.heuristics import head_parts as second_tile
    if head_parts and not any(second_tile(head_dim, f) for f in TRITON_HEAD_DIMS[head_dim]):
        pytest.skip(f"head dim {head_dim} is one tile in every format tested")
    rng = random.Random(f"triton:{head_dim}")
    for kv_format in TRITON_HEAD_DIMS[head_dim]:
        for mode in ("decode", "extend"):
            # (the interpreter has no bf16: mxfp4's usual queries)
            args, options = random_case(rng, head_dim, kv_format, mode,
                                        q_dtype=torch.float16 if Q_DTYPE[kv_format] == torch.bfloat16 else None)
            try:
                check_against_reference("triton", args, options)
            except AssertionError as e:
                raise AssertionError(f"{kv_format} {mode} lens={args['seq_lens'].tolist()} "
                                     f"heads={args['q'].shape[1]}/{args['k_cache'].shape[2]} {options}: {e}") from None
    # splits (the interpreter's CHUNK is 2 tiles): partials of the padded width merged
    args = random_paged_inputs([300, 45], [2, 1], num_q_heads=4, num_kv_heads=2, head_dim=head_dim,
                               kv_format="fp16", q_dtype=torch.float16, seed=head_dim)
    check_against_reference("triton", args, dict(window_left=-1, soft_cap=0.0))


@pytest.mark.skipif(not TRITON_INTERPRETED, reason="the interpreter's run (no GPU)")
@pytest.mark.parametrize("kv_format, pairs, parts, head_dim, wrap", [
    ("nvfp4", False, False, 96, False), ("mxfp4", False, False, 96, False), ("fp8_e4m3", False, False, 96, False),
    ("fp8_e4m3", True, False, 96, False), ("fp8_e4m3", True, True, 80, False), ("fp16", False, True, 80, False),
    ("nvfp4", False, True, 160, False), ("fp16", False, False, 96, True), ("fp8_e4m3", False, True, 80, True)])
def test_triton_padded_tiles_read_nothing_past_the_head_dim(kv_format, pairs, parts, head_dim, wrap, monkeypatch):
    """Caches (and 4-bit block scales) as views into rows wider than the head dim, the columns past it NaN bytes:
    a padded tile that read them (its tile's width, 128 for 96) would put NaN into every score (0 x NaN); the
    result must be the reference's. `pairs`: fp8 read as 16-bit words (FP8_V_PAIRS/FP8_K_PAIRS, forced); `parts`:
    two tiles (HEAD_PARTS, forced), whose second one is padded too at 80 (64 + 32); `wrap`: the columns past the
    head dim read as copies of the first ones (PAD_WRAP, forced)."""
    from attnops.backends.triton import heuristics
    forced = (["FP8_V_PAIRS=1", "FP8_K_PAIRS=1"] if pairs else []) + (["HEAD_PARTS=1"] if parts else []) + (
        ["PAD_WRAP=1"] if wrap else [])
    if forced:
        monkeypatch.setenv("ATTNOPS_TRITON_TUNABLES", ",".join(forced))
    heuristics.forced_tunables.cache_clear()
    try:
        args = random_paged_inputs([70, 9, 130], [3, 1, 2], num_q_heads=8, num_kv_heads=2, head_dim=head_dim,
                                   page_size=16, kv_format=kv_format, q_dtype=torch.float16, seed=11)
        for name in ("k_cache", "v_cache") + (("k_scale", "v_scale") if kv_format in ("nvfp4", "mxfp4") else ()):
            t = args[name]
            raw = t.view(torch.uint8) if t.dtype != torch.uint8 else t
            wide = torch.full(raw.shape[:-1] + (2 * raw.shape[-1],), 0x7F if name.endswith("cache") else 0xFF,
                              dtype=torch.uint8)
            if kv_format == "nvfp4" and name.endswith("scale"):
                wide.fill_(0x7F)  # (e4m3's NaN; mxfp4's e8m0 NaN is 0xFF)
            wide[..., :raw.shape[-1]] = raw
            args[name] = wide[..., :raw.shape[-1]].view(t.dtype)
        check_against_reference("triton", args, dict(window_left=-1, soft_cap=0.0))
    finally:
        heuristics.forced_tunables.cache_clear()


@pytest.mark.skipif(not TRITON_INTERPRETED, reason="the interpreter's run (no GPU)")
@pytest.mark.parametrize("head_dim", [48, 80, 96, 160])
def test_wrapped_padded_columns_change_no_bit(head_dim, monkeypatch):
    """PAD_WRAP (a padded tile's columns past the head dim read as copies of its first ones, not masked to 0) gives
    the masked tile's bits, output and LSE: the copies meet q's zero columns in q.k (adding exact zeros) and fill
    output columns that are never stored. Random ragged decode and extend batches with splits, windows and sinks,
    one tile and two (HEAD_PARTS, whose second tile is padded at 80 and 160)."""
    from attnops.backends.triton import heuristics
    rng = random.Random(f"wrap:{head_dim}")
    for i, (kv_format, parts) in enumerate(itertools.product(("fp16", "fp8_e5m2", "fp32"), (0, 1))):
        q_lens = None if i % 2 == 0 else [rng.randint(1, 4) for _ in range(3)]
        kv_lens = [rng.randint(5, 300), rng.randint(1, 70), rng.randint(30, 200)]
        args = random_paged_inputs(kv_lens, q_lens, num_q_heads=8, num_kv_heads=2, head_dim=head_dim, page_size=16,
                                   kv_format=kv_format, q_dtype=torch.float32 if kv_format == "fp32" else
                                   torch.float16, seed=rng.randrange(1 << 30))
        options = dict(window_left=rng.choice([-1, 40]), sinks=torch.randn(8))
        results = []
        for wrap in (0, 1):
            monkeypatch.setenv("ATTNOPS_TRITON_TUNABLES", f"HEAD_PARTS={parts},PAD_WRAP={wrap}")
            heuristics.forced_tunables.cache_clear()
            with attnops.use_backend("triton"):
                results.append(attnops.paged_attention_with_lse(**args, **options))
        heuristics.forced_tunables.cache_clear()
        (out0, lse0), (out1, lse1) = results
        assert torch.equal(out0, out1) and torch.equal(lse0, lse1), (kv_format, parts, kv_lens, q_lens, options)
        assert not out0.isnan().any()


@pytest.mark.skipif(not TRITON_INTERPRETED, reason="the interpreter's run (no GPU)")
@pytest.mark.parametrize("head_dim", [48, 96])
def test_triton_cache_write_in_padded_tiles(head_dim):
    """reshape_and_cache's Triton kernel at a padded width writes exactly what the reference does, and nothing past
    a row's head dim (the next head's values stay)."""
    gen = torch.Generator().manual_seed(head_dim)
    for kv_format in ("fp16", "fp8_e4m3", "nvfp4") + (("mxfp4",) if head_dim % 32 == 0 else ()):
        caches = {}
        key = torch.randn(10, 2, head_dim, generator=gen).half()
        value = torch.randn(10, 2, head_dim, generator=gen).half()
        slots = torch.randperm(4 * 8, generator=gen)[:10]
        slots[3] = -1
        for backend in ("reference", "triton"):
            cache = attnops.PagedKVCache(1, 4, 8, 2, head_dim, kv_format=kv_format, k_scale=torch.tensor(0.05),
                                         v_scale=torch.tensor(0.04))
            cache.kv[0].view(torch.uint8).fill_(0x3C)
            if cache.block_scales is not None:
                cache.block_scales[0].view(torch.uint8).fill_(0x3C)
            write = cache.write_args(0)
            with attnops.use_backend(backend):
                attnops.reshape_and_cache(key, value, slot_mapping=slots, **write)
            caches[backend] = [t[0].view(torch.uint8).clone() for t in (cache.kv, cache.block_scales) if t]
        assert all(torch.equal(t, r) for t, r in zip(caches["triton"], caches["reference"])), kv_format


@pytest.mark.gpu
@pytest.mark.parametrize("head_parts", ["one-tile", "two-tiles", "wrapped"], indirect=True)
@pytest.mark.parametrize("head_dim", [48, 80, 96, 160, 192, 512])
def test_triton_padded_tiles_on_the_gpu(head_dim, head_parts, request, monkeypatch):
    """bf16, fp16, fp8 and the 4-bit formats whose block divides the head dim through Triton's padded tiles (or
    two tiles, HEAD_PARTS; or columns past the head dim read as copies, PAD_WRAP) on the GPU, decode and verify with
    splits, windows and sinks, against the float64 reference; and under a CUDA graph the user captured."""
    if head_parts and head_dim in (48, 512):
        pytest.skip(f"head dim {head_dim} is one tile")
    if "wrapped" in request.node.callspec.id and head_dim == 512:
        pytest.skip("head dim 512 fills its tile")
    monkeypatch.delenv("ATTNOPS_TRITON_PADDED_HEADS", raising=False)
    dispatch._select_cached.cache_clear()
    rng = random.Random(head_dim)
    four_bit = [(f, torch.bfloat16) for f in ("nvfp4", "mxfp4") if head_dim % formats.FORMATS[f].block == 0]
    plain = [("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp8_e4m3", torch.bfloat16)]
    for kv_format, q_dtype in plain + four_bit:
        for q_lens in (None, [4, 1, 7]):
            kv_lens = [rng.randint(1, 5000), rng.randint(1, 300), rng.randint(7, 9000)]
            args = random_paged_inputs(kv_lens, q_lens, num_q_heads=8, num_kv_heads=2, head_dim=head_dim,
                                       page_size=16, kv_format=kv_format, q_dtype=q_dtype, device="cuda",
                                       seed=rng.randrange(1 << 30))
            options = dict(window_left=rng.choice([-1, 700]), sinks=torch.randn(8, device="cuda"))
            with attnops.use_backend("triton"):
                out, lse = attnops.paged_attention_with_lse(**args, **options)
            cpu_args = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
            ref, ref_lse = paged_attention_reference(**{**cpu_args, "q": cpu_args["q"].double()},
                                                     **{**options, "sinks": options["sinks"].cpu()}, return_lse=True)
            assert relative_error(out.cpu(), ref) < 1e-2, (kv_format, q_lens)
            torch.testing.assert_close(lse.cpu(), ref_lse.float(), rtol=1e-3, atol=2e-3)
    graph, static = torch.cuda.CUDAGraph(), torch.empty_like(args["q"])
    with attnops.use_backend("triton"):
        attnops.paged_attention(**args, out=static)
        with torch.cuda.graph(graph):
            attnops.paged_attention(**args, out=static)
    static.zero_()
    graph.replay()
    with attnops.use_backend("triton"):
        assert torch.equal(static, attnops.paged_attention(**args))


def test_triton_serves_padded_head_dims_on_a_gpu_unless_switched_off(monkeypatch):
    """Triton's padded tiles (and 512) serve a GPU's calls by default, 4-bit formats too;
    ATTNOPS_TRITON_PADDED_HEADS=0 turns them off there, saying so."""
    triton_backend = BACKENDS["triton"]
    if triton_backend.unavailable() and not torch.cuda.is_available():
        monkeypatch.setattr(type(triton_backend), "unavailable", lambda self: [])
    monkeypatch.delenv("ATTNOPS_TRITON_PADDED_HEADS", raising=False)
    case = AttentionCase.of_shapes(device_type="cuda", arch=(9, 0), q_dtype=torch.bfloat16, kv_format="bf16",
                                   head_dim=96, page_size=16, num_q_heads=32, num_kv_heads=8, batch=4, num_tokens=4,
                                   max_kv_len=4096, decode=True)
    for head_dim in (96, 512):
        assert triton_backend.supports(type(case)(**{**case.__dict__, "head_dim": head_dim})) == []
        fp4 = type(case)(**{**case.__dict__, "kv_format": "nvfp4", "head_dim": head_dim})
        assert triton_backend.supports(fp4) == []
    monkeypatch.setenv("ATTNOPS_TRITON_PADDED_HEADS", "0")
    for head_dim in (96, 512):
        reasons = triton_backend.supports(type(case)(**{**case.__dict__, "head_dim": head_dim}))
        assert any("ATTNOPS_TRITON_PADDED_HEADS=0" in r for r in reasons), reasons
    assert triton_backend.supports(type(case)(**{**case.__dict__, "head_dim": 128})) == []


@pytest.mark.skipif("cpu" not in BACKEND_NAMES, reason="C++ CPU kernels not built")
@pytest.mark.parametrize("head_dim", [80, 96, 512])
def test_long_sequences_split_over_threads(head_dim):
    """Keys split over threads (partial results merged by log-sum-exp in the kernels' merge) at widths whose
    rows are not a power of two, and the widest."""
    previous = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        for q_lens in (None, [3, 1]):
            args = random_paged_inputs([1500, 700], q_lens, num_q_heads=4, num_kv_heads=1, head_dim=head_dim,
                                       kv_format="bf16", q_dtype=torch.bfloat16, seed=head_dim)
            check_against_reference("cpu", args, dict(window_left=900))
    finally:
        torch.set_num_threads(previous)


# (on its own: importing this file would import conftest, and with it transformers, in each subprocess)
ISA_SCRIPT = textwrap.dedent("""
    import torch, attnops
    from attnops.backends import BACKENDS
    from attnops.backends.reference import paged_attention_reference
    from attnops.testing import random_paged_inputs, relative_error
    print("isa", BACKENDS["cpu"].isa())
    for head_dim in (80, 48):
        for kv_format, q_dtype, tolerance in (("fp32", torch.float32, 1e-5), ("bf16", torch.bfloat16, 1e-2),
                                              ("fp16", torch.float16, 1e-2), ("fp8_e4m3", torch.float32, 1e-5),
                                              ("fp8_e5m2", torch.float16, 1e-2)):
            for q_lens in (None, [3, 9, 0]):
                args = random_paged_inputs([40, 77, 5], q_lens, num_q_heads=8, num_kv_heads=2, head_dim=head_dim,
                                           kv_format=kv_format, q_dtype=q_dtype, seed=head_dim)
                with attnops.use_backend("cpu"):
                    out = attnops.paged_attention(**args, soft_cap=20.0)
                ref = paged_attention_reference(**{**args, "q": args["q"].double()}, soft_cap=20.0)
                error = relative_error(out, ref)
                assert error < tolerance, (head_dim, kv_format, q_lens, error)
        print("head_dim", head_dim, "ok")
""")


@pytest.mark.skipif("cpu" not in BACKEND_NAMES, reason="C++ CPU kernels not built")
@pytest.mark.parametrize("capability,isa", ISA_PARAMS)
def test_every_instruction_set_at_odd_widths(capability, isa):
    """A row of 80 values is 5 AVX-512 vectors (10 of AVX2's), of 48 three: the value loop's register blocks do not
    divide them."""
    run_with_cpu_isa(ISA_SCRIPT, capability, isa)


# ----------------------------------------------------------------------------------------------------------------
# reshape_and_cache

# how far a value read back from each format may be from the value written (relative norm error)
ROUND_TRIP = {"fp32": 0.0, "bf16": 4e-3, "fp16": 5e-4, "fp8_e4m3": 0.04, "fp8_e5m2": 0.08, "nvfp4": 0.15,
              "mxfp4": 0.2}


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("head_dim", TESTED_HEAD_DIMS)
def test_reshape_and_cache_round_trips(backend, head_dim):
    """Tokens written at random slots (some padding) hold exactly what attnops.formats makes of them, read back
    close to what was written, and nothing else of the cache changes."""
    gen = torch.Generator().manual_seed(head_dim)
    heads, tokens, page_size = 2, 24, 8
    num_pages = tokens // page_size + 2
    for kv_format in served_formats(backend, head_dim, writes=True):
        fmt = formats.FORMATS[kv_format]
        cache = attnops.PagedKVCache(1, num_pages, page_size, heads, head_dim, kv_format=kv_format,
                                     k_scale=torch.tensor([0.02, 0.03]), v_scale=torch.tensor(0.025))
        cache.kv[0].view(torch.uint8).random_(0, 256, generator=gen)  # old contents, which must stay
        write = cache.write_args(0)
        before = [t.clone() for t in (write["k_cache"], write["v_cache"])]
        key = torch.randn(tokens, heads, head_dim, generator=gen)
        value = torch.randn(tokens, heads, head_dim, generator=gen)
        slots = torch.randperm(num_pages * page_size, generator=gen)[:tokens]
        slots[::5] = -1
        with attnops.use_backend(backend):
            attnops.reshape_and_cache(key, value, slot_mapping=slots, **write)
        keep = slots >= 0
        pages, offsets = slots[keep] // page_size, slots[keep] % page_size
        for name, src, scale_name, old in (("k_cache", key, "k", before[0]), ("v_cache", value, "v", before[1])):
            block = fmt.scale == formats.BLOCK_SCALE
            scale = write.get(f"{scale_name}_block_scale" if block else f"{scale_name}_scale")
            stored = write[name][pages, offsets]
            expected, expected_block = formats.quantize(src[keep], kv_format, scale, fmt.storage_dtype)
            assert torch.equal(stored.view(torch.uint8), expected.view(torch.uint8)), f"{kv_format} {name}"
            if block:
                assert torch.equal(scale[pages, offsets].view(torch.uint8), expected_block.view(torch.uint8))
            read = formats.dequantize(stored, kv_format, scale[pages, offsets] if block else scale)
            assert relative_error(read, src[keep]) <= ROUND_TRIP[kv_format], f"{kv_format} {name}"
            untouched = torch.ones(num_pages, page_size, dtype=torch.bool)
            untouched[pages, offsets] = False
            assert torch.equal(write[name][untouched].view(torch.uint8), old[untouched].view(torch.uint8))


# ----------------------------------------------------------------------------------------------------------------
# merge_attention_states and cascade_attention


@pytest.mark.parametrize("head_dim", TESTED_HEAD_DIMS)
def test_merge_attention_states(head_dim):
    """The op on the CPU against the merge in float64, sides with no key included; the GPU's Triton kernel (run
    here by its interpreter) pads a head dim to a power of two and masks, so it takes these too."""
    gen = torch.Generator().manual_seed(head_dim)
    out_a, out_b = (torch.randn(5, 3, head_dim, generator=gen) for _ in range(2))
    lse_a, lse_b = (torch.randn(5, 3, generator=gen) * 3 for _ in range(2))
    lse_a[0, 0] = lse_b[1, 1] = float("-inf")
    lse_a[2, 2] = lse_b[2, 2] = float("-inf")
    want_out, want_lse = torch.empty(out_a.shape, dtype=torch.float64), torch.empty(lse_a.shape, dtype=torch.float64)
    merge_attention_states_reference(out_a, lse_a, out_b, lse_b, want_out, want_lse)
    out, lse = attnops.merge_attention_states(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(out, want_out.float())
    torch.testing.assert_close(lse, want_lse.float())
    if head_dim in (80, 512) and not BACKENDS["triton"].unavailable():
        from attnops.backends.triton.merge_states import merge_states
        out, lse = torch.full_like(out_a, float("nan")), torch.full_like(lse_a, float("nan"))
        merge_states(out_a, lse_a, out_b, lse_b, out, lse)
        torch.testing.assert_close(out, want_out.float())
        torch.testing.assert_close(lse, want_lse.float())


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("head_dim", [16, 80, 96, 192, 512])
def test_cascade_attention(backend, head_dim):
    """A shared prefix read once and merged with each sequence's own keys equals attention over the whole
    sequences (the reference's 4-bit formats at a head dim each takes)."""
    kv_format = "fp32" if backend == "cpu" else ("mxfp4" if head_dim % 32 == 0 else "nvfp4")
    for q_lens in (None, [2, 5, 1]):
        cascade, full = shared_case(45, [3, 16, 30], q_lens, kv_format=kv_format, head_dim=head_dim,
                                    num_q_heads=4, num_kv_heads=2, seed=head_dim)
        with attnops.use_backend(backend):
            got = attnops.cascade_attention(**cascade)
        want = paged_attention_reference(**full, compute_dtype=torch.float64)
        assert relative_error(got, want) < 1e-5


# ----------------------------------------------------------------------------------------------------------------
# what is not served


def test_the_ops_take_every_multiple_of_16_up_to_512():
    assert HEAD_DIMS == tuple(range(16, 513, 16))
    assert BACKENDS["cpu"].supports(dispatch.describe_attention(device="cpu", head_dim=80, kv_format="fp32")) == []


@pytest.mark.parametrize("head_dim", [72, 8, 528])
def test_head_dims_not_served_are_errors_naming_head_dim(head_dim):
    rule = "multiple of 16 from 16 to 512"
    args = random_paged_inputs([5, 9], head_dim=head_dim)
    with pytest.raises(ValueError, match=rf"head_dim of q must be a {rule} \(got {head_dim}\)"):
        attnops.paged_attention(**args)
    key = torch.randn(2, 2, head_dim)
    with pytest.raises(ValueError, match=f"head_dim of key must be a {rule}"):
        attnops.reshape_and_cache(key, key, args["k_cache"], args["v_cache"], torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=rf"head_dim \(out_a.shape\[2\]\) must be a {rule}"):
        attnops.merge_attention_states(key, torch.zeros(2, 2), key, torch.zeros(2, 2))
    with pytest.raises(ValueError, match=f"PagedKVCache: head_dim must be a {rule}"):
        attnops.PagedKVCache(1, 4, 16, 2, head_dim)
    with pytest.raises(ValueError, match="attnops.explain: head_dim"):
        attnops.explain(device="cpu", head_dim=head_dim)


def test_a_format_whose_block_does_not_divide_the_head_dim_is_an_error():
    """mxfp4 scales 32 values a block: head dim 80 has no whole number of them (nvfp4's 16 do)."""
    message = r"kv_format mxfp4 scales blocks of 32 values, so head_dim must be a multiple of 32 \(got 80\)"
    with pytest.raises(ValueError, match=message):
        attnops.PagedKVCache(1, 4, 16, 2, 80, kv_format="mxfp4")
    args = random_paged_inputs([5, 9], head_dim=80, kv_format="nvfp4")  # a uint8 cache of 40 bytes a row
    with pytest.raises(ValueError, match=message):
        attnops.paged_attention(**{**args, "kv_format": "mxfp4"})
    key = torch.randn(2, 2, 80)
    with pytest.raises(ValueError, match=message):
        attnops.reshape_and_cache(key, key, args["k_cache"], args["v_cache"], torch.tensor([0, 1]),
                                  kv_format="mxfp4", k_block_scale=args["k_scale"], v_block_scale=args["v_scale"])
    assert attnops.PagedKVCache(1, 4, 16, 2, 80, kv_format="nvfp4").block_scales[0].shape[-1] == 5


def test_gpu_dispatch_of_head_dim_96(monkeypatch):
    """On a GPU, head dim 96 goes to Triton's padded tile (FlashInfer and the cuda backend decline it, saying why);
    with the padded tiles switched off, to the reference (slow, with a warning) rather than to no backend at all."""
    monkeypatch.delenv("ATTNOPS_TRITON_PADDED_HEADS", raising=False)
    dispatch._select_cached.cache_clear()
    case = AttentionCase.of_shapes(device_type="cuda", arch=(9, 0), q_dtype=torch.bfloat16, kv_format="bf16",
                                   head_dim=96, page_size=16, num_q_heads=32, num_kv_heads=8, batch=4, num_tokens=4,
                                   max_kv_len=4096, decode=True)
    triton_backend = BACKENDS["triton"]
    if triton_backend.unavailable() and not torch.cuda.is_available():
        monkeypatch.setattr(type(triton_backend), "unavailable", lambda self: [])
    assert dispatch.explain_case(case).chosen == "triton"
    monkeypatch.setenv("ATTNOPS_TRITON_PADDED_HEADS", "0")
    dispatch._select_cached.cache_clear()
    explanation = dispatch.explain_case(case)
    assert explanation.chosen == "reference"
    for name in ("triton", "flashinfer", "cuda"):
        assert any(reason.startswith("head_dim 96 not supported (its kernels take ") or "turned off" in reason
                   for reason in explanation.rejected[name]), (name, explanation.rejected[name])
        assert f"passed over {name}:" in str(explanation)
    with pytest.warns(UserWarning, match="the reference backend"):
        assert dispatch.select_backend(case).name == "reference"
    dispatch._select_cached.cache_clear()
