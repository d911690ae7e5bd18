"""Every KV format round-trips through reshape_and_cache: what the op stores dequantizes back to the input within
the format's own rounding, padding slots are skipped, and the 4-bit encodings hit their exact values."""
import pytest
import torch

import attnops
from attnops import formats

FORMATS = ["fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "nvfp4", "mxfp4"]


def write_and_read_back(kv_format, num_tokens=40, num_kv_heads=2, head_dim=64, page_size=16, scale_kind="per_tensor",
                        src_dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cache = attnops.PagedKVCache(1, 8, page_size, num_kv_heads, head_dim, kv_format=kv_format,
                                 k_scale=torch.tensor([0.02, 0.05])[: 1 if scale_kind == "per_tensor" else 2],
                                 v_scale=torch.tensor([0.03, 0.01])[: 1 if scale_kind == "per_tensor" else 2],
                                 shuffle_pages=True)
    before = [t.clone() for t in cache.kv + (cache.block_scales or [])]
    cache.allocate("a")
    meta = cache.prepare(["a"], num_tokens, decode=False)
    slots = meta.slot_mapping.clone()
    slots[::5] = -1  # padding: these tokens must not be written anywhere
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(src_dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(src_dtype)
    attnops.reshape_and_cache(key, value, slot_mapping=slots, **cache.write_args(0))
    args = cache.attention_args(0)
    keep = slots >= 0
    pages, offsets = slots[keep] // page_size, slots[keep] % page_size
    read = []
    for name, scale_name in (("k_cache", "k_scale"), ("v_cache", "v_scale")):
        scale = args.get(scale_name)
        if scale is not None and formats.is_fp4(cache.kv_format):
            scale = scale[pages, offsets]
        fmt = formats.resolve_kv_format(args["kv_format"], args[name].dtype)
        read.append(formats.dequantize(args[name][pages, offsets], fmt, scale, torch.float64))
    # untouched slots (padding and the rest of the pool) keep their old bytes
    written = torch.zeros(cache.num_pages * page_size, dtype=torch.bool)
    written[slots[keep]] = True
    for old, new in zip(before, cache.kv + (cache.block_scales or [])):
        old_rows = old.transpose(0, 1).flatten(1, 2)[:, ~written]
        new_rows = new.transpose(0, 1).flatten(1, 2)[:, ~written]
        assert torch.equal(old_rows.view(torch.uint8), new_rows.view(torch.uint8))
    return key[keep].double(), value[keep].double(), read, args


@pytest.mark.parametrize("kv_format,scale_kind", [(f, "per_tensor") for f in FORMATS] +
                         [("fp8_e4m3", "per_head"), ("fp8_e5m2", "per_head")])
def test_round_trip(kv_format, scale_kind):
    key, value, (k_read, v_read), args = write_and_read_back(kv_format, scale_kind=scale_kind)
    for src, got, scale in ((key, k_read, args.get("k_scale")), (value, v_read, args.get("v_scale"))):
        err = (got - src).abs()
        if kv_format == "fp32":
            assert torch.equal(got, src)
        elif kv_format in ("bf16", "fp16"):
            dtype = torch.bfloat16 if kv_format == "bf16" else torch.float16
            assert torch.equal(got, src.to(dtype).double())
        elif formats.is_fp8(kv_format):
            # a relative rounding of half an ulp: 2^-4 (e4m3) or 2^-3 (e5m2), plus the subnormal floor
            mantissa_bits = 3 if kv_format == "fp8_e4m3" else 2
            s = scale.double().reshape(-1, 1) if scale.numel() > 1 else scale.double()
            floor = s * torch.finfo(formats.FORMATS[kv_format].storage_dtype).smallest_normal
            assert (err <= src.abs() * 2.0 ** -(mantissa_bits + 1) + floor).all()
        else:
            block = formats.FORMATS[kv_format].block
            amax = src.unflatten(-1, (-1, block)).abs().amax(-1, keepdim=True)
            # nvfp4: the scale is amax/6 rounded to e4m3, half the widest e2m1 gap (1.0) times it bounds the error;
            # mxfp4: a power-of-two scale in (amax/8, amax/4], values past 6 saturate: 2 steps of it at most
            bound = amax / 6 * 1.07 if kv_format == "nvfp4" else amax / 4 * 2
            assert (err.unflatten(-1, (-1, block)) <= bound + 1e-12).all()
            assert (err.norm() / src.norm()) < 0.2


def test_fp8_saturates_instead_of_overflowing():
    x = torch.tensor([1e6, -1e6, 1.0]).reshape(3, 1, 1).expand(3, 1, 32).contiguous()
    for fmt in ("fp8_e4m3", "fp8_e5m2"):
        q = formats.quantize_fp8(x, torch.tensor(1.0), fmt).float()
        assert torch.isfinite(q).all()
        assert q[0].eq(formats.fp8_max(fmt)).all() and q[1].eq(-formats.fp8_max(fmt)).all()


def test_nvfp4_exact_values_and_ties_to_even():
    # amax 6 gives block scale 1 exactly, so each value below is representable or a tie
    block = torch.tensor([6.0, -3.0, 0.5, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, 0.0, -0.1, 4.0, 1.5, 2.0])
    packed, scale = formats.quantize_fp4(block.reshape(1, 16), "nvfp4")
    assert scale.float().item() == 1.0
    got = formats.dequantize_fp4(packed, scale, "nvfp4").flatten()
    expected = torch.tensor([6.0, -3.0, 0.5, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -4.0, 0.0, 0.0, 4.0, 1.5, 2.0])
    assert torch.equal(got, expected)
    assert packed[0, 0].item() == (7 | (13 << 4))  # 6.0 -> code 7 in the low nibble, -3.0 -> 8|5 in the high one


def test_mxfp4_scale_is_a_power_of_two():
    x = torch.randn(4, 64) * 10
    packed, scale = formats.quantize_fp4(x, "mxfp4")
    amax = x.unflatten(-1, (-1, 32)).abs().amax(-1)
    s = torch.exp2(scale.float() - 127)
    assert ((amax / s >= 4) & (amax / s < 8)).all()
    assert packed.shape == (4, 32) and scale.dtype == torch.uint8
