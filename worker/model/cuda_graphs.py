"""CUDA graphs for decode steps: capture the model forward once per batch size, replay it.

A decode step of a small model is launch-bound: hundreds of small kernels whose launch overhead
exceeds their run time. A captured graph launches them all at once. The graph reads static
buffers, so a step copies its inputs into them, pads the batch up to the next captured size, and
replays; padded rows get slot -1 (the KV-cache write skips them) and a one-token context, so they
touch nothing real and cost almost nothing. The split-K grid is sized for `max_model_len` at
capture, and its programs past a sequence's context exit at once.

Needs the Triton backend (its forward never syncs with the host) and a CUDA device. The model
runner hooks it in with `CUDAGraphRunner.maybe_create` after the KV cache exists and
`can_run` / `run` in its forward; `KVSCALE_CUDA_GRAPHS=0` turns graphs off.
"""

from __future__ import annotations

import bisect
import logging
import os
import time
from collections.abc import Callable

import torch

from kvscale.worker.model.attention.backend import CommonAttentionMetadata

logger = logging.getLogger(__name__)

CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class CUDAGraphRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend,
        *,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        capture_sizes: tuple[int, ...] = CAPTURE_SIZES,
    ) -> None:
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.max_model_len = max_model_len
        # Every size up to the first one that holds max_num_seqs.
        sizes = sorted(capture_sizes)
        self.sizes = [s for s in sizes if s < max_num_seqs] + [s for s in sizes if s >= max_num_seqs][:1]
        n = self.max_batch_size = self.sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.long, device=device)
        self.device = device
        self.replays: dict[int, Callable[[], None]] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # static hidden states, one per captured size
        self.pool = None

    @classmethod
    def maybe_create(cls, runner, max_num_seqs: int) -> CUDAGraphRunner | None:
        """A captured runner for a ModelRunner when graphs apply (CUDA, Triton backend), else None."""
        if runner.device.type != "cuda" or getattr(runner.backend, "name", "") != "triton":
            return None
        if os.environ.get("KVSCALE_CUDA_GRAPHS", "1") == "0":
            return None
        graphs = cls(
            runner.model, runner.kv_caches, runner.backend,
            max_num_seqs=max_num_seqs, max_model_len=runner.max_model_len,
            block_size=runner.block_size, device=runner.device,
        )  # fmt: skip
        graphs.capture()
        return graphs

    def _forward(self, size: int) -> torch.Tensor:
        metadata = self.backend.build_decode_metadata(
            self.slot_mapping[:size], self.block_tables[:size], self.seq_lens[:size], self.max_model_len
        )
        return self.model(
            self.input_ids[:size], self.positions[:size], self.kv_caches, self.backend, metadata
        )

    def _capture_graph(self, size: int) -> Callable[[], None]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[size] = self._forward(size)
        self.pool = graph.pool()
        return graph.replay

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        # Padding state everywhere: the warm-up and capture runs write no KV and read block 0.
        self.slot_mapping.fill_(-1)
        self.seq_lens.fill_(1)
        self.block_tables.zero_()
        self._forward(self.max_batch_size)  # compiles the Triton kernels outside any capture
        self._synchronize()
        for size in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
            self.replays[size] = self._capture_graph(size)
        self._synchronize()
        logger.info(
            "captured CUDA graphs for decode batch sizes %s in %.1f s",
            self.sizes, time.perf_counter() - start,
        )  # fmt: skip

    def can_run(self, common: CommonAttentionMetadata) -> bool:
        num_seqs = common.seq_lens.shape[0]
        return (
            common.num_decodes == num_seqs
            and 0 < num_seqs <= self.max_batch_size
            and common.block_tables.shape[1] <= self.block_tables.shape[1]
        )

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, common: CommonAttentionMetadata
    ) -> torch.Tensor:
        """Hidden states [num_seqs, hidden] of a decode-only step; valid until the next run."""
        n = input_ids.shape[0]
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(common.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(common.seq_lens, non_blocking=True)
        cols = common.block_tables.shape[1]
        self.block_tables[:n, :cols].copy_(common.block_tables, non_blocking=True)
        if size > n:  # padded rows: no KV write, a one-token context in block 0
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(1)
            self.block_tables[n:size, 0].zero_()
        self.replays[size]()
        return self.outputs[size][:n]
