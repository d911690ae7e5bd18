"""Ops honour their tensors' device: correct results for tensors on one GPU while another is current, and a
clear error for tensors on different devices."""
import pytest
import torch

import attnops
from attnops.backends.reference import paged_attention_reference
from attnops.testing import random_paged_inputs, relative_error


def test_mixed_devices_are_an_error_naming_the_argument():
    args = random_paged_inputs([10, 20])
    args["seq_lens"] = args["seq_lens"].to("meta")
    with pytest.raises(ValueError, match="seq_lens must be on the same device as q"):
        torch.ops.attnops.paged_attention(**args)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("backend", [None, "triton", "flashinfer"])
def test_tensors_on_cuda0_while_cuda1_is_current(backend):
    from attnops.backends import BACKENDS
    if backend and BACKENDS[backend].unavailable():
        pytest.skip("; ".join(BACKENDS[backend].unavailable()))
    args = random_paged_inputs([300, 0, 45], num_q_heads=32, num_kv_heads=8, head_dim=128, kv_format="bf16",
                               q_dtype=torch.bfloat16, device="cuda:0")
    cache = attnops.PagedKVCache(1, 8, 16, 8, 128, kv_format="bf16", device="cuda:0")
    cache.allocate("a")
    meta = cache.prepare(["a"], 5, decode=False)
    key = torch.randn(5, 8, 128, device="cuda:0", dtype=torch.bfloat16)
    with torch.cuda.device(1), attnops.use_backend(backend):
        out = attnops.paged_attention(**args)
        attnops.reshape_and_cache(key, key, slot_mapping=meta.slot_mapping, **cache.write_args(0))
    torch.cuda.synchronize(0)
    assert out.device == torch.device("cuda:0")
    assert relative_error(out, paged_attention_reference(**args, compute_dtype=torch.float64)) < 2e-2
    torch.testing.assert_close(cache.kv[0][:, 0].flatten(0, 1)[meta.slot_mapping], key)
