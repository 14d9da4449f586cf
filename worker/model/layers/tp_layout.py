"""Which slice of each weight a tensor-parallel rank holds: pure arithmetic on the model's shape.

Query heads split evenly (tp must divide num_heads). KV heads split evenly when tp <= num_kv_heads;
past that each rank holds one KV head, replicated across tp / num_kv_heads ranks (as vLLM does), so
the query heads of a rank always find their KV head locally. The MLP splits its intermediate size;
the vocabulary splits in ceil(vocab / tp) rows per rank, the last rank's padded.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TPLayout:
    rank: int
    size: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank
    kv_head_start: int  # the first of them, in the checkpoint's numbering
    intermediate_size: int
    vocab_per_rank: int

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank


def tp_layout(
    *, num_heads: int, num_kv_heads: int, intermediate_size: int, vocab_size: int, rank: int, size: int
) -> TPLayout:
    """Raises ValueError for a tensor-parallel size the model's heads cannot be split into."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"bad tensor-parallel rank {rank} of {size}")
    if num_heads % size:
        raise ValueError(
            f"tensor_parallel_size {size} does not divide the model's {num_heads} attention heads"
        )
    if num_kv_heads >= size:
        if num_kv_heads % size:
            raise ValueError(
                f"tensor_parallel_size {size} does not divide the model's {num_kv_heads} KV heads"
            )
        local_kv, kv_start = num_kv_heads // size, rank * (num_kv_heads // size)
    else:
        if size % num_kv_heads:
            raise ValueError(
                f"tensor_parallel_size {size} is not a multiple of the model's {num_kv_heads} KV heads"
            )
        local_kv, kv_start = 1, rank // (size // num_kv_heads)
    if intermediate_size % size:
        raise ValueError(
            f"tensor_parallel_size {size} does not divide the MLP's intermediate size {intermediate_size}"
        )
    return TPLayout(
        rank=rank,
        size=size,
        num_heads=num_heads // size,
        num_kv_heads=local_kv,
        kv_head_start=kv_start,
        intermediate_size=intermediate_size // size,
        vocab_per_rank=-(-vocab_size // size),
    )
