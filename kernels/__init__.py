"""Compute kernels: a plain-torch reference for each (CPU path, and the ground truth for tests);
Triton versions with the same signatures arrive for the GPU path."""

from kvscale.kernels.kv_cache import write_kv_cache
from kvscale.kernels.norm import fused_add_rms_norm, rms_norm
from kvscale.kernels.paged_attention import paged_decode_attention, paged_prefill_attention
from kvscale.kernels.rotary import apply_rotary_embedding

__all__ = [
    "apply_rotary_embedding",
    "fused_add_rms_norm",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "write_kv_cache",
]
