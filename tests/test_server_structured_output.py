"""Structured outputs through the server with the real `openai` client: OpenAI's response_format
(json_schema, json_object, and the client's own pydantic `parse`), vLLM's structured_outputs and
guided_* extras, streaming, and the 400s in OpenAI's error shape. The fixture model writes Python,
so the JSON it is made to write is odd, but valid."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

ERROR_KEYS = {"message", "type", "param", "code"}
MESSAGES = [{"role": "user", "content": "describe a point"}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "x": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 2},
    },
    "required": ["name", "x", "tags"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "point", "schema": SCHEMA, "strict": True}}
MAX_TOKENS = 96


def error_of(exc: pytest.ExceptionInfo) -> dict:
    assert exc.value.status_code == 400
    body = exc.value.response.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
    return body["error"]


def test_chat_response_format_json_schema_returns_valid_json(client, model) -> None:
    for temperature in (0.0, 1.0):
        r = client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=temperature, seed=5,
            response_format=RESPONSE_FORMAT,
        )  # fmt: skip
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_streamed_json_schema_assembles_into_valid_json(client, model) -> None:
    chunks = list(
        client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0.0, stream=True,
            response_format=RESPONSE_FORMAT,
        )
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


class Point(BaseModel):
    label: str = Field(max_length=6)
    x: int = Field(ge=-5, le=5)
    visible: bool


def test_the_clients_own_pydantic_parse(client, model) -> None:
    r = client.chat.completions.parse(
        model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0.0, response_format=Point
    )
    point = r.choices[0].message.parsed
    assert isinstance(point, Point) and -5 <= point.x <= 5 and len(point.label) <= 6


def test_completions_json_object_regex_and_choice_extras(client, model) -> None:
    common = dict(model=model, prompt="def f(x):\n", max_tokens=48, temperature=0.0)
    # Free keys are free strings: a prompt after which the fixture model closes its object soon.
    r = client.completions.create(
        **{**common, "prompt": "x = {}\n"}, extra_body={"response_format": {"type": "json_object"}}
    )
    assert isinstance(json.loads(r.choices[0].text), dict) and r.choices[0].finish_reason == "stop"
    r = client.completions.create(**common, extra_body={"structured_outputs": {"regex": r"[a-z]{3}\d{2}"}})
    assert re.fullmatch(r"[a-z]{3}\d{2}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    r = client.completions.create(**common, extra_body={"guided_regex": r"0x[0-9a-f]{4}"})
    assert re.fullmatch(r"0x[0-9a-f]{4}", r.choices[0].text)
    r = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=8, extra_body={"guided_choice": ["left", "right"]}
    )
    assert r.choices[0].message.content in ("left", "right")
    r = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=16,
        extra_body={"structured_outputs": {"grammar": 'root ::= "x" [0-9] [0-9]?'}},
    )  # fmt: skip
    assert re.fullmatch(r"x[0-9][0-9]?", r.choices[0].message.content)
    r = client.completions.create(
        **common, extra_body={"guided_json": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}}
    )
    assert all(isinstance(b, bool) for b in json.loads(r.choices[0].text))


def schema_format(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        (schema_format({"type": "array", "uniqueItems": True}), "response_format", "uniqueItems"),
        (schema_format({"oneOf": [{"type": "integer"}, {"type": "null"}]}), "response_format", "oneOf"),
        ({"structured_outputs": {"regex": "[a-z"}}, "structured_outputs", "regex"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag", "Extra"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar", "grammar"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "only one"),
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", ""),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "required"),
        ({"min_tokens": 3, "guided_choice": ["a"]}, "guided_choice", "min_tokens"),
    ],
)  # fmt: skip
def test_unenforceable_constraints_are_400_in_openais_shape(client, model, extra, param, message) -> None:
    for call in (
        lambda: client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=4, extra_body=extra
        ),
        lambda: client.completions.create(model=model, prompt="x = 1\n", max_tokens=4, extra_body=extra),
    ):
        with pytest.raises(openai.BadRequestError) as exc:
            call()
        error = error_of(exc)
        assert error["param"] == param and message in error["message"], error
