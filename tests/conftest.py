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
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the lent H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
