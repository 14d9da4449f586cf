"""Device dispatch for the kernels the model calls directly (norms, rotary): Triton on CUDA
tensors, the plain-torch reference everywhere else. Attention and the KV-cache write are chosen by
the engine's attention backend instead (worker/model/attention/backend.py), so they are not dispatched here.

Triton is imported lazily: importing kvscale.kernels never needs it. `KVSCALE_TRITON_KERNELS=0`
forces the references on CUDA too (debugging, bisecting a numerical difference).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from kvscale.kernels import lora, norm, rotary


@functools.cache
def triton_available() -> bool:
    if os.environ.get("KVSCALE_TRITON_KERNELS", "1") == "0" or importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # a broken install (e.g. no C compiler for its launcher) means "no Triton"
        return False
    return True


def triton_interpreting() -> bool:
    """True when Triton kernels run under the CPU interpreter (tests set TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") and triton_available()


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and triton_available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _use_triton(x):
        from kvscale.kernels import triton_norm

        return triton_norm.rms_norm(x, weight, eps)
    return norm.rms_norm(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if _use_triton(x):
        from kvscale.kernels import triton_norm

        return triton_norm.fused_add_rms_norm(x, residual, weight, eps)
    return norm.fused_add_rms_norm(x, residual, weight, eps)


def apply_rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    if _use_triton(query):
        from kvscale.kernels import triton_rotary

        return triton_rotary.apply_rotary_embedding(positions, query, key, cos_cache, sin_cache)
    return rotary.apply_rotary_embedding(positions, query, key, cos_cache, sin_cache)


def add_lora(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    lora_b_bd: torch.Tensor | None,
    rows: lora.StepRows,
    slices: list[tuple[int, int]],
    targeted=lambda slot: True,
) -> torch.Tensor:
    """Each row's LoRA product added into `out` (kernels/lora.py): on the CPU the way the step's
    rows were planned (lora.plan_rows, once per step); on CUDA, Triton's per-row gather."""
    if _use_triton(x):
        from kvscale.kernels import triton_lora

        return triton_lora.add_lora(out, x, lora_a, lora_b, rows.token_slots, slices)
    return lora.add_lora_step(out, x, lora_a, lora_b, lora_b_bd, rows, slices, targeted)
