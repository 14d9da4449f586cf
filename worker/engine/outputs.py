"""What the engine hands back: vLLM-shaped RequestOutput / CompletionOutput deltas, plus timings,
and the accumulator that turns a request's deltas into its whole output."""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import pairwise

from kvscale.worker.core.request import Request
from kvscale.worker.sample.logprobs import TokenLogprobs


@dataclass
class RequestMetrics:
    """Seconds on the monotonic clock; latencies are relative to arrival. `token_times` are the
    times of the output's tokens: in a delta, of its new tokens only."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    token_times: list[float]
    finished_time: float | None
    num_preemptions: int

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

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
    """One sequence's output. What LLMEngine.step returns is a delta (vLLM's
    RequestOutputKind.DELTA): `text`, `token_ids`, `logprobs` and `metrics.token_times` hold only
    what is new since that sequence's previous output, so a step costs what it produces; every
    other field is current. `LLM.generate` and RequestOutputAccumulator give whole outputs."""

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
    """A request's output. From LLMEngine.step, a delta: `outputs` holds only the sequences that
    advanced in that step (each a delta, told apart by `index` when n > 1)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first child)
    # SamplingParams.prompt_logprobs: one entry per prompt token, None for the first; complete in
    # every output (the prompt is computed before the first token); None when not asked.
    prompt_logprobs: list[TokenLogprobs | None] | None = None


def stream_now(num_sent: int, num_output_tokens: int, finished: bool, interval: int) -> bool:
    """Whether a sequence hands out a delta this step: always with stream_interval 1; above it, its
    first output, its last, and then once `interval` tokens have gathered since the previous one
    (vLLM's and SGLang's --stream-interval). Fewer, larger deltas cost the HTTP side and the client
    less per token; the tokens' own times (TPOT, the metrics) do not change."""
    return interval <= 1 or finished or num_sent == 0 or num_output_tokens - num_sent >= interval


def completion_delta(index: int, request: Request, text: str, start: int) -> CompletionOutput:
    """The sequence's output from its output token `start` on (what the previous delta did not
    carry), with `text` the new text; copies only the new tokens."""
    return CompletionOutput(
        index=index,
        text=text,
        token_ids=request.output_token_ids[start:],
        finish_reason=request.status.finish_reason,
        stop_reason=request.stop_reason,
        logprobs=request.logprobs[start:] if request.logprobs is not None else None,
        metrics=RequestMetrics(
            arrival_time=request.arrival_time,
            first_scheduled_time=request.first_scheduled_time,
            first_token_time=request.token_times[0] if request.token_times else None,
            token_times=request.token_times[start:],
            finished_time=request.finished_time,
            num_preemptions=request.num_preemptions,
        ),
        num_draft_tokens=request.num_draft_tokens,
        num_accepted_tokens=request.num_accepted_tokens,
    )


def merge_completion(whole: CompletionOutput, delta: CompletionOutput) -> CompletionOutput:
    """`whole` followed by `delta` (a new object; for short runs of deltas, e.g. text held back
    from a stream; RequestOutputAccumulator keeps long ones without re-copying the text)."""
    logprobs = None
    if whole.logprobs is not None or delta.logprobs is not None:
        logprobs = [*(whole.logprobs or []), *(delta.logprobs or [])]
    metrics = replace(delta.metrics, token_times=[*whole.metrics.token_times, *delta.metrics.token_times])
    return replace(
        delta,
        text=whole.text + delta.text,
        token_ids=[*whole.token_ids, *delta.token_ids],
        logprobs=logprobs,
        metrics=metrics,
    )


class RequestOutputAccumulator:
    """Whole outputs from a request's deltas, in time proportional to each delta (lists are
    extended in place, text is kept in pieces and joined by get())."""

    def __init__(self, first: RequestOutput) -> None:
        self._request = replace(first, outputs=[])
        self._outputs: dict[int, CompletionOutput] = {}
        self._texts: dict[int, list[str]] = {}
        self._add_completions(first)

    def add(self, delta: RequestOutput) -> None:
        self._request.finished = delta.finished
        self._request.num_cached_tokens = delta.num_cached_tokens
        self._add_completions(delta)

    def _add_completions(self, delta: RequestOutput) -> None:
        for c in delta.outputs:
            whole = self._outputs.get(c.index)
            if whole is None:
                self._outputs[c.index] = replace(
                    c,
                    token_ids=list(c.token_ids),
                    logprobs=None if c.logprobs is None else list(c.logprobs),
                    metrics=replace(c.metrics, token_times=list(c.metrics.token_times)),
                )
                self._texts[c.index] = [c.text]
                continue
            whole.token_ids.extend(c.token_ids)
            if c.logprobs is not None:
                if whole.logprobs is None:
                    whole.logprobs = []
                whole.logprobs.extend(c.logprobs)
            whole.metrics.token_times.extend(c.metrics.token_times)
            whole.metrics = replace(c.metrics, token_times=whole.metrics.token_times)
            whole.finish_reason, whole.stop_reason = c.finish_reason, c.stop_reason
            whole.num_draft_tokens, whole.num_accepted_tokens = c.num_draft_tokens, c.num_accepted_tokens
            if c.text:
                self._texts[c.index].append(c.text)

    @property
    def finished(self) -> bool:
        return self._request.finished

    def get(self) -> RequestOutput:
        """Everything so far, sequences in index order."""
        outputs = []
        for index in sorted(self._outputs):
            pieces = self._texts[index]
            if len(pieces) > 1:
                pieces[:] = ["".join(pieces)]
            outputs.append(replace(self._outputs[index], text=pieces[0]))
        return replace(self._request, outputs=outputs)


def add_delta(acc: RequestOutputAccumulator | None, delta: RequestOutput) -> RequestOutputAccumulator:
    """`delta` added to `acc`, or the first accumulator of a request when there is none yet."""
    if acc is None:
        return RequestOutputAccumulator(delta)
    acc.add(delta)
    return acc
