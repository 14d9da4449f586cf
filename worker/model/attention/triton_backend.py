"""The Triton attention backend: the GPU path (and, under TRITON_INTERPRET=1, a CPU test path).

`prepare` does every host-side computation once per step (device copies of the lengths, grid
sizes), so `forward`, called once per layer, only launches kernels: a KV-cache write, split-K
decode attention over the step's decode sequences, and paged prefill attention over its chunks.
Nothing in `forward` syncs with the host, which is what lets decode steps be captured in CUDA
graphs (worker/model/cuda_graphs.py builds the same metadata over static buffers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvscale.kernels.triton_kv_cache import write_kv_cache
from kvscale.kernels.triton_paged_attention import paged_decode_attention, paged_prefill_attention
from kvscale.worker.model.attention.backend import CommonAttentionMetadata


@dataclass
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # [T]; a negative slot writes nothing (CUDA-graph padding)
    num_decodes: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] on the device
    decode_seq_lens: torch.Tensor  # [num_decodes] on the device
    decode_max_seq_len: int  # sizes the split-K grid; an upper bound is enough
    num_prefills: int
    prefill_block_tables: torch.Tensor
    prefill_query_start_loc: torch.Tensor  # [num_prefills + 1] on the device, from 0
    prefill_seq_lens: torch.Tensor
    prefill_max_query_len: int


class TritonAttentionBackend:
    name = "triton"

    def prepare(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        nd = common.num_decodes
        device = common.block_tables.device
        seq_lens = common.seq_lens.to(device, non_blocking=True)
        qsl = common.query_start_loc[nd:]
        prefill_qsl = qsl - qsl[0]
        lens = common.seq_lens.tolist()  # CPU already: no sync
        return TritonAttentionMetadata(
            slot_mapping=common.slot_mapping,
            num_decodes=nd,
            decode_block_tables=common.block_tables[:nd],
            decode_seq_lens=seq_lens[:nd],
            decode_max_seq_len=max(lens[:nd], default=0),
            num_prefills=len(lens) - nd,
            prefill_block_tables=common.block_tables[nd:],
            prefill_query_start_loc=prefill_qsl.to(device, non_blocking=True),
            prefill_seq_lens=seq_lens[nd:],
            prefill_max_query_len=int((prefill_qsl[1:] - prefill_qsl[:-1]).max()) if len(lens) > nd else 0,
        )

    def build_decode_metadata(
        self,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        max_seq_len: int,
    ) -> TritonAttentionMetadata:
        """Decode-only metadata over caller-owned (e.g. CUDA-graph static) device tensors."""
        empty = block_tables[:0]
        return TritonAttentionMetadata(
            slot_mapping=slot_mapping,
            num_decodes=seq_lens.shape[0],
            decode_block_tables=block_tables,
            decode_seq_lens=seq_lens,
            decode_max_seq_len=max_seq_len,
            num_prefills=0,
            prefill_block_tables=empty,
            prefill_query_start_loc=seq_lens[:1],
            prefill_seq_lens=seq_lens[:0],
            prefill_max_query_len=0,
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: TritonAttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        write_kv_cache(key, value, k_cache, v_cache, metadata.slot_mapping)
        query = query if query.stride(-1) == 1 else query.contiguous()
        out = torch.empty_like(query)
        nd = metadata.num_decodes
        if nd:
            paged_decode_attention(
                query[:nd], k_cache, v_cache, metadata.decode_block_tables, metadata.decode_seq_lens,
                scale, sliding_window, max_seq_len=metadata.decode_max_seq_len, out=out[:nd],
            )  # fmt: skip
        if metadata.num_prefills:
            paged_prefill_attention(
                query[nd:], k_cache, v_cache, metadata.prefill_block_tables,
                metadata.prefill_query_start_loc, metadata.prefill_seq_lens, scale, sliding_window,
                max_query_len=metadata.prefill_max_query_len, out=out[nd:],
            )  # fmt: skip
        return out
