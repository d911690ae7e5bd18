"""The CPU backend (C++ kernels of csrc/cpu) against the float64 reference.

- 200 seeded random ragged cases through the public op with the CPU backend serving: decode, verify, prefill and
  extend; sliding windows, soft cap, GQA/MQA ratios 1 to 16, every page size 1..256, lengths 0 and 1; q in
  fp32/bf16/fp16; caches fp32/bf16/fp16, fp8 e4m3/e5m2 with per-tensor or per-head scales (k and v of different
  kinds too) and 4-bit (nvfp4, mxfp4: block scales); caches as views of one [pages, 2, ...] tensor or as separate
  tensors; strided q. Each case's parameters and error are printed (pytest -s shows them; a failure shows its own).
  Quantized caches are compared with the reference fed the same stored cache, so the test checks the kernel, not the
  format.
- Long sequences split over threads (KV splits merged by log-sum-exp), at several thread counts.
- Every instruction-set copy of the inner loops (avx512, avx2, portable), each in a subprocess with
  ATEN_CPU_CAPABILITY capping the choice.
- reshape_and_cache bit-exact against the reference for every format.
- torch.library.opcheck on the public ops with the CPU backend serving; dispatch picks "cpu" for CPU tensors.
- No AVX2/AVX-512 instruction outside the instruction-set copies (they are enabled by a pragma, not by flags).
Outputs are poisoned (NaN) before each run.
"""
from __future__ import annotations

import os
import platform
import random
import re
import shutil
import subprocess
import textwrap

import pytest
import torch

import attnops
from attnops import formats
from attnops.backends import BACKENDS
from attnops.backends.reference import paged_attention_reference, reshape_and_cache_reference
from attnops.dispatch import select_backend
from attnops.checks import check_paged_attention, check_reshape_and_cache
from attnops.testing import random_paged_inputs, relative_error
from conftest import ISA_PARAMS, run_with_cpu_isa

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
NUM_RANDOM_CASES = 200
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(BACKENDS["cpu"].unavailable() != [], reason="C++ CPU kernels not built")


def random_case(rng: random.Random) -> dict:
    """Parameters of one random case (plain data, so that it prints)."""
    mode = rng.choice(["decode", "decode", "verify", "prefill", "extend"])
    batch = rng.randint(1, 4)
    num_kv_heads = rng.choice([1, 2, 4])
    group = rng.choice([1, 2, 4, 8, 16] if num_kv_heads == 1 else [1, 2, 4, 8])
    head_dim = rng.choice([32, 64, 128, 256])
    page_size = 2 ** rng.randint(0, 8)
    # keep the float64 reference cheap: prefill/extend are quadratic in the length
    max_len = rng.choice([16, 64, 160]) if mode in ("prefill", "extend") else rng.choice([16, 100, 600, 1500])
    kv_lens = [rng.choice([0, 1, rng.randint(1, max_len), rng.randint(1, max_len)]) for _ in range(batch)]
    if mode == "decode":
        q_lens = None
    elif mode == "verify":
        q_lens = [min(n, rng.randint(1, 8)) for n in kv_lens]
    elif mode == "prefill":
        q_lens = list(kv_lens)
    else:  # extend: new tokens on a cached prefix
        q_lens = [rng.randint(1, n) if n else 0 for n in kv_lens]
    q_dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
    kv_format = rng.choice(["fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "nvfp4", "mxfp4",
                            {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[q_dtype]])
    return dict(mode=mode, kv_lens=kv_lens, q_lens=q_lens, num_kv_heads=num_kv_heads,
                num_q_heads=num_kv_heads * group, head_dim=head_dim, page_size=page_size, q_dtype=q_dtype,
                kv_format=kv_format,
                k_scale_kind=rng.choice(["per_tensor", "per_head"]), v_scale_kind=rng.choice(["per_tensor", "per_head"]),
                window_left=rng.choice([-1, -1, rng.randint(0, 8), rng.randint(0, 200)]),
                soft_cap=rng.choice([0.0, 0.0, rng.uniform(2.0, 30.0)]),
                scale=rng.choice([None, None, rng.uniform(0.02, 0.3)]),
                separate_caches=rng.random() < 0.25, strided_q=rng.random() < 0.2, out_variant=rng.random() < 0.5,
                seed=rng.randrange(1 << 30))


def build_inputs(case: dict) -> tuple[dict, dict]:
    """(tensor arguments, options) of paged_attention for `case`."""
    args = random_paged_inputs(case["kv_lens"], case["q_lens"], num_q_heads=case["num_q_heads"],
                               num_kv_heads=case["num_kv_heads"], head_dim=case["head_dim"],
                               page_size=case["page_size"], kv_format=case["kv_format"], q_dtype=case["q_dtype"],
                               scale_kind=case["k_scale_kind"], seed=case["seed"])
    if formats.is_fp8(case["kv_format"]) and case["v_scale_kind"] != case["k_scale_kind"]:
        # k and v scales of different kinds: the kernel reads each one separately
        gen = torch.Generator().manual_seed(case["seed"] + 1)
        n = case["num_kv_heads"] if case["v_scale_kind"] == "per_head" else 1
        args["v_scale"] = (torch.rand(n, generator=gen) * 0.5 + 0.25).reshape(() if n == 1 else (n,))
    if case["separate_caches"]:  # two tensors rather than views of one [pages, 2, ...] tensor
        args["k_cache"], args["v_cache"] = args["k_cache"].contiguous(), args["v_cache"].contiguous()
    if case["strided_q"]:  # q a slice of a wider tensor: token and head strides are not those of a packed q
        q = args["q"]
        wide = torch.randn(q.shape[0], q.shape[1], 2 * q.shape[2]).to(q.dtype)
        wide[..., : q.shape[2]] = q
        args["q"] = wide[..., : q.shape[2]]
    options = dict(window_left=case["window_left"], soft_cap=case["soft_cap"], scale=case["scale"])
    return args, options


def run_cpu(args: dict, options: dict, out_variant: bool) -> torch.Tensor:
    """The public op with the CPU backend pinned; out= is poisoned (NaN) first."""
    with attnops.use_backend("cpu"):
        if out_variant:
            out = torch.full(args["q"].shape, float("nan"), dtype=args["q"].dtype)
            attnops.paged_attention(**args, **options, out=out)
            return out
        return attnops.paged_attention(**args, **options)


def check_case(case: dict) -> float:
    args, options = build_inputs(case)
    out = run_cpu(args, options, case["out_variant"])
    # q in float64 (exact): the reference then computes and returns float64, fed the very same (stored) cache
    ref = paged_attention_reference(**{**args, "q": args["q"].double()}, **options, compute_dtype=torch.float64)
    assert out.dtype == args["q"].dtype and out.shape == args["q"].shape
    assert torch.isfinite(out).all(), "NaN/inf in the output"
    if ref.numel() == 0 or ref.abs().max() == 0:  # every sequence empty: all rows (if any) exactly 0
        assert (out == 0).all()
        return 0.0
    if case["q_lens"] is None:  # rows of empty sequences are exactly 0, never NaN
        empty = args["seq_lens"] == 0
        assert (out[empty] == 0).all()
    err = relative_error(out, ref)
    assert err < TOLERANCE[case["q_dtype"]], f"relative error {err:.3g}"
    return err


def describe(case: dict) -> str:
    return " ".join(f"{k}={str(v).replace('torch.', '')}" for k, v in case.items())


def test_random_cases_match_reference():
    """200 seeded random ragged cases; prints each case and its error."""
    rng = random.Random(20261202)
    worst = {}
    for i in range(NUM_RANDOM_CASES):
        case = random_case(rng)
        try:
            err = check_case(case)
        except AssertionError as e:
            raise AssertionError(f"case {i}: {describe(case)}: {e}") from None
        print(f"case {i:3d} err={err:.2e} {describe(case)}")
        key = str(case["q_dtype"]).replace("torch.", "")
        worst[key] = max(worst.get(key, 0.0), err)
    print("worst relative error by q dtype:", {k: f"{v:.2e}" for k, v in worst.items()})


@pytest.mark.parametrize("threads", [1, 2, 8])
@pytest.mark.parametrize("kv_format,num_kv_heads", [("fp32", 1), ("bf16", 4), ("fp8_e4m3", 2), ("mxfp4", 2)])
def test_long_sequence_kv_splits(threads, kv_format, num_kv_heads):
    """One long sequence: with several threads its keys are split into pieces (one KV head at 8 threads: 16 pieces
    of 256 keys, since paged_attention.cpp splits tiles until there are ~4 items per thread) whose partial results
    are merged by log-sum-exp; with several KV heads, tiles take fewer heads as threads grow. The result must not
    depend on the thread count. A sliding window and a verify block make the pieces see different rows."""
    q_dtype = torch.float32 if kv_format != "bf16" else torch.bfloat16
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for q_lens, options in ((None, {}), ([5], dict(window_left=1000, soft_cap=20.0))):
            args = random_paged_inputs([4096], q_lens, num_q_heads=4 * num_kv_heads, num_kv_heads=num_kv_heads,
                                       head_dim=128, page_size=16, kv_format=kv_format, q_dtype=q_dtype,
                                       seed=threads)
            out = run_cpu(args, options, out_variant=True)
            ref = paged_attention_reference(**{**args, "q": args["q"].double()}, **options,
                                            compute_dtype=torch.float64)
            err = relative_error(out, ref)
            print(f"threads={threads} {kv_format} q_lens={q_lens} {options}: err={err:.2e}")
            assert err < TOLERANCE[q_dtype]
    finally:
        torch.set_num_threads(previous)


ISA_SCRIPT = textwrap.dedent("""
    import random, sys
    import torch
    sys.path.insert(0, {tests!r})
    from attnops.backends import BACKENDS
    import test_cpu_backend as t
    print("isa", BACKENDS["cpu"].isa())
    rng = random.Random({seed})
    for i in range(12):
        case = t.random_case(rng)
        print(f"case {{i}} err={{t.check_case(case):.2e}} {{t.describe(case)}}")
""")


@pytest.mark.parametrize("capability,isa", ISA_PARAMS)
def test_every_instruction_set(capability, isa):
    """Each compiled copy of the inner loops (the process picks one at first use, so each runs in a subprocess)."""
    run_with_cpu_isa(ISA_SCRIPT.format(tests=os.path.join(ROOT, "tests"), seed=len(isa)), capability, isa)


# ----------------------------------------------------------------------------------------------------------------
# reshape_and_cache


@pytest.mark.parametrize("kv_format", ["fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size,scale_kind", [(1, "per_tensor"), (16, "per_head"), (256, "per_tensor")])
def test_reshape_and_cache_bit_exact(kv_format, src_dtype, page_size, scale_kind):
    """Every token lands in its slot, converted exactly as the reference converts it (fp8: divided by the scale
    and saturated, values far out of range included); slot -1 is skipped; nothing else is touched."""
    gen = torch.Generator().manual_seed(page_size + len(kv_format))
    heads, dim, tokens = 2, 64, 40
    num_pages = tokens // page_size + 3
    storage = formats.FORMATS[kv_format].storage_dtype
    kv = torch.randn(num_pages, 2, page_size, heads, dim, generator=gen).to(storage)  # old contents, kept
    key = (torch.randn(tokens, heads, dim, generator=gen) * 4).to(src_dtype)
    value = (torch.randn(tokens, heads, dim, generator=gen) * 4).to(src_dtype)
    key[0, 0, :4] = torch.tensor([1e4, -1e4, 500.0, -0.0])  # saturation in fp8
    slots = torch.randperm(num_pages * page_size, generator=gen)[:tokens]
    slots[torch.rand(tokens, generator=gen) < 0.2] = -1  # padding
    scales = {}
    if formats.is_fp8(kv_format):
        n = heads if scale_kind == "per_head" else 1
        scales = dict(k_scale=(torch.rand(n, generator=gen) + 0.1).reshape(() if n == 1 else (n,)),
                      v_scale=(torch.rand(n, generator=gen) + 0.1).reshape(() if n == 1 else (n,)))
    expected = kv.clone()
    reshape_and_cache_reference(key, value, expected[:, 0], expected[:, 1], slots, **scales)
    with attnops.use_backend("cpu"):
        attnops.reshape_and_cache(key, value, kv[:, 0], kv[:, 1], slots, **scales)
    if formats.is_fp8(kv_format):
        assert torch.equal(kv.view(torch.uint8), expected.view(torch.uint8))
    else:
        assert torch.equal(kv, expected)


def test_write_then_attend_through_paged_kv_cache():
    """The two ops together as a serving loop uses them: prefill, then decode steps, via PagedKVCache."""
    cache = attnops.PagedKVCache(1, 64, 16, 2, 64, kv_format="bf16", shuffle_pages=True)
    gen = torch.Generator().manual_seed(3)
    seqs = ["a", "b", "c"]
    for s in seqs:
        cache.allocate(s)
    for step, new in enumerate([[30, 1, 17], [1, 1, 1], [1, 1, 1]]):
        meta = cache.prepare(seqs, new)
        k = torch.randn(meta.num_tokens, 2, 64, generator=gen)
        v = torch.randn(meta.num_tokens, 2, 64, generator=gen)
        q = torch.randn(meta.num_tokens, 8, 64, generator=gen).bfloat16()
        with attnops.use_backend("cpu"):
            attnops.reshape_and_cache(k, v, slot_mapping=meta.slot_mapping, **cache.write_args(0))
            out = attnops.paged_attention(q, block_table=meta.block_table, seq_lens=meta.seq_lens,
                                          cu_seqlens_q=meta.cu_seqlens_q, **cache.attention_args(0))
        ref = paged_attention_reference(q.double(), block_table=meta.block_table, seq_lens=meta.seq_lens,
                                        cu_seqlens_q=meta.cu_seqlens_q, **cache.attention_args(0))
        assert relative_error(out, ref) < 1e-2, step


# ----------------------------------------------------------------------------------------------------------------
# opcheck and dispatch

OPCHECK_SAMPLES = {
    "decode-fp32-gqa4-page1": (dict(kv_lens=[5, 17, 0], page_size=1, num_q_heads=8, num_kv_heads=2), {}),
    "verify-bf16-window-softcap": (dict(kv_lens=[50, 64], q_lens=[4, 4], kv_format="bf16", q_dtype=torch.bfloat16),
                                   dict(window_left=7, soft_cap=5.0, scale=0.2)),
    "prefill-fp16-page256": (dict(kv_lens=[20, 35], q_lens=[20, 35], kv_format="fp16", q_dtype=torch.float16,
                                  page_size=256), {}),
    "extend-fp8-per-head-mqa": (dict(kv_lens=[90, 40], q_lens=[10, 40], kv_format="fp8_e4m3", scale_kind="per_head",
                                     num_q_heads=4, num_kv_heads=1), dict(window_left=30)),
    "decode-fp8-e5m2-long": (dict(kv_lens=[1500], kv_format="fp8_e5m2", num_q_heads=4, num_kv_heads=1), {}),
}
@pytest.mark.parametrize("sample", OPCHECK_SAMPLES)
def test_opcheck_paged_attention_cpu(sample, fp8_comparable):
    spec, options = OPCHECK_SAMPLES[sample]
    args = random_paged_inputs(**spec, seed=len(sample))
    q, k, v, table, lens, cu = (args.pop(n) for n in ("q", "k_cache", "v_cache", "block_table", "seq_lens",
                                                      "cu_seqlens_q"))
    kwargs = {**args, **options}
    with attnops.use_backend("cpu"):
        torch.library.opcheck(torch.ops.attnops.paged_attention.default, (q, k, v, table, lens, cu), kwargs)
        out = torch.full_like(q, float("nan"))
        torch.library.opcheck(torch.ops.attnops.paged_attention.out, (q, k, v, table, lens, cu),
                              {**kwargs, "out": out})


@pytest.mark.parametrize("kv_format,scale_kind", [("bf16", None), ("fp8_e4m3", "per_head")])
def test_opcheck_reshape_and_cache_cpu(kv_format, scale_kind, fp8_comparable):
    cache = attnops.PagedKVCache(1, 8, 16, 2, 64, kv_format=kv_format, shuffle_pages=True,
                                 k_scale=torch.tensor([0.5, 0.25]) if scale_kind else None)
    cache.allocate(0)
    meta = cache.prepare([0], 20)
    key, value = torch.randn(20, 2, 64), torch.randn(20, 2, 64)
    write = cache.write_args(0)
    k_cache, v_cache = write.pop("k_cache").clone(), write.pop("v_cache").clone()  # two separate tensors
    with attnops.use_backend("cpu"):
        torch.library.opcheck(torch.ops.attnops.reshape_and_cache.default,
                              (key, value, k_cache, v_cache, meta.slot_mapping), write)


def test_dispatch_picks_cpu_for_cpu_tensors():
    args = random_paged_inputs([10, 0, 3], kv_format="bf16", q_dtype=torch.bfloat16)
    case = check_paged_attention(args["q"], args["k_cache"], args["v_cache"], args["block_table"],
                                 args["seq_lens"], None, None, 0.0, -1, "auto", None, None)
    assert select_backend(case).name == "cpu"
    assert attnops.explain(**args).chosen == "cpu"
    write_case = check_reshape_and_cache(torch.randn(2, 2, 64), torch.randn(2, 2, 64), args["k_cache"],
                                         args["v_cache"], torch.tensor([0, 1]), "auto", None, None, None, None)
    assert select_backend(write_case).name == "cpu"
    # 4-bit caches: read by the CPU kernels, written by the reference backend (explain says why the CPU one passed)
    fp4 = random_paged_inputs([10, 0, 3], kv_format="nvfp4")
    assert attnops.explain(**fp4).chosen == "cpu"
    key = torch.randn(2, fp4["k_cache"].shape[2], 2 * fp4["k_cache"].shape[3])  # [tokens, Hkv, head_dim]
    write = attnops.explain(key=key, value=key, k_cache=fp4["k_cache"], v_cache=fp4["v_cache"],
                            slot_mapping=torch.tensor([0, 1]), kv_format="nvfp4", k_block_scale=fp4["k_scale"],
                            v_block_scale=fp4["v_scale"])
    assert write.chosen == "reference" and any("4-bit" in reason for reason in write.rejected["cpu"])


def test_cpp_kernel_keeps_reads_in_bounds():
    """The C++ op reads the indices from host memory, whoever calls it (here directly, bypassing the Python
    validation): a page index past the cache or a length past the table reads nothing outside the tensors, gives
    NaN rows (docs/design.md, "Bad indices") and is recorded in the error buffer it is given."""
    args = random_paged_inputs([40, 7], page_size=16)
    out = torch.empty_like(args["q"])
    errors = torch.full((4,), 2 ** 31 - 1, dtype=torch.int32)
    call = lambda table, lens: torch.ops.attnops.cpu_paged_attention(  # noqa: E731
        args["q"], args["k_cache"], args["v_cache"], table, lens, None, 0.125, 0.0, -1, None, None, None, None, out,
        errors)
    bad_table = args["block_table"].clone()
    bad_table[0, 1] = args["k_cache"].shape[0]
    call(bad_table, args["seq_lens"])
    assert out[0].isnan().all() and not out[1].isnan().any() and errors.tolist()[0] == 0
    call(args["block_table"], torch.tensor([40, 10_000], dtype=torch.int32))
    assert out[1].isnan().all() and not out[0].isnan().any() and errors.tolist()[1] == 1
    call(args["block_table"], args["seq_lens"])  # and the good input runs
    assert not out.isnan().any()


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump (binutils)")
def test_wide_instructions_stay_in_their_instruction_set_copies():
    """setup.py compiles every source for the baseline x86-64; kernels_avx2.cpp / kernels_avx512.cpp turn on wider
    instructions with a pragma, after the headers they share with other translation units (isa_preamble.h). If an
    inline function shared with other code were compiled under the pragma, the linker could keep that copy, and a
    CPU without AVX2/AVX-512 would crash in unrelated code. So: no function of attnops._C outside the ISA
    namespaces may touch a ymm/zmm register."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86-64 only")
    library = attnops._C.__file__
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", library], capture_output=True, text=True,
                             check=True).stdout
    wide, name = set(), None
    for line in listing.splitlines():
        if line.endswith(">:"):
            name = line
        elif name and ("%ymm" in line or "%zmm" in line):
            wide.add(name)
    inside = {n for n in wide if re.search(r"isa_avx(2|512)|at::vec::AVX(2|512)", n)}
    assert inside, "no AVX2/AVX-512 code found at all: were the instruction-set copies compiled?"
    assert wide == inside, f"wide instructions outside the ISA copies: {sorted(wide - inside)[:5]}"


@pytest.mark.parametrize("q_lens", [None, [3, 2]], ids=["decode", "extend"])
@pytest.mark.parametrize("where,position", [("q", 0), ("k", 0), ("k", 20), ("k", 39), ("v", 20), ("v", 39)])
def test_nan_reaches_the_same_rows_as_in_the_reference(q_lens, where, position, request):
    """A NaN in q or K, or in a V every row of the sequence sees, reaches exactly the rows that read it (the C++
    online softmax used to drop a NaN score from its running max and return zeros or a finite row)."""
    if where == "v" and q_lens is not None and position == 39:  # documented in docs/design.md
        request.applymarker(pytest.mark.xfail(strict=True, reason="a V value only the last query sees: the other "
                                              "rows' masked weight 0 meets it in the kernel's P @ V (0 x NaN)"))
    args = random_paged_inputs([40, 33], q_lens, num_q_heads=4, num_kv_heads=2, head_dim=64, seed=1)
    page = args["block_table"][0, position // 16].item()
    if where == "q":
        args["q"][0, 1, 0] = float("nan")
    else:
        args[f"{where}_cache"][page, position % 16, 0, 3] = float("nan")
    with attnops.use_backend("cpu"):
        out = torch.ops.attnops.paged_attention(**args)
    ref = paged_attention_reference(**args)
    assert torch.equal(out.isnan(), ref.isnan())
    torch.testing.assert_close(out[~ref.isnan()], ref[~ref.isnan()], rtol=1e-4, atol=1e-5)
