"""Per-request sampling parameters, shaped like vLLM's `SamplingParams` (which many users know)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

GREEDY_TEMPERATURE = 1e-5

# The fields a model's generation_config.json may default (vLLM's `--generation-config auto` set,
# less max_new_tokens), with the values they take when neither the request nor the model sets them.
GENERATION_CONFIG_FIELDS: dict[str, float] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the output, enforced while decoding (vLLM's `StructuredOutputsParams`):
    exactly one of a JSON schema, any JSON object, a regular expression, a choice among strings,
    or a grammar (EBNF as in GBNF, `root ::= ...`, or Lark, `start: ...`).

    disable_any_whitespace: JSON is generated compact (one space after `,` and `:`, no newlines)
    instead of with any whitespace the model likes; a small model can otherwise spend its tokens
    on whitespace."""

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise ValueError(
                "structured outputs need exactly one of json, json_object, regex, choice or grammar; "
                f"got {', '.join(kinds) or 'none'}"
            )
        if self.choice is not None and not (
            self.choice and all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("structured outputs choice must be a non-empty list of non-empty strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value.strip()):
                raise ValueError(f"structured outputs {name} must be a non-empty string")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError("structured outputs json must be a JSON schema (an object or its JSON text)")

    @property
    def kind(self) -> str:
        """json | json_object | regex | choice | grammar."""
        if self.json_object:
            return "json_object"
        return next(k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None)

    @property
    def key(self) -> tuple[str, str, bool]:
        """What the compiled grammar depends on: the compile cache's key. A schema given as a dict
        and as its JSON text share one entry."""
        kind = self.kind
        spec: object = getattr(self, kind)
        if kind == "json":
            spec = json.loads(spec) if isinstance(spec, str) else spec
            spec = json.dumps(spec, sort_keys=True, separators=(",", ":"))
        elif kind == "choice":
            spec = json.dumps(list(spec))
        elif kind == "json_object":
            spec = ""
        return kind, str(spec), self.disable_any_whitespace


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature == 0 means greedy. top_k <= 0 (or >= vocab) and top_p == 1 and min_p == 0 disable
    those filters. Penalties follow vLLM/OpenAI semantics: presence and frequency penalties act on
    generated tokens, the repetition penalty on prompt and generated tokens.

    seed: the same seed gives the same tokens for the same prompt and parameters, whatever else
    shares the batch and with speculative decoding on or off (the noise at each output position
    is a function of the seed and the position), provided the model's logits are the same; the
    kernels are not batch-invariant, so in rare cases floating point can flip a token
    (docs/engine.md). With n > 1, sequence i uses seed + i.

    temperature, top_p, top_k, min_p and repetition_penalty left unset (None) take the model's
    generation_config.json values when the engine receives the request (`with_defaults`), else
    the neutral values of GENERATION_CONFIG_FIELDS; until then they read as the neutral values.
    """

    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    # Number of most likely alternatives to report per generated token (None: no logprobs).
    logprobs: int | None = None
    # vLLM's prompt_logprobs: logprobs (with this many alternatives) of each prompt token after the
    # first; None: none. Such a request computes its whole prompt (no prefix-cache hit).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Prefix-cache isolation (vLLM's `cache_salt`): mixed into the hash of the first KV block, so
    # only requests carrying the same salt can share cached KV. Not a sampling parameter, but it
    # travels with one request like them. None: the shared, unsalted cache.
    cache_salt: str | None = None
    # Constrained decoding (docs/server.md, Structured outputs); None: unconstrained.
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's: only these token ids may be sampled; None: any. (Ids past the vocabulary are refused
    # by the engine, which knows its size.)
    allowed_token_ids: list[int] | None = None
    # vLLM's: words never generated. Each is tokenized as written and after a space (the engine,
    # `bad_words_token_ids`); the token that would complete one of those sequences is masked.
    bad_words: list[str] = field(default_factory=list)
    # The GENERATION_CONFIG_FIELDS the caller left unset; None: find out from the None values.
    # dataclasses.replace carries it, and a field replaced by a non-neutral value counts as set.
    unset_fields: frozenset[str] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.unset_fields is None:
            self.unset_fields = frozenset(k for k in GENERATION_CONFIG_FIELDS if getattr(self, k) is None)
        for name, neutral in GENERATION_CONFIG_FIELDS.items():
            if getattr(self, name) is None:
                setattr(self, name, neutral)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        self.bad_words = list(self.bad_words)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the parameter when a value is out of range."""
        floats = (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        )
        for name in floats:
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        checks: list[tuple[bool, str]] = [
            (self.n >= 1, f"n must be at least 1, got {self.n}"),
            (self.temperature >= 0.0, f"temperature must be non-negative, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= -1, f"top_k must be -1 (disable), 0 (disable) or positive, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (
                -2.0 <= self.presence_penalty <= 2.0,
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                -2.0 <= self.frequency_penalty <= 2.0,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (
                0.01 <= self.repetition_penalty <= 100.0,
                f"repetition_penalty must be in [0.01, 100], got {self.repetition_penalty}",
            ),
            (
                self.max_tokens is None or self.max_tokens >= 1,
                f"max_tokens must be at least 1, got {self.max_tokens}",
            ),
            (self.min_tokens >= 0, f"min_tokens must be non-negative, got {self.min_tokens}"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            ),
            (
                self.logprobs is None or 0 <= self.logprobs <= 20,
                f"logprobs must be in [0, 20], got {self.logprobs}",
            ),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
                f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}",
            ),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings"),
            (
                all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                "stop_token_ids must be token ids",
            ),
            (
                self.allowed_token_ids is None
                or (
                    len(self.allowed_token_ids) > 0
                    and all(isinstance(t, int) and t >= 0 for t in self.allowed_token_ids)
                ),
                "allowed_token_ids must be a non-empty list of token ids",
            ),
            (
                all(isinstance(w, str) and w.strip() for w in self.bad_words),
                "bad_words must be strings with something besides spaces",
            ),
            (
                self.cache_salt is None or (isinstance(self.cache_salt, str) and self.cache_salt != ""),
                "cache_salt must be a non-empty string if given",
            ),
            (
                self.structured_outputs is None
                or isinstance(self.structured_outputs, StructuredOutputsParams),
                "structured_outputs must be a StructuredOutputsParams",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def with_defaults(self, defaults: Mapping[str, float]) -> SamplingParams:
        """These parameters with each unset field taken from `defaults` (a model's
        generation_config.json values, GENERATION_CONFIG_FIELDS names only)."""
        fill = {
            name: value
            for name, value in defaults.items()
            if name in self.unset_fields and getattr(self, name) == GENERATION_CONFIG_FIELDS[name]
        }
        if not fill:
            return self
        return dataclasses.replace(self, **fill, unset_fields=self.unset_fields - fill.keys())

    @property
    def is_greedy(self) -> bool:
        # Below 1e-5 (vLLM's epsilon) dividing logits by the temperature overflows float32: greedy.
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
