"""Fuzz of the Python API above the ops: cascade_attention (random shared prefixes and suffixes, every format a CPU
backend serves, sinks, soft caps, decode and multi-token batches, and corrupted prefix arguments) against
paged_attention's reference over the whole sequences, or against the bad-index rules where an argument is bad.
The cache's own model-based test is tests/test_kv_cache_model.py.

Environment: ATTNOPS_FUZZ_CASES (cases, default CPU-sized) and ATTNOPS_FUZZ_SEED (default 20), as tests/test_fuzz.py.
"""
from __future__ import annotations

import os
import random

import pytest
import torch

import attnops
from attnops.backends import BACKENDS
from attnops.backends.reference import paged_attention_reference
from attnops.cascade import cascade_attention
from attnops.testing import relative_error
from test_cascade import shared_case

SEED = int(os.environ.get("ATTNOPS_FUZZ_SEED", "20"))
CASES = int(os.environ.get("ATTNOPS_FUZZ_CASES", "0")) or 60
FORMATS = [("fp32", torch.float32, 1e-5), ("fp16", torch.float16, 2e-3), ("fp8_e4m3", torch.float16, 2e-3),
           ("nvfp4", torch.float16, 2e-3), ("mxfp4", torch.float32, 1e-5)]
CORRUPTIONS = {  # (prefix_table, prefix_len) -> (new table, new length, the argument recorded)
    "length past the table": lambda t, n: (t, t.shape[0] * 16 + 1, "prefix_len"),
    "negative length": lambda t, n: (t, -1 - n, "prefix_len"),
    "page past the cache": lambda t, n: (torch.cat([t[:-1], torch.tensor([1 << 20], dtype=torch.int32)]),
                                         max(n, 16 * (t.shape[0] - 1) + 1), "prefix_table"),
}


def fuzz_case(rng: random.Random) -> dict:
    kv_format, q_dtype, tol = rng.choice(FORMATS)
    batch = rng.randint(1, 5)
    decode = rng.random() < 0.6
    suffixes = [rng.randint(1, 40) for _ in range(batch)]
    return dict(prefix=rng.choice([0, 1, 15, 16, 17, rng.randint(1, 90)]), suffixes=suffixes,
                q_lens=None if decode else [rng.randint(1, n) for n in suffixes], kv_format=kv_format,
                q_dtype=q_dtype, tol=tol, backend=rng.choice(["reference", "cpu", "triton"]),
                sinks=rng.random() < 0.3, soft_cap=rng.choice([0.0, 0.0, 6.0]), seed=rng.randrange(1 << 30),
                corrupt=rng.choice(list(CORRUPTIONS)) if rng.random() < 0.2 else None)


@pytest.mark.parametrize("chunk", range(4))
def test_cascade_fuzz(chunk):
    rng = random.Random(SEED * 1000 + chunk)
    for index in range(CASES // 4):
        spec = fuzz_case(rng)
        backend = BACKENDS[spec["backend"]]
        cascade, full = shared_case(spec["prefix"], spec["suffixes"], spec["q_lens"], kv_format=spec["kv_format"],
                                    q_dtype=spec["q_dtype"], head_dim=64, seed=spec["seed"])
        extra = dict(soft_cap=spec["soft_cap"])
        if spec["sinks"]:
            extra["sinks"] = torch.randn(cascade["q"].shape[1], generator=torch.Generator().manual_seed(index)) * 2
        if backend.unavailable():
            continue
        attnops.take_errors()
        if spec["corrupt"] is None:
            try:
                with attnops.use_backend(spec["backend"]):
                    got = cascade_attention(**cascade, **extra)
            except ValueError as e:  # the pinned backend does not serve this format: nothing to compare
                assert "this case" in str(e), (index, spec, e)
                continue
            want = paged_attention_reference(**full, **extra, compute_dtype=torch.float64)
            assert relative_error(got, want) < spec["tol"], (index, spec)
            assert attnops.take_errors() == {}, (index, spec)
        else:
            table, length, argument = CORRUPTIONS[spec["corrupt"]](cascade["prefix_table"], spec["prefix"])
            try:
                with attnops.use_backend(spec["backend"]):
                    got = cascade_attention(**dict(cascade, prefix_table=table.to(torch.int32),
                                                   prefix_len=torch.tensor([length], dtype=torch.int32)), **extra)
            except ValueError as e:
                assert "this case" in str(e), (index, spec, e)
                continue
            assert got.isnan().all(), (index, spec)
            assert argument in attnops.take_errors(), (index, spec)
