"""bench membw's bytes per decoded token (worker/bench/membw.py): every weight a one-stream decode
step reads, the embedding table as the one row looked up, unless the LM head is that table."""

from __future__ import annotations

import torch
from torch import nn

from kvscale.worker.bench.membw import decode_bytes_per_token


class Tiny(nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(1000, 64)
        self.model.proj = nn.Linear(64, 64, bias=False)
        self.lm_head = nn.Linear(64, 1000, bias=False)
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight


def test_untied_the_embedding_counts_one_row():
    f32 = 4
    assert decode_bytes_per_token(Tiny(tied=False)) == (64 * 64 + 1000 * 64 + 64) * f32


def test_tied_the_lm_head_read_is_the_table_once():
    f32 = 4
    assert decode_bytes_per_token(Tiny(tied=True)) == (64 * 64 + 1000 * 64) * f32


def test_the_dtype_served_counts():
    assert decode_bytes_per_token(Tiny(tied=False).to(torch.bfloat16)) == (64 * 64 + 1000 * 64 + 64) * 2
