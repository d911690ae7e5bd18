"""The CUDA backend's latent-attention decode (attnops/backends/cuda_mla.py, csrc/cuda/mla_decode_sm90.cuh).

Here: what it declines and why, its split plan, and its kernel through nvcc for sm_90a (resources, no spills, the
wgmmas kept pipelined). On an H100/H200 (`-m gpu`, bf16 and fp8 caches): the op
pinned to it against the float64 reference on random ragged decode batches (1 to 128 heads, pages of 16 and 64,
one and many splits, LSE, sinks), bad indices, a user's CUDA graph replaying new lengths and tables, and
reduce-overhead.
"""
from __future__ import annotations

import os
import random
import re
import shutil
import subprocess

import pytest
import torch
from torch.utils import cpp_extension

import attnops
from attnops import formats
from attnops.backends import cuda_mla
from attnops.backends.reference import mla_attention_reference
from attnops.cases import MLACase
from attnops.checks_mla import check_mla_attention, rows_16_byte_aligned
from attnops.testing import random_mla_inputs, relative_error
from test_mla import check_reduce_overhead, check_user_graph_replays

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASE = MLACase(device_type="cuda", arch=(9, 0), q_dtype=torch.bfloat16, kv_format="bf16", latent_dim=512,
               rope_dim=64, num_heads=128, page_size=64, decode=True, batch=8, max_kv_len=8192)


def test_serves_bf16_and_fp8_by_default_bf16_when_asked_and_nothing_when_off(monkeypatch):
    monkeypatch.setattr(cuda_mla, "sm90a_built", lambda device: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    fp8 = MLACase(**{**CASE.__dict__, "kv_format": "fp8_e4m3"})
    monkeypatch.delenv(cuda_mla.ENV, raising=False)
    assert cuda_mla.reasons(CASE) == cuda_mla.reasons(fp8) == []
    monkeypatch.setenv(cuda_mla.ENV, "bf16")
    assert cuda_mla.reasons(CASE) == [] and any(f"{cuda_mla.ENV}=bf16" in r for r in cuda_mla.reasons(fp8))
    monkeypatch.setenv(cuda_mla.ENV, "0")
    assert any("turned off" in r for r in cuda_mla.reasons(CASE))


def test_declines_what_its_kernel_is_not_built_for(monkeypatch):
    monkeypatch.delenv(cuda_mla.ENV, raising=False)
    monkeypatch.setattr(cuda_mla, "sm90a_built", lambda device: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert cuda_mla.reasons(CASE) == []
    for change, words in [(dict(latent_dim=256), "R 256, P 64"), (dict(rope_dim=32), "R 512, P 32"),
                          (dict(q_dtype=torch.float16, kv_format="fp16"), "dtype"),
                          (dict(kv_format="fp8_e5m2"), "fp8_e5m2"),
                          (dict(decode=False, shape_class="prefill"), "decode and verify only"),
                          (dict(decode=False, tree_mask=True), "tree_mask"), (dict(aligned_kv=False), "16-byte"),
                          (dict(arch=(8, 0)), "sm_80"), (dict(arch=(10, 0)), "sm_100"),
                          (dict(device_type="cpu", arch=None), "cuda")]:
        found = cuda_mla.reasons(MLACase(**{**CASE.__dict__, **change}))
        assert any(words in r for r in found), (change, found)
    assert cuda_mla.reasons(MLACase(**{**CASE.__dict__, "sinks": True, "num_heads": 7})) == []
    assert cuda_mla.reasons(MLACase(**{**CASE.__dict__, "kv_format": "fp8_e4m3"})) == []
    verify = MLACase(**{**CASE.__dict__, "decode": False, "shape_class": "verify"})
    assert cuda_mla.reasons(verify) == []
    monkeypatch.setenv(cuda_mla.VERIFY_ENV, "0")
    assert any(f"{cuda_mla.VERIFY_ENV}=0" in r for r in cuda_mla.reasons(verify))
    monkeypatch.delenv(cuda_mla.VERIFY_ENV)
    monkeypatch.setattr(cuda_mla, "sm90a_built", lambda device: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert any("9.0a" in r for r in cuda_mla.reasons(CASE))


def test_deepseeks_fp8_layout_is_served_everywhere_by_the_keys_form_or_the_cp_async_form(monkeypatch):
    """The layout is served at any head count, page size and split (measured faster than Triton's everywhere):
    the keys form at up to 16 heads, pages of 8 rows or more and splits of 2048 keys or more, the cp.async form
    otherwise; ATTNOPS_CUDA_MLA_DS=0 leaves it to the others."""
    for name in (cuda_mla.ENV, cuda_mla.DS_ENV, cuda_mla.VARIANT_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cuda_mla, "sm90a_built", lambda device: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    ds = MLACase(**{**CASE.__dict__, "kv_format": "fp8_ds_mla", "num_heads": 16, "batch": 32, "max_kv_len": 8192})
    for change in (dict(), dict(batch=1, max_kv_len=32768), dict(decode=False, shape_class="verify"),
                   dict(num_heads=17), dict(num_heads=128), dict(page_size=4), dict(page_size=1)):
        assert cuda_mla.reasons(MLACase(**{**ds.__dict__, **change})) == [], change
    with attnops.batch_invariant():
        assert cuda_mla.reasons(ds) == []
    for change, words in [(dict(latent_dim=256), "R 256"), (dict(decode=False, tree_mask=True), "tree_mask")]:
        found = cuda_mla.reasons(MLACase(**{**ds.__dict__, **change}))
        assert any(words in r for r in found), (change, found)
    monkeypatch.setenv(cuda_mla.DS_ENV, "0")
    assert any(f"{cuda_mla.DS_ENV}=0" in r for r in cuda_mla.reasons(ds))
    monkeypatch.delenv(cuda_mla.DS_ENV)
    monkeypatch.setenv(cuda_mla.ENV, "bf16")
    assert any(f"{cuda_mla.ENV}=bf16" in r for r in cuda_mla.reasons(ds))
    keys, cp_async = cuda_mla.VARIANTS.index("keys"), cuda_mla.VARIANTS.index("cp.async")
    long = cuda_mla.KEYS_FP8_MIN_CHUNK
    assert cuda_mla.kernel_variant("fp8_ds_mla", 64, 16, long) == cuda_mla.kernel_variant("fp8_ds_mla", 8, 1, long) \
        == keys
    for page, heads, chunk, packed in [(64, 16, long - 64, False), (64, 17, long, False), (4, 16, long, False),
                                       (64, 128, 256, False), (64, 16, long, True)]:
        assert cuda_mla.kernel_variant("fp8_ds_mla", page, heads, chunk, packed) == cp_async, (page, heads, chunk)
    for name in cuda_mla.VARIANTS:  # (whatever form is asked for: one of the two that read it)
        monkeypatch.setenv(cuda_mla.VARIANT_ENV, name)
        assert cuda_mla.kernel_variant("fp8_ds_mla", 64, 16, 256) == (keys if name in ("keys", "regs") else cp_async)
        assert cuda_mla.kernel_variant("fp8_ds_mla", 64, 17, long) == cp_async
        assert cuda_mla.kernel_variant("fp8_ds_mla", 4, 16, long) == cp_async


def test_the_merge_is_by_warps_from_many_splits_unless_asked_or_invariant(monkeypatch):
    monkeypatch.delenv(cuda_mla.MERGE_ENV, raising=False)
    many = cuda_mla.WARPS_MERGE_SPLITS
    assert cuda_mla.merge_form(many - 1) == cuda_mla.MERGES.index("columns") == 0
    assert cuda_mla.merge_form(many) == cuda_mla.MERGES.index("warps") == 1
    with attnops.batch_invariant():  # (the split count follows the table's width there: one merge for all)
        assert cuda_mla.merge_form(many) == cuda_mla.merge_form(2) == 0
    monkeypatch.setenv(cuda_mla.MERGE_ENV, "warps")
    assert cuda_mla.merge_form(2) == 1
    monkeypatch.setenv(cuda_mla.MERGE_ENV, "columns")
    assert cuda_mla.merge_form(many) == 0
    monkeypatch.setenv(cuda_mla.MERGE_ENV, "rows")
    with pytest.raises(ValueError, match=cuda_mla.MERGE_ENV):
        cuda_mla.merge_form(many)


def test_the_modes_split_size_is_a_whole_number_of_tiles(monkeypatch):
    monkeypatch.delenv(cuda_mla.INVARIANT_CHUNK_ENV, raising=False)
    assert cuda_mla.invariant_chunk() == cuda_mla.INVARIANT_CHUNK
    monkeypatch.setenv(cuda_mla.INVARIANT_CHUNK_ENV, "512")
    assert cuda_mla.invariant_chunk() == 512
    for bad in ("0", "100", "-64", "1k"):
        monkeypatch.setenv(cuda_mla.INVARIANT_CHUNK_ENV, bad)
        with pytest.raises(ValueError, match=cuda_mla.INVARIANT_CHUNK_ENV):
            cuda_mla.invariant_chunk()


@pytest.mark.parametrize("tokens,heads,capacity,sinks", [(1, 128, 32768, False), (32, 16, 8192, False),
                                                         (128, 128, 4096, False), (64, 16, 8192, True),
                                                         (3, 1, 64, True), (1, 8, 1, False), (5, 64, 2 ** 26, False),
                                                         (64, 16, 61184, False)])
def test_split_plan_covers_the_capacity_in_whole_tiles(tokens, heads, capacity, sinks):
    splits, chunk = cuda_mla.plan(tokens, heads, capacity, 132, sinks)
    assert chunk % cuda_mla.TILE == 0 and chunk >= cuda_mla.MIN_CHUNK
    assert splits * chunk >= capacity and 1 <= splits <= cuda_mla.MAX_SPLITS
    assert (splits - 1) * chunk < capacity or (sinks and splits == 2)  # no empty split but the sinks' second
    assert splits >= (2 if sinks else 1)
    assert chunk <= cuda_mla.MAX_CHUNK or capacity > cuda_mla.MAX_CHUNK * cuda_mla.MAX_SPLITS
    blocks = tokens * -(-heads // cuda_mla.ROWS)
    if splits > 1 and not sinks and chunk < cuda_mla.MAX_CHUNK:  # never a second wave of a few blocks (one an SM)
        assert blocks * splits <= 132
    if capacity >= 132 * cuda_mla.MIN_CHUNK and blocks < 132:  # a small batch fills the GPU by its splits
        assert blocks * splits > 66


def test_an_unaligned_cache_view_is_named_in_the_case():
    args = random_mla_inputs([10, 3], num_heads=4, latent_dim=64, rope_dim=16, page_size=4)
    assert rows_16_byte_aligned(args["kv_cache"])
    shifted = torch.empty(args["kv_cache"].numel() + 1, dtype=args["kv_cache"].dtype)[1:]
    view = shifted.view(args["kv_cache"].shape)
    assert not rows_16_byte_aligned(view)
    case = check_mla_attention(**{**args, "kv_cache": view, "kv_format": "auto"}, kv_scale=None)
    assert not case.aligned_kv


def cuda_tool(name: str) -> str | None:
    """Triton's bundled CUDA tools (its wheel ships cuobjdump), else one on PATH. (compile_check has the same
    lookup, but importing it turns Triton's interpreter off for the whole test process.)"""
    import triton
    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return bundled if os.path.exists(bundled) else shutil.which(name)


def compile_for_sm90a(source: str, tmp_path) -> tuple[str, str]:
    """nvcc + ptxas -v of csrc/cuda/`source` for sm_90a (no GPU needed): (the log, the cubin's path). The
    extension's own source, built as torch's extension builds build it (their nvcc flags turn off bf16's and f16's
    implicit conversions; the host code parsed against this torch's headers); a CPU torch lacks the header CUDA
    builds generate: an empty one stands in."""
    generated = tmp_path / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    generated.parent.mkdir(parents=True, exist_ok=True)
    generated.write_text("#pragma once\n")
    cubin = tmp_path / (os.path.splitext(source)[0] + ".cubin")
    done = subprocess.run(["nvcc", "-std=c++17", "-O3", "-arch=sm_90a", "-cubin", "-Xptxas", "-v",
                           *cpp_extension.COMMON_NVCC_FLAGS, "-DTORCH_EXTENSION_NAME=_C", f"-I{tmp_path}",
                           *[f"-I{path}" for path in cpp_extension.include_paths()], "-o", str(cubin),
                           os.path.join(ROOT, "csrc", "cuda", source)],
                          capture_output=True, text=True, timeout=600)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    return log, str(cubin)


def spill_frames(log: str) -> dict:
    """Each kernel's "N bytes stack frame, N bytes spill stores, N bytes spill loads" from a ptxas -v log."""
    return dict(re.findall(r"Function properties for (\w+)\n\s*(\d+ bytes stack frame, \d+ bytes spill stores, "
                           r"\d+ bytes spill loads)", log))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_kernel_compiles_for_sm90a_without_spills_and_keeps_its_wgmmas_pipelined(tmp_path):
    """nvcc + ptxas for sm_90a (no GPU needed): the kernel fits its registers with no spill and no stack, ptxas
    does not serialise its wgmmas (it does when it cannot tell a branch is warp-uniform), and the SASS holds the
    MMAs the design says: 36 of m64n64k16 for Q K^T over 576 values and 4 of m64n256k16 a warpgroup for P V, in
    each form's kernel (bf16 by cp.async, bf16 by the TMA, fp8; the keys and regs forms' own, below); the TMA's
    copies in the TMA forms' kernels only."""
    log, cubin = compile_for_sm90a("mla_decode_sm90.cu", tmp_path)
    frames = spill_frames(log)
    # (bf16's by cp.async and by the TMA, fp8's and DeepSeek's layout's, each also packed, the keys form's three, the
    # regs form's, verify's rows, the two merges, the probe): none spills
    assert len(frames) == 16, log
    for name, frame in frames.items():
        assert frame.startswith("0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"), (name, frame)
    marker = [part for part in log.split("Compiling entry function") if "sm90a_marker" in part]
    assert marker and re.search(r"[1-9]\d* bytes smem", marker[0]), log  # (the probe: static shared memory in sm_90a)
    assert all(int(n) <= 255 for n in re.findall(r"Used (\d+) registers", log)), log
    assert "serialized" not in log, log
    # the regs form's setmaxnreg counts hand out no more registers than ptxas gave its block at launch (else a
    # warpgroup waits forever; the header's static_assert assumes the count this reads)
    regs_source = open(os.path.join(ROOT, "csrc", "cuda", "mla_regs_sm90.cuh")).read()
    producer, consumer = (int(re.search(rf"{name} = (\d+)", regs_source).group(1))
                          for name in ("kProducerRegisters", "kConsumerRegisters"))
    launched = [part for part in log.split("Compiling entry function") if "mla_regs_kernel" in part.split("\n")[0]]
    assert len(launched) == 1, log
    registers = int(re.search(r"Used (\d+) registers", launched[0]).group(1))
    assert 128 * producer + 256 * consumer <= 384 * registers, (producer, consumer, registers)
    cuobjdump = cuda_tool("cuobjdump")
    if cuobjdump is None:
        pytest.skip("no cuobjdump to read the SASS")
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, timeout=120).stdout
    functions = {f.split("\n", 1)[0].strip(): f for f in re.split(r"\n\s*Function : ", sass)[1:]}
    kernels = {name: body for name, body in functions.items() if "decode_kernel" in name}
    assert len(kernels) == 8, list(functions)  # (four decode kernels, each also packed)
    keys_form = [body for name, body in functions.items() if "keys_kernel" in name]
    assert len(keys_form) == 3, list(functions)  # (bf16, fp8, DeepSeek's fp8 layout)
    # the keys form: S^T = K Q^T (36 of m64n16k16 over 576 values), O^T += V^T P^T (8 row blocks x 4 key steps,
    # V^T read M-major: transposed A), each warpgroup all of them for its own tiles (DeepSeek's layout: the same
    # MMAs, the scores' into five accumulators)
    for name, body in functions.items():
        if "keys_kernel" in name:  # (fp8: the staged bytes widened in the kernel; bf16: none)
            assert ("E4M3" in body) == ("ILb1E" in name), name
    for body in keys_form:
        assert len(re.findall(r"HGMMA\.64x16x16\.F32\.BF16", body)) == 36 + 32
        assert len(re.findall(r"HGMMA\.64x16x16\.F32\.BF16 \S+, gdesc\[\w+\]\.tnspA", body)) == 32
    # the regs form: the same 36 + 32 MMAs in f16 (F16 is SASS's unnamed input type), A from registers (R, not
    # gdesc), each thread's fp8 bytes loaded 16 at a time (2 a chunk for the scores, 4 a key step for P V) and
    # widened by the hardware's e4m3 pairs conversion (144 for the scores, 128 for P V)
    regs_form = [body for name, body in functions.items() if "regs_kernel" in name]
    assert len(regs_form) == 1, list(functions)
    assert len(re.findall(r"HGMMA\.64x16x16\.F32 R\d+, R\d+, gdesc", regs_form[0])) == 36 + 32
    assert len(re.findall(r"LDS\.128", regs_form[0])) == 2 * 9 + 4 * 4
    assert len(re.findall(r"F2FP\.F16\.E4M3", regs_form[0])) == 144 + 128
    for name, body in kernels.items():
        assert len(re.findall(r"HGMMA\.64x64x16\.F32\.BF16", body)) == 36, name
        assert len(re.findall(r"HGMMA\.64x256x16\.F32\.BF16", body)) == 8, name
    # the warps merge: a round's 8 splits x 4 16-byte loads a lane all issued before the first weighted sum
    merge = [body for name, body in functions.items() if "merge_warps" in name]
    assert len(merge) == 1, list(functions)
    assert len(re.findall(r"LDG\.E\.128", merge[0][:merge[0].index("FFMA")])) == 32
    tma = [name for name, body in functions.items() if "UTMALDG" in body]  # (the TMA's copies)
    kinds = sorted(next(k for k in ("keys", "regs", "ILb0ELb1E") if k in name) for name in tma)
    # (the tma form's decode kernel, one token a block and packed)
    assert kinds == ["ILb0ELb1E", "ILb0ELb1E", "keys", "keys", "keys", "regs"], tma
    assert not any(("LDL" in body or "STL" in body) for body in functions.values())


# ---- on an H100/H200 ----

def sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.fixture(params=cuda_mla.VARIANTS + ("warps_merge",),  # (-k tma_form ...)
                ids=lambda variant: variant if variant == "warps_merge" else variant.replace(".", "") + "_form")
def cuda_on(monkeypatch, request):
    """The kernel on an sm_90 GPU, both cache formats, in each of its forms (fp8 by the cp.async, keys and regs
    forms) with the splits merged by columns, and the default forms with the splits merged by warps (each merge
    pinned: the default picks by the split count)."""
    if not sm90():
        pytest.skip("needs an sm_90 GPU")
    monkeypatch.delenv(cuda_mla.ENV, raising=False)  # (both formats)
    if request.param == "warps_merge":
        monkeypatch.delenv(cuda_mla.VARIANT_ENV, raising=False)
        monkeypatch.setenv(cuda_mla.MERGE_ENV, "warps")
    else:
        monkeypatch.setenv(cuda_mla.VARIANT_ENV, request.param)
        monkeypatch.setenv(cuda_mla.MERGE_ENV, "columns")
    yield


def deepseek_inputs(kv_lens, heads, page_size=64, seed=0, kv_format="auto", q_lens=None):
    return random_mla_inputs(kv_lens, q_lens, num_heads=heads, latent_dim=512, rope_dim=64, page_size=page_size,
                             q_dtype=torch.bfloat16, kv_format=kv_format, device="cuda", seed=seed, scale=0.0625)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(3))
def test_matches_the_reference_on_random_decode_batches(cuda_on, seed):
    rng = random.Random(seed)
    for _ in range(12):
        heads = rng.choice([1, 16, 64, 100, 128])
        batch = rng.choice([1, 3, 17, 150])
        kv_lens = [rng.choice([0, 1, 63, 64, 65, rng.randint(2, 5000)]) for _ in range(batch)]
        args = deepseek_inputs(kv_lens, heads, page_size=rng.choice([4, 8, 16, 64, 128]), seed=rng.randrange(1 << 30),
                               kv_format=rng.choice(["auto", "fp8_e4m3"]))
        if rng.random() < 0.3:
            args["sinks"] = torch.randn(heads, device="cuda") * 2
        check_pinned(args, (heads, batch, kv_lens[:4], "sinks" in args, args["kv_format"]))


def check_pinned(args: dict, what, reference_args: dict | None = None) -> None:
    """The op pinned to cuda (explain agrees) against the float64 reference (over reference_args where given): the
    output within 1e-2, the LSE within 2e-3, and mla_attention's output equal to mla_attention_with_lse's."""
    with attnops.use_backend("cuda"):
        assert attnops.explain(**args).chosen == "cuda"
        out, lse = torch.ops.attnops.mla_attention_with_lse(**args)
        plain = torch.ops.attnops.mla_attention(**args)
    ref, ref_lse = mla_attention_reference(**(reference_args or args), return_lse=True)
    assert relative_error(out, ref) < 1e-2, what
    assert torch.equal(out, plain), what
    torch.testing.assert_close(lse, ref_lse.float(), atol=2e-3, rtol=1e-3, equal_nan=True, msg=str(what))


# (every form serves 64 and 128 heads; the keys form only 16 or fewer)
HEADS = [1, 16, 128]


@pytest.mark.gpu
@pytest.mark.parametrize("heads", HEADS)
def test_a_long_sequence_among_short_ones(cuda_on, heads):
    """A ragged batch: the table as wide as its longest sequence, so the short ones' splits past their ends are
    empty (the blocks leave at once, the merge skips them); with sinks and the LSE."""
    rng = random.Random(heads)
    kv_lens = [rng.choice([0, 1, rng.randint(2, 700)]) for _ in range(40)] + [12000, 5000]
    args = deepseek_inputs(kv_lens, heads, seed=heads, kv_format=rng.choice(["auto", "fp8_e4m3"]))
    args["sinks"] = torch.randn(heads, device="cuda")
    assert cuda_mla.plan(len(kv_lens), heads, args["block_table"].shape[1] * 64, 132, True)[0] > 2
    with attnops.use_backend("cuda"):
        out, lse = torch.ops.attnops.mla_attention_with_lse(**args)
    ref, ref_lse = mla_attention_reference(**args, return_lse=True)
    assert relative_error(out, ref) < 1e-2
    torch.testing.assert_close(lse, ref_lse.float(), atol=2e-3, rtol=1e-3, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", HEADS)
def test_one_split_and_many_give_the_same_rows(cuda_on, heads):
    """A large batch takes one split (the kernel writes out and the LSE itself); a single sequence takes many
    (partials merged): each against the reference, and one sequence's row equal in both within rounding."""
    args = deepseek_inputs([1500] * 300, heads, seed=3)
    assert cuda_mla.plan(300, heads, args["block_table"].shape[1] * 64, 132, False)[0] == 1
    with attnops.use_backend("cuda"):
        out, lse = torch.ops.attnops.mla_attention_with_lse(**args)
        alone = {k: (v[:1] if k in ("q_nope", "q_pe", "block_table", "seq_lens") else v) for k, v in args.items()}
        out1, lse1 = torch.ops.attnops.mla_attention_with_lse(**alone)
    ref, ref_lse = mla_attention_reference(**args, return_lse=True)
    assert relative_error(out, ref) < 1e-2
    torch.testing.assert_close(lse, ref_lse.float(), atol=2e-3, rtol=1e-3)
    assert relative_error(out1, out[:1]) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("page_size", [8, 64])
def test_rows_past_a_sequences_end_are_never_met(cuda_on, page_size, heads, kv_format):
    """NaN in every cache row no sequence holds (past each sequence's end in its last page, and the pages of no
    sequence): P V must never multiply them, not even by zero. Lengths of 1 key, 1 tile less one, 2 tiles, an odd
    count of tiles."""
    args = deepseek_inputs([1, 63, 65, 128, 700, 1000], heads, page_size=page_size, kv_format=kv_format)
    held = torch.zeros(args["kv_cache"].shape[:2], dtype=torch.bool, device="cuda")
    for b, n in enumerate(args["seq_lens"].tolist()):
        keys = torch.arange(n, device="cuda")
        held[args["block_table"][b, keys // page_size].long(), keys % page_size] = True
    if args["kv_cache"].dtype == torch.float8_e4m3fn:  # (no masked fill for fp8: its NaN byte, 0x7f, instead)
        args["kv_cache"].view(torch.uint8)[~held] = 0x7F
    else:
        args["kv_cache"][~held] = float("nan")
    with attnops.use_backend("cuda"):
        out = torch.ops.attnops.mla_attention(**args)
    assert not out.isnan().any()
    assert relative_error(out, mla_attention_reference(**args)) < 1e-2


def test_the_forms_each_serve_what_they_can_and_the_defaults_are_the_fastest_measured(monkeypatch):
    variant, code = cuda_mla.kernel_variant, cuda_mla.VARIANTS.index
    monkeypatch.delenv(cuda_mla.VARIANT_ENV, raising=False)  # the defaults: tma for bf16; for fp8 keys or cp.async
    long = cuda_mla.KEYS_FP8_MIN_CHUNK
    assert variant("bf16", 64, 16, 256) == variant("bf16", 64, 128, long) == code("tma")
    assert variant("fp8_e4m3", 64, 16, long) == variant("fp8_e4m3", 64, 1, 2 * long) == code("keys")
    assert variant("fp8_e4m3", 64, 16, long - 64) == variant("fp8_e4m3", 64, 17, long) == code("cp.async")
    assert variant("bf16", 4, 16, long) == variant("fp8_e4m3", 4, 16, long) == code("cp.async")
    assert code("regs") not in {variant(kv, page, heads, chunk) for kv in ("bf16", "fp8_e4m3") for page in (8, 64)
                                for heads in (1, 16, 128) for chunk in (256, long, 2 * long)}  # (not yet measured)
    for number, name in enumerate(cuda_mla.VARIANTS):
        monkeypatch.setenv(cuda_mla.VARIANT_ENV, name)
        assert variant("bf16", 8, 16, 256) == variant("bf16", 256, 1, long) == \
            (code("tma") if name == "regs" else number)  # (regs: fp8 only)
        assert variant("bf16", 4, 16, long) == 0
        assert variant("fp8_e4m3", 64, 16, 256) == (number if name in ("keys", "regs") else 0)
    # the keys and regs forms: at most KEYS_MAX_HEADS heads (their MMAs' N), the tma form above (cp.async for fp8)
    for name in ("keys", "regs"):
        monkeypatch.setenv(cuda_mla.VARIANT_ENV, name)
        assert variant("bf16", 64, cuda_mla.KEYS_MAX_HEADS + 1, long) == code("tma")
        assert variant("fp8_e4m3", 64, cuda_mla.KEYS_MAX_HEADS + 1, long) == 0
        assert variant("fp8_e4m3", 4, 16, long) == 0
        assert variant("fp8_e4m3", 8, cuda_mla.KEYS_MAX_HEADS, long) == code(name)
    monkeypatch.setenv(cuda_mla.VARIANT_ENV, "fast")
    with pytest.raises(ValueError, match=cuda_mla.VARIANT_ENV):
        variant("bf16", 64, 16, long)
    # several tokens a block (packed verify): the cp.async and tma forms only
    monkeypatch.delenv(cuda_mla.VARIANT_ENV)
    assert variant("fp8_e4m3", 64, 16, long, packed=True) == code("cp.async")
    assert variant("bf16", 64, 16, long, packed=True) == code("tma")
    for name in cuda_mla.VARIANTS:
        monkeypatch.setenv(cuda_mla.VARIANT_ENV, name)
        assert variant("bf16", 64, 16, long, packed=True) == code("cp.async" if name == "cp.async" else "tma")


def test_verify_packs_a_sequences_tokens_into_a_blocks_rows_unless_switched_off(monkeypatch):
    monkeypatch.setenv(cuda_mla.PACK_ENV, "0")
    assert all(cuda_mla.tokens_per_block(heads, True) == 1 for heads in (1, 16, 128))
    monkeypatch.delenv(cuda_mla.PACK_ENV)
    assert [cuda_mla.tokens_per_block(heads, True) for heads in (1, 3, 8, 16, 32, 33, 64, 128)] == \
        [64, 21, 8, 4, 2, 1, 1, 1]
    assert cuda_mla.tokens_per_block(16, False) == 1  # (decode: one token a sequence)
    for heads in range(1, 129):
        assert cuda_mla.tokens_per_block(heads, True) * heads <= cuda_mla.ROWS or heads > cuda_mla.ROWS // 2


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", ["auto", "fp8_e4m3"])
def test_bad_indices_follow_paged_attentions_rules(cuda_on, kv_format):
    check_bad_indices(kv_format)


def check_bad_indices(kv_format: str) -> None:
    args = deepseek_inputs([100, 70, 1200], 16, page_size=16, kv_format=kv_format)
    args["seq_lens"][1] = 10_000  # sequence 1: NaN, nothing read
    args["block_table"][2, 40] = 99_999  # sequence 2's 41st page: its row sees it
    attnops.take_errors()
    with attnops.use_backend("cuda"):
        out = torch.ops.attnops.mla_attention(**args)
    assert attnops.take_errors() == {"seq_lens": 1, "block_table": 2}
    assert out[1:].isnan().all() and not out[0].isnan().any()


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(2))
def test_verify_matches_the_reference(cuda_on, monkeypatch, seed):
    """Several query tokens a sequence, each its own block (packed: below): each row sees the keys up to its own
    position; sequences with no query row, rows past a short sequence's keys, sinks and the LSE."""
    monkeypatch.delenv(cuda_mla.VERIFY_ENV, raising=False)
    monkeypatch.setenv(cuda_mla.PACK_ENV, "0")
    check_verify_batches(random.Random(seed), heads=[1, 16, 128], q_lens=[0, 1, 2, 4, 8])


def check_verify_batches(rng: random.Random, heads: list[int], q_lens: list[int]) -> None:
    """Six random ragged verify batches (heads and each sequence's query tokens drawn from these; 0 to 5000 keys;
    pages of 8 or 64; bf16 or fp8; sinks or none) on the cuda backend against the float64 reference, LSE too."""
    for _ in range(6):
        num_heads = rng.choice(heads)
        batch = rng.choice([1, 5, 33])
        rows = [rng.choice(q_lens) for _ in range(batch)]
        rows[0] = max(rows[0], 1)
        kv_lens = [rng.choice([0, 1, 3, 64, rng.randint(2, 5000)]) for _ in range(batch)]
        args = deepseek_inputs(kv_lens, num_heads, page_size=rng.choice([8, 64]), seed=rng.randrange(1 << 30),
                               kv_format=rng.choice(["auto", "fp8_e4m3"]), q_lens=rows)
        if rng.random() < 0.5:
            args["sinks"] = torch.randn(num_heads, device="cuda")
        with attnops.use_backend("cuda"):
            assert attnops.explain(**args).chosen == "cuda"
            out, lse = torch.ops.attnops.mla_attention_with_lse(**args)
        ref, ref_lse = mla_attention_reference(**args, return_lse=True)
        what = (num_heads, rows[:4], kv_lens[:4], "sinks" in args, args["kv_format"])
        assert relative_error(out, ref) < 1e-2, what
        torch.testing.assert_close(lse, ref_lse.float(), atol=2e-3, rtol=1e-3, equal_nan=True)


@pytest.mark.gpu
def test_verify_bad_indices_name_the_sequence(cuda_on, monkeypatch):
    monkeypatch.delenv(cuda_mla.VERIFY_ENV, raising=False)
    monkeypatch.setenv(cuda_mla.PACK_ENV, "0")  # (each token its own block; packed: below)
    args = deepseek_inputs([100, 70, 1200, 90], 16, page_size=16, q_lens=[2, 3, 4, 1])
    args["seq_lens"][1] = 10_000  # sequence 1 (rows 2-4): NaN, nothing read
    args["block_table"][2, 74] = 99_999  # sequence 2's 75th page (keys 1184-1199): all its rows (1196-1199) see it
    attnops.take_errors()
    with attnops.use_backend("cuda"):
        out = torch.ops.attnops.mla_attention(**args)
    assert attnops.take_errors() == {"seq_lens": 1, "block_table": 2}
    nan_rows = out.isnan().flatten(1).all(1).tolist()
    assert nan_rows == [False, False, True, True, True, True, True, True, True, False]
    args = deepseek_inputs([100, 70], 16, page_size=16, q_lens=[2, 3])
    args["cu_seqlens_q"][1] = 6  # past T = 5 (and then decreasing)
    with attnops.use_backend("cuda"):
        out = torch.ops.attnops.mla_attention(**args)
    assert attnops.take_errors() == {"cu_seqlens_q": 1} and out.isnan().all()


@pytest.fixture(params=["tma", "cp.async"], ids=["packed_tma", "packed_cpasync"])
def packed_on(monkeypatch, request):
    """Verify's tokens packed into a block's rows (the default), in the two forms that take them (fp8 by cp.async
    in both)."""
    if not sm90():
        pytest.skip("needs an sm_90 GPU")
    monkeypatch.delenv(cuda_mla.ENV, raising=False)
    monkeypatch.delenv(cuda_mla.VERIFY_ENV, raising=False)
    monkeypatch.delenv(cuda_mla.PACK_ENV, raising=False)
    monkeypatch.setenv(cuda_mla.VARIANT_ENV, request.param)
    yield


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(3))
def test_packed_verify_matches_the_reference(packed_on, seed):
    """Each block a sequence's tokens x its heads (1 to 32 heads: 64 to 2 tokens a block): groups cut short by a
    sequence's rows, rows past a short sequence's keys, sequences with no query row, one split and many, sinks and
    the LSE, bf16 and fp8."""
    assert all(cuda_mla.tokens_per_block(heads, True) >= 2 for heads in (1, 3, 8, 16, 32))
    check_verify_batches(random.Random(100 + seed), heads=[1, 3, 8, 16, 32], q_lens=[0, 1, 2, 3, 4, 5, 8, 9])


@pytest.mark.gpu
def test_packed_verify_makes_nan_only_the_rows_that_see_a_bad_page(packed_on):
    """A block holds several rows of a sequence: a bad page only its last row sees makes that row NaN, the others
    exact (paged attention's rule); a bad length makes all its rows NaN."""
    args = deepseek_inputs([1201, 100, 70], 16, page_size=16, q_lens=[4, 2, 3])
    args["block_table"][0, 75] = 99_999  # keys 1200-1215: only the last row (keys < 1201) sees key 1200
    args["seq_lens"][2] = 10_000
    attnops.take_errors()
    with attnops.use_backend("cuda"):
        out = torch.ops.attnops.mla_attention(**args)
    assert attnops.take_errors() == {"seq_lens": 2, "block_table": 0}
    nan_rows = out.isnan().flatten(1).all(1).tolist()
    assert nan_rows == [False, False, False, True, False, False, True, True, True]
    fixed = {**args, "block_table": args["block_table"].clone(), "seq_lens": args["seq_lens"].clone()}
    fixed["block_table"][0, 75] = 0
    fixed["seq_lens"][2] = 70
    ref = mla_attention_reference(**fixed)
    assert relative_error(out[:3], ref[:3]) < 1e-2 and relative_error(out[4:6], ref[4:6]) < 1e-2


@pytest.mark.gpu
def test_packed_verify_in_a_user_cuda_graph_and_compiled(packed_on):
    check_user_graph_replays("cuda", deepseek_inputs([300, 40, 1000], 16, page_size=16, q_lens=[3, 4, 2]))
    check_reduce_overhead("cuda", deepseek_inputs([300, 40], 8, page_size=16, q_lens=[5, 2]))


@pytest.mark.gpu
def test_the_sm90a_probe_answers_inside_a_capture(cuda_on):
    cuda_mla._sm90a.clear()  # (as in a process whose first latent-attention call is captured)
    graph, x = torch.cuda.CUDAGraph(), torch.zeros(1, device="cuda")
    with torch.cuda.graph(graph):
        built = cuda_mla.sm90a_built(torch.cuda.current_device())
        x += 1
    graph.replay()
    assert built and x.item() == 1


@pytest.mark.gpu
def test_a_user_cuda_graph_replays_new_lengths_and_tables(cuda_on):
    check_user_graph_replays("cuda", deepseek_inputs([300, 40, 1000], 16, page_size=16))


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_compiled_with_cuda_graphs(cuda_on, heads):
    check_reduce_overhead("cuda", deepseek_inputs([300, 40], heads, page_size=16))


@pytest.mark.gpu
def test_outputs_and_queries_of_any_layout(cuda_on):
    """An out whose rows are an odd number of values apart (the kernel stores value pairs), a strided lse, and
    queries one element off a 16-byte boundary (the kernel copies query rows by 16-byte words)."""
    args = deepseek_inputs([500, 70], 16)
    for name in ("q_nope", "q_pe"):
        shifted = torch.empty(args[name].numel() + 1, dtype=torch.bfloat16, device="cuda")[1:].view(args[name].shape)
        args[name] = shifted.copy_(args[name])
    out = torch.full((2, 16, 513), float("nan"), dtype=torch.bfloat16, device="cuda")[..., :512]
    lse = torch.full((16, 2), float("nan"), device="cuda").t()
    with attnops.use_backend("cuda"):
        torch.ops.attnops.mla_attention_with_lse.out(**args, out=out, lse=lse)
    ref, ref_lse = mla_attention_reference(**args, return_lse=True)
    assert relative_error(out, ref) < 1e-2
    torch.testing.assert_close(lse, ref_lse.float(), atol=2e-3, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("kv_format", ["auto", "fp8_e4m3"])
def test_the_value_path_alone(cuda_on, kv_format, heads):
    """P V without Q K^T: zero queries weigh every visible key alike (the mean of the latent rows' c parts), and a
    sequence of one key returns its c part whatever the query (both exact up to bf16 rounding)."""
    args = deepseek_inputs([1, 200, 64, 777], heads, kv_format=kv_format)
    args["q_nope"].zero_()
    args["q_pe"].zero_()
    with attnops.use_backend("cuda"):
        out = torch.ops.attnops.mla_attention(**args)
    for b, n in enumerate(args["seq_lens"].tolist()):
        mean = rows_of(args, b)[:, :512].mean(0)
        assert relative_error(out[b], mean.expand(heads, 512)) < 1e-2, (b, n)
    args = deepseek_inputs([1, 1], heads, kv_format=kv_format)
    with attnops.use_backend("cuda"):
        out = torch.ops.attnops.mla_attention(**args)
    for b in range(2):
        first = rows_of(args, b)[0, :512]
        assert relative_error(out[b], first.expand(heads, 512)) < 1e-2


def rows_of(args, b):
    """Sequence b's latent rows, dequantized, float32 [n, 576]."""
    n = int(args["seq_lens"][b])
    pages = args["block_table"][b, :-(-n // args["kv_cache"].shape[1])].long()
    rows = args["kv_cache"][pages].flatten(0, 1)[:n].float()
    return rows * args["kv_scale"] if "kv_scale" in args else rows


# ---- DeepSeek's fp8 layout (kv_format "fp8_ds_mla") in the keys and cp.async forms, on an H100/H200 ----

@pytest.fixture(params=[(form, merge) for form in ("keys", "cp.async") for merge in cuda_mla.MERGES],
                ids=lambda p: "-".join(p))
def ds_on(monkeypatch, request):
    """DeepSeek's fp8 layout through each form that reads it (the keys form where it serves the call: at up to 16
    heads and pages of 8 rows or more, at any split; the cp.async form everywhere), the splits merged each way."""
    if not sm90():
        pytest.skip("needs an sm_90 GPU")
    monkeypatch.delenv(cuda_mla.ENV, raising=False)
    monkeypatch.delenv(cuda_mla.DS_ENV, raising=False)
    monkeypatch.setenv(cuda_mla.VARIANT_ENV, request.param[0])
    monkeypatch.setenv(cuda_mla.MERGE_ENV, request.param[1])
    yield


def ds_reference_args(args: dict, form: str | None = None) -> dict:
    """What the float64 reference reads to check the cuda form that serves `args` over DeepSeek's fp8 layout (by
    default the one ATTNOPS_CUDA_MLA_VARIANT asks for): the layout itself for the keys form (it widens the values
    exactly and applies the scales to its products); for the cp.async form, a bf16 cache of the layout's values
    rounded as that form rounds them (each value times its scale in fp32, rounded once: the same bits)."""
    code = cuda_mla.kernel_variant("fp8_ds_mla", args["kv_cache"].shape[1], args["q_nope"].shape[1], 0)
    if (form or cuda_mla.VARIANTS[code]) == "keys":
        return args
    values = formats.dequantize_latent_fp8(args["kv_cache"], 512, 64).to(torch.bfloat16)
    return dict(args, kv_cache=values, kv_format="auto")


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(3))
def test_deepseeks_layout_matches_the_reference_on_random_batches(ds_on, seed):
    """Random ragged decode and verify batches of 1-128 heads, pages of 4-128 rows, one split and many, sinks, the
    LSE: within 1e-2 (output) and 2e-3 (LSE) of the float64 reference (ds_reference_args: over the layout's exact
    values for the keys form, over them rounded to bf16 as the cp.async form rounds them)."""
    rng = random.Random(seed)
    for _ in range(12):
        heads = rng.choice([1, 5, 16, 64, 100, 128])
        batch = rng.choice([1, 3, 17, 150])
        kv_lens = [rng.choice([0, 1, 63, 64, 65, 128, rng.randint(2, 5000)]) for _ in range(batch)]
        q_lens = None if rng.random() < 0.6 else [rng.randint(1, min(4, n)) if n else 0 for n in kv_lens]
        args = deepseek_inputs(kv_lens, heads, page_size=rng.choice([4, 8, 16, 64, 128]),
                               seed=rng.randrange(1 << 30), kv_format="fp8_ds_mla", q_lens=q_lens)
        if rng.random() < 0.3:
            args["sinks"] = torch.randn(heads, device="cuda") * 2
        check_pinned(args, (heads, batch, kv_lens[:4], q_lens is not None, "sinks" in args),
                     ds_reference_args(args))


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("page_size", [8, 64])
def test_deepseeks_layout_rows_past_a_sequences_end_are_never_met(ds_on, page_size, heads):
    """Every byte of every row no sequence holds set to 0x7F (NaN values, NaN scales, NaN rotary values): P V must
    never multiply them (nor P's scaled copies their scales), not even by zero."""
    args = deepseek_inputs([1, 63, 65, 128, 700, 1000], heads, page_size=page_size, kv_format="fp8_ds_mla")
    held = torch.zeros(args["kv_cache"].shape[:2], dtype=torch.bool, device="cuda")
    for b, n in enumerate(args["seq_lens"].tolist()):
        keys = torch.arange(n, device="cuda")
        held[args["block_table"][b, keys // page_size].long(), keys % page_size] = True
    args["kv_cache"][~held] = 0x7F
    with attnops.use_backend("cuda"):
        out = torch.ops.attnops.mla_attention(**args)
    assert not out.isnan().any()
    assert relative_error(out, mla_attention_reference(**ds_reference_args(args))) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_deepseeks_layout_scales_reach_every_128_and_the_rotary_part(ds_on, heads):
    """Each 128 of the values its own scale (a row's four 128s scaled 1, 1e-3, 1e3 and 1e-6 apart by the write), and
    scores made only by the rotary part (zero q_nope), only by one 128 (q_nope zero elsewhere): each against the
    reference."""
    args = deepseek_inputs([1000, 70, 1], heads, page_size=64, kv_format="fp8_ds_mla", seed=4)
    rows = formats.dequantize_latent_fp8(args["kv_cache"], 512, 64)
    spread = torch.tensor([1.0, 1e-3, 1e3, 1e-6], device="cuda").repeat_interleave(128)
    args["kv_cache"] = formats.quantize_latent_fp8(rows[..., :512] * spread, rows[..., 512:])
    for keep in ("rotary", 0, 1, 2, 3, "all"):
        case = dict(args, q_nope=args["q_nope"].clone())
        if keep == "rotary":
            case["q_nope"].zero_()
        elif keep != "all":
            mask = torch.zeros(512, dtype=torch.bool, device="cuda")
            mask[128 * keep:128 * keep + 128] = True
            case["q_nope"][..., ~mask] = 0
        with attnops.use_backend("cuda"):
            out, lse = torch.ops.attnops.mla_attention_with_lse(**case)
        ref, ref_lse = mla_attention_reference(**ds_reference_args(case), return_lse=True)
        for part in range(4):  # each 128 of the output on its own scale
            chunk = slice(128 * part, 128 * part + 128)
            assert relative_error(out[..., chunk], ref[..., chunk]) < 1e-2, (keep, part)
        torch.testing.assert_close(lse, ref_lse.float(), atol=2e-3, rtol=1e-3, msg=str(keep))


@pytest.mark.gpu
def test_deepseeks_layout_bad_indices_follow_paged_attentions_rules(ds_on):
    check_bad_indices("fp8_ds_mla")


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_deepseeks_layout_in_a_user_cuda_graph_and_compiled(ds_on, heads):
    check_user_graph_replays("cuda", deepseek_inputs([300, 40, 1000], heads, page_size=16, kv_format="fp8_ds_mla"))
    check_reduce_overhead("cuda", deepseek_inputs([300, 40], heads, page_size=16, kv_format="fp8_ds_mla"))


@pytest.mark.gpu
def test_deepseeks_layout_goes_to_cuda(monkeypatch):
    """By default auto sends the layout to the cuda backend: a batch whose splits are long to the keys form, a
    single long sequence (splits of 256 keys) and 128 heads to the cp.async form; each against the reference."""
    if not sm90():
        pytest.skip("needs an sm_90 GPU")
    for name in (cuda_mla.ENV, cuda_mla.DS_ENV, cuda_mla.VARIANT_ENV):
        monkeypatch.delenv(name, raising=False)
    for kv_lens, heads, form in (([4096] * 128, 16, "keys"), ([32768], 16, "cp.async"), ([4096] * 8, 128, "cp.async")):
        args = deepseek_inputs(kv_lens, heads, kv_format="fp8_ds_mla", seed=len(kv_lens))
        assert attnops.explain(**args).chosen == "cuda", (kv_lens[:1], heads)
        out = torch.ops.attnops.mla_attention(**args)
        assert relative_error(out, mla_attention_reference(**ds_reference_args(args, form))) < 1e-2
