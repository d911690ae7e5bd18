"""The CUDA backend's prefill over bf16/fp16 caches (attnops/backends/cuda_prefill.py, csrc/cuda/prefill_sm90.cu).

CPU (CI): off by default and behind the timed backends when on (dispatch never picks it unmeasured), what it serves
and declines, and its kernel through nvcc for sm_90a (no spill, the wgmmas not serialised, the MMAs the design
says). GPU (marked gpu, an H100/H200, ATTNOPS_CUDA_PREFILL=1, the backend pinned): random ragged prefill and extend
batches against the float64 reference (GQA groups 1-128, odd ones too, pages of 1-128 keys, queries before the
sequence's start, bf16 and fp16, the LSE), the bad-index rules, a user's CUDA graph replaying new lengths, and
torch.compile.
"""
from __future__ import annotations

import dataclasses
import random
import re
import shutil
import subprocess

import pytest
import torch

import attnops
from attnops import dispatch
from attnops.backends import BACKENDS, cuda_mla, cuda_prefill
from attnops.backends.reference import paged_attention_reference
from attnops.dispatch import describe_attention
from attnops.testing import random_paged_inputs, relative_error
from test_cuda_backend import check_graph_replays_new_lengths
from test_cuda_mla import cuda_tool, compile_for_sm90a, spill_frames

BACKEND = BACKENDS["cuda"]
gpu = pytest.mark.gpu


def prefill_case(**fields):
    """A bf16 prefill case on an sm_90 GPU (q bf16), these fields changed."""
    case = describe_attention(device="cpu", **{"decode": False, "batch": 8, **fields})
    return dataclasses.replace(case, device_type="cuda", arch=(9, 0), q_dtype=torch.bfloat16)


# ----------------------------------------------------------------------------------------------------------------
# CPU: what it declares


def test_off_by_default_saying_so_beside_what_it_would_decline(monkeypatch):
    monkeypatch.delenv(cuda_prefill.ENV, raising=False)
    reasons = BACKEND.supports(prefill_case())
    assert len(reasons) == 1 and cuda_prefill.ENV in reasons[0]
    reasons = BACKEND.supports(prefill_case(head_dim=96, decode=True))
    assert any(r.startswith("head_dim 96 not supported") for r in reasons), reasons
    assert any("prefill and extend only" in r for r in reasons) and any(cuda_prefill.ENV in r for r in reasons)


def test_serves_16_bit_prefill_at_head_dim_128_when_on_and_declines_the_rest(monkeypatch):
    monkeypatch.setenv(cuda_prefill.ENV, "1")
    monkeypatch.setattr(cuda_mla, "sm90a_built", lambda device: True)
    assert BACKEND.supports(prefill_case()) == []
    assert BACKEND.supports(dataclasses.replace(prefill_case(kv_format="fp16"), q_dtype=torch.float16)) == []
    assert BACKEND.supports(prefill_case(num_q_heads=28, num_kv_heads=4)) == []  # a group of 7
    declined = {
        "prefill and extend only": prefill_case(shape_class="verify"),
        "head_dim 64": prefill_case(head_dim=64),
        "sliding window": prefill_case(sliding_window=True),
        "soft_cap": prefill_case(soft_cap=True),
        "sinks": prefill_case(sinks=True),
        "tree_mask": prefill_case(tree_mask=True),
        "sm_80": dataclasses.replace(prefill_case(), arch=(8, 0)),
        "q of the cache's dtype": prefill_case(kv_format="fp16"),  # bf16 q
        "16-byte words": dataclasses.replace(prefill_case(), aligned_kv=False),
    }
    for words, case in declined.items():
        reasons = BACKEND.supports(case)
        assert any(words in r for r in reasons), (words, reasons)
    assert BACKEND.invariance_reasons(prefill_case()), "not yet tested in batch-invariant mode: declined there"


def test_dispatch_puts_it_behind_the_timed_backends_when_on(monkeypatch):
    """Turned on, it is still untimed on 16-bit caches: the measured rule's order moves it behind the backends
    timed there, so auto picks Triton (or FlashInfer) and only a pinned `cuda` backend runs it."""
    monkeypatch.setenv(cuda_prefill.ENV, "1")
    order = dispatch.policy(prefill_case())
    assert order.index("triton") < order.index("cuda"), order


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_kernel_compiles_for_sm90a_without_spills_and_keeps_its_wgmmas_pipelined(tmp_path):
    """nvcc + ptxas for sm_90a (no GPU needed), with torch's extension flags: both kernels (bf16, fp16) fit their
    registers with no spill or stack, ptxas does not serialise their wgmmas, and each issues 8 m64n64k16 MMAs for
    Q K^T over 128 values and 4 m64n128k16 for P V a tile."""
    log, cubin = compile_for_sm90a("prefill_sm90.cu", tmp_path)
    frames = spill_frames(log)
    assert len(frames) == 2 and all("prefill_kernel" in name for name in frames), log[-4000:]
    for name, frame in frames.items():
        assert frame.startswith("0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"), (name, frame)
    assert all(int(n) <= 255 for n in re.findall(r"Used (\d+) registers", log)), log
    assert "serialized" not in log, log
    cuobjdump = cuda_tool("cuobjdump")
    if cuobjdump is None:
        pytest.skip("no cuobjdump to read the SASS")
    sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    assert len(re.findall(r"HGMMA\.64x64x16\.F32", sass)) == 2 * 8, "Q K^T: 8 a tile, a kernel"
    assert len(re.findall(r"HGMMA\.64x128x16\.F32", sass)) == 2 * 4, "P V: 4 a tile, a kernel"


# ----------------------------------------------------------------------------------------------------------------
# GPU

@pytest.fixture
def pinned(monkeypatch):
    monkeypatch.setenv(cuda_prefill.ENV, "1")
    if BACKEND.unavailable():
        pytest.skip("; ".join(BACKEND.unavailable()))
    if torch.cuda.get_device_capability() != (9, 0) or not cuda_mla.sm90a_built(torch.cuda.current_device()):
        pytest.skip("needs an sm_90 GPU and attnops built with sm_90a code")


def run_cuda(args, **options):
    out = torch.full_like(args["q"], float("nan"))
    with attnops.use_backend("cuda"):
        attnops.paged_attention(**args, **options, out=out)
    return out


def random_case(rng: random.Random, seed: int) -> dict:
    num_kv_heads, group = rng.choice([(1, 1), (8, 1), (2, 2), (8, 4), (1, 4), (4, 8), (2, 16), (4, 7), (1, 5),
                                      (1, 128)])
    batch = rng.randint(1, 6)
    kv_lens = [rng.choice([0, 1, rng.randint(2, 64), rng.randint(65, 3000), int(10 ** rng.uniform(0, 3.7))])
               for _ in range(batch)]
    # mostly the last tokens of each sequence (extend; all of them: prefill), now and then more queries than keys
    q_lens = [max(17, min(n, rng.randint(1, 700))) if rng.random() < 0.8 else rng.randint(17, 300) for n in kv_lens]
    dtype = rng.choice([torch.bfloat16, torch.float16])
    return dict(kv_lens=kv_lens, q_lens=q_lens, num_q_heads=num_kv_heads * group, num_kv_heads=num_kv_heads,
                head_dim=128, page_size=rng.choice([1, 3, 16, 16, 64, 128]),
                kv_format="bf16" if dtype == torch.bfloat16 else "fp16", q_dtype=dtype, device="cuda", seed=seed)


@gpu
def test_random_prefill_and_extend_against_the_reference(pinned):
    """120 seeded random ragged batches (empty and one-key sequences among them, queries placed before position 0
    where a sequence has more queries than keys), output and LSE against the float64 reference; failures listed
    together."""
    rng = random.Random(46)
    failures = []
    for i in range(120):
        inputs = random_case(rng, seed=i)
        options = {"scale": rng.uniform(0.02, 0.3)} if rng.random() < 0.3 else {}
        args = random_paged_inputs(**inputs)
        try:
            with attnops.use_backend("cuda"):
                assert attnops.explain(**args).chosen == "cuda"
                out, lse = attnops.paged_attention_with_lse(**args, **options)
            ref, ref_lse = paged_attention_reference(**args, **options, compute_dtype=torch.float64,
                                                     return_lse=True)
            assert not out.isnan().any(), "NaN in the output"
            err = relative_error(out, ref)
            assert err < 1e-2, f"relative error {err:.3g}"
            finite = torch.isfinite(ref_lse)
            assert torch.equal(finite, torch.isfinite(lse)), "LSE: -inf where the reference's is not, or back"
            assert (lse[finite].double() - ref_lse[finite]).abs().max() < 1e-3, "LSE"
        except AssertionError as e:
            failures.append(f"case {i}: {inputs} {options}: {e}")
    assert not failures, f"{len(failures)} of 120 failed:\n" + "\n".join(failures[:20])


@gpu
def test_bad_indices_follow_the_rules(pinned):
    """A length past the capacity: its rows NaN; a page outside the cache: the rows that see it NaN, the others
    exact; cu_seqlens_q not running from 0 to T: every row NaN. Each recorded."""
    args = random_paged_inputs([289, 300, 50], [40, 20, 30], num_q_heads=8, num_kv_heads=2, head_dim=128,
                               kv_format="bf16", q_dtype=torch.bfloat16, device="cuda", seed=5, table_padding=0)
    ref = paged_attention_reference(**args, compute_dtype=torch.float64)
    attnops.take_errors()
    bad = dict(args, seq_lens=args["seq_lens"].clone(), block_table=args["block_table"].clone())
    bad["seq_lens"][2] = bad["block_table"].shape[1] * 16 + 1
    # page 17 holds keys 272-287 of sequence 0: its rows at positions 272 on (the last 17 of its 40) see them
    bad["block_table"][0, 17] = 10 ** 6
    out = run_cuda(bad)
    assert out[23:40].isnan().all() and not out[:23].isnan().any()
    assert out[60:90].isnan().all() and not out[40:60].isnan().any()
    assert relative_error(out[:23], ref[:23]) < 1e-2 and relative_error(out[40:60], ref[40:60]) < 1e-2
    assert attnops.take_errors() == {"block_table": 0, "seq_lens": 2}
    cu = args["cu_seqlens_q"].clone()
    cu[1] = 70  # above cu[2] = 60
    out = run_cuda(dict(args, cu_seqlens_q=cu))
    assert out.isnan().all()
    assert attnops.take_errors() == {"cu_seqlens_q": 2}


@gpu
def test_user_captured_cuda_graph_replays_new_lengths(pinned):
    """Captured once with torch.cuda.graph, replayed with new lengths and queries: the grid is a function of the
    shapes only."""
    args = random_paged_inputs([3000] * 4, [256] * 4, num_q_heads=32, num_kv_heads=8, head_dim=128,
                               kv_format="bf16", q_dtype=torch.bfloat16, device="cuda", seed=0)
    check_graph_replays_new_lengths(args, ([256, 2900, 300, 700], [3000] * 4, [0, 256, 256, 1000]))


@gpu
def test_compiled_fullgraph(pinned):
    args = random_paged_inputs([500, 700], [100, 300], num_q_heads=16, num_kv_heads=4, head_dim=128,
                               kv_format="fp16", q_dtype=torch.float16, device="cuda", seed=9)
    ref = paged_attention_reference(**args, compute_dtype=torch.float64)
    with attnops.use_backend("cuda"):
        compiled = torch.compile(lambda a: torch.ops.attnops.paged_attention(**a), fullgraph=True)
        assert relative_error(compiled(args), ref) < 1e-2
