"""Verify proposed tokens against the target in one pass, keeping the target's output distribution.

Each speculating request brings n proposed tokens d_1..d_n and the target's logits at n + 1
positions (after the last known token, then after each proposed one). Greedy requests keep the
longest run of proposals equal to the target's argmax, then the argmax where they part (or the
bonus token after a full run). Sampled requests use rejection sampling (Leviathan et al. 2023;
Chen et al. 2023): d_j is accepted with probability min(1, p_j(d_j) / q_j(d_j)); the first rejected
position samples from normalise(max(p_j - q_j, 0)); a full run samples the bonus from p_{n+1}.
The emitted tokens are then distributed exactly as sampling the target token by token. q is the
distribution the proposer drew from: the draft model's, or a point mass for n-gram lookup and
greedy drafts (q(d) = 1, so acceptance is p(d) and the residual is p without d).

p is what the request's own sampling parameters make of the logits (penalties see the proposed
tokens before each position, then temperature, top-k/top-p, min-p), so those parameters keep
their meaning under speculation.

Seeded requests are verified by coupling instead: the target token at each position is the
exponential race argmax(p_j / E_j) with the position's own noise E_j (sampler.noise_seed), exactly
what plain decoding samples there, and the proposals are accepted while they equal it. The output
is then the plain-decoding output token for token, so it cannot depend on how many tokens were
proposed (which depends on the batch). Each emitted token is still an exact sample of p_j. For
point-mass proposals the acceptance probability is p(d), as with rejection sampling; a draft
model that samples with the same noise is accepted with probability P(argmax q/E = argmax p/E),
somewhat below rejection sampling's sum min(p, q) (docs/speculative.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from kvscale.worker.sample.logprobs import TokenLogprobs
from kvscale.worker.sample.sampler import (
    PenaltyState,
    SamplingMetadata,
    gather_logprobs,
    random_sample,
    target_distribution,
)

if TYPE_CHECKING:  # a request is passed in; this layer sits below core/ (tests/test_layers.py)
    from kvscale.worker.core.request import Request


@dataclass
class SpecDecodeRow:
    request: Request
    draft_token_ids: list[int]
    # [n, V] the distribution each proposed token was drawn from; None: point masses (greedy, n-gram).
    draft_probs: torch.Tensor | None = None


@dataclass
class VerifyOutput:
    token_ids: list[list[int]]  # per row: the accepted proposals, then one target token
    num_accepted: list[int]
    logprobs: list[list[TokenLogprobs] | None]


def accept_proposals(p_draft: torch.Tensor, q_draft: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The acceptance test per proposed token: u < p(d) / q(d), i.e. accepted with probability
    min(1, p/q). A module-level function so that tests can swap in a wrong rule and see it caught."""
    return uniform * q_draft < p_draft


class RejectionSampler:
    def __call__(
        self,
        logits: torch.Tensor,
        rows: list[SpecDecodeRow],
        vocab_size: int,
        penalty_state: PenaltyState | None = None,
        mask_logits: Callable[[torch.Tensor], None] | None = None,
    ) -> VerifyOutput:
        """logits: [sum(n_i + 1), V], row i's n_i + 1 positions in order, rows one after another.
        mask_logits: structured outputs' grammar mask, a row per position (as in the plain
        sampler: applied to a copy, after the raw logprobs' logits, before everything else)."""
        device = logits.device
        requests, extra = [], []
        for row in rows:
            drafts = row.draft_token_ids
            for j in range(len(drafts) + 1):
                requests.append(row.request)
                extra.append(drafts[:j])  # the position follows the output and these proposals
        metadata = SamplingMetadata.from_requests(requests, vocab_size, device, extra, penalty_state)
        logits = logits.to(torch.float32)
        masked = logits
        if mask_logits is not None:
            masked = logits.clone()
            mask_logits(masked)
        dist = target_distribution(masked, metadata)
        greedy = dist.greedy_token_ids.tolist() if dist.greedy_token_ids is not None else None

        token_ids: list[list[int]] = []
        num_accepted: list[int] = []
        offset = 0
        for row in rows:
            n = len(row.draft_token_ids)
            if row.request.sampling_params.is_greedy:
                assert greedy is not None
                emitted = _verify_exact(row.draft_token_ids, greedy[offset : offset + n + 1])
            elif row.request.seed is not None:
                assert dist.probs is not None
                seeds = {j: metadata.noise_seeds[offset + j] for j in range(n + 1)}
                targets = random_sample(dist.probs[offset : offset + n + 1], seeds).tolist()
                emitted = _verify_exact(row.draft_token_ids, targets)
            else:
                assert dist.probs is not None
                emitted = self._verify_random(row, dist.probs[offset : offset + n + 1])
            token_ids.append(emitted)
            num_accepted.append(len(emitted) - 1)
            offset += n + 1

        logprobs: list[list[TokenLogprobs] | None] = [None] * len(rows)
        if metadata.max_num_logprobs is not None:
            logprobs = self._logprobs(logits, metadata, rows, token_ids)
        return VerifyOutput(token_ids, num_accepted, logprobs)

    @staticmethod
    def _verify_random(row: SpecDecodeRow, probs: torch.Tensor) -> list[int]:
        """Rejection sampling (unseeded rows), with the global generator."""
        drafts, device = row.draft_token_ids, probs.device
        n = len(drafts)
        if n:
            d = torch.tensor(drafts, device=device)
            p_d = probs[torch.arange(n, device=device), d]
            if row.draft_probs is None:
                q_d = torch.ones_like(p_d)
            else:
                q_d = row.draft_probs[torch.arange(n, device=device), d].to(p_d.dtype)
            accepted = accept_proposals(p_d, q_d, torch.rand(n, device=device)).tolist()
            a = accepted.index(False) if False in accepted else n
        else:
            a = 0
        if a < n:
            # Rejected at position a: draw from what p has beyond q there.
            if row.draft_probs is None:
                residual = probs[a].clone()
                residual[drafts[a]] = 0.0
            else:
                residual = (probs[a] - row.draft_probs[a].to(probs.dtype)).clamp_min_(0.0)
            if residual.sum() <= 0:  # p == q exactly; the rejection had probability 0
                residual = probs[a]
            target = residual / residual.sum()
        else:
            target = probs[n]
        last = int(random_sample(target.unsqueeze(0), {})[0])
        return [*drafts[:a], last]

    @staticmethod
    def _logprobs(logits, metadata, rows, token_ids) -> list[list[TokenLogprobs] | None]:
        """Logprobs of the emitted tokens, from the raw target distribution at their positions."""
        index, sampled, spans = [], [], []
        offset = 0
        for row, emitted in zip(rows, token_ids, strict=True):
            spans.append((len(index), len(emitted)))
            index.extend(range(offset, offset + len(emitted)))
            sampled.extend(emitted)
            offset += len(row.draft_token_ids) + 1
        rows_t = torch.tensor(index, device=logits.device)
        raw = logits[rows_t].log_softmax(dim=-1)
        wanted = metadata.num_logprobs
        sub = replace(metadata, num_logprobs=None if wanted is None else [wanted[i] for i in index])
        per_token = gather_logprobs(raw, torch.tensor(sampled, device=logits.device), sub)
        result: list[list[TokenLogprobs] | None] = []
        for start, count in spans:
            lps = per_token[start : start + count]
            result.append(None if any(lp is None for lp in lps) else lps)
        return result


def _verify_exact(drafts: list[int], targets: list[int]) -> list[int]:
    """The longest run of proposals equal to the target's own token at their position, then the
    target's token where they part (or the bonus after a full run): targets has len(drafts) + 1."""
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return [*drafts[:a], targets[a]]
