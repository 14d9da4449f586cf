"""Turn one step's logits (one row per request) into next tokens, vectorised over the batch.

Order of operations, per row: raw logprobs (of the unprocessed logits) -> grammar mask (structured
outputs) -> allowed_token_ids -> min_tokens and bad_words masks -> penalties -> greedy argmax, or
temperature -> top-k/top-p -> min-p -> sample. Sampling uses the exponential race (argmax of
probs / q with q ~ Exp(1)), which needs no cumulative sum and lets each row bring its own noise.

Seeded requests: the noise that picks the token at output position t is a pure function of
(seed, t) (`noise_seed`), drawn from a generator seeded for that row alone. Nothing else (the other
rows, how many steps or proposals came before, a preemption) moves it, so the same seed gives the
same tokens whatever shares the batch, provided the logits are the same (see docs/engine.md for
when floating point makes them differ). Speculative decoding uses the same noise (draft and
verification alike), so a seeded request emits the same tokens with speculation on or off.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvscale.worker.sample.logprobs import TokenLogprobs

if TYPE_CHECKING:  # a request is passed in; this layer sits below core/ (tests/test_layers.py)
    from kvscale.worker.core.request import Request

_NEG_INF = float("-inf")


# Rows of a batch (indices into its requests) whose last output token is pending (sampled by the
# step in flight, async scheduling), and those tokens: a device tensor, aligned with the rows.
PendingTokens = tuple[list[int], torch.Tensor]


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [B] float32; 0.0 marks a greedy row
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None  # [B] int64; 0 (or >= vocab) disables; None when no row uses it
    top_p: torch.Tensor | None  # [B] float32; 1.0 disables; None when no row uses it
    min_p: torch.Tensor | None  # [B] float32; 0.0 disables; None when no row uses it
    # row -> seed of the noise for the position that row samples (seeded, non-greedy rows only)
    noise_seeds: dict[int, int]
    no_penalties: bool
    presence_penalties: torch.Tensor | None  # [B] float32; None when no row uses it
    frequency_penalties: torch.Tensor | None  # [B] float32; None when no row uses it
    repetition_penalties: torch.Tensor | None  # [B] float32; None when no row uses it
    # [B, V] bool: the token is in the row's prompt; None when no row has a repetition penalty.
    prompt_mask: torch.Tensor | None
    # [B, V] float32: how often each token occurs in the row's output; None without penalties.
    output_token_counts: torch.Tensor | None
    # row -> token ids forbidden at this position: the stop ids until the row reaches min_tokens,
    # and the tokens that would complete one of its bad words
    min_tokens: dict[int, set[int]]
    max_num_logprobs: int | None  # largest `logprobs` any row asked for; None: nobody wants logprobs
    # Per row `logprobs` (None: that row did not ask). None here: every row reports max_num_logprobs.
    num_logprobs: list[int | None] | None = field(default=None)
    # row -> the only token ids it may sample (allowed_token_ids); rows absent: any
    allowed_token_ids: dict[int, list[int]] = field(default_factory=dict)

    @classmethod
    def from_requests(
        cls,
        requests: list[Request],
        vocab_size: int,
        device: torch.device,
        extra_output_token_ids: list[list[int]] | None = None,
        penalty_state: PenaltyState | None = None,
        pending_tokens: PendingTokens | None = None,
    ) -> SamplingMetadata:
        """One row per entry of `requests` (a request may fill several rows: speculative verification
        scores each proposed position, and `extra_output_token_ids` then gives each row the
        proposed tokens before it, which penalties and min_tokens count as output).

        With a `penalty_state` (the engine's), output token counts come from its device tensors,
        updated with the new tokens only; without one they are counted from the requests' lists
        (tests, one-off use). `pending_tokens` (async scheduling): the rows whose last output token
        is still on the device only, and those tokens; the penalty state counts them there."""
        extra = extra_output_token_ids
        temperature: list[float] = []
        top_k: list[int] = []
        top_p: list[float] = []
        min_p: list[float] = []
        presence: list[float] = []
        frequency: list[float] = []
        repetition: list[float] = []
        noise_seeds: dict[int, int] = {}
        min_tokens: dict[int, set[int]] = {}
        num_logprobs: list[int | None] = []
        allowed: dict[int, list[int]] = {}
        for i, req in enumerate(requests):
            params = req.sampling_params
            greedy = params.is_greedy
            temperature.append(0.0 if greedy else params.temperature)
            # Filters cannot change an argmax, so greedy rows keep them off and an all-greedy batch
            # builds no filter tensors at all.
            top_k.append(0 if greedy or params.top_k <= 0 or params.top_k >= vocab_size else params.top_k)
            top_p.append(1.0 if greedy else params.top_p)
            min_p.append(0.0 if greedy else params.min_p)
            presence.append(params.presence_penalty)
            frequency.append(params.frequency_penalty)
            repetition.append(params.repetition_penalty)
            # Tokens a launched step sampled and the host has not seen yet count too (async scheduling).
            num_output = req.num_output_tokens + req.num_pending_tokens
            num_output += len(extra[i]) if extra is not None else 0
            if not greedy and req.seed is not None:
                # The row samples output position num_output (later for a proposed position).
                noise_seeds[i] = noise_seed(req.seed, num_output)
            if num_output < params.min_tokens:
                banned = {t for t in (*req.eos_token_ids, *params.stop_token_ids) if t < vocab_size}
                if banned:
                    min_tokens[i] = banned
            if req.bad_words_token_ids:
                # A multi-token bad word's rows are never sampled with a token pending (scheduler).
                past = req.output_token_ids + extra[i] if extra is not None else req.output_token_ids
                completing = bad_word_completions(req.bad_words_token_ids, past)
                if completing:
                    min_tokens[i] = min_tokens.get(i, set()) | completing
            if params.allowed_token_ids is not None:
                allowed[i] = params.allowed_token_ids
            num_logprobs.append(params.logprobs)

        def as_tensor(values: list[float], off: float) -> torch.Tensor | None:
            if all(v == off for v in values):
                return None
            return torch.tensor(values, dtype=torch.float32, device=device)

        presence_t = as_tensor(presence, 0.0)
        frequency_t = as_tensor(frequency, 0.0)
        repetition_t = as_tensor(repetition, 1.0)
        no_penalties = presence_t is None and frequency_t is None and repetition_t is None
        prompt_mask = counts = None
        if not no_penalties:
            if penalty_state is not None:
                counts, prompt_mask = penalty_state.gather(requests, repetition_t is not None, pending_tokens)
            else:
                counts = token_counts([r.output_token_ids for r in requests], vocab_size, device)
                if repetition_t is not None:
                    # Rows without a repetition penalty need no prompt: their penalty is the identity.
                    prompts = [
                        r.prompt_token_ids if p != 1.0 else []
                        for r, p in zip(requests, repetition, strict=True)
                    ]
                    prompt_mask = token_counts(prompts, vocab_size, device) > 0
            if extra is not None and any(extra):
                counts = counts + token_counts(extra, vocab_size, device)
        asked = [n for n in num_logprobs if n is not None]
        return cls(
            temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
            all_greedy=all(t == 0.0 for t in temperature),
            all_random=all(t != 0.0 for t in temperature),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device) if any(top_k) else None,
            top_p=as_tensor(top_p, 1.0),
            min_p=as_tensor(min_p, 0.0),
            noise_seeds=noise_seeds,
            no_penalties=no_penalties,
            presence_penalties=presence_t,
            frequency_penalties=frequency_t,
            repetition_penalties=repetition_t,
            prompt_mask=prompt_mask,
            output_token_counts=counts,
            min_tokens=min_tokens,
            max_num_logprobs=max(asked) if asked else None,
            num_logprobs=num_logprobs,
            allowed_token_ids=allowed,
        )


def bad_word_completions(bad_words: list[list[int]], past: list[int]) -> set[int]:
    """The tokens that would complete a bad word after `past` (the output so far): a word's last
    token wherever the output ends with the rest of it (vLLM's rule; output tokens only)."""
    banned: set[int] = set()
    for word in bad_words:
        prefix = len(word) - 1
        if prefix > len(past):
            continue
        if prefix == 0 or past[-prefix:] == word[:-1]:
            banned.add(word[-1])
    return banned


def plain_greedy(request: Request) -> bool:
    """The request's next token is the argmax of its logits, untouched: greedy, no logprobs, no
    penalties, no min_tokens ban in force. A step of such rows needs none of the sampler's set-up
    (the common case of a greedy stream; grammars are the caller's to check)."""
    params = request.sampling_params
    return (
        params.is_greedy
        and params.logprobs is None
        and not params.has_penalties
        and params.allowed_token_ids is None
        and not request.bad_words_token_ids
        and request.num_output_tokens + request.num_pending_tokens >= params.min_tokens
    )


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: list[TokenLogprobs | None] | None  # per row when anyone asked; None for rows that did not


def token_counts(rows: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[B, V] float32: how often each token id occurs in each row."""
    counts = torch.zeros(len(rows), vocab_size, dtype=torch.float32, device=device)
    index = [(r, t) for r, ids in enumerate(rows) for t in ids]
    if index:
        at = torch.tensor(index, dtype=torch.int64, device=device).T
        counts.index_put_((at[0], at[1]), torch.ones(len(index), device=device), accumulate=True)
    return counts


@dataclass
class _Tracked:
    request: Request  # held so that its id() is not reused while the row is taken
    row: int
    num_counted: int  # leading output tokens already in the row's counts
    has_prompt: bool  # the row's prompt mask is filled


class PenaltyState:
    """Per-request output token counts and prompt masks for the penalties, kept on the device and
    updated with each step's new tokens, so that a step's penalty work does not grow with how
    much a request has generated (rebuilding counts from the token lists every step did).

    Row 0 stays zero, for rows of a batch without penalties. A request gets a row the first time
    it is sampled with a penalty and gives it back once finished. Output tokens only ever grow
    while a request runs (a preemption keeps them); a shorter output than was counted (a stop
    string cut a speculative run) recounts the row."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.counts = torch.zeros(1, vocab_size, dtype=torch.float32, device=device)
        self.prompt_mask = torch.zeros(1, vocab_size, dtype=torch.bool, device=device)
        self._tracked: dict[int, _Tracked] = {}
        self._free_rows: list[int] = []

    @property
    def num_tracked(self) -> int:
        return len(self._tracked)

    def gather(
        self, requests: list[Request], with_prompt: bool, pending: PendingTokens | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[B, V] output counts (and prompt masks) of the batch's rows; a request may fill several.

        A pending token (async scheduling) is counted from the device, where the step in flight
        sampled it, and counts as counted: when it reaches the host there is nothing left to add.
        So a penalised row needs no round trip through the host and takes async steps too."""
        self._release_finished()
        rows: list[int] = []
        new_rows: list[int] = []
        new_tokens: list[int] = []
        for req in requests:
            p = req.sampling_params
            if not p.has_penalties:
                rows.append(0)
                continue
            tracked = self._tracked.get(id(req))
            if tracked is None:
                tracked = self._tracked[id(req)] = _Tracked(req, self._take_row(), 0, False)
            elif req.num_output_tokens + req.num_pending_tokens < tracked.num_counted:
                self.counts[tracked.row].zero_()
                tracked.num_counted = 0
            if tracked.num_counted < req.num_output_tokens:
                ids = req.output_token_ids[tracked.num_counted :]
                new_rows.extend([tracked.row] * len(ids))
                new_tokens.extend(ids)
                tracked.num_counted = req.num_output_tokens
            if with_prompt and p.repetition_penalty != 1.0 and not tracked.has_prompt:
                ids = torch.tensor(req.prompt_token_ids, dtype=torch.int64, device=self.device)
                self.prompt_mask[tracked.row, ids] = True
                tracked.has_prompt = True
            rows.append(tracked.row)
        if new_tokens:
            at = torch.tensor([new_rows, new_tokens], dtype=torch.int64, device=self.device)
            ones = torch.ones(len(new_tokens), dtype=torch.float32, device=self.device)
            self.counts.index_put_((at[0], at[1]), ones, accumulate=True)
        if pending is not None:
            self._count_pending(requests, rows, pending)
        index = torch.tensor(rows, dtype=torch.int64, device=self.device)
        counts = self.counts.index_select(0, index)
        return counts, self.prompt_mask.index_select(0, index) if with_prompt else None

    def _count_pending(self, requests: list[Request], rows: list[int], pending: PendingTokens) -> None:
        at_rows: list[int] = []
        taken: list[int] = []
        for j, k in enumerate(pending[0]):
            if rows[k] == 0:  # no penalties
                continue
            tracked = self._tracked[id(requests[k])]
            if tracked.num_counted == requests[k].num_output_tokens + requests[k].num_pending_tokens:
                continue  # counted already (a row met again before its token reached the host)
            at_rows.append(tracked.row)
            taken.append(j)
            tracked.num_counted += 1
        if at_rows:
            tokens = pending[1][torch.tensor(taken, dtype=torch.int64, device=self.device)]
            index = (torch.tensor(at_rows, dtype=torch.int64, device=self.device), tokens.to(torch.int64))
            ones = torch.ones(len(at_rows), dtype=torch.float32, device=self.device)
            self.counts.index_put_(index, ones, accumulate=True)

    def _take_row(self) -> int:
        if not self._free_rows:
            old = self.counts.shape[0]
            grow = max(old, 8)
            self.counts = torch.cat([self.counts, self.counts.new_zeros(grow, self.vocab_size)])
            mask = self.prompt_mask
            self.prompt_mask = torch.cat([mask, mask.new_zeros(grow, self.vocab_size)])
            self._free_rows = list(range(old + grow - 1, old - 1, -1))
        return self._free_rows.pop()

    def _release_finished(self) -> None:
        done = [key for key, t in self._tracked.items() if t.request.is_finished]
        for key in done:
            row = self._tracked.pop(key).row
            self.counts[row].zero_()
            self.prompt_mask[row].zero_()
            self._free_rows.append(row)


def apply_allowed_token_ids(logits: torch.Tensor, allowed: dict[int, list[int]]) -> torch.Tensor:
    """Forbid (-inf) every token a row with allowed_token_ids does not list."""
    if not allowed:
        return logits
    banned = torch.zeros_like(logits, dtype=torch.bool)
    rows = torch.tensor(list(allowed), device=logits.device)
    banned[rows] = True
    at_rows = [row for row, ids in allowed.items() for _ in ids]
    at_cols = [t for ids in allowed.values() for t in ids]
    banned[torch.tensor(at_rows, device=logits.device), torch.tensor(at_cols, device=logits.device)] = False
    return logits.masked_fill(banned, _NEG_INF)


def apply_min_tokens(logits: torch.Tensor, min_tokens: dict[int, set[int]]) -> torch.Tensor:
    """Forbid (-inf) the stop/eos ids of rows that have not yet produced their min_tokens."""
    if not min_tokens:
        return logits
    rows = [row for row, ids in min_tokens.items() for _ in ids]
    cols = [t for ids in min_tokens.values() for t in ids]
    index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
    return logits.index_put(index, torch.tensor(_NEG_INF, device=logits.device, dtype=logits.dtype))


def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor | None,
    output_token_counts: torch.Tensor,
    presence_penalties: torch.Tensor | None,
    frequency_penalties: torch.Tensor | None,
    repetition_penalties: torch.Tensor | None,
) -> torch.Tensor:
    """vLLM/OpenAI penalties. Repetition acts on prompt + output tokens (positive logits divided, others
    multiplied, so it always makes a seen token less likely); frequency subtracts penalty * count and
    presence subtracts penalty once, both over output tokens only."""
    if presence_penalties is None and frequency_penalties is None and repetition_penalties is None:
        return logits
    counts = output_token_counts.to(logits.dtype)
    if repetition_penalties is not None:
        seen = counts > 0
        if prompt_mask is not None:
            seen |= prompt_mask
        rep = repetition_penalties.unsqueeze(1)
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    if frequency_penalties is not None:
        logits = logits - frequency_penalties.unsqueeze(1) * counts
    if presence_penalties is not None:
        logits = logits - presence_penalties.unsqueeze(1) * (counts > 0).to(logits.dtype)
    return logits


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Set to -inf what top-k and top-p drop; one ascending sort serves both.

    top_k <= 0 or >= vocab, and top_p == 1, leave a row alone. Top-p keeps the smallest set of most likely
    tokens (after top-k) whose mass reaches p, and never less than the single most likely token.
    """
    if top_k is None and top_p is None:
        return logits
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1)
    if top_k is not None:
        k = torch.where((top_k <= 0) | (top_k > vocab), vocab, top_k)
        kth_largest = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_largest, _NEG_INF)
    if top_p is not None:
        # Ascending order: a token is dropped when it and everything less likely together hold at most
        # 1 - p, i.e. when the more likely tokens alone already reach p.
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1.0 - top_p).unsqueeze(1)
        drop[:, -1] = False
        # Rows with p == 1 are left exactly alone (float error could otherwise drop 0-probability tails).
        drop &= (top_p < 1.0).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    """Drop (-inf) tokens whose probability is below min_p times the row's largest probability."""
    if min_p is None:
        return logits
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, _NEG_INF)


_MASK64 = (1 << 64) - 1


def noise_seed(seed: int, position: int) -> int:
    """The seed of a seeded request's noise at output position `position`: splitmix64 of the pair,
    so neighbouring seeds and positions give unrelated streams."""
    x = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first maximum, as torch's). Several rows on the CPU go through numpy:
    torch's reduction enters its thread pool for them, and after a decode step took 133 µs for 8
    bfloat16 rows and ~500 for 64, against 64 and ~225 widened to float32 (exactly) and reduced by
    numpy (docs/benchmarks.md "Argmax on the CPU"). One row stays with torch, which is faster there."""
    if x.device.type != "cpu" or x.dim() != 2 or x.shape[0] < 2:
        return x.argmax(dim=-1)
    if x.dtype in (torch.bfloat16, torch.float16):  # numpy has no bfloat16
        x = x.float()
    return torch.from_numpy(np.argmax(x.numpy(), axis=-1))


def random_sample(probs: torch.Tensor, noise_seeds: dict[int, int]) -> torch.Tensor:
    """Exponential race: argmax(p / q), q ~ Exp(1) i.i.d., picks token i with probability p_i.

    Rows in `noise_seeds` draw q from a generator seeded with their seed (so q depends on nothing
    but that seed and the vocabulary size); the others share the global generator."""
    q = torch.empty_like(probs)
    if len(noise_seeds) < probs.shape[0]:
        q.exponential_()
    if noise_seeds:
        gen = torch.Generator(device=q.device)
        for row, seed in noise_seeds.items():
            q[row].exponential_(generator=gen.manual_seed(seed))
    # Exp(1) can return exactly 0; 0/0 would be NaN and could win argmax for a masked token.
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    return argmax_rows(probs.div(q))


@dataclass
class TargetDistribution:
    """Per row, what the request's sampling parameters make of the logits."""

    greedy_token_ids: torch.Tensor | None  # [B] argmax after min_tokens and penalties; None: no greedy row
    probs: torch.Tensor | None  # [B, V] after temperature, top-k/top-p, min-p; None: every row is greedy


def target_distribution(logits: torch.Tensor, metadata: SamplingMetadata) -> TargetDistribution:
    """Logits (float32) -> the distribution each row samples from. Out-of-place: the caller's logits
    are never modified. Greedy rows also get a (temperature 1) row in `probs` when the batch is mixed;
    it is never used."""
    logits = apply_allowed_token_ids(logits, metadata.allowed_token_ids)
    logits = apply_min_tokens(logits, metadata.min_tokens)
    if not metadata.no_penalties:
        assert metadata.output_token_counts is not None
        logits = apply_penalties(
            logits,
            metadata.prompt_mask,
            metadata.output_token_counts,
            metadata.presence_penalties,
            metadata.frequency_penalties,
            metadata.repetition_penalties,
        )
    if metadata.all_greedy:
        return TargetDistribution(argmax_rows(logits), None)
    greedy = None if metadata.all_random else argmax_rows(logits)
    temperature = metadata.temperature
    if greedy is not None:
        # Dividing greedy rows by 1 keeps their values finite.
        temperature = torch.where(temperature == 0.0, 1.0, temperature)
    logits = logits / temperature.unsqueeze(1)
    logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
    logits = apply_min_p(logits, metadata.min_p)
    return TargetDistribution(greedy, logits.softmax(dim=-1))


class Sampler:
    def __call__(
        self,
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        mask_logits: Callable[[torch.Tensor], None] | None = None,
    ) -> SamplerOutput:
        """mask_logits: structured outputs' grammar mask, applied in place to a copy of the float32
        logits after the raw logprobs (which stay what the model said) and before everything else,
        so greedy and every sampling mode only ever pick tokens the grammar allows."""
        logits = logits.to(torch.float32)
        raw_logprobs = logits.log_softmax(dim=-1) if metadata.max_num_logprobs is not None else None
        if mask_logits is not None:
            logits = logits.clone()
            mask_logits(logits)
        dist = target_distribution(logits, metadata)
        if dist.probs is None:
            sampled = dist.greedy_token_ids
        else:
            sampled = random_sample(dist.probs, metadata.noise_seeds)
            if dist.greedy_token_ids is not None:
                sampled = torch.where(metadata.temperature == 0.0, dist.greedy_token_ids, sampled)
        logprobs = None if raw_logprobs is None else gather_logprobs(raw_logprobs, sampled, metadata)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)


def gather_logprobs(
    raw_logprobs: torch.Tensor, sampled: torch.Tensor, metadata: SamplingMetadata
) -> list[TokenLogprobs | None]:
    assert metadata.max_num_logprobs is not None
    batch, vocab = raw_logprobs.shape
    k = min(metadata.max_num_logprobs, vocab)
    top_values, top_ids = raw_logprobs.topk(k, dim=-1)  # sorted, most likely first
    token_logprob = raw_logprobs.gather(1, sampled.unsqueeze(1))
    rank = (raw_logprobs > token_logprob).sum(dim=-1) + 1
    # Copy the small results to the host before the per-row Python loop (not the [B, V] tensor).
    top_values_l, top_ids_l = top_values.tolist(), top_ids.tolist()
    token_logprob_l, rank_l, sampled_l = token_logprob.squeeze(1).tolist(), rank.tolist(), sampled.tolist()
    wanted = metadata.num_logprobs or [metadata.max_num_logprobs] * batch
    result: list[TokenLogprobs | None] = []
    for row, n in enumerate(wanted):
        if n is None:
            result.append(None)
            continue
        top = list(zip(top_ids_l[row][:n], top_values_l[row][:n], strict=True))
        result.append(TokenLogprobs(sampled_l[row], token_logprob_l[row], rank_l[row], top))
    return result


def prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprobs]:
    """Logprobs of the prompt tokens `targets` (row i of `logits` predicts targets[i]) with their
    top-k alternatives, from the raw distribution. In slices of rows, so that the float32 copy
    costs a bounded amount of memory beyond the logits themselves."""
    out: list[TokenLogprobs] = []
    vocab = logits.shape[-1]
    k = min(k, vocab)
    step = max(1, (1 << 26) // max(vocab, 1))  # rows per slice: ~256 MB of float32
    for begin in range(0, len(targets), step):
        rows = logits[begin : begin + step].float().log_softmax(dim=-1)
        tgt = torch.tensor(targets[begin : begin + step], dtype=torch.long, device=rows.device)
        token_lp = rows.gather(1, tgt.unsqueeze(1)).squeeze(1)
        rank = (rows > token_lp.unsqueeze(1)).sum(dim=-1) + 1
        top_values, top_ids = rows.topk(k, dim=-1) if k > 0 else (rows[:, :0], rows[:, :0].long())
        for t, lp, r, ids, vals in zip(
            tgt.tolist(), token_lp.tolist(), rank.tolist(), top_ids.tolist(), top_values.tolist(), strict=True
        ):
            out.append(TokenLogprobs(t, lp, r, list(zip(ids, vals, strict=True))))
    return out
