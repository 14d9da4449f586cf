"""RMSNorm and fused residual-add RMSNorm in Triton, same signatures as norm.py.

One program per row (token). The statistics are float32; the normalised row is rounded to the
input dtype before the weight multiply, exactly like the reference (and Hugging Face), so the two
paths differ only by the order of the float32 reduction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    out_ptr,
    residual_out_ptr,
    x_ptr,
    residual_ptr,
    weight_ptr,
    eps,
    n_cols,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    dtype = x.dtype
    x32 = x.to(tl.float32)  # all arithmetic in float32 (the interpreter cannot add bfloat16)
    if HAS_RESIDUAL:
        # The sum is rounded to the activation dtype: it *is* the next residual stream.
        r32 = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        x = (x32 + r32).to(dtype)
        tl.store(residual_out_ptr + row * stride_ro + offs, x, mask=mask)
        x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, axis=0) / n_cols + eps)
    normed = (x32 * rstd).to(dtype).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch(x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor | None]:
    n = x.shape[-1]
    x2 = _rows(x)
    out_dtype = torch.promote_types(weight.dtype, x.dtype)  # as `weight * x` in the reference
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    r2 = _rows(residual) if residual is not None else x2
    residual_out = torch.empty_like(x2) if residual is not None else out
    if x2.shape[0] > 0:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(x2.shape[0],)](
            out, residual_out, x2, r2, weight, eps, n,
            x2.stride(0), r2.stride(0), out.stride(0), residual_out.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
        )  # fmt: skip
    out = out.view(x.shape)
    return out, (residual_out.view(x.shape) if residual is not None else None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual), one read of each input, one kernel."""
    out, residual_out = _launch(x, residual, weight, eps)
    return out, residual_out
