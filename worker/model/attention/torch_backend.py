"""The torch attention backend: the CPU path and the reference for the Triton one."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise

import torch

from kvscale.kernels.kv_cache import write_kv_cache
from kvscale.kernels.paged_attention import decode_key_mask, paged_decode_attention, paged_prefill_attention
from kvscale.worker.model.attention.backend import CommonAttentionMetadata


def plan_decode_buckets(
    seq_lens: list[int], block_size: int, growth: float = 1.5, min_size: int = 4
) -> list[int]:
    """Split decode sequences (sorted ascending by length) into contiguous buckets, each padded to
    its own longest member. A bucket closes when the next sequence is `growth` times longer (in
    blocks) than the bucket's first, so padding work stays within ~growth x the real work while
    the number of kernel calls grows only logarithmically with the spread of lengths.
    Returns bucket boundaries [0, b1, ..., len(seq_lens)]."""
    bounds = [0]
    first_blocks = None
    for i, n in enumerate(seq_lens):
        blocks = -(-n // block_size)
        if first_blocks is None:
            first_blocks = blocks
        elif blocks > growth * first_blocks and i - bounds[-1] >= min_size:
            bounds.append(i)
            first_blocks = blocks
    if seq_lens:
        bounds.append(len(seq_lens))
    return bounds


@dataclass
class _DecodeBucket:
    start: int
    end: int
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    # Key masks per sliding window (None: full attention), made by the step's first layer.
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def mask(self, block_size: int, sliding_window: int | None) -> torch.Tensor:
        if sliding_window not in self.masks:
            max_len = self.block_tables.shape[1] * block_size
            self.masks[sliding_window] = decode_key_mask(self.seq_lens, max_len, sliding_window)
        return self.masks[sliding_window]


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor
    decode_buckets: list[_DecodeBucket]
    num_decodes: int
    prefill_block_tables: torch.Tensor
    prefill_query_start_loc: torch.Tensor
    prefill_seq_lens: torch.Tensor


class TorchAttentionBackend:
    """The CPU path and the reference: padded-per-bucket batched decode, per-sequence prefill."""

    name = "torch"

    def prepare(self, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        nd, bs = common.num_decodes, common.block_size
        device = common.block_tables.device
        seq_lens = common.seq_lens.tolist()
        bounds = plan_decode_buckets(seq_lens[:nd], bs)
        buckets = []
        for s, e in pairwise(bounds):
            max_blocks = -(-seq_lens[e - 1] // bs)
            buckets.append(
                _DecodeBucket(s, e, common.block_tables[s:e, :max_blocks], common.seq_lens[s:e].to(device))
            )
        qsl = common.query_start_loc[nd:]
        return TorchAttentionMetadata(
            slot_mapping=common.slot_mapping,
            decode_buckets=buckets,
            num_decodes=nd,
            prefill_block_tables=common.block_tables[nd:],
            prefill_query_start_loc=qsl - qsl[0],
            prefill_seq_lens=common.seq_lens[nd:],
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: TorchAttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        write_kv_cache(key, value, k_cache, v_cache, metadata.slot_mapping)
        if not metadata.decode_buckets:
            return paged_prefill_attention(
                query, k_cache, v_cache, metadata.prefill_block_tables, metadata.prefill_query_start_loc,
                metadata.prefill_seq_lens, scale, sliding_window,
            )  # fmt: skip
        buckets, nd, bs = metadata.decode_buckets, metadata.num_decodes, k_cache.shape[2]
        if len(buckets) == 1 and query.shape[0] == nd:  # the common decode step: no copy into `out`
            b = buckets[0]
            return paged_decode_attention(
                query,
                k_cache,
                v_cache,
                b.block_tables,
                b.seq_lens,
                scale,
                sliding_window,
                b.mask(bs, sliding_window),
            )
        out = torch.empty_like(query)
        for b in buckets:
            out[b.start : b.end] = paged_decode_attention(
                query[b.start : b.end], k_cache, v_cache, b.block_tables, b.seq_lens, scale, sliding_window,
                b.mask(bs, sliding_window),
            )  # fmt: skip
        if query.shape[0] > nd:
            out[nd:] = paged_prefill_attention(
                query[nd:], k_cache, v_cache, metadata.prefill_block_tables, metadata.prefill_query_start_loc,
                metadata.prefill_seq_lens, scale, sliding_window,
            )  # fmt: skip
        return out
