"""A request's life inside the engine: WAITING -> RUNNING -> FINISHED_*, RUNNING -> PREEMPTED -> RUNNING;
a constrained request starts in WAITING_FOR_GRAMMAR until its grammar is compiled."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvscale.worker.sample.logprobs import TokenLogprobs
from kvscale.worker.sample.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvscale.worker.lora.request import LoRARequest
    from kvscale.worker.structured_output.request import StructuredOutputRequest


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    # Queued, but its grammar is still compiling (structured outputs): the scheduler passes it over
    # and admits the requests behind it until the grammar is ready.
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"
    RUNNING = "running"
    # Lost its KV blocks to make room; waits (first in line) to be recomputed from its tokens.
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH_CAPPED = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_ABORTED,
        )

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's finish_reason: "stop", "length" or "abort"; None while unfinished."""
        return self.value if self.is_finished else None


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    # Effective cap on generated tokens (max_tokens already clipped to the model length).
    max_tokens: int = 16
    arrival_time: float = field(default_factory=time.monotonic)
    prompt: str | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    # Tokens whose K/V sit in the cache. The newest sampled token is never computed yet. Under
    # async scheduling it counts the tokens of steps launched but not yet processed too.
    num_computed_tokens: int = 0
    # Async scheduling: tokens sampled on the device by a launched step and not yet appended here
    # (0 or 1 between steps). The next step already feeds them in, from the device.
    num_pending_tokens: int = 0
    # Chained SHA-256 hashes of the full blocks of all_token_ids (block_pool.hash_block_tokens),
    # extended lazily by the KV cache manager.
    block_hashes: list[bytes] = field(default_factory=list)
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit on first admission; -1 until then
    logprobs: list[TokenLogprobs] | None = None
    # SamplingParams.prompt_logprobs: entry k for prompt token k (None for the first, which nothing
    # predicts), filled as the prompt's chunks are computed; None: not asked (or not this child's
    # to compute: the first of n computes them for all).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # The sequence's sampling seed (SamplingParams.seed, + i for the i-th of n); None: unseeded.
    seed: int | None = None
    # Constrained decoding: the grammar and this sequence's matcher; None: unconstrained.
    structured_output: StructuredOutputRequest | None = None
    # SamplingParams.bad_words as token id sequences (LLMEngine.make_request fills it).
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # LoRA: the adapter the request runs with (None: the base model) and the digest of its weights,
    # which seeds the block-hash chain: an adapter's KV never serves another's request.
    lora_request: LoRARequest | None = None
    adapter_digest: str | None = None

    # Speculative decoding: how many leading tokens the draft model's cache holds (verified ones
    # only), tokens proposed and accepted so far, and decayed counts behind the next lookahead.
    num_draft_computed_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    spec_accepted: float = 0.0
    spec_rejected: float = 0.0

    # Timestamps (time.monotonic) for metrics.
    first_scheduled_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        if self.sampling_params.logprobs is not None:
            self.logprobs = []
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    @property
    def cache_salt(self) -> str | None:
        """Seeds the request's block-hash chain: only requests with the same salt share KV blocks."""
        return self.sampling_params.cache_salt

    @property
    def lora_name(self) -> str | None:
        return None if self.lora_request is None else self.lora_request.lora_name

    @property
    def needs_host_tokens(self) -> bool:
        """Its next step's mask depends on its last token, on the host: a grammar's, or a bad
        word of several tokens (async scheduling holds it back while that token is pending)."""
        return self.structured_output is not None or any(len(w) > 1 for w in self.bad_words_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int, now: float, logprobs: TokenLogprobs | None = None) -> None:
        """Append one generated token with its logprobs (when the request asked for them): both are
        appended together, so a run cut short by a stop keeps exactly one entry per token."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self.token_times.append(now)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.append(logprobs)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop output tokens past the first num_output_tokens (a finished request whose stop string
        ended inside a run of several tokens accepted in one step)."""
        del self.output_token_ids[num_output_tokens:]
        del self.all_token_ids[self.num_prompt_tokens + num_output_tokens :]
        del self.token_times[num_output_tokens:]
        if self.logprobs is not None:
            del self.logprobs[num_output_tokens:]
