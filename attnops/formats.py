"""KV-cache storage formats: names, how a cache of each is laid out, and plain-PyTorch (de)quantization.

This module is the definition of every format: the reference backend dequantizes through it, the kernels are
tested against it, and `reshape_and_cache`'s reference path quantizes through it.

- "bf16", "fp16", "fp32": stored as is.
- "fp8_e4m3", "fp8_e5m2": value = stored x scale; scale per tensor (0-d or [1]) or per KV head ([Hkv]), float32.
- "nvfp4": uint8 [..., D/2], two e2m1 values a byte (element 2i in the low nibble), one float8_e4m3fn scale per
  16 values, [..., D/16].
- "mxfp4": the same packing, one e8m0 scale per 32 values (uint8 s, value 2^(s-127)), [..., D/32].
- "fp8_ds_mla" (latent attention's alone, DeepSeek's layout): a token's whole latent row in bytes, its scales inside
  (the last section below).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


# How a format's values are scaled (KVFormat.scale): what the checks ask of k_scale/v_scale, how the kernels index
# them, and which scale kind a case records
NO_SCALE = "none"  # stored as is
TENSOR_SCALE = "tensor"  # float32, per tensor (0-d or [1]) or per KV head ([Hkv]); read-only
BLOCK_SCALE = "block"  # one per `block` values, paged like the cache; written by reshape_and_cache
SCALES = (NO_SCALE, TENSOR_SCALE, BLOCK_SCALE)


@dataclass(frozen=True)
class KVFormat:
    """One KV-cache format: everything the ops, dispatch, the cache, the kernels' launch code, the tests and the
    benchmarks need to know about it. A new format is a new entry here, its (de)quantization below, the kernels
    that read it, and its name in the KV_FORMATS of each backend that serves it (every backend names its own).
    Code that depends on how values are scaled branches on `scale` (an unknown kind is an error there), and on
    is_fp8/is_fp4 only where the encoding of a value matters."""

    name: str
    storage_dtype: torch.dtype  # the cache tensor's dtype
    value_bits: int  # bits a value takes in the cache (scales apart)
    scale: str  # one of SCALES: NO_SCALE, TENSOR_SCALE (fp8), BLOCK_SCALE (4-bit)
    block: int = 0  # values per block scale (BLOCK_SCALE formats)
    scale_dtype: torch.dtype | None = None  # the block scales' dtype
    kernel_code: int = 0  # what the kernels' FMT constexpr is for this format (0: read as is, converted on load)

    @property
    def family(self) -> str:
        """What a timing of this format stands for: fp8_e4m3 and fp8_e5m2 ("fp8") share every kernel's code path
        and bytes but the decode of a value, so a backend timed on one counts as timed on both (dispatch's tables)."""
        return "fp8" if self.scale == TENSOR_SCALE else self.name

    @property
    def default_scale_kind(self) -> str:
        """The scale kind of a case in this format unless its scales say otherwise (fp8 may be per_head)."""
        return {NO_SCALE: "none", TENSOR_SCALE: "per_tensor", BLOCK_SCALE: "block"}[self.scale]

    def scale_kind(self, k_scale, v_scale) -> str:
        """The scale kind of a call with these (validated) scales: "none", "per_tensor" or "per_head" (a tensor
        scale of one element each, or one a KV head), or "block"."""
        if self.scale == NO_SCALE:
            return "none"
        if self.scale == TENSOR_SCALE:
            return "per_tensor" if k_scale.numel() == 1 and v_scale.numel() == 1 else "per_head"
        if self.scale == BLOCK_SCALE:
            return "block"
        raise ValueError(f"kv_format {self.name}: unknown scale {self.scale!r} (expected one of {SCALES})")

    def stored_head_dim(self, head_dim: int) -> int:
        """The cache's last dimension for `head_dim` values (two 4-bit values a byte)."""
        return head_dim * self.value_bits // (8 * self.storage_dtype.itemsize)

    def block_scale_shape(self, cache_shape: tuple, head_dim: int) -> tuple:
        """The block scales' shape for a cache (or cache slice) of `cache_shape` [..., D or D/2]."""
        return (*cache_shape[:-1], head_dim // self.block)

    def bytes_per_value(self) -> float:
        """Cache bytes a value costs, block scales included."""
        scales = self.scale_dtype.itemsize / self.block if self.scale == BLOCK_SCALE else 0.0
        return self.value_bits / 8 + scales


FORMATS = {f.name: f for f in (
    KVFormat("bf16", torch.bfloat16, 16, NO_SCALE),
    KVFormat("fp16", torch.float16, 16, NO_SCALE),
    KVFormat("fp32", torch.float32, 32, NO_SCALE),
    KVFormat("fp8_e4m3", torch.float8_e4m3fn, 8, TENSOR_SCALE, kernel_code=1),
    KVFormat("fp8_e5m2", torch.float8_e5m2, 8, TENSOR_SCALE, kernel_code=1),
    KVFormat("nvfp4", torch.uint8, 4, BLOCK_SCALE, block=16, scale_dtype=torch.float8_e4m3fn, kernel_code=2),
    KVFormat("mxfp4", torch.uint8, 4, BLOCK_SCALE, block=32, scale_dtype=torch.uint8, kernel_code=3),
)}
KV_FORMATS = tuple(FORMATS)
# formats found from the cache's dtype alone (kv_format="auto"): the plain and fp8 ones
_BY_DTYPE = {f.storage_dtype: f.name for f in FORMATS.values() if f.scale != BLOCK_SCALE}


def resolve_kv_format(kv_format: str, cache_dtype: torch.dtype) -> str | None:
    """The format name for a cache of `cache_dtype` asked for as `kv_format`, or None if they do not fit."""
    if kv_format == "auto":
        return _BY_DTYPE.get(cache_dtype)
    fmt = FORMATS.get(kv_format)
    return kv_format if fmt is not None and fmt.storage_dtype == cache_dtype else None


def family(fmt: str) -> str:
    """What a timing of format `fmt` stands for (KVFormat.family); latent attention's own layout ("fp8_ds_mla")
    stands for itself."""
    return FORMATS[fmt].family if fmt in FORMATS else fmt


def is_fp8(fmt: str) -> bool:
    """8-bit float values (fp8_e4m3, fp8_e5m2): the encoding of a value, not how it is scaled (KVFormat.scale)."""
    f = FORMATS[fmt]
    return f.value_bits == 8 and f.storage_dtype.is_floating_point


def is_fp4(fmt: str) -> bool:
    """4-bit e2m1 values packed two a byte (nvfp4, mxfp4): the encoding of a value, not how it is scaled."""
    return FORMATS[fmt].value_bits == 4


def stored_head_dim(fmt: str, head_dim: int) -> int:
    """The cache's last dimension for `head_dim` values in format `fmt`."""
    return FORMATS[fmt].stored_head_dim(head_dim)


def fp8_max(fmt: str) -> float:
    return torch.finfo(FORMATS[fmt].storage_dtype).max


# e2m1: sign bit 3, then 3 magnitude bits indexing these values.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


# ----------------------------------------------------------------------------------------------------------------
# FP8


def broadcast_scale(scale: torch.Tensor, num_heads_dim: int = -2) -> torch.Tensor:
    """A per-tensor (0-d or [1]) or per-head ([Hkv]) scale shaped to broadcast against [..., Hkv, D]."""
    scale = scale.float()
    if scale.numel() == 1:
        return scale.reshape(())
    return scale.reshape(-1, 1)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """x / scale, saturated at the format's max, rounded to the fp8 dtype. x is [..., Hkv, D]."""
    limit = fp8_max(fmt)
    y = (x.float() / broadcast_scale(scale)).clamp(-limit, limit)
    return y.to(FORMATS[fmt].storage_dtype)


def dequantize_fp8(stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return stored.to(dtype) * broadcast_scale(scale).to(dtype)


# ----------------------------------------------------------------------------------------------------------------
# 4-bit (e2m1 values with per-block scales)


def _e2m1_encode(magnitude_over_scale: torch.Tensor) -> torch.Tensor:
    """Round |x|/scale (fp32, >= 0) to the nearest e2m1 code 0..7, ties to the even code, saturating at 6."""
    x = magnitude_over_scale.clamp(max=E2M1_MAX)
    midpoints = torch.tensor(_E2M1_MIDPOINTS, dtype=x.dtype, device=x.device)
    code = torch.bucketize(x, midpoints)  # x <= midpoint[i] gives code i: ties round down...
    tie = x == midpoints[code.clamp(max=len(_E2M1_MIDPOINTS) - 1)]
    return torch.where(tie & (code % 2 == 1), code + 1, code)  # ...unless the lower code is odd


def fp4_block_scales(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """The stored block scales for x [..., D]: [..., D/block] of float8_e4m3fn (nvfp4) or uint8 e8m0 (mxfp4)."""
    block = FORMATS[fmt].block
    amax = x.float().unflatten(-1, (-1, block)).abs().amax(-1)
    if fmt == "nvfp4":
        # the scale that maps the block's largest magnitude onto e2m1's largest value, rounded to e4m3
        return (amax / E2M1_MAX).clamp(max=torch.finfo(torch.float8_e4m3fn).max).to(torch.float8_e4m3fn)
    # mxfp4 (OCP MX): 2^(floor(log2(amax)) - emax(e2m1) = 2), biased by 127; a zero block gets the smallest scale
    exponent = torch.floor(torch.log2(amax.clamp(min=2.0**-127))) - 2
    return (exponent + 127).clamp(0, 254).to(torch.uint8)


def fp4_scale_values(block_scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """Stored block scales as float32 multipliers."""
    if fmt == "nvfp4":
        return block_scale.float()
    return torch.exp2(block_scale.float() - 127.0)


def quantize_fp4(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (packed uint8 [..., D/2], block scales [..., D/block])."""
    block = FORMATS[fmt].block
    block_scale = fp4_block_scales(x, fmt)
    scale = fp4_scale_values(block_scale, fmt).repeat_interleave(block, dim=-1)
    xf = x.float()
    safe_scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    code = torch.where(scale > 0, _e2m1_encode(xf.abs() / safe_scale), torch.zeros_like(xf, dtype=torch.long))
    code = code | ((xf < 0) & (code > 0)).long() << 3  # no negative zero: -0 encodes as +0
    code = code.to(torch.uint8)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed, block_scale


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., D/2] -> e2m1 values as float32 [..., D] (before the block scale)."""
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2).long()
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    magnitude = table[codes & 7]
    return torch.where(codes >= 8, -magnitude, magnitude)


def dequantize_fp4(packed: torch.Tensor, block_scale: torch.Tensor, fmt: str,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    values = unpack_fp4(packed)
    scale = fp4_scale_values(block_scale, fmt).repeat_interleave(FORMATS[fmt].block, dim=-1)
    return (values * scale).to(dtype)


def dequantize(stored: torch.Tensor, fmt: str, scale: torch.Tensor | None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Any cache slice [..., Hkv, D or D/2] of format `fmt` as `dtype` values [..., Hkv, D].

    `scale` is the fp8 scale (per tensor or per head) or the matching slice of the 4-bit block scales."""
    if is_fp8(fmt):
        return dequantize_fp8(stored, scale, dtype)
    if is_fp4(fmt):
        return dequantize_fp4(stored, scale, fmt, dtype)
    return stored.to(dtype)


def quantize(x: torch.Tensor, fmt: str, scale: torch.Tensor | None = None, cache_dtype: torch.dtype | None = None):
    """Values [..., Hkv, D] -> (stored, block_scale or None) in format `fmt`."""
    if is_fp8(fmt):
        return quantize_fp8(x, scale, fmt), None
    if is_fp4(fmt):
        return quantize_fp4(x, fmt)
    return x.to(cache_dtype), None


# ----------------------------------------------------------------------------------------------------------------
# Latent rows in DeepSeek's fp8 layout (mla_attention's kv_format "fp8_ds_mla"; latent attention only)
#
# A token's row is uint8 [R + 4 R/128 + 2 P] bytes (656 for R = 512, P = 64): the R latent values as float8_e4m3fn,
# then one float32 scale per 128 of them, then the P rotary values as bf16. A tile's scale maps its largest
# magnitude onto 448 (max(amax, 1e-4) / 448): value = stored x scale. A tile holding a NaN or an infinity reads back
# as NaN (its scale is not finite).

LATENT_FP8_FORMAT = "fp8_ds_mla"
LATENT_FP8_TILE = 128  # latent values a scale
_LATENT_FP8_AMAX_FLOOR = 1e-4  # (an all-zero tile gets a scale, not a division by zero)


def latent_fp8_row_bytes(latent_dim: int, rope_dim: int) -> int:
    """Bytes a token's row takes in the "fp8_ds_mla" layout."""
    return latent_dim + 4 * (latent_dim // LATENT_FP8_TILE) + 2 * rope_dim


def latent_row(kv_format: str, latent_dim: int, rope_dim: int) -> tuple[int, torch.dtype]:
    """A latent cache's row in `kv_format` (a plain or fp8 format's name, or "fp8_ds_mla"): its last dimension and
    the cache's dtype."""
    if kv_format == LATENT_FP8_FORMAT:
        return latent_fp8_row_bytes(latent_dim, rope_dim), torch.uint8
    return latent_dim + rope_dim, FORMATS[kv_format].storage_dtype


def quantize_latent_fp8(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """kv_c [..., R], k_pe [..., P] -> their rows in the "fp8_ds_mla" layout, uint8 [..., R + 4 R/128 + 2 P]."""
    tiles = kv_c.float().unflatten(-1, (-1, LATENT_FP8_TILE))
    scale = tiles.abs().amax(-1).clamp(min=_LATENT_FP8_AMAX_FLOOR) / 448.0
    scale = torch.where(scale.isnan(), float("nan"), scale)  # (one NaN, 0x7FC00000, whatever the tile's)
    stored = (tiles / scale[..., None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).flatten(-2).view(torch.uint8)
    # one NaN, whatever the sign a platform's division gives it: 0x7F (e4m3), 0x7FC0 (bf16; torch's vectorized CPU
    # conversion writes 0xFFFF, its scalar one and the GPU's 0x7FC0)
    stored = torch.where((stored & 0x7F) == 0x7F, 0x7F, stored).to(torch.uint8)
    rope = k_pe.to(torch.bfloat16)
    rope = torch.where(rope.isnan(), torch.tensor(0x7FC0, dtype=torch.int16, device=rope.device),
                       rope.view(torch.int16))
    return torch.cat([stored, scale.view(torch.uint8), rope.view(torch.uint8)], dim=-1)


def dequantize_latent_fp8(rows: torch.Tensor, latent_dim: int, rope_dim: int,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows uint8 [..., R + 4 R/128 + 2 P] in the "fp8_ds_mla" layout as `dtype` values [..., R + P]."""
    tiles = latent_dim // LATENT_FP8_TILE
    rows = rows.contiguous()
    stored = rows[..., :latent_dim].view(torch.float8_e4m3fn).to(dtype).unflatten(-1, (tiles, LATENT_FP8_TILE))
    scale = rows[..., latent_dim:latent_dim + 4 * tiles].contiguous().view(torch.float32).to(dtype)
    rope = rows[..., latent_dim + 4 * tiles:].contiguous().view(torch.bfloat16).to(dtype)
    return torch.cat([(stored * scale[..., None]).flatten(-2), rope], dim=-1)
