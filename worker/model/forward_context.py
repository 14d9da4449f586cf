"""The per-forward state that attention needs but a compiled graph must not see: the backend, its
metadata for this step and the KV cache tensors.

torch.compile traces the model as a function of token ids and positions only; the attention layers
reach this step's plan through `get_forward_context()` inside the opaque `unified_attention` op
(attention/unified_attention.py), so a step with another batch plan never triggers a recompile.
vLLM's forward context has the same job.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class ForwardContext:
    backend: object  # an AttentionBackend
    attn_metadata: object  # what backend.prepare returned for this step
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (K, V)


_current: ForwardContext | None = None


@contextmanager
def set_forward_context(backend, attn_metadata, kv_caches) -> Iterator[None]:
    global _current
    previous, _current = _current, ForwardContext(backend, attn_metadata, kv_caches)
    try:
        yield
    finally:
        _current = previous


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("attention ran outside a forward: the model must be called through forward()")
    return _current
