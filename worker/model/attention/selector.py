"""Which attention backend a device gets."""

from __future__ import annotations

import torch

from kvscale.kernels.dispatch import triton_available, triton_interpreting
from kvscale.worker.model.attention.backend import AttentionBackend
from kvscale.worker.model.attention.torch_backend import TorchAttentionBackend


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """`auto` picks Triton on CUDA when triton imports, plain torch elsewhere. `triton` off CUDA
    runs only under the Triton interpreter (TRITON_INTERPRET=1: tests)."""
    if name == "auto":
        name = "triton" if device.type == "cuda" and triton_available() else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        if not triton_available():
            raise ValueError("attention_backend='triton' needs the triton package; install it or use 'torch'")
        if device.type != "cuda" and not triton_interpreting():
            raise ValueError(
                f"attention_backend='triton' needs a CUDA device (got {device.type}); "
                "on a CPU it runs only under the Triton interpreter (TRITON_INTERPRET=1, for tests)"
            )
        # Imported here: the Triton kernels' modules import triton, which CPU-only installs may lack.
        from kvscale.worker.model.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention_backend {name!r}; choose auto, torch or triton")
