"""Owns the model and the KV tensors; turns one SchedulerOutput into one forward pass and samples.

The flat batch is ordered [decodes sorted by context length..., prefill chunks...]: the attention
backend batches decodes by length bucket and walks prefill chunks one by one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from kvscale.worker.attention import CommonAttentionMetadata, get_attention_backend
from kvscale.worker.config import EngineArgs
from kvscale.worker.kv_cache_sizing import bytes_per_block, free_memory_bytes, num_blocks_for
from kvscale.worker.model_loader import load_config, load_model, resolve_dtype
from kvscale.worker.request import TokenLogprobs
from kvscale.worker.sampler import Sampler, SamplingMetadata
from kvscale.worker.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but no CUDA device is available")
    return device


def resolve_max_model_len(requested: int | None, hf_config) -> int:
    limit = getattr(hf_config, "max_position_embeddings", None)
    if requested is None:
        if limit is None:
            raise ValueError("the model config has no max_position_embeddings; pass max_model_len")
        return limit
    return requested


@dataclass
class ModelRunnerOutput:
    # Aligned with SchedulerOutput.requests; empty for prefill chunks that do not end the prompt.
    sampled_token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None]


class ModelRunner:
    def __init__(self, args: EngineArgs) -> None:
        self.device = resolve_device(args.device)
        self.hf_config = load_config(args.model)
        self.dtype = resolve_dtype(args.dtype, self.hf_config, self.device)
        self.max_model_len = resolve_max_model_len(args.max_model_len, self.hf_config)
        self.block_size = args.block_size
        torch.manual_seed(args.seed)
        self.model = load_model(args.model, self.hf_config, self.max_model_len, self.device, self.dtype)
        self.spec = self.model.spec
        self.backend = get_attention_backend(args.attention_backend, self.device)
        self.sampler = Sampler()
        self.num_blocks = self._size_kv_cache(args)
        self.kv_caches = self._allocate_kv_cache(self.num_blocks)

    # -- KV cache ----------------------------------------------------------------------------
    def _size_kv_cache(self, args: EngineArgs) -> int:
        spec = self.spec
        block_bytes = bytes_per_block(
            spec.num_layers, self.block_size, spec.num_kv_heads, spec.head_dim, self.dtype
        )
        reserve = self._profile_activation_bytes(args) if self.device.type == "cuda" else 0
        num_blocks = num_blocks_for(
            block_bytes=block_bytes,
            device_type=self.device.type,
            free_bytes=free_memory_bytes(self.device),
            activation_reserve=reserve,
            max_useful_blocks=args.max_num_seqs * -(-self.max_model_len // self.block_size),
            num_kv_blocks=args.num_kv_blocks,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            kv_cache_memory_fraction=args.kv_cache_memory_fraction,
        )
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB, %d tokens)",
            num_blocks, self.block_size, num_blocks * block_bytes / 2**20, num_blocks * self.block_size,
        )  # fmt: skip
        return num_blocks

    def _allocate_kv_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        # Zeroed, not empty: padded attention reads stale slots (masked out), and 0 * NaN would leak.
        shape = (self.spec.num_kv_heads, num_blocks, self.block_size, self.spec.head_dim)  # head-major
        return [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(self.spec.num_layers)
        ]

    def _profile_activation_bytes(self, args: EngineArgs) -> int:
        """Peak memory of the largest step (one full-budget prefill), measured with a scratch cache."""
        n = min(args.max_num_batched_tokens, self.max_model_len)
        blocks = -(-n // self.block_size)
        self.kv_caches = self._allocate_kv_cache(blocks)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        tokens = torch.zeros(n, dtype=torch.long, device=self.device)
        positions = torch.arange(n, device=self.device)
        common = CommonAttentionMetadata(
            slot_mapping=positions,
            query_start_loc=torch.tensor([0, n]),
            seq_lens=torch.tensor([n]),
            block_tables=torch.arange(blocks, device=self.device)[None, :],
            num_decodes=0,
            block_size=self.block_size,
        )
        with torch.inference_mode():
            hidden = self.model(tokens, positions, self.kv_caches, self.backend, self.backend.prepare(common))
            self.model.compute_logits(hidden[-min(n, args.max_num_seqs) :])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        self.kv_caches = []
        torch.cuda.empty_cache()
        return int(peak * 1.1)

    # -- one step ----------------------------------------------------------------------------
    def _order(self, out: SchedulerOutput) -> list[int]:
        decodes = [i for i, n in enumerate(out.num_scheduled_tokens) if n == 1]
        decodes.sort(key=lambda i: out.requests[i].num_computed_tokens)
        taken = set(decodes)
        return decodes + [i for i in range(len(out.requests)) if i not in taken]

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        order = self._order(out)
        bs = self.block_size
        num_seqs = len(order)
        max_blocks = max(len(out.block_ids[i]) for i in order)
        block_tables = np.zeros((num_seqs, max_blocks), dtype=np.int64)
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        seq_lens = np.zeros(num_seqs, dtype=np.int64)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []  # row in `order` of each sequence that samples this step
        num_decodes = 0
        for row, i in enumerate(order):
            request, n, block_ids = out.requests[i], out.num_scheduled_tokens[i], out.block_ids[i]
            start = request.num_computed_tokens
            end = start + n
            block_tables[row, : len(block_ids)] = block_ids
            query_start_loc[row + 1] = query_start_loc[row] + n
            seq_lens[row] = end
            if n == 1:
                num_decodes += 1
                input_ids.append(request.all_token_ids[start])
                positions.append(start)
                slots.append(block_ids[start // bs] * bs + start % bs)
            else:
                input_ids.extend(request.all_token_ids[start:end])
                pos = np.arange(start, end)
                positions.extend(pos.tolist())
                slots.extend((np.asarray(block_ids)[pos // bs] * bs + pos % bs).tolist())
            if end == request.num_tokens:
                sample_rows.append(row)

        dev = self.device
        positions_t = torch.tensor(positions, dtype=torch.long, device=dev)
        common = CommonAttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_start_loc=torch.from_numpy(query_start_loc),
            seq_lens=torch.from_numpy(seq_lens),
            block_tables=torch.from_numpy(block_tables).to(dev),
            num_decodes=num_decodes,
            block_size=bs,
        )
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            positions_t,
            self.kv_caches,
            self.backend,
            self.backend.prepare(common),
        )

        sampled: list[list[int]] = [[] for _ in out.requests]
        logprobs: list[list[TokenLogprobs] | None] = [None for _ in out.requests]
        if sample_rows:
            last_token_index = torch.from_numpy(query_start_loc[1:][sample_rows] - 1).to(dev)
            logits = self.model.compute_logits(hidden[last_token_index])
            requests = [out.requests[order[r]] for r in sample_rows]
            result = self.sampler(logits, SamplingMetadata.from_requests(requests, self.spec.vocab_size, dev))
            token_ids = result.sampled_token_ids.tolist()
            for k, r in enumerate(sample_rows):
                sampled[order[r]] = [token_ids[k]]
                if result.logprobs is not None and result.logprobs[k] is not None:
                    logprobs[order[r]] = [result.logprobs[k]]
        return ModelRunnerOutput(sampled, logprobs)
