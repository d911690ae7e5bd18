"""The merge of two partial attention results over disjoint key sets (attnops.merge_attention_states on a GPU):
one program per query row and block of heads (a row of many wide heads, as latent attention's 128 x 512, would not
fit one program's registers), natural-log LSEs (the op's contract, not the attention kernel's base 2). A head dim
that is not a power of two is padded to one and masked."""
from __future__ import annotations

import triton
import triton.language as tl

LN2 = tl.constexpr(0.6931471805599453)
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def merge_states_kernel(out_a_ptr, lse_a_ptr, out_b_ptr, lse_b_ptr, out_ptr, lse_ptr,
                        stride_at, stride_ah, stride_bt, stride_bh, stride_ot, stride_oh,
                        stride_lat, stride_lbt, stride_lot,
                        NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
                        HEAD_DIM_P2: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hv = h < NUM_HEADS
    d = tl.arange(0, HEAD_DIM_P2)
    rows = hv[:, None] & (d[None, :] < HEAD_DIM)
    la = tl.load(lse_a_ptr + t * stride_lat + h, mask=hv, other=float("-inf")).to(tl.float32)
    lb = tl.load(lse_b_ptr + t * stride_lbt + h, mask=hv, other=float("-inf")).to(tl.float32)
    m = tl.maximum(la, lb)
    # NaN in either lse: tl.maximum may drop it, so it is carried explicitly
    has_nan = (la != la) | (lb != lb)
    m_use = tl.where(m == float("-inf"), 0.0, m)  # both sides empty: weights 0, output 0
    wa = tl.exp2((la - m_use) * LOG2E)
    wb = tl.exp2((lb - m_use) * LOG2E)
    total = wa + wb
    inv = tl.where(total > 0.0, 1.0 / tl.where(total > 0.0, total, 1.0), 0.0)
    a = tl.load(out_a_ptr + t * stride_at + h[:, None] * stride_ah + d[None, :], mask=rows, other=0.0)
    b = tl.load(out_b_ptr + t * stride_bt + h[:, None] * stride_bh + d[None, :], mask=rows, other=0.0)
    # an empty side (weight 0) contributes nothing, whatever its output holds
    a = tl.where((wa > 0.0)[:, None], a.to(tl.float32) * (wa * inv)[:, None], 0.0)
    b = tl.where((wb > 0.0)[:, None], b.to(tl.float32) * (wb * inv)[:, None], 0.0)
    o = tl.where(has_nan[:, None], float("nan"), a + b)
    lse = tl.where(total > 0.0, m_use + tl.log2(tl.where(total > 0.0, total, 1.0)) * LN2, float("-inf"))
    lse = tl.where(has_nan, float("nan"), lse)
    tl.store(out_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=rows)
    tl.store(lse_ptr + t * stride_lot + h, lse.to(lse_ptr.dtype.element_ty), mask=hv)


def merge_states(out_a, lse_a, out_b, lse_b, out, lse) -> None:
    """Writes the merge into `out` [T, H, D] and `lse` [T, H]; inputs validated by the op (last dims
    contiguous)."""
    num_tokens, num_heads, head_dim = out_a.shape
    if num_tokens == 0:
        return
    head_dim_p2 = triton.next_power_of_2(head_dim)
    # at most 4096 values a program (16 heads of 256, 8 of 512), all heads where they fit
    block_h = min(triton.next_power_of_2(num_heads), max(1, 4096 // head_dim_p2))
    merge_states_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        out_a_ptr=out_a, lse_a_ptr=lse_a, out_b_ptr=out_b, lse_b_ptr=lse_b, out_ptr=out, lse_ptr=lse,
        stride_at=out_a.stride(0), stride_ah=out_a.stride(1), stride_bt=out_b.stride(0), stride_bh=out_b.stride(1),
        stride_ot=out.stride(0), stride_oh=out.stride(1), stride_lat=lse_a.stride(0), stride_lbt=lse_b.stride(0),
        stride_lot=lse.stride(0), NUM_HEADS=num_heads, BLOCK_H=block_h, HEAD_DIM=head_dim, HEAD_DIM_P2=head_dim_p2,
        num_warps=4 if head_dim_p2 * block_h >= 2048 else 2)
