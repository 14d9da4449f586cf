"""Compute kernels: a plain-torch reference for each (the CPU path, and the ground truth for
tests) and a Triton version with the same signature for the GPU path.

- `kv_cache`, `norm`, `rotary`, `paged_attention`: the references.
- `triton_kv_cache`, `triton_norm`, `triton_rotary`, `triton_paged_attention`: the Triton kernels,
  imported only on demand (they need the `triton` package; on a CPU only under TRITON_INTERPRET=1).
- The names exported here: the norms and rotary dispatch on the tensor's device (Triton on CUDA);
  attention and the KV-cache write are the references, the engine's attention backend picks the
  implementation (worker/model/attention/backend.py, worker/model/attention/triton_backend.py).
"""

from kvscale.kernels.dispatch import (
    apply_rotary_embedding,
    fused_add_rms_norm,
    rms_norm,
    triton_available,
    triton_interpreting,
)
from kvscale.kernels.kv_cache import write_kv_cache
from kvscale.kernels.paged_attention import paged_decode_attention, paged_prefill_attention

__all__ = [
    "apply_rotary_embedding",
    "fused_add_rms_norm",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "triton_available",
    "triton_interpreting",
    "write_kv_cache",
]
