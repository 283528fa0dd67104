"""The request bodies of the API, declared as Pydantic models: they are the OpenAPI schema that
``/docs`` shows and that the fuzzing test (schemathesis) generates requests from.

Validation itself stays in the gateway (``minillm.serving.validation.parse_completion_body``): it
names the offending field in an OpenAI-style 400, checks sampling values with the engine's own
rules, and runs after authentication, so a stranger learns nothing about a body. A test keeps
the two in step: every field declared here is one the gateway reads or refuses by name.
"""
from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")     # unknown OpenAI fields: ignored, or refused by name


class StreamOptions(BaseModel):
    include_usage: bool | None = None


class _Sampling(_Body):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="vLLM's extension; -1 or 0: off")
    seed: int | None = None
    stop: Union[str, list[str], None] = None
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


class ChatCompletionBody(_Sampling):
    messages: list[Message] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)


class TokenizeBody(_Body):
    model: str | None = None
    prompt: str | None = Field(None, description="text to tokenize (or messages)")
    messages: list[Message] | None = None
    add_special_tokens: bool | None = True


class DetokenizeBody(_Body):
    model: str | None = None
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


def request_body(model: type[BaseModel]) -> dict:
    """``openapi_extra`` for a route that reads its body itself."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline_schema(model)}}}}
