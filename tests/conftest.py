"""Test set-up. Without a GPU, Triton kernels run in its interpreter (TRITON_INTERPRET=1), which must be set
before triton (and so attnops) is imported. Tests marked `gpu` are skipped where CUDA is unavailable."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

os.environ.pop("ATTNOPS_BACKEND", None)  # tests pin backends themselves
os.environ.pop("ATTNOPS_CHECK", None)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fp8_comparable(monkeypatch):
    """opcheck's test_schema detects mutation with torch.allclose, which has no fp8 kernel on the CPU
    ("mul_cpu_reduced_float" not implemented for 'Float8_e4m3fn'). Compare fp8 tensors bit for bit instead:
    stricter than allclose, and the check still runs."""
    allclose = torch.allclose
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)

    def allclose_with_fp8(lhs, rhs, *args, **kwargs):
        if lhs.dtype in fp8 and rhs.dtype in fp8:
            return torch.equal(lhs.view(torch.uint8), rhs.view(torch.uint8))
        return allclose(lhs, rhs, *args, **kwargs)

    monkeypatch.setattr(torch, "allclose", allclose_with_fp8)
