"""The attention backend interface: `prepare` once per step, `forward` once per layer.

The model runner orders each batch as [decode sequences sorted by length..., prefill chunks...]
and describes it with CommonAttentionMetadata; a backend turns that into whatever plan its
kernels want (torch_backend.py: length buckets for decode; triton_backend.py: split-K decode
and paged prefill kernels). selector.py picks one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class CommonAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, where each new token's K/V goes
    query_start_loc: torch.Tensor  # [B + 1] int64 (CPU)
    seq_lens: torch.Tensor  # [B] int64 (CPU): context incl. this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] int64 on the device
    # The first num_decodes sequences have exactly one query token, sorted by ascending seq_len.
    num_decodes: int
    block_size: int


class AttentionBackend(Protocol):
    name: str

    def prepare(self, common: CommonAttentionMetadata) -> object: ...

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: object,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor: ...
