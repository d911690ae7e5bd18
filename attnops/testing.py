"""Random paged inputs for tests and benchmarks: fresh random data (never zeros), pages in random order, garbage in
the block table past each sequence's last page, as a real allocator and serving loop would leave them."""
from __future__ import annotations

import torch

from . import formats


def random_block_table(kv_lens, page_size: int, spare_pages: int, table_padding: int, gen: torch.Generator,
                       device) -> tuple[torch.Tensor, int]:
    """(a block table [B, pages of the longest + table_padding] (int64), the cache's page count): each sequence's
    pages at random places of a cache with `spare_pages` more, and garbage past each sequence's last page (-1 or a
    random page index, which kernels must never read)."""
    pages_needed = [-(-n // page_size) for n in kv_lens]
    num_pages = sum(pages_needed) + spare_pages
    order = torch.randperm(num_pages, generator=gen, device=device)
    width = max(pages_needed + [1]) + table_padding
    table = torch.where(torch.rand(len(kv_lens), width, generator=gen, device=device) < 0.5, -1,
                        torch.randint(0, num_pages, (len(kv_lens), width), generator=gen, device=device))
    start = 0
    for b, n in enumerate(pages_needed):
        table[b, :n] = order[start:start + n]
        start += n
    return table, num_pages


def random_paged_inputs(kv_lens, q_lens=None, *, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                        kv_format="fp32", q_dtype=torch.float32, scale_kind="per_tensor", device="cpu", seed=0,
                        spare_pages=3, table_padding=2) -> dict:
    """Keyword arguments for paged_attention.

    kv_lens: KV length of each sequence (this step's tokens included). q_lens: query tokens per sequence, or None
    for decode (one each, cu_seqlens_q None). scale_kind: "per_tensor" or "per_head" for fp8 caches."""
    device = torch.device(device)
    gen = torch.Generator(device).manual_seed(seed)  # made where it is used: benchmark caches are many GB
    batch = len(kv_lens)
    table, num_pages = random_block_table(kv_lens, page_size, spare_pages, table_padding, gen, device)

    fmt = formats.FORMATS[kv_format]
    shape = (num_pages, 2, page_size, num_kv_heads, fmt.stored_head_dim(head_dim))
    k_scale = v_scale = None
    if fmt.scale == "block":
        kv = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8, device=device)
        scale_shape = fmt.block_scale_shape(shape, head_dim)
        if kv_format == "nvfp4":
            block_scales = (torch.rand(scale_shape, generator=gen, device=device) * 0.3 + 0.02).to(
                torch.float8_e4m3fn)
        else:
            block_scales = torch.randint(122, 126, scale_shape, generator=gen, dtype=torch.uint8, device=device)
        k_scale, v_scale = block_scales[:, 0], block_scales[:, 1]
    else:
        values = torch.randn(shape, generator=gen, device=device)
        if formats.is_fp8(kv_format):
            n = num_kv_heads if scale_kind == "per_head" else 1
            k_scale = (torch.rand(n, generator=gen, device=device) * 0.5 + 0.25).reshape(() if n == 1 else (n,))
            v_scale = (torch.rand(n, generator=gen, device=device) * 0.5 + 0.25).reshape(k_scale.shape)
            kv = torch.stack((formats.quantize_fp8(values[:, 0], k_scale, kv_format),
                              formats.quantize_fp8(values[:, 1], v_scale, kv_format)), dim=1)
        else:
            kv = values.to(fmt.storage_dtype)
        del values

    if q_lens is None:
        cu_seqlens_q, num_tokens = None, batch
    else:
        cu = torch.zeros(batch + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0)
        cu_seqlens_q, num_tokens = cu, int(cu[-1])
    q = torch.randn(num_tokens, num_q_heads, head_dim, generator=gen, device=device).to(q_dtype)

    args = dict(q=q, k_cache=kv[:, 0], v_cache=kv[:, 1], block_table=table.to(torch.int32),
                seq_lens=torch.tensor(kv_lens, dtype=torch.int32, device=device),
                cu_seqlens_q=None if cu_seqlens_q is None else cu_seqlens_q.to(device),
                kv_format=kv_format if formats.is_fp4(kv_format) else "auto")
    if k_scale is not None:
        args.update(k_scale=k_scale, v_scale=v_scale)
    return args


def random_mla_inputs(kv_lens, q_lens=None, *, num_heads=4, latent_dim=64, rope_dim=16, page_size=4,
                      q_dtype=torch.float16, kv_format="auto", device="cpu", seed=0, spare_pages=2,
                      table_padding=1, scale=0.13) -> dict:
    """Keyword arguments of mla_attention: a paged latent cache of random rows in random page order (kv_format
    "auto": q's dtype; "fp8_e4m3": stored / kv_scale; "fp8_ds_mla": DeepSeek's layout, each 128 latent values of
    their own size), garbage (-1 or a random page) past each sequence's pages, one query row a sequence (decode) or
    q_lens rows each."""
    device = torch.device(device)
    gen = torch.Generator(device).manual_seed(seed)  # (made where it is used, as random_paged_inputs)
    batch = len(kv_lens)
    table, num_pages = random_block_table(kv_lens, page_size, spare_pages, table_padding, gen, device)
    table = table.to(torch.int32)
    rows = torch.randn(num_pages, page_size, latent_dim + rope_dim, generator=gen, device=device)
    args = {}
    if kv_format == "fp8_e4m3":
        args["kv_scale"] = torch.tensor([0.5], device=device)
        kv = (rows / args["kv_scale"]).to(torch.float8_e4m3fn)
    elif kv_format == formats.LATENT_FP8_FORMAT:  # each row's 128-value tiles of unlike sizes: unlike scales
        tiles = latent_dim // formats.LATENT_FP8_TILE
        size = torch.rand(num_pages, page_size, tiles, 1, generator=gen, device=device) * 4 + 0.1
        latent = (rows[..., :latent_dim].unflatten(-1, (tiles, -1)) * size).flatten(-2)
        kv = formats.quantize_latent_fp8(latent, rows[..., latent_dim:])
    else:
        kv = rows.to(q_dtype)
    del rows
    tokens = batch if q_lens is None else sum(q_lens)
    args.update(q_nope=torch.randn(tokens, num_heads, latent_dim, generator=gen, device=device).to(q_dtype),
                q_pe=torch.randn(tokens, num_heads, rope_dim, generator=gen, device=device).to(q_dtype),
                kv_cache=kv, block_table=table, seq_lens=torch.tensor(kv_lens, dtype=torch.int32, device=device),
                kv_format=kv_format, scale=scale,
                cu_seqlens_q=None if q_lens is None else
                torch.tensor([0] + list(q_lens)).cumsum(0).to(torch.int32).to(device))
    return args


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (NaN if out has any NaN)."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp(min=1e-30)).item()


def extra_call_memory(call) -> int:
    """The device memory `call()` allocates beyond what is live before it (its peak), measured on a second call
    after a warm-up one (compiles and caches outside the measurement)."""
    call()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    call()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before
