"""Vocabulary-parallel embedding and LM head (vLLM's names): each rank holds vocab_per_rank rows
starting at vocab_start (the last rank's tail is zero padding)."""

from __future__ import annotations

import torch
from torch import nn

from kvscale.worker.distributed.communication_op import (
    tensor_model_parallel_all_reduce,
    tensor_model_parallel_gather,
)
from kvscale.worker.model.layers.linear import Linear


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, num_embeddings: int, embedding_dim: int, tp=None, vocab_start: int = 0) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.tp, self.vocab_start = tp, vocab_start

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0)  # rows another rank owns
        return tensor_model_parallel_all_reduce(out, self.tp)


class ParallelLMHead(Linear):
    def __init__(self, in_features: int, out_features: int, vocab_size: int, tp=None) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.tp, self.vocab_size = tp, vocab_size

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Full-vocabulary logits on rank 0 (where the sampler runs); None on the other ranks."""
        logits = self(hidden)
        if self.tp is None:
            return logits
        gathered = tensor_model_parallel_gather(logits, self.tp)
        return gathered[:, : self.vocab_size] if gathered is not None else None
