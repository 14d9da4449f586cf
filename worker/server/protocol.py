"""OpenAI request models (pydantic); the error shape is errors.APIError.

Fields OpenAI defines and we support are validated here, as strictly typed as OpenAI's own
(`"max_tokens": "5"` or `"stream": "yes"` is a 400, not coerced); fields it defines that we do
not support are refused with a 400 naming them (never silently ignored); fields nobody defines
are ignored, as OpenAI-compatible servers do, so clients that send extras keep working. vLLM's
extra sampling fields (top_k, min_p, repetition_penalty, ...) are accepted too.

Every list a request may carry is bounded (the LIMITS below, documented in docs/server.md), so
no single request can make a step, or its own validation, cost more than a bounded amount.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationInfo, field_validator

from kvscale.common.errors import APIError
from kvscale.worker.sample.sampling_params import SamplingParams, StructuredOutputsParams
from kvscale.worker.server.tool_calls import parameters_schema, required_calls_schema
from kvscale.worker.structured_output.budget import (
    MAX_TOOL_SCHEMA_BYTES,
    BudgetError,
    check_constraint,
    check_json_schema,
)

# Bounds on the work one request may ask for (docs/server.md has the table). The prompt itself is
# bounded by max_model_len, and its bytes before tokenization by max_model_len x the longest token.
MAX_N = 16  # sequences per prompt
MAX_PROMPTS = 64  # prompts in one /v1/completions request
MAX_MESSAGES = 1024  # messages in one chat request
MAX_CONTENT_PARTS = 64  # text parts in one message
MAX_STOP = 16  # stop strings
MAX_STOP_CHARS = 64  # characters in one stop string
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20  # logprobs (completions) / top_logprobs (chat)
MAX_ALLOWED_TOKEN_IDS = 8192  # allowed_token_ids: each step masks the rest of the vocabulary
MAX_BAD_WORDS = 64  # bad_words: each step compares each (twice tokenized) with the output's tail
MAX_BAD_WORD_CHARS = 64
MAX_CHOICES = 256  # strings in one structured-outputs choice list
MAX_TOOLS = 128  # tools in one chat request (OpenAI's limit)
MAX_TOOL_CALLS = 128  # calls in one assistant message of the history
MAX_TEMPLATE_KWARGS = 32  # chat_template_kwargs entries

# apply_chat_template's own parameters and what the server renders from the request itself.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
        "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
        "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    }
)  # fmt: skip

# OpenAI-defined fields that ask for something we do not do: refused unless absent, null, or the
# value that means what we do anyway.
_NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "functions": ([],),
    "function_call": ("none",),
    "prediction": (),
    "audio": (),
    "modalities": (["text"],),
    "web_search_options": (),
    "reasoning_effort": (),
    "verbosity": (),
    "store": (False,),
    "service_tier": ("auto", "default"),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`. The schema is always enforced while decoding: `strict` only
    says the client wants that (OpenAI's strict mode), so it changes nothing here."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | bool = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(default=None, validate_default=True)

    @field_validator("json_schema")
    @classmethod
    def _schema_for_its_type(cls, v, info: ValidationInfo):
        if (v is not None) != (info.data.get("type") == "json_schema"):
            raise ValueError("json_schema is required with type json_schema, and only then")
        return v


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` extra: exactly one constraint. Unknown keys (vLLM's
    `structural_tag`, `whitespace_pattern`) are refused, not ignored."""

    model_config = ConfigDict(strict=True, extra="forbid")

    json: dict[str, Any] | bool | str | None = None
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1, max_length=MAX_CHOICES)
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


# vLLM's fields before v0.12 (`guided_json` -> structured_outputs.json, ...), still sent by many clients.
_GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def _within_budget(params: StructuredOutputsParams, param: str) -> StructuredOutputsParams:
    """A 400 naming `param` for a constraint over its budget (structured_output/budget.py): a cheap,
    bounded walk, before anything is parsed into a grammar or compiled."""
    try:
        check_constraint(params.kind, getattr(params, params.kind))
    except ValueError as e:  # BudgetError, or JSON text that does not parse
        raise APIError(400, str(e), param=param) from None
    return params


class _SamplingFields(BaseModel):
    """Sampling fields shared by both endpoints (OpenAI's, then vLLM's extras)."""

    # strict: no coercion ("5" is not 5, "yes" not true, true not 1); ints still pass as floats.
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    # Unset sampling fields (None) take the model's generation_config.json defaults.
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, ge=0.01, le=100.0)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    allowed_token_ids: list[int] | None = Field(default=None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)
    bad_words: list[str] | None = Field(default=None, max_length=MAX_BAD_WORDS)
    include_stop_str_in_output: bool = False
    # Logprobs of the prompt's tokens, with this many alternatives each (vLLM's extra).
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    skip_special_tokens: bool = True
    # Prefix-cache isolation: only requests with the same salt share cached KV (docs/server.md).
    cache_salt: str | None = Field(default=None, min_length=1)
    # Structured outputs (docs/server.md): OpenAI's response_format, vLLM's structured_outputs and
    # its older guided_* fields; at most one of them constrains a request.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, min_length=1, max_length=MAX_CHOICES)
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None

    @field_validator("guided_whitespace_pattern")
    @classmethod
    def _no_whitespace_pattern(cls, v):
        if v is not None:
            raise ValueError("not supported (structured_outputs.disable_any_whitespace is)")
        return v

    @field_validator("guided_decoding_backend")
    @classmethod
    def _xgrammar_only(cls, v):
        # vLLM removed the field; a client naming the backend we run (or auto) is served.
        if v is not None and v not in ("auto", "xgrammar"):
            raise ValueError("only xgrammar is available")
        return v

    # Field validators (not model validators), so that the 400's `param` names the field.
    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v):
        if v:
            raise ValueError("not supported")
        return v

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, v):
        # Each step checks every stop string against the text's tail: bound both count and length.
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings are allowed, got {len(stops)}")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters")
        return v

    @field_validator("allowed_token_ids")
    @classmethod
    def _token_ids(cls, v):
        if v is not None and any(t < 0 for t in v):
            raise ValueError("token ids must be non-negative")
        return v

    @field_validator("bad_words")
    @classmethod
    def _bounded_bad_words(cls, v):
        for word in v or []:
            if not word.strip():
                raise ValueError("a bad word must have something besides spaces")
            if len(word) > MAX_BAD_WORD_CHARS:
                raise ValueError(f"a bad word may have at most {MAX_BAD_WORD_CHARS} characters")
        return v

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs_not_streamed(cls, v, info: ValidationInfo):
        # A stream would carry them in its first chunk; not implemented: refused, not dropped.
        if v is not None and info.data.get("stream"):
            raise ValueError("not supported with stream: true (completions' echo + logprobs is)")
        return v

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, v, info: ValidationInfo):
        if v is not None and not info.data.get("stream"):
            raise ValueError("only allowed with stream=true")
        return v

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=list(self.bad_words or []),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=self.wanted_prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            cache_salt=self.cache_salt,
            structured_outputs=self.structured_outputs_params(),
        )

    @property
    def wanted_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token the engine must compute (None: no prompt logprobs)."""
        return self.prompt_logprobs

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The request's one constraint; APIError (400 naming the field) for two, or a malformed one."""
        given: list[tuple[str, dict[str, Any]]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif fmt is not None and fmt.type == "json_schema":
            given.append(("response_format", {"json": fmt.json_schema.json_schema}))
        if self.structured_outputs is not None:
            given.append(("structured_outputs", self.structured_outputs.model_dump(exclude_none=True)))
        for name, key in _GUIDED_FIELDS.items():
            if getattr(self, name) is not None:
                given.append((name, {key: getattr(self, name)}))
        tool_constraint = self.tool_constraint()
        if tool_constraint is not None:
            if given:
                raise APIError(
                    400, f"tool_choice forces a call, which {given[0][0]} cannot also constrain",
                    param="tool_choice",
                )  # fmt: skip
            return _within_budget(tool_constraint, "tools")
        if not given:
            return None
        if len(given) > 1:
            names = ", ".join(n for n, _ in given)
            raise APIError(
                400, f"only one structured-output constraint is allowed, got {names}", param=given[1][0]
            )
        param, fields = given[0]
        try:
            params = StructuredOutputsParams(**fields)
        except ValueError as e:
            raise APIError(400, str(e), param=param) from None
        if param == "response_format":
            field = "response_format.json_schema.schema"
        elif param == "structured_outputs":
            field = f"structured_outputs.{params.kind}"
        else:
            field = param
        return _within_budget(params, field)

    def tool_constraint(self) -> StructuredOutputsParams | None:
        """The constraint the request's tool_choice imposes (chat only)."""
        return None

    @property
    def structured_outputs_param(self) -> str | None:
        """The field that carries the request's constraint (for the 400 of one the engine refuses)."""
        if getattr(self, "tools", None) and self.tool_constraint() is not None:
            return "tools"
        if self.response_format is not None and self.response_format.type != "text":
            return "response_format"
        if self.structured_outputs is not None:
            return "structured_outputs"
        return next((n for n in _GUIDED_FIELDS if getattr(self, n) is not None), None)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    # Strict ints: JSON true/false must not pass as token ids 1/0.
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("must not be empty")
        if isinstance(v, list) and not isinstance(v[0], int) and len(v) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts are allowed in one request, got {len(v)}")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, v, info: ValidationInfo):
        if v is not None and v != info.data.get("n", 1):
            raise ValueError("values other than n are not supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        if v:
            raise ValueError("not supported")
        return v

    @property
    def wanted_prompt_logprobs(self) -> int | None:
        # echo + logprobs: the echoed prompt's tokens come with their logprobs (lm-eval's scoring).
        asked = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(asked) if asked else None

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text"]
    text: str


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; absent: the function takes none
    strict: bool | None = None  # required and named calls are always enforced; auto ones never

    @field_validator("parameters")
    @classmethod
    def _parameters_within_budget(cls, v):
        # Every tool's schema goes to the chat template and may become a grammar (required, named).
        if v is not None:
            try:
                check_json_schema(v, MAX_TOOL_SCHEMA_BYTES)
            except BudgetError as e:
                raise ValueError(str(e)) from None
        return v


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["function"]
    function: FunctionName


class FunctionCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    name: str
    arguments: str


class ToolCallItem(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    id: str
    type: Literal["function"]
    function: FunctionCall

    def template_call(self) -> dict[str, Any]:
        try:
            arguments: Any = json.loads(self.function.arguments)
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's stack
            arguments = self.function.arguments
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.function.name, "arguments": arguments},
        }


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Only an assistant message may leave its content out or null (OpenAI's rule); validate_default
    # so that a missing content is checked too.
    content: str | list[TextPart] | None = Field(default=None, validate_default=True)
    name: str | None = None
    # An assistant's calls, and a tool message's answer to one of them: both go to the chat template.
    tool_calls: list[ToolCallItem] | None = Field(default=None, max_length=MAX_TOOL_CALLS)
    tool_call_id: str | None = Field(default=None, validate_default=True)
    # The deprecated function calling is not implemented: a conversation carrying it is refused,
    # not rendered without it.
    function_call: Any = None
    audio: Any = None
    refusal: Any = None

    @field_validator("tool_calls")
    @classmethod
    def _assistant_calls(cls, v, info: ValidationInfo):
        if v is not None and info.data.get("role") != "assistant":
            raise ValueError("only an assistant message makes tool calls")
        return v

    @field_validator("tool_call_id")
    @classmethod
    def _tool_answers(cls, v, info: ValidationInfo):
        if (v is not None) != (info.data.get("role") == "tool"):
            raise ValueError("a tool message answers a tool call by its id, and only a tool message does")
        return v

    @field_validator("content")
    @classmethod
    def _content_required(cls, v, info: ValidationInfo):
        if v is None and info.data.get("role", "assistant") != "assistant":
            raise ValueError(f"must not be null in a {info.data['role']} message")
        if isinstance(v, list) and len(v) > MAX_CONTENT_PARTS:
            raise ValueError(f"at most {MAX_CONTENT_PARTS} content parts are allowed, got {len(v)}")
        return v

    @field_validator("function_call", "audio", "refusal")
    @classmethod
    def _no_tool_fields(cls, v):
        if v is not None:
            raise ValueError("not supported")
        return v

    def template_message(self) -> dict[str, Any]:
        """The message as chat templates read it (Hermes, Qwen, Llama 3): a call's arguments as an
        object when they are JSON (as vLLM passes them), else the string."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [call.template_call() for call in self.tool_calls]
        return message

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's extra: variables for the chat template (Qwen3's `enable_thinking`, ...).
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, max_length=MAX_TEMPLATE_KWARGS)
    # OpenAI's, not implemented (see _NO_OP_VALUES)
    functions: Any = None
    function_call: Any = None
    prediction: Any = None
    audio: Any = None
    modalities: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    store: Any = None
    service_tier: Any = None

    @field_validator(*_NO_OP_VALUES)
    @classmethod
    def _refuse_unsupported(cls, v, info: ValidationInfo):
        no_ops = _NO_OP_VALUES[info.field_name]
        if v is not None and not any(v == ok and type(v) is type(ok) for ok in no_ops):
            raise ValueError("not supported")
        return v

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables_only(cls, v):
        # The names apply_chat_template itself takes (or renders from the request) would let a
        # client replace the messages or tools, or change what is returned: refused, not passed.
        taken = sorted(set(v or ()) & _RESERVED_TEMPLATE_KWARGS)
        if taken:
            raise ValueError(f"{', '.join(taken)} cannot be set here (they come from the request)")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _choice_of_the_tools(cls, v, info: ValidationInfo):
        names = [t.function.name for t in info.data.get("tools") or []]
        if isinstance(v, NamedToolChoice) and v.function.name not in names:
            raise ValueError(f"names {v.function.name!r}, which is not one of the tools")
        if v == "required" and not names:
            raise ValueError("required needs tools")
        return v

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: auto with tools, none without."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @property
    def tool_choice_param(self) -> str:
        return "tool_choice" if self.tool_choice is not None else "tools"

    def tool_constraint(self) -> StructuredOutputsParams | None:
        """`required` and a named function are enforced by the grammar: the tool's parameters (named),
        or an array of calls of the tools (required)."""
        choice = self.effective_tool_choice
        tools = self.tools or []
        if isinstance(choice, NamedToolChoice):
            tool = next(t for t in tools if t.function.name == choice.function.name)
            return StructuredOutputsParams(json=parameters_schema(tool.function.parameters))
        if choice == "required":
            calls = [(t.function.name, t.function.parameters) for t in tools]
            return StructuredOutputsParams(
                json=required_calls_schema(calls, self.parallel_tool_calls is not False)
            )
        return None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, v, info: ValidationInfo):
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("requires logprobs=true")
        return v

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
