"""Tool calling through the server with the real `openai` client: tool_choice required and a named
function (enforced by the grammar; plain and streamed, assembled by the client), a multi-turn
transcript with the calls and their results rendered into the prompt, and the 400s. The fixture
model writes Python, not calls: what it is made to write is odd but valid."""

from __future__ import annotations

import json
import shutil

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from kvscale.worker.server.openai_serving import render_chat
from kvscale.worker.server.protocol import ChatCompletionRequest

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "units": {"enum": ["C", "F"]},
    },
    "required": ["city", "days", "units"],
    "additionalProperties": False,
}
NOW = {"type": "object", "properties": {}, "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER, "strict": True}},
    {"type": "function", "function": {"name": "now", "parameters": NOW, "strict": True}},
]
SCHEMAS = {"get_weather": WEATHER, "now": NOW}
MESSAGES = [{"role": "user", "content": "weather in Paris?"}]
TRANSCRIPT = [
    *MESSAGES,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": '{"city": "Paris", "days": 1, "units": "C"}',
                },
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
]
MAX_TOKENS = 96


def check_calls(calls, names=SCHEMAS) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_returns_valid_calls(client, model, parallel) -> None:
    for temperature in (0.0, 1.0):
        r = client.chat.completions.create(
            model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel,
            max_tokens=MAX_TOKENS, temperature=temperature, seed=3,
        )  # fmt: skip
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        check_calls(choice.message.tool_calls)
        if not parallel:
            assert len(choice.message.tool_calls) == 1


def test_named_function_returns_a_call_of_it(client, model) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, tool_choice=named, max_tokens=MAX_TOKENS, temperature=0.0
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    check_calls(choice.message.tool_calls, names={"get_weather"})
    assert len(choice.message.tool_calls) == 1


def test_streamed_named_call_is_assembled_by_the_clients_stream_helper(client, model) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    common = dict(model=model, messages=MESSAGES, tools=TOOLS, tool_choice=named, max_tokens=MAX_TOKENS)
    with client.chat.completions.stream(**common, temperature=0.0) as stream:
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    check_calls(choice.message.tool_calls, names={"get_weather"})
    # strict tools: the client parsed the arguments itself
    assert choice.message.tool_calls[0].function.parsed_arguments == json.loads(
        choice.message.tool_calls[0].function.arguments
    )
    plain = client.chat.completions.create(**common, temperature=0.0)
    assert (
        choice.message.tool_calls[0].function.arguments
        == plain.choices[0].message.tool_calls[0].function.arguments
    )


def test_streamed_required_calls_assemble_from_deltas(client, model) -> None:
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=MAX_TOKENS,
        temperature=1.0, seed=11, stream=True,
    ):  # fmt: skip
        delta = chunk.choices[0].delta
        assert not delta.content
        for d in delta.tool_calls or []:
            call = calls.setdefault(d.index, {"name": None, "arguments": ""})
            if d.id is not None:
                assert call["name"] is None and d.type == "function"
                call["name"] = d.function.name
            call["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and calls
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_multi_turn_transcript_renders_calls_and_results_into_the_prompt(client, model) -> None:
    """The fixture's template prints each message's content: the tool's answer is in the prompt."""
    r = client.chat.completions.create(
        model=model, messages=TRANSCRIPT, tools=TOOLS, tool_choice="none", max_tokens=4
    )
    assert r.choices[0].finish_reason in ("stop", "length") and not r.choices[0].message.tool_calls
    tokenizer = AutoTokenizer.from_pretrained(model)

    def tokens(messages) -> int:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return len(ids if isinstance(ids, list) else ids["input_ids"])

    # What the fixture's template makes of it: the call message has no content, the answer does.
    expected = [
        *MESSAGES,
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": "18 degrees and sunny"},
    ]
    assert r.usage.prompt_tokens == tokens(expected)
    assert r.usage.prompt_tokens > tokens([*expected[:-1], {"role": "tool", "content": ""}])


# A Hermes-style template (written for this test; the fixture's own ignores tools), in a copy of the
# fixture's tokenizer folder: the same code path as a model that ships one.
HERMES_TEMPLATE = """{%- if tools %}<|system|>
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
{% endif %}
{%- for message in messages %}<|{{ message.role }}|>
{%- if message.tool_calls %}{% for c in message.tool_calls %}
<tool_call>{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}</tool_call>
{%- endfor %}{% elif message.role == "tool" %}
<tool_response id="{{ message.tool_call_id }}">{{ message.content }}</tool_response>
{%- else %}
{{ message.content }}
{%- endif %}
{% endfor %}{% if add_generation_prompt %}<|assistant|>
{% endif %}"""


def test_tools_and_history_reach_a_template_that_reads_them(target_model, tmp_path) -> None:
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(f"{target_model}/{name}", folder / name)
    (folder / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    body = ChatCompletionRequest.model_validate({"messages": TRANSCRIPT, "tools": TOOLS})
    ids = render_chat(
        tokenizer,
        [m.template_message() for m in body.messages],
        True,
        [t.model_dump(exclude_none=True) for t in body.tools],
    )
    prompt = tokenizer.decode(ids)
    assert json.dumps(TOOLS[0], ensure_ascii=False) in prompt  # the tool, as the template dumps it
    # The call's arguments went to the template as an object (tojson prints it back).
    arguments = '{"city": "Paris", "days": 1, "units": "C"}'
    assert f'<tool_call>{{"name": "get_weather", "arguments": {arguments}}}</tool_call>' in prompt
    assert '<tool_response id="call_1">18 degrees and sunny</tool_response>' in prompt
    assert prompt.endswith("<|assistant|>\n")


THINKING_TEMPLATE = """{% for message in messages %}<|{{ message.role }}|>
{{ message.content }}
{% endfor %}<|assistant|>
{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"""


def test_chat_template_kwargs_reach_the_template(target_model, tmp_path) -> None:
    # Qwen3's switch: before this change the field was dropped and thinking stayed on.
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(f"{target_model}/{name}", folder / name)
    (folder / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"enable_thinking": False}}
    )
    messages = [m.template_message() for m in body.messages]
    off = tokenizer.decode(render_chat(tokenizer, messages, True, None, body.chat_template_kwargs))
    on = tokenizer.decode(render_chat(tokenizer, messages, True, None, None))
    assert off.endswith("<think></think>") and not on.endswith("</think>")


@pytest.mark.parametrize("key", ["messages", "tools", "tokenize", "chat_template", "return_dict"])
def test_chat_template_kwargs_cannot_replace_what_the_request_renders(client, model, key) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=1, extra_body={"chat_template_kwargs": {key: 1}}
        )
    assert error_of(exc)["param"] == "chat_template_kwargs"


def error_of(exc: pytest.ExceptionInfo) -> dict:
    assert exc.value.status_code == 400
    body = exc.value.response.json()
    assert set(body) == {"error"} and body["error"]["type"] == "invalid_request_error", body
    return body["error"]


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({}, "tools", "tool-call parser"),  # auto is OpenAI's default with tools; no parser here
        ({"tool_choice": "auto"}, "tool_choice", "tool-call parser"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not one of"),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "cannot also constrain",
        ),
        (
            {
                "tool_choice": "required",
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"uniqueItems": True}}}
                ],
            },
            "tools",
            "uniqueItems",
        ),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name", None),
    ],
)
def test_tool_requests_that_cannot_be_served_are_400(client, model, extra, param, message) -> None:
    body = {"tools": TOOLS, **extra}
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, extra_body=body)
    error = error_of(exc)
    assert error["param"] == param, error
    assert message is None or message in error["message"], error


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "tool", "content": "18"}, "messages.1.tool_call_id"),
        ({"role": "user", "content": "x", "tool_call_id": "c"}, "messages.1.tool_call_id"),
        (
            {"role": "user", "content": "x", "tool_calls": TRANSCRIPT[1]["tool_calls"]},
            "messages.1.tool_calls",
        ),
    ],
)
def test_tool_fields_on_the_wrong_message_are_400(client, model, message, param) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=model, messages=[*MESSAGES, message], max_tokens=2)
    assert error_of(exc)["param"] == param


# -- tool_choice auto, read by the hermes parser -----------------------------------------------
# The fixture model never writes <tool_call> on its own: a regex makes it write a known output
# (auto is not grammar-enforced, so a constraint may be added), which the parser must then read.
HERMES_REGEX = (
    r'ok <tool_call>\{"name": "get_weather", "arguments": \{"city": "Oslo", "days": 2, "units": "C"\}\}'
    r'</tool_call><tool_call>\{"name": "now", "arguments": \{\}\}</tool_call>'
)


@pytest.fixture(scope="module")
def hermes_client(target_model, tmp_path_factory):
    from server_fixtures import start_server

    proc = start_server(
        target_model,
        tmp_path_factory.mktemp("hermes"),
        "--tool-call-parser",
        "hermes",
        "--num-kv-blocks",
        "256",
    )
    yield openai.OpenAI(base_url=proc.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert proc.stop() == 0, proc.log()


def test_auto_calls_are_read_by_the_hermes_parser_plain_and_streamed(hermes_client, model) -> None:
    common = dict(
        model=model, messages=MESSAGES, tools=TOOLS, max_tokens=256, temperature=0.0,
        extra_body={"structured_outputs": {"regex": HERMES_REGEX}},
    )  # fmt: skip
    r = hermes_client.chat.completions.create(**common)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "ok "
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls == [("get_weather", {"city": "Oslo", "days": 2, "units": "C"}), ("now", {})]
    with hermes_client.chat.completions.stream(**common) as stream:
        final = stream.get_final_completion()
    streamed = final.choices[0]
    assert streamed.finish_reason == "tool_calls" and streamed.message.content == "ok "
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]


def test_auto_without_a_call_is_plain_content(hermes_client, model) -> None:
    r = hermes_client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, max_tokens=8, temperature=0.0
    )
    choice = r.choices[0]
    assert not choice.message.tool_calls and choice.finish_reason in ("stop", "length")
    assert choice.message.content  # the model's own text, unchanged


def test_parallel_tool_calls_false_returns_the_first_call_only(hermes_client, model) -> None:
    # The model writes two calls; before this change both came back under auto.
    common = dict(
        model=model, messages=MESSAGES, tools=TOOLS, max_tokens=256, temperature=0.0,
        parallel_tool_calls=False, extra_body={"structured_outputs": {"regex": HERMES_REGEX}},
    )  # fmt: skip
    r = hermes_client.chat.completions.create(**common)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]
    assert r.choices[0].finish_reason == "tool_calls"
    with hermes_client.chat.completions.stream(**common) as stream:
        final = stream.get_final_completion()
    assert [c.function.name for c in final.choices[0].message.tool_calls] == ["get_weather"]
