"""The CUDA C++ backend (csrc/cuda/fp4_paged_attention.cu): 4-bit KV decode and verify against the float64 reference.

CPU (CI): what it declares (the cases it serves and declines, why it is unavailable), its split plan, and the
measured rule's handling of a backend that declines a case. GPU (marked gpu): 320 seeded random cases per format
(ragged lengths with 0 and 1, GQA groups 1-16, page sizes 1-256, head dims 64/128/256, one split and many), each row's
LSE, the bad-index rules, a cache over 2^31 elements, call memory independent of the cache size, a CUDA graph the
user captures replayed with new lengths, torch.compile, and opcheck.
"""
from __future__ import annotations

import dataclasses
import os
import random
import re
import shutil
import subprocess

import pytest
import torch

import attnops
from attnops import formats, rules
from attnops.backends import BACKENDS
from attnops.backends import cuda as cuda_backend
from attnops.backends.reference import paged_attention_reference
from attnops.cases import AttentionCall
from attnops.dispatch import describe_attention
from attnops.testing import extra_call_memory, random_paged_inputs, relative_error

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
BACKEND = BACKENDS["cuda"]


def served_case(**fields):
    case = describe_attention(device="cpu", **{"kv_format": "nvfp4", **fields})
    return dataclasses.replace(case, device_type="cuda", arch=(9, 0), q_dtype=torch.bfloat16)


# ----------------------------------------------------------------------------------------------------------------
# CPU: what it declares


def test_serves_4bit_decode_and_verify_and_declines_the_rest():
    assert BACKEND.supports(served_case()) == []
    assert BACKEND.supports(served_case(kv_format="mxfp4")) == []
    assert BACKEND.supports(served_case(head_dim=64)) == []
    assert BACKEND.supports(served_case(head_dim=256)) == []
    assert BACKEND.supports(served_case(kv_format="mxfp4", head_dim=256)) == []
    assert BACKEND.supports(served_case(kv_format="mxfp4", head_dim=64)) == []
    assert BACKEND.supports(served_case(decode=False, shape_class="verify")) == []
    assert BACKEND.supports(served_case(sliding_window=True, soft_cap=True)) == []
    declined = {
        "kv_format bf16": served_case(kv_format="bf16", scale_kind="none"),
        "head_dim 32": served_case(head_dim=32),
        "prefill": served_case(decode=False, shape_class="prefill"),
        "sinks": served_case(sinks=True),
        "tree_mask": served_case(tree_mask=True),
        "sm_80": dataclasses.replace(served_case(), arch=(8, 0)),
        "float32": dataclasses.replace(served_case(), q_dtype=torch.float32),
    }
    for words, case in declined.items():
        reasons = BACKEND.supports(case)
        assert any(words.split()[-1] in r for r in reasons), (words, reasons)


def test_says_why_it_is_unavailable():
    reasons = BACKEND.unavailable()
    if not CUDA:
        assert reasons == ["no CUDA GPU"]
    elif not cuda_backend.built():
        assert "built without its CUDA kernels" in reasons[0]


@pytest.mark.parametrize("batch,heads,capacity", [(128, 8, 4096), (1, 8, 32768), (64, 8, 65536), (3, 1, 100),
                                                  (32, 8, 4096), (256, 8, 8192), (1, 1, 1)])
def test_split_plan_covers_the_capacity_in_whole_tiles(monkeypatch, batch, heads, capacity):
    monkeypatch.setattr(cuda_backend, "sm_count", lambda device: 132)
    splits, chunk = cuda_backend.plan_splits(0, batch, heads, capacity)
    assert chunk % cuda_backend.TILE == 0 and 1 <= splits <= cuda_backend.MAX_SPLITS
    assert (splits - 1) * chunk < capacity <= splits * chunk  # every key in a split, no split past the capacity
    assert chunk <= max(cuda_backend.SPLIT_KEYS, 2 * cuda_backend.TILE) or splits == cuda_backend.MAX_SPLITS


def test_rule_orders_a_backend_that_declines_some_cases_last_there():
    """4-bit cases timed on triton and cuda only, bf16 cases on flashinfer and triton only: the fitted rule splits
    on the format and puts the declining backend last in each leaf."""
    bf16 = [(rules.features(served_case(kv_format="bf16", batch=b)), {"flashinfer": 100.0, "triton": 120.0})
            for b in (1, 8, 64)]
    fp4 = [(rules.features(served_case(kv_format="nvfp4", batch=b)), {"triton": 100.0, "cuda": 60.0})
           for b in (1, 8, 64)]
    rule = rules.fit(bf16 + fp4, ["flashinfer", "triton", "cuda"])
    leaf_bf16, _ = rules.decide(rule, bf16[0][0])
    leaf_fp4, _ = rules.decide(rule, fp4[0][0])
    assert leaf_bf16["order"] == ["flashinfer", "triton", "cuda"]
    assert leaf_fp4["order"][:2] == ["cuda", "triton"]
    assert "flashinfer declines these cases" in rules.describe_leaf(leaf_fp4)
    assert leaf_fp4["slower"][0] == pytest.approx(100 / 60, rel=1e-3)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_kernels_compile_for_sm90(tmp_path):
    """nvcc + ptxas for sm_90 (no GPU needed) against this torch's headers and with its extension builds' flags:
    every instantiation of the attention kernel and the merge compiles, within its registers (the wide-row 128
    tiles spill at most 64 bytes; the rest and the merge none). A CPU torch lacks the header CUDA builds generate:
    an empty one stands in."""
    from torch.utils import cpp_extension
    generated = tmp_path / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    generated.parent.mkdir(parents=True)
    generated.write_text("#pragma once\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(["nvcc", "-std=c++17", "-O3", "-gencode=arch=compute_90,code=sm_90", "-c",
                           os.path.join(root, "csrc", "cuda", "fp4_paged_attention.cu"), "-o",
                           str(tmp_path / "fp4.o"), "-Xptxas", "-v",
                           "-DTORCH_EXTENSION_NAME=_C", f"-I{tmp_path}", *cpp_extension.COMMON_NVCC_FLAGS]
                          + [f"-I{path}" for path in cpp_extension.include_paths()],
                          capture_output=True, text=True, timeout=600)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    frames = dict(re.findall(r"Function properties for (\w+)\n\s*(\d+ bytes stack frame, \d+ bytes spill stores, "
                             r"\d+ bytes spill loads)", log))
    attention = {name: frame for name, frame in frames.items() if "fp4_attention_kernel" in name}
    assert len(attention) == 20 and any("merge_kernel" in name for name in frames), log[-4000:]
    for name, frame in frames.items():
        stack, stores, loads = map(int, re.findall(r"\d+", frame))
        limit = 64 if "fp4_attention_kernelILi128" in name and "Li2ELb" in name else 0
        assert stack <= limit and stores <= limit and loads <= limit, (name, frame)


# ----------------------------------------------------------------------------------------------------------------
# GPU

def needs_kernels():
    if BACKEND.unavailable():
        pytest.skip("; ".join(BACKEND.unavailable()))


def run_cuda(args, **options):
    out = torch.full_like(args["q"], float("nan"))
    with attnops.use_backend("cuda"):
        attnops.paged_attention(**args, **options, out=out)
    return out


def check(args, tolerance=1e-2, **options):
    out = run_cuda(args, **options)
    ref = paged_attention_reference(**args, **options, compute_dtype=torch.float64)
    assert not out.isnan().any(), "NaN in the output"
    err = relative_error(out, ref)
    assert err < tolerance, f"relative error {err:.3g}"
    if args["cu_seqlens_q"] is None:
        assert (out[args["seq_lens"] == 0] == 0).all()


def random_case(rng: random.Random, kv_format: str, multi_token: bool):
    num_kv_heads, group = rng.choice([(1, 1), (2, 1), (8, 1), (1, 4), (2, 4), (8, 4), (1, 8), (2, 16), (1, 3),
                                      (4, 6), (1, 12)])
    batch = rng.randint(1, 8)
    kv_lens = [rng.choice([0, 1, rng.randint(2, 64), rng.randint(65, 3000), int(10 ** rng.uniform(0, 4))])
               for _ in range(batch)]
    q_lens = [min(n, rng.randint(1, 16 // min(group, 16) or 1) if rng.random() < 0.8 else rng.randint(1, 16))
              for n in kv_lens] if multi_token else None
    return dict(kv_lens=kv_lens, q_lens=q_lens, num_q_heads=num_kv_heads * group, num_kv_heads=num_kv_heads,
                head_dim=rng.choice([64, 128, 256]),
                page_size=rng.choice([1, 2, 4, 8, 16, 32, 64, 128, 256]), kv_format=kv_format,
                q_dtype=rng.choice([torch.bfloat16, torch.float16]))


@gpu
@pytest.mark.parametrize("multi_token", [False, True], ids=["decode", "verify"])
@pytest.mark.parametrize("kv_format", ["nvfp4", "mxfp4"])
def test_random_sweep(kv_format, multi_token, monkeypatch):
    """320 seeded random cases a format and kind, about a third with a sliding window and a third with a soft cap;
    every fourth with the split plan forced to many small splits (the merge kernel), the rest as planned. Failures
    are listed together."""
    needs_kernels()
    plan = cuda_backend.plan_splits
    rng = random.Random(24 + multi_token + 2 * (kv_format == "mxfp4"))
    failures = []
    for i in range(320):
        inputs = random_case(rng, kv_format, multi_token)
        options = {"scale": rng.uniform(0.02, 0.5)} if rng.random() < 0.2 else {}
        if rng.random() < 0.3:
            options["window_left"] = rng.choice([0, 1, 15, 100, 1000])
        if rng.random() < 0.3:
            options["soft_cap"] = rng.choice([1.0, 5.0, 30.0])
        small = i % 4 == 0
        monkeypatch.setattr(cuda_backend, "plan_splits",
                            (lambda d, b, h, cap: (-(-cap // 256), 256)) if small else plan)
        args = random_paged_inputs(**inputs, device="cuda", seed=i)
        try:
            check(args, **options)
        except AssertionError as e:
            failures.append(f"case {i} (small splits {small}): {inputs} {options}: {e}")
    assert not failures, f"{len(failures)} of 320 failed:\n" + "\n".join(failures[:20])


@gpu
@pytest.mark.parametrize("splits", ["planned", "small"])
def test_lse_matches_the_reference(splits, monkeypatch):
    needs_kernels()
    if splits == "small":
        monkeypatch.setattr(cuda_backend, "plan_splits", lambda d, b, h, cap: (-(-cap // 128), 128))
    args = random_paged_inputs([700, 0, 1, 2000], [3, 0, 1, 4], num_q_heads=16, num_kv_heads=4, head_dim=128,
                               kv_format="nvfp4", q_dtype=torch.bfloat16, device="cuda", seed=3)
    with attnops.use_backend("cuda"):
        out, lse = attnops.paged_attention_with_lse(**args)
    ref, ref_lse = paged_attention_reference(**args, compute_dtype=torch.float64, return_lse=True)
    assert relative_error(out, ref) < 1e-2
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert (lse[finite].double() - ref_lse[finite]).abs().max() < 1e-3


@gpu
@pytest.mark.parametrize("skip_empty", ["0", "1"], ids=["empty-splits-run", "empty-splits-skipped"])
def test_bad_indices_follow_the_rules(skip_empty, monkeypatch):
    """A length past the capacity: its rows NaN; a page outside the cache: the rows that see it NaN, the others
    exact; cu_seqlens_q not running from 0 to T: every row NaN. Each recorded. The same with empty splits skipped
    (ATTNOPS_CUDA_SKIP_EMPTY_SPLITS=1, splits of 128 keys: the shorter sequences have splits past their ends)."""
    needs_kernels()
    monkeypatch.setenv(cuda_backend.SKIP_EMPTY_SPLITS_ENV, skip_empty)
    if skip_empty == "1":
        monkeypatch.setattr(cuda_backend, "plan_splits", lambda d, b, h, cap: (-(-cap // 128), 128))
    args = random_paged_inputs([289, 300, 50], [2, 2, 2], num_q_heads=8, num_kv_heads=2, head_dim=128,
                               kv_format="nvfp4", q_dtype=torch.bfloat16, device="cuda", seed=5, table_padding=0)
    ref = paged_attention_reference(**args, compute_dtype=torch.float64)
    attnops.take_errors()
    bad = dict(args, seq_lens=args["seq_lens"].clone(), block_table=args["block_table"].clone())
    bad["seq_lens"][2] = bad["block_table"].shape[1] * 16 + 1
    # page 18 holds key 288 of sequence 0, which only its second row (position 288) sees
    bad["block_table"][0, 18] = 10 ** 6
    out = run_cuda(bad)
    assert out[1].isnan().all() and out[4:6].isnan().all()
    assert not out[0].isnan().any() and not out[2:4].isnan().any()
    assert relative_error(out[0], ref[0]) < 1e-2 and relative_error(out[2:4], ref[2:4]) < 1e-2
    assert attnops.take_errors() == {"block_table": 0, "seq_lens": 2}
    cu = args["cu_seqlens_q"].clone()
    cu[1] = 5  # above cu[2] = 4
    out = run_cuda(dict(args, cu_seqlens_q=cu))
    assert out.isnan().all()
    assert attnops.take_errors() == {"cu_seqlens_q": 2}


@gpu
@pytest.mark.parametrize("kv_format", ["nvfp4", "mxfp4"])
def test_skipping_empty_splits_changes_no_bit(kv_format, monkeypatch):
    """ATTNOPS_CUDA_SKIP_EMPTY_SPLITS=1 (a split past its sequence's end only marks its partials empty; the merge
    reads no partial of weight 0): random ragged decode and verify batches (empty and one-key sequences among them,
    GQA groups 1-16, windows, soft caps, splits of 128 keys, so that most splits of a batch are past their
    sequence's end) give the same bits as without it, output and LSE, and the reference's values."""
    needs_kernels()
    monkeypatch.setattr(cuda_backend, "plan_splits", lambda d, b, h, cap: (-(-cap // 128), 128))
    rng = random.Random(31 + (kv_format == "mxfp4"))
    for i in range(40):
        inputs = random_case(rng, kv_format, multi_token=i % 2 == 1)
        options = dict(window_left=rng.choice([-1, -1, 15, 300]), soft_cap=rng.choice([0.0, 0.0, 5.0]))
        args = random_paged_inputs(**inputs, device="cuda", seed=200 + i)
        results = []
        for skip in ("0", "1"):
            monkeypatch.setenv(cuda_backend.SKIP_EMPTY_SPLITS_ENV, skip)
            with attnops.use_backend("cuda"):
                results.append(attnops.paged_attention_with_lse(**args, **options))
        (out0, lse0), (out1, lse1) = results
        assert torch.equal(out0.view(torch.int16), out1.view(torch.int16)), (i, inputs, options)
        assert torch.equal(lse0.view(torch.int32), lse1.view(torch.int32)), (i, inputs, options)
        check(args, **options)


@gpu
def test_bad_pages_under_a_window():
    """With a sliding window a bad page makes NaN only the rows whose window reaches it; a page behind every window
    is not looked at (an engine may free it): no NaN, nothing recorded."""
    needs_kernels()
    args = random_paged_inputs([300], [4], num_q_heads=4, num_kv_heads=1, head_dim=128, kv_format="nvfp4",
                               q_dtype=torch.bfloat16, device="cuda", seed=7, page_size=1, table_padding=0)
    options = dict(window_left=20)  # rows at positions 296..299 see keys 276..296, ..., 279..299
    ref = paged_attention_reference(**args, **options, compute_dtype=torch.float64)
    attnops.take_errors()
    behind = dict(args, block_table=args["block_table"].clone())
    behind["block_table"][0, 100] = -7  # behind every window
    out = run_cuda(behind, **options)
    assert not out.isnan().any() and relative_error(out, ref) < 1e-2
    assert attnops.take_errors() == {}
    first_only = dict(args, block_table=args["block_table"].clone())
    first_only["block_table"][0, 276] = 10 ** 6  # only the first row's window holds key 276
    out = run_cuda(first_only, **options)
    assert out[0].isnan().all() and not out[1:].isnan().any()
    assert relative_error(out[1:], ref[1:]) < 1e-2
    assert attnops.take_errors() == {"block_table": 0}


def check_graph_replays_new_lengths(args, lengths):
    """paged_attention on the pinned `cuda` backend captured once with torch.cuda.graph, then replayed with each of
    `lengths` as seq_lens and new queries, each replay against the float64 reference."""
    out = torch.empty_like(args["q"])
    with attnops.use_backend("cuda"):
        attnops.paged_attention(**args, out=out)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            attnops.paged_attention(**args, out=out)
    for lens in lengths:
        args["seq_lens"].copy_(torch.tensor(lens, dtype=torch.int32))
        args["q"].normal_()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert relative_error(out, paged_attention_reference(**args, compute_dtype=torch.float64)) < 1e-2


@gpu
def test_user_captured_cuda_graph_replays_new_lengths():
    """Captured once with torch.cuda.graph, replayed with new lengths: the split plan depends on shapes only."""
    needs_kernels()
    args = random_paged_inputs([3000] * 4, num_q_heads=32, num_kv_heads=8, head_dim=128, kv_format="nvfp4",
                               q_dtype=torch.bfloat16, device="cuda", seed=0)
    check_graph_replays_new_lengths(args, ([1, 2900, 0, 700], [3000] * 4, [0, 0, 0, 5]))


@gpu
def test_compiled_fullgraph_and_opcheck():
    needs_kernels()
    args = random_paged_inputs([500, 33], [3, 1], num_q_heads=8, num_kv_heads=2, head_dim=128, kv_format="mxfp4",
                               q_dtype=torch.bfloat16, device="cuda", seed=9)
    ref = paged_attention_reference(**args, compute_dtype=torch.float64)
    with attnops.use_backend("cuda"):
        compiled = torch.compile(lambda a: torch.ops.attnops.paged_attention(**a), fullgraph=True)
        assert relative_error(compiled(args), ref) < 1e-2
        torch.library.opcheck(torch.ops.attnops.paged_attention.default, (), args)


@gpu
def test_attention_on_cache_over_2_31_elements():
    """Pages past byte 2^31 of a cache tensor of more than 2^31 elements: the page offset is 64-bit."""
    needs_kernels()
    page_size, num_kv_heads, head_dim = 16, 8, 128
    stored = head_dim // 2
    per_page = 2 * page_size * num_kv_heads * stored
    num_pages = 2 ** 31 // per_page + 4096
    kv = torch.zeros((num_pages, 2, page_size, num_kv_heads, stored), dtype=torch.uint8, device="cuda")
    scales = torch.zeros((num_pages, 2, page_size, num_kv_heads, head_dim // 16), dtype=torch.uint8, device="cuda")
    assert kv.numel() > 2 ** 31
    lens = [1000, 4000]
    pages_needed = [-(-n // page_size) for n in lens]
    used = torch.arange(num_pages - sum(pages_needed), num_pages, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    kv[used] = torch.randint(0, 256, (len(used),) + kv.shape[1:], generator=gen, device="cuda", dtype=torch.uint8)
    scales.view(torch.float8_e4m3fn)[used] = (torch.rand((len(used),) + scales.shape[1:], generator=gen,
                                                         device="cuda") * 0.3 + 0.02).to(torch.float8_e4m3fn)
    table = torch.full((2, max(pages_needed)), -1, dtype=torch.int32, device="cuda")
    table[0, :pages_needed[0]] = used[:pages_needed[0]].int()
    table[1, :pages_needed[1]] = used[pages_needed[0]:].int().flip(0)
    block_scales = scales.view(torch.float8_e4m3fn)
    args = dict(q=torch.randn(2, 32, head_dim, device="cuda", generator=gen).bfloat16(), k_cache=kv[:, 0],
                v_cache=kv[:, 1], block_table=table, seq_lens=torch.tensor(lens, dtype=torch.int32, device="cuda"),
                cu_seqlens_q=None, kv_format="nvfp4", k_scale=block_scales[:, 0], v_scale=block_scales[:, 1])
    out = run_cuda(args)
    # the reference on the used pages only (a copy of them, renumbered)
    small = dict(args, k_cache=kv[used, 0], v_cache=kv[used, 1], k_scale=block_scales[used, 0],
                 v_scale=block_scales[used, 1], block_table=torch.where(table >= 0, table - used[0].int(), -1))
    assert relative_error(out, paged_attention_reference(**small, compute_dtype=torch.float64)) < 1e-2


@gpu
@pytest.mark.parametrize("kv_format", ["nvfp4", "mxfp4"])
def test_call_memory_independent_of_cache_size(kv_format):
    needs_kernels()
    page_size, num_kv_heads, head_dim, batch, max_pages = 16, 8, 128, 32, 256
    fmt = formats.FORMATS[kv_format]
    extra = {}
    for gigabytes in (1, 40):
        num_pages = gigabytes * 2 ** 30 // (2 * page_size * num_kv_heads * head_dim // 2)
        kv = torch.zeros((num_pages, 2, page_size, num_kv_heads, head_dim // 2), dtype=torch.uint8, device="cuda")
        scales = torch.zeros((num_pages, 2, page_size, num_kv_heads, head_dim // fmt.block), dtype=torch.uint8,
                             device="cuda").view(fmt.scale_dtype)
        args = dict(q=torch.randn(batch, 32, head_dim, device="cuda").bfloat16(), k_cache=kv[:, 0], v_cache=kv[:, 1],
                    block_table=torch.randint(0, num_pages, (batch, max_pages), dtype=torch.int32, device="cuda"),
                    seq_lens=torch.full((batch,), max_pages * page_size, dtype=torch.int32, device="cuda"),
                    kv_format=kv_format, k_scale=scales[:, 0], v_scale=scales[:, 1])
        out = torch.empty_like(args["q"])
        with attnops.use_backend("cuda"):
            extra[gigabytes] = extra_call_memory(lambda: attnops.paged_attention(**args, out=out))
        del kv, scales, args
        torch.cuda.empty_cache()
    assert extra[1] == extra[40], extra


def test_layout_it_cannot_copy_by_words_is_declined_for_triton():
    """The caches attnops makes are read in place; a view at an odd byte offset, or K's and V's block scales with
    different strides, is named by checks.kv_layout_reasons, recorded in the case (aligned_kv), and declined by
    the cuda backend with a reason, so dispatch gives it to the Triton kernels and explain says why."""
    from attnops.checks import check_paged_attention, kv_layout_reasons
    args = random_paged_inputs([40, 7], num_q_heads=8, num_kv_heads=2, head_dim=128, kv_format="nvfp4", seed=1)
    assert kv_layout_reasons("nvfp4", args["k_cache"], args["v_cache"], args["k_scale"], args["v_scale"]) == []
    raw = torch.zeros(args["k_cache"].numel() + 1, dtype=torch.uint8)
    odd = raw[1:].view(args["k_cache"].shape)
    assert kv_layout_reasons("nvfp4", odd, odd, args["k_scale"], args["v_scale"]) == [
        "k_cache is not 16-byte aligned with unit inner stride",
        "v_cache is not 16-byte aligned with unit inner stride"]
    # a key's scale row (8 bytes at head dim 128) is one copy: a view 4 bytes off is named
    scales = args["k_scale"]
    raw = torch.zeros(scales.numel() + 4, dtype=torch.uint8)
    shifted = raw[4:].view(scales.dtype).view(scales.shape)
    assert kv_layout_reasons("nvfp4", args["k_cache"], args["v_cache"], shifted, shifted) == [
        "k_scale is not 8-byte aligned with unit inner stride", "v_scale is not 8-byte aligned with unit inner stride"]
    transposed = scales.transpose(0, 1).contiguous().transpose(0, 1)
    assert "k and v caches (or their scales) have different strides" in kv_layout_reasons(
        "nvfp4", args["k_cache"], args["v_cache"], transposed, args["v_scale"])

    def case(**changes):
        case = check_paged_attention(**{**args, "scale": None, "soft_cap": 0.0, "window_left": -1, "sinks": None,
                                        "tree_mask": None, **changes})
        return dataclasses.replace(case, device_type="cuda", arch=(9, 0), q_dtype=torch.bfloat16)

    assert case().aligned_kv and BACKEND.supports(case()) == []
    misaligned = case(k_cache=odd, v_cache=odd)  # (the same address: its alignment, not the data, is asked)
    assert not misaligned.aligned_kv
    assert any("aligned words" in r for r in BACKEND.supports(misaligned))
    assert BACKENDS["triton"].supports(misaligned) == []
    assert not case(k_scale=shifted, v_scale=shifted).aligned_kv
    # the op's memoized validation tells the views apart by address: the same shapes and strides, aligned or not
    from attnops.checks import attention_case
    memo = dict(scale=None, soft_cap=0.0, window_left=-1, sinks=None, tree_mask=None, out=args["q"])
    assert attention_case(**args, **memo).aligned_kv
    assert not attention_case(**{**args, "k_cache": odd, "v_cache": odd}, **memo).aligned_kv


def test_rows_without_a_sequence_are_nan_and_recorded():
    """cu_seqlens_q = [0] with query rows cannot run from 0 to T: every row NaN, recorded, no kernel launched."""
    q = torch.randn(3, 4, 64)
    cache = torch.zeros(2, 16, 1, 32, dtype=torch.uint8)
    scales = torch.zeros(2, 16, 1, 4, dtype=torch.uint8).view(torch.float8_e4m3fn)
    out, lse = torch.zeros(3, 4, 64), torch.zeros(3, 4)
    attnops.take_errors()
    BACKEND.paged_attention(AttentionCall.of(
        q, cache, cache, torch.zeros(0, 1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32), scale=0.1, soft_cap=0.0, window_left=-1, kv_format="nvfp4",
        k_scale=scales, v_scale=scales, out=out, lse=lse))
    assert out.isnan().all() and lse.isnan().all()
    assert attnops.take_errors() == {"cu_seqlens_q": 0}
