"""The request bodies of the API, declared as Pydantic models: they are the OpenAPI schema that
``/docs`` shows and that the fuzzing test (schemathesis) generates requests from.

Validation itself stays in the gateway (``minillm.serving.validation.parse_completion_body``): it
names the offending field in an OpenAI-style 400, checks sampling values with the engine's own
rules, and runs after authentication, so a stranger learns nothing about a body. A test keeps
the two in step: every field declared here is one the gateway reads or refuses by name.
"""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from minillm.serving.validation import MAX_STOP, UNSUPPORTED_UNLESS_NEUTRAL

# Rules between fields, stated in the schema as the server applies them
STREAM_OPTIONS_NEED_STREAM = {      # stream_options (an object) only with stream: true, as OpenAI says
    "if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
    "then": {"required": ["stream"], "properties": {"stream": {"const": True}}}}
TOP_LOGPROBS_NEED_LOGPROBS = {      # chat: top_logprobs (a number) only with logprobs: true
    "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
    "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")     # unknown OpenAI fields: ignored, or refused by name


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")    # an unknown option is refused by name (400)
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = Field(None,
                                                description="vLLM's extension: token counts on every chunk")


class _Sampling(_Body):
    model_config = ConfigDict(extra="allow", json_schema_extra={"allOf": [STREAM_OPTIONS_NEED_STREAM]})
    model: str | None = Field(None, min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="vLLM's extension; -1 or 0: off")
    seed: int | None = Field(None, ge=-2**63, le=2**63 - 1, description="64-bit")
    stop: Union[Annotated[str, Field(min_length=1)],
                Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP)], None] = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    min_tokens: int | None = Field(None, ge=0, description="vLLM's extension")
    n: int | None = Field(None, ge=1, le=1, description="only 1")
    user: str | None = None


class CompletionBody(_Sampling):
    prompt: str = Field(..., min_length=1, description="one prompt per request")
    logprobs: int | None = Field(None, ge=0, le=20, description="the top-N alternatives per token")


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart]]
    # a conversation without function calling: an assistant message may carry none (null or []), which
    # OpenAI's clients send back as they received it; any other value is refused by name
    tool_calls: list[dict] | None = Field(None, max_length=0,
                                          description="none: this server does no function calling")


class ChatCompletionBody(_Sampling):
    model_config = ConfigDict(extra="allow", json_schema_extra={
        "allOf": [STREAM_OPTIONS_NEED_STREAM, TOP_LOGPROBS_NEED_LOGPROBS]})
    messages: list[Message] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)


class TokenizeBody(_Body):
    # exactly one of prompt and messages: said in the schema, so a client generated from it knows
    model_config = ConfigDict(extra="allow", json_schema_extra={
        "oneOf": [{"required": ["prompt"], "not": {"required": ["messages"]}},
                  {"required": ["messages"], "not": {"required": ["prompt"]}}]})
    model: str | None = Field(None, min_length=1)
    prompt: str = Field(None, description="text to tokenize (exactly one of prompt and messages)")
    messages: list[Message] = Field(None, min_length=1,
                                    description="a chat to tokenize with the chat template")
    add_special_tokens: bool | None = True


class DetokenizeBody(_Body):
    model: str | None = Field(None, min_length=1)
    tokens: list[int]


def inline_schema(model: type[BaseModel]) -> dict:
    """The model's JSON schema with its ``$defs`` inlined (a request body in OpenAPI cannot
    point into its own ``$defs``: ``#/...`` refs resolve from the document's root)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def walk(node):
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return walk(dict(defs[ref.rsplit("/", 1)[1]]))
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node
    return walk(schema)


def request_body(model: type[BaseModel], neutral_only: bool = False) -> dict:
    """``openapi_extra`` for a route that reads its body itself. ``neutral_only``: the OpenAI and
    vLLM fields the server does not implement, each allowed only at its neutral value (or null),
    as the server refuses any other by name."""
    schema = inline_schema(model)
    if neutral_only:
        for name, neutral in UNSUPPORTED_UNLESS_NEUTRAL.items():
            values: list = []                   # one per JSON value: 1 and 1.0 are the same number
            for n in neutral:
                if not any(n == v and isinstance(n, bool) == isinstance(v, bool) for v in values):
                    values.append(n)
            schema["properties"][name] = {"enum": [*values, None],
                                          "description": "not supported: only its neutral value"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


# ---------------------------------------------------------------------------------------------
# Errors, as the OpenAPI schema documents them
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str


class ErrorBody(BaseModel):
    """OpenAI's error shape, the body of every 4xx and 5xx this server sends."""
    error: ErrorDetail


ERROR_MEANINGS = {
    400: "the request is invalid (the message and `param` name what and why)",
    401: "no valid API key (`Authorization: Bearer <key>`)",
    403: "the key may not do this (the engine's step records need the admin key)",
    404: "no such model (the `model` field names one this server does not serve)",
    413: "the request body is larger than max_body_bytes",
    415: "the request body is not JSON",
    429: "over the key's request rate or token quota (`Retry-After` says when to retry)",
    500: "the engine failed on this request",
    503: "the server is full (max_queue_depth) or shutting down (`Retry-After`)",
}


def error_responses(*codes: int) -> dict:
    """FastAPI's ``responses=`` for the error statuses an operation can return."""
    return {c: {"model": ErrorBody, "description": ERROR_MEANINGS[c]} for c in codes}
