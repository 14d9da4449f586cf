"""Flatten the sequences of one forward pass into model inputs: token ids, positions, KV slots and
the attention metadata, and run it. Shared by the target's model runner and the draft model.

Rows are ordered [single-token sequences sorted by context length..., multi-token chunks...]: the
attention backends batch decodes by length bucket and walk longer chunks one by one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvscale.worker.model.attention.backend import CommonAttentionMetadata


@dataclass
class SeqChunk:
    """One sequence's share of a forward: tokens at positions start, start + 1, ... whose K/V go
    into the sequence's blocks (which must already cover them)."""

    token_ids: list[int]
    start: int
    block_ids: list[int]
    lora_slot: int = -1  # the LoRA adapter slot of its rows (-1: the base model alone)


@dataclass
class ForwardBatch:
    order: list[int]  # row -> index of its chunk in the caller's list
    input_ids: torch.Tensor
    positions: torch.Tensor
    common: CommonAttentionMetadata
    query_start_loc: np.ndarray  # [rows + 1]: row r owns flat tokens [loc[r], loc[r + 1])
    lora_slots: np.ndarray | None = None  # [tokens]: each flat token's adapter slot; None: no adapter

    def last_token_rows(self, num_last: list[int]) -> torch.Tensor:
        """Flat indices of the last num_last[i] tokens of chunk i, chunk by chunk in the caller's
        order (the rows whose logits a sampler or verifier needs). Vectorised: it runs every step."""
        row_of = np.empty(len(self.order), dtype=np.int64)
        row_of[self.order] = np.arange(len(self.order))
        ends = self.query_start_loc[1:][row_of]
        num = np.asarray(num_last, dtype=np.int64)
        starts = np.repeat(ends - num, num)  # per wanted row: where its chunk's wanted tokens start
        within = np.arange(starts.shape[0]) - np.repeat(np.cumsum(num) - num, num)
        return torch.from_numpy(starts + within).to(self.input_ids.device)

    def all_rows_in_order(self, num_last: list[int]) -> bool:
        """Whether last_token_rows would be every flat row, in order (a decode-only step whose rows
        kept the caller's order, e.g. one stream): the hidden states need no indexing."""
        n = len(self.order)
        return self.input_ids.shape[0] == n and num_last.count(1) == n and self.order == list(range(n))


def build_forward_batch(chunks: list[SeqChunk], block_size: int, device: torch.device) -> ForwardBatch:
    decodes = [i for i, c in enumerate(chunks) if len(c.token_ids) == 1]
    decodes.sort(key=lambda i: chunks[i].start)
    taken = set(decodes)
    order = decodes + [i for i in range(len(chunks)) if i not in taken]

    num_seqs = len(order)
    max_blocks = max(len(chunks[i].block_ids) for i in order)
    block_tables = np.zeros((num_seqs, max_blocks), dtype=np.int64)
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
    seq_lens = np.zeros(num_seqs, dtype=np.int64)
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    for row, i in enumerate(order):
        chunk = chunks[i]
        n, start, block_ids = len(chunk.token_ids), chunk.start, chunk.block_ids
        block_tables[row, : len(block_ids)] = block_ids
        query_start_loc[row + 1] = query_start_loc[row] + n
        seq_lens[row] = start + n
        input_ids.extend(chunk.token_ids)
        if n == 1:
            positions.append(start)
            slots.append(block_ids[start // block_size] * block_size + start % block_size)
        else:
            pos = np.arange(start, start + n)
            positions.extend(pos.tolist())
            slots.extend((np.asarray(block_ids)[pos // block_size] * block_size + pos % block_size).tolist())

    lora_slots = None
    if any(c.lora_slot >= 0 for c in chunks):
        per_row = np.asarray([chunks[i].lora_slot for i in order], dtype=np.int64)
        lora_slots = np.repeat(per_row, np.diff(query_start_loc))
    common = CommonAttentionMetadata(
        slot_mapping=_long_tensor(slots, device),
        query_start_loc=torch.from_numpy(query_start_loc),
        seq_lens=torch.from_numpy(seq_lens),
        block_tables=torch.from_numpy(block_tables).to(device),
        num_decodes=len(decodes),
        block_size=block_size,
    )
    return ForwardBatch(
        order=order,
        input_ids=_long_tensor(input_ids, device),
        positions=_long_tensor(positions, device),
        common=common,
        query_start_loc=query_start_loc,
        lora_slots=lora_slots,
    )


def _long_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    # Through numpy: a third of torch.tensor's time for a short list (0.7 against 2.2 µs), three
    # times a step.
    return torch.from_numpy(np.asarray(values, dtype=np.int64)).to(device)


# Async scheduling: (indices of the chunks whose last token is a placeholder, the real tokens on
# the device, in the same order). The placeholders are overwritten on the device before the forward.
TokenFill = tuple[list[int], torch.Tensor]


# In-graph decode attention computes every sequence over the longest one's blocks (the padding
# reads block 0, in cache, again): taken while that is at most this many times the real work.
MAX_DECODE_PADDING = 4.0


def in_graph_decode(common: CommonAttentionMetadata) -> bool:
    """Whether a decode-only step takes the compiled graph's own decode attention rather than the
    backend's length buckets: when padding every sequence to the longest costs at most
    MAX_DECODE_PADDING times the real work (in blocks)."""
    num_seqs = common.seq_lens.shape[0]
    if common.num_decodes != num_seqs:
        return False
    if num_seqs == 1:  # no padding: one stream's every step, without numpy's cost
        return True
    blocks = -(-common.seq_lens.numpy() // common.block_size)  # numpy: a few µs, every step
    return int(blocks.max()) * blocks.shape[0] <= MAX_DECODE_PADDING * int(blocks.sum())


def forward_logits(
    model,
    backend,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    chunks: list[SeqChunk],
    num_logits: list[int],
    block_size: int,
    device: torch.device,
    graphs=None,
    token_fill: TokenFill | None = None,
    lora_table=None,
) -> torch.Tensor:
    """One forward over the chunks; logits of the last num_logits[i] tokens of each, chunk after
    chunk. Decode-only steps replay `graphs` (a CUDAGraphRunner) when it can run them. A step with
    LoRA rows (chunks with a lora_slot, whose adapters are in `lora_table`'s slots) runs the
    compiled forward's LoRA graphs where its rows pack (kernels/lora.pack_rows), else eagerly."""
    batch = build_forward_batch(chunks, block_size, device)
    if token_fill is not None:
        filled, tokens = token_fill
        last = [0] * len(chunks)
        for i in filled:  # ascending, as last_token_rows lists them
            last[i] = 1
        batch.input_ids[batch.last_token_rows(last)] = tokens
    common = batch.common
    compiled = getattr(model, "compiled", None)  # read once: the whole step takes one forward
    in_graph = compiled is not None and in_graph_decode(common)
    lora = None  # the step's adapter rows as the compiled LoRA graphs take them
    lora_graph = compiled is not None and compiled.serves_lora and (in_graph or len(batch.input_ids) > 1)
    if batch.lora_slots is not None and lora_graph:
        lora = lora_table.graph_inputs(batch.lora_slots)
    if batch.lora_slots is not None and lora is None:
        eager_lora = lora_table.batch(batch.lora_slots)
        hidden = model(
            batch.input_ids, batch.positions, kv_caches, backend, backend.prepare(common), eager_lora
        )
    elif graphs is not None and graphs.can_run(common):
        hidden = graphs.run(batch.input_ids, batch.positions, common)
    elif in_graph:
        # Decode-only on the compiled CPU forward: attention inside the graph. Two block columns at
        # least, so that no context length makes a size-1 dimension (which the graph specialises).
        tables = common.block_tables
        if tables.shape[1] < 2:
            tables = torch.cat([tables, tables], dim=1)  # the padding is masked (past seq_len)
        logits = model.forward_decode(
            batch.input_ids,
            batch.positions,
            kv_caches,
            tables,
            common.seq_lens,
            common.slot_mapping,
            compiled,
            lora,
        )  # the LM head ran inside the graph, on every row
        return logits if batch.all_rows_in_order(num_logits) else logits[batch.last_token_rows(num_logits)]
    else:
        hidden = model(
            batch.input_ids, batch.positions, kv_caches, backend, backend.prepare(common), lora_inputs=lora
        )
    if not batch.all_rows_in_order(num_logits):
        hidden = hidden[batch.last_token_rows(num_logits)]
    return model.compute_logits(hidden)
