"""A draft model proposes tokens for the target to verify.

The draft is any model the runner loads with the target's tokenizer. Its K/V live in tensors of
its own but in the same block ids as the target's (the target's block tables index both), so the
scheduler's allocation covers the draft too and freeing a request frees both. Each request tracks
how far the draft's cache is valid (`num_draft_computed_tokens`): only verified tokens count,
so a proposal first feeds the draft what it has not seen (the accepted run and the target's
bonus token, or the whole prompt the first time), then drafts one token per forward.
"""

from __future__ import annotations

import logging

import torch

from kvscale.worker.config import EngineArgs
from kvscale.worker.core.request import Request
from kvscale.worker.model.attention.selector import get_attention_backend
from kvscale.worker.model.forward_batch import SeqChunk, forward_logits
from kvscale.worker.model.kv_cache import allocate_kv_cache, bytes_per_block
from kvscale.worker.model.loader import load_config, load_model
from kvscale.worker.sample.sampler import (
    PenaltyState,
    SamplingMetadata,
    argmax_rows,
    random_sample,
    target_distribution,
)

logger = logging.getLogger(__name__)


class DraftModelProposer:
    def __init__(
        self, args: EngineArgs, device: torch.device, dtype: torch.dtype, max_model_len: int, vocab_size: int
    ) -> None:
        assert args.draft_model
        self.device, self.dtype, self.block_size = device, dtype, args.block_size
        hf_config = load_config(args.draft_model)
        self.model = load_model(args.draft_model, hf_config, max_model_len, device, dtype)
        self.spec = self.model.spec
        if self.spec.vocab_size != vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({self.spec.vocab_size}) differs from the target's "
                f"({vocab_size}); a draft must share the target's tokenizer"
            )
        self.backend = get_attention_backend(args.attention_backend, device)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # The target runner's penalty counts (set by it): the draft's sampled rows share them.
        self.penalty_state: PenaltyState | None = None

    def block_bytes(self) -> int:
        s = self.spec
        return bytes_per_block(s.num_layers, self.block_size, s.num_kv_heads, s.head_dim, self.dtype)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_cache(self.spec, num_blocks, self.block_size, self.dtype, self.device)

    def forward(self, chunks: list[SeqChunk]) -> torch.Tensor:
        """Logits at the last token of each chunk, in the chunks' order."""
        return forward_logits(
            self.model, self.backend, self.kv_caches, chunks, [1] * len(chunks), self.block_size, self.device
        )

    @torch.inference_mode()
    def propose(
        self, requests: list[Request], num_tokens: list[int], block_ids: list[list[int]]
    ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Up to num_tokens[i] tokens for requests[i] (0: none), with the distribution each was drawn
        from ([n, V] for sampled requests; None for greedy ones, whose drafts are the argmax)."""
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        active = [i for i, k in enumerate(num_tokens) if k > 0]
        step = 0
        while active:
            chunks = []
            for i in active:
                r = requests[i]
                if step == 0:  # catch up on the verified tokens the draft has not seen
                    start = min(r.num_draft_computed_tokens, r.num_computed_tokens)
                    tokens = r.all_token_ids[start:]
                else:
                    start, tokens = r.num_tokens + step - 1, [drafts[i][-1]]
                chunks.append(SeqChunk(tokens, start, block_ids[i]))
                r.num_draft_computed_tokens = start + len(tokens)
            logits = self.forward(chunks).to(torch.float32)
            for i, token, row_probs in zip(
                active, *self._choose(logits, active, requests, drafts), strict=True
            ):
                drafts[i].append(token)
                if row_probs is not None:
                    probs[i].append(row_probs)
            step += 1
            active = [i for i in active if len(drafts[i]) < num_tokens[i]]
        return drafts, [torch.stack(p) if p else None for p in probs]

    def _choose(
        self, logits: torch.Tensor, active: list[int], requests: list[Request], drafts: list[list[int]]
    ) -> tuple[list[int], list[torch.Tensor | None]]:
        """Greedy requests draft the argmax; sampled ones draw from what their own sampling
        parameters make of the draft's logits (so q is close to the target's p). A seeded request
        draws with the noise of the position it drafts, the noise its verification will use: the
        draft then proposes exactly the target's token wherever the two argmaxes agree."""
        rows = [requests[i] for i in active]
        if all(r.sampling_params.is_greedy for r in rows):
            return argmax_rows(logits).tolist(), [None] * len(rows)
        extra = [drafts[i] for i in active]  # penalties count the tokens drafted so far as output
        metadata = SamplingMetadata.from_requests(
            rows, logits.shape[-1], logits.device, extra, self.penalty_state
        )
        dist = target_distribution(logits, metadata)
        assert dist.probs is not None
        sampled = random_sample(dist.probs, metadata.noise_seeds)
        tokens, row_probs = [], []
        for b, r in enumerate(rows):
            if r.sampling_params.is_greedy:
                assert dist.greedy_token_ids is not None
                tokens.append(int(dist.greedy_token_ids[b]))
                row_probs.append(None)
            else:
                tokens.append(int(sampled[b]))
                row_probs.append(dist.probs[b])
        return tokens, row_probs
