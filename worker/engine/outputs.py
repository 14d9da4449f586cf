"""What the engine hands back: vLLM-shaped RequestOutput / CompletionOutput, plus timings."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

from kvscale.worker.core.request import Request, TokenLogprobs


@dataclass
class RequestMetrics:
    """Seconds on the monotonic clock; latencies are relative to arrival."""

    arrival_time: float
    first_scheduled_time: float | None
    token_times: list[float]
    finished_time: float | None
    num_preemptions: int

    @property
    def time_to_first_token(self) -> float | None:
        return self.token_times[0] - self.arrival_time if self.token_times else None

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def inter_token_latencies(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in pairwise(t)]

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None  # the stop token id or stop string that ended it
    logprobs: list[TokenLogprobs] | None
    metrics: RequestMetrics
    # Speculative decoding: tokens proposed for this sequence and how many the target accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first child)


def completion_output(index: int, request: Request, text: str) -> CompletionOutput:
    return CompletionOutput(
        index=index,
        text=text,
        token_ids=list(request.output_token_ids),
        finish_reason=request.status.finish_reason,
        stop_reason=request.stop_reason,
        logprobs=list(request.logprobs) if request.logprobs is not None else None,
        metrics=RequestMetrics(
            arrival_time=request.arrival_time,
            first_scheduled_time=request.first_scheduled_time,
            token_times=list(request.token_times),
            finished_time=request.finished_time,
            num_preemptions=request.num_preemptions,
        ),
        num_draft_tokens=request.num_draft_tokens,
        num_accepted_tokens=request.num_accepted_tokens,
    )
