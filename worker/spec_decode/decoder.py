"""Speculative decoding inside continuous batching: plan, propose, then record what was verified.

Each step, after the scheduler has chosen the batch: requests that are decoding (one new token
to compute) get a lookahead from the planner (lookahead.py), the scheduler reserves KV slots
for it (speculation never preempts anyone: without room a request simply decodes plainly), and
the proposer fills it. The model runner then verifies every proposal of the batch in the same
forward as the other requests' decodes and prefill chunks (rejection_sampler.py). Requests with
and without proposals share the batch.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable

import torch

from kvscale.worker.config import EngineArgs
from kvscale.worker.core.request import Request
from kvscale.worker.core.scheduler import Scheduler, SchedulerOutput
from kvscale.worker.metrics.stats import IterationStats
from kvscale.worker.model.forward_batch import SeqChunk
from kvscale.worker.sample.sampling_params import SamplingParams
from kvscale.worker.spec_decode.draft_proposer import DraftModelProposer
from kvscale.worker.spec_decode.lookahead import (
    StepCostModel,
    acceptance_rate,
    idle_acceptance,
    plan_lookahead,
    update_acceptance,
)
from kvscale.worker.spec_decode.ngram_proposer import NgramProposer

logger = logging.getLogger(__name__)


class SpeculativeDecoder:
    def __init__(
        self,
        args: EngineArgs,
        scheduler: Scheduler,
        proposer: DraftModelProposer | NgramProposer,
        max_model_len: int,
    ) -> None:
        self.k_max = args.num_lookahead_tokens
        self.scheduler = scheduler
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.costs: StepCostModel | None = None  # set by profile(); None: always the full lookahead

    def caps(self, request: Request) -> int:
        """The most tokens worth proposing: the bonus token comes on top of an accepted run, and
        nothing may pass max_tokens or the model length."""
        left = request.max_tokens - request.num_output_tokens - 1
        room = self.max_model_len - request.num_tokens
        return max(0, min(self.k_max, left, room))

    def propose(self, out: SchedulerOutput) -> None:
        """Choose lookaheads, reserve their slots and fill out.spec_token_ids for this step."""
        rows = [
            i
            for i, (r, n) in enumerate(zip(out.requests, out.num_scheduled_tokens, strict=True))
            if n == 1 and r.num_computed_tokens + 1 == r.num_tokens
        ]
        if not rows:
            return
        requests = [out.requests[i] for i in rows]
        caps = [self.caps(r) for r in requests]
        budget = self.scheduler.config.max_num_batched_tokens - out.total_num_scheduled_tokens
        if self.costs is None:
            ks, left = [], budget
            for c in caps:
                ks.append(min(c, left))
                left -= ks[-1]
        else:
            rates = [acceptance_rate(r.spec_accepted, r.spec_rejected) for r in requests]
            ks = plan_lookahead(rates, caps, budget, self.costs)
        ks = [self.scheduler.reserve_lookahead(r, k) if k else 0 for r, k in zip(requests, ks, strict=True)]
        for r, k in zip(requests, ks, strict=True):
            if k == 0:
                r.spec_accepted, r.spec_rejected = idle_acceptance(r.spec_accepted, r.spec_rejected)
        if not any(ks):
            return
        if isinstance(self.proposer, NgramProposer):
            drafts = self.proposer.propose(requests, ks)
            probs: list[torch.Tensor | None] = [None] * len(requests)
        else:
            drafts, probs = self.proposer.propose(requests, ks, [out.block_ids[i] for i in rows])
        for i, d, p in zip(rows, drafts, probs, strict=True):
            if d:
                out.spec_token_ids[i] = d
                out.spec_draft_probs[i] = p
                out.num_scheduled_tokens[i] = 1 + len(d)

    def record(self, out: SchedulerOutput, sampled: list[list[int]], stats: IterationStats) -> None:
        """Count what was proposed and accepted, per request (for its output and its next plan) and
        for the metrics."""
        for request, drafts, new_ids in zip(out.requests, out.spec_token_ids, sampled, strict=True):
            if not drafts:
                continue
            n, a = len(drafts), len(new_ids) - 1
            request.num_draft_tokens += n
            request.num_accepted_tokens += a
            request.spec_accepted, request.spec_rejected = update_acceptance(
                request.spec_accepted, request.spec_rejected, n, a
            )
            stats.num_drafts += 1
            stats.num_draft_tokens += n
            stats.num_accepted_tokens += a
            if len(stats.accepted_per_position) < self.k_max:
                stats.accepted_per_position.extend([0] * (self.k_max - len(stats.accepted_per_position)))
            for pos in range(a):
                stats.accepted_per_position[pos] += 1


# -- measuring step costs at start-up ---------------------------------------------------------------
PROFILE_BATCH_SIZES = (1, 4, 16, 64, 256)
PROFILE_CONTEXT = 256


def _median_time(fn: Callable[[], object], device: torch.device, reps: int = 3) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def profile_step_costs(
    forward_target: Callable[[list[SeqChunk], list[int]], object],
    proposer: DraftModelProposer | NgramProposer,
    device: torch.device,
    k_max: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    num_blocks: int,
    block_size: int,
) -> StepCostModel:
    """Time the target's forward for spec-shaped batches (B sequences of 1 + k tokens over a short
    context) and the proposer, before any request runs. Every sequence uses the same scratch
    blocks: the pool is empty and what is written there is never read."""
    context = min(PROFILE_CONTEXT, max_model_len - k_max - 1)
    blocks = list(range(min(num_blocks, -(-(context + k_max + 1) // block_size))))
    context = min(context, len(blocks) * block_size - k_max - 1)
    sizes = [b for b in PROFILE_BATCH_SIZES if b <= min(max_num_seqs, max_num_batched_tokens)] or [1]
    if sizes[-1] < max_num_seqs:
        sizes.append(min(max_num_seqs, 2 * sizes[-1]))
    lookaheads = sorted({k for k in (0, 1, 2, 4, 8, 16) if k <= k_max} | {k_max})
    target: list[list[float]] = []
    for b in sizes:
        row = []
        for k in lookaheads:
            if b * (1 + k) > max_num_batched_tokens:  # the scheduler never builds this step
                row.append(row[-1] * (1 + k) / (1 + lookaheads[len(row) - 1]))
                continue
            chunks = [SeqChunk([0] * (1 + k), context, blocks) for _ in range(b)]
            row.append(_median_time(lambda c=chunks, k=k: forward_target(c, [1 + k] * len(c)), device))
        target.append(row)
    if isinstance(proposer, DraftModelProposer):
        draft = proposer

        def propose(b: int) -> object:  # one draft forward (one proposed position) for b sequences
            return draft.forward([SeqChunk([0], context, blocks) for _ in range(b)])
    else:
        # A scratch proposer: its indexes of these stand-in requests are dropped with it.
        ngram = NgramProposer(proposer.max_n, proposer.min_n)
        history = list(range(PROFILE_CONTEXT)) * 2
        stand_ins = [Request(f"profile-{i}", history, SamplingParams()) for i in range(max(sizes))]

        def propose(b: int) -> object:  # the lookup for b sequences (always a match), index built
            return ngram.propose(stand_ins[:b], [k_max] * b)

    proposer_times = [_median_time(lambda b=b: propose(b), device) for b in sizes]
    costs = StepCostModel(
        sizes,
        lookaheads,
        target,
        proposer_times,
        proposer_per_position=isinstance(proposer, DraftModelProposer),
    )
    logger.info("speculative decoding step costs (s): %s", costs)
    return costs
