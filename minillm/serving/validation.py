"""The request body, validated: a completion or chat body becomes a :class:`CompletionRequest` or a
:class:`~minillm.serving.errors.GatewayError` that names the field and the limit."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minillm.serving.errors import GatewayError, invalid

# ---------------------------------------------------------------------------------------------
# Validation: the request body
# ---------------------------------------------------------------------------------------------

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP = 4                                         # OpenAI's limit on stop sequences

Message = dict[str, str]


STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")   # OpenAI's, and vLLM's per-chunk counts


@dataclass
class CompletionRequest:
    """A validated, normalised ``/v1/completions`` or ``/v1/chat/completions`` body.

    ``prompt`` is the text for a completion, or the list of ``{"role", "content"}`` messages for
    a chat (the server applies the chat template). ``max_tokens`` stays ``None`` when the client
    did not ask: the gateway picks a default that fits the context (:func:`default_max_tokens`).
    ``model`` ``None`` means "the served model".
    """
    prompt: str | list[Message]
    chat: bool = False
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                   # -1: off (vLLM's convention)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False       # stream_options.include_usage: a final chunk with token counts
    continuous_usage: bool = False    # stream_options.continuous_usage_stats (vLLM's): counts on every chunk
    ignore_eos: bool = False          # benchmarks: generate exactly max_tokens (chapter 10.6)
    include_stop_str_in_output: bool = False   # vLLM's: keep the matched stop string in the text
    n: int = 1
    user: str | None = None
    # logprobs, min_tokens: SamplingParams' names
    extra_sampling: dict[str, Any] = field(default_factory=dict)


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)      # True is an int in Python; not here


def integral(x: Any) -> Any:
    """A JSON number with no fractional part (``1324.0``) as the integer JSON Schema says it is;
    anything else unchanged, for the field's own check to judge."""
    if isinstance(x, float) and x.is_integer() and abs(x) < 2**63:
        return int(x)
    return x


INT_FIELDS = ("max_tokens", "max_completion_tokens", "top_k", "seed", "min_tokens", "n", "logprobs",
              "top_logprobs")


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _get_int(body: dict, name: str, *, minimum: int | None = None) -> int | None:
    v = integral(body.get(name))
    if v is None:
        return None
    if not is_int(v):
        raise invalid(name, f"'{name}' must be an integer, got {type(v).__name__} {v!r}.")
    if minimum is not None and v < minimum:
        raise invalid(name, f"'{name}' must be at least {minimum}, got {v}.")
    return v


def _get_bool(body: dict, name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise invalid(name, f"'{name}' must be a boolean, got {type(v).__name__} {v!r}.")
    return v


def _get_str(body: dict, name: str) -> str | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, str):
        raise invalid(name, f"'{name}' must be a string, got {type(v).__name__} {v!r}.")
    return v


def _parse_prompt(body: dict) -> str:
    p = body.get("prompt")
    if p is None or p == "":
        raise invalid("prompt", "'prompt' is required and must be a non-empty string.")
    if isinstance(p, list):
        # The OpenAI API allows a batch of prompts (or token ids) in one request. minillm serves
        # one prompt per request so that one request has one trace and one set of metrics.
        if p and all(isinstance(x, str) for x in p):
            raise invalid("prompt", f"Batched prompts are not supported: 'prompt' is a list of {len(p)} "
                                     "strings; send one request per prompt.")
        raise invalid("prompt",
                      "'prompt' must be a single string; lists (batches, token ids) are not supported.")
    if not isinstance(p, str):
        raise invalid("prompt", f"'prompt' must be a string, got {type(p).__name__}.")
    return p


def _message_content(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        # The newer "content parts" form: [{"type": "text", "text": "..."}, ...]. Text only.
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise invalid(f"{param}[{j}]",
                              "Only text content parts ({'type': 'text', 'text': ...}) are supported.")
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(param, f"'{param}' must be a string, got {type(content).__name__}.")


def parse_messages(body: dict) -> list[Message]:
    msgs = body.get("messages")
    if msgs is None or msgs == []:
        raise invalid("messages", "'messages' is required and must be a non-empty list.")
    if not isinstance(msgs, list):
        raise invalid("messages", f"'messages' must be a list of messages, got {type(msgs).__name__}.")
    out: list[Message] = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(where, f"'{where}' must be an object with 'role' and 'content'.")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise invalid(f"{where}.role",
                          f"'{where}.role' must be one of {', '.join(CHAT_ROLES)}; got {role!r}.")
        if m.get("tool_calls") not in (None, []):     # before content: such a message often has none
            raise invalid(f"{where}.tool_calls",
                          f"'{where}.tool_calls' is not supported: this server does no "
   "function calling (no 'tools'), so a conversation cannot hold tool calls.")
        if "content" not in m or m["content"] is None:
            raise invalid(f"{where}.content", f"'{where}.content' is required.")
        out.append({"role": role, "content": _message_content(m["content"], f"{where}.content")})
    return out


def _parse_stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list):
        raise invalid("stop", f"'stop' must be a string or a list of strings, got {type(stop).__name__}.")
    if len(stop) > MAX_STOP:
        raise invalid("stop", f"'stop' may hold at most {MAX_STOP} sequences, got {len(stop)}.")
    return list(stop)             # its strings are checked with the other sampling fields


def undecodable_text(body: Any) -> str | None:
    """The path of the first string that is not valid Unicode text (JSON allows lone surrogate
    escapes such as "\\ud800", which no tokenizer can encode), or None. Iterative: a deeply
    nested body cannot blow the stack here."""
    todo: list[tuple[str, Any]] = [("", body)]
    while todo:
        path, v = todo.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(v, dict):
            for k, x in v.items():
                todo.append((f"{path}.{k}" if path else str(k), x))
                todo.append((path or "body", k))
        elif isinstance(v, list):
            todo.extend((f"{path}[{i}]", x) for i, x in enumerate(v))
    return None


# OpenAI fields this server does not implement, with the values that mean "not used". A body
# that sets one to anything else gets a 400 naming it: silently ignoring a penalty or a
# response_format would return something other than what the client asked for.
UNSUPPORTED_UNLESS_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "echo": (False,), "best_of": (1,), "suffix": ("",),
    "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
    "logit_bias": ({},), "response_format": ({"type": "text"},), "tools": ([],), "tool_choice": ("none",),
    "functions": ([],), "function_call": ("none",), "parallel_tool_calls": (False,),
    "prompt_logprobs": (0,), "min_p": (0, 0.0), "guided_json": (), "guided_regex": (), "guided_choice": (),
    "guided_grammar": (), "modalities": (["text"],), "audio": (), "prediction": (),
}


def _check_unsupported(body: dict) -> None:
    for name, neutral in UNSUPPORTED_UNLESS_NEUTRAL.items():
        v = body.get(name)
        # JSON's equality: 1 and 1.0 are one number, but true is not 1
        if v is not None and not any(v == n and isinstance(v, bool) == isinstance(n, bool) for n in neutral):
            raise invalid(name, f"'{name}' is not supported by this server (got {v!r}); leave it out or "
                                 f"use its neutral value{'s' if len(neutral) > 1 else ''} "
                                 f"{', '.join(map(repr, neutral)) or 'null'}."[:300])


def parse_completion_body(body: Any, *, chat: bool) -> CompletionRequest:
    """Validate a decoded JSON body; raise 400 ``invalid_request`` naming the bad field.

    Unknown fields are ignored (clients send many optional OpenAI fields), but every field
    minillm does use is checked here, at the door, so the engine never sees a bad value and a
    client gets a 400 naming its mistake instead of a 500 from deep inside sampling. Sampling
    fields are checked by ``SamplingParams``'s own rules (see :func:`_parse_sampling`).
    """
    if not isinstance(body, dict):
        raise invalid(None, f"The request body must be a JSON object, got {type(body).__name__}.")
    bad = undecodable_text(body)
    if bad is not None:
        raise invalid(bad, f"'{bad}' holds text that is not valid Unicode (a lone surrogate escape?).")
    _check_unsupported(body)

    prompt: str | list[Message] = parse_messages(body) if chat else _parse_prompt(body)

    model = _get_str(body, "model")
    if model == "":
        raise invalid("model", "'model' must be a non-empty string (or omitted).")

    sampling = _parse_sampling(body, chat)

    n = _get_int(body, "n")
    if n is not None and n != 1:
        raise invalid("n", f"Only n=1 is supported (one completion per request), got n={n}.")

    stream = _get_bool(body, "stream")
    include_usage = continuous_usage = False
    opts = body.get("stream_options")
    if opts is not None:
        if not stream:
            raise invalid("stream_options", "'stream_options' is only allowed when 'stream' is true.")
        if not isinstance(opts, dict):
            raise invalid("stream_options", "'stream_options' must be an object.")
        unknown = sorted(set(opts) - set(STREAM_OPTIONS))
        if unknown:
            raise invalid(f"stream_options.{unknown[0]}",
                          f"'stream_options.{unknown[0]}' is not supported (supported: "
                          f"{', '.join(STREAM_OPTIONS)}).")
        include_usage = _get_bool(opts, "include_usage")
        continuous_usage = _get_bool(opts, "continuous_usage_stats")

    return CompletionRequest(prompt=prompt, chat=chat, model=model, stream=stream,
                             include_usage=include_usage,
                             continuous_usage=continuous_usage,
                             n=1, user=_get_str(body, "user"),
                             extra_sampling=_parse_logprobs_min_tokens(body, chat),
                             **sampling)


def _parse_logprobs_min_tokens(body: dict, chat: bool) -> dict[str, Any]:
    """``logprobs`` (completions: an integer, the top-N alternatives; chat: a boolean, with
    ``top_logprobs`` the N) and ``min_tokens`` (vLLM's), as SamplingParams fields."""
    out: dict[str, Any] = {}
    if chat:
        want = _get_bool(body, "logprobs")
        top = body.get("top_logprobs")
        if top is not None and not want:
            raise invalid("top_logprobs", "'top_logprobs' needs 'logprobs': true.")
        if want:
            out["logprobs"] = 0 if top is None else top
            _check_sampling_field("top_logprobs", "logprobs", out["logprobs"])
    elif body.get("logprobs") is not None:
        out["logprobs"] = body["logprobs"]
        _check_sampling_field("logprobs", "logprobs", out["logprobs"])
    if body.get("min_tokens") is not None:   # against max_tokens: when SamplingParams is built
        out["min_tokens"] = _get_int(body, "min_tokens", minimum=0)
    return out


# Body fields that are SamplingParams fields of the same name and meaning (vLLM's extensions
# top_k, ignore_eos and include_stop_str_in_output included). ``stop`` and ``max_tokens`` are
# sampling fields too, with rules of the API's own first (a list of at most 4; an alias).
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "ignore_eos", "include_stop_str_in_output")


def _parse_sampling(body: dict, chat: bool) -> dict[str, Any]:
    """The sampling fields of a body, validated by ``SamplingParams``'s one validation function
    (``minillm.engine.sampling.sampling_problems``), so that the gateway and the engine can never
    disagree on what is valid. A missing or null field takes SamplingParams's default, except
    ``max_tokens``, which stays None (the gateway picks a default that fits the context)."""
    max_tokens = None
    for key in INT_FIELDS:
        if isinstance(body.get(key), float):
            body[key] = integral(body[key])
    # The chat API renamed max_tokens to max_completion_tokens; the new name wins (as in vLLM).
    for key in ("max_tokens", "max_completion_tokens") if chat else ("max_tokens",):
        if body.get(key) is not None:
            _check_sampling_field(key, "max_tokens", body[key])
            max_tokens = body[key]
    given = {name: body[name] for name in _SAMPLING_FIELDS if body.get(name) is not None}
    for name, value in given.items():
        _check_sampling_field(name, name, value)
    stop = _parse_stop(body)
    _check_sampling_field("stop", "stop", stop)
    for name in ("temperature", "top_p"):
        if name in given:
            given[name] = float(given[name])          # JSON's 1 is the float 1.0 here
    return {**given, "stop": stop, "max_tokens": max_tokens}


def _check_sampling_field(key: str, name: str, value: Any) -> None:
    """400 naming body field ``key`` if SamplingParams rejects ``value`` for its field ``name``.

    One field at a time, on top of the defaults (all valid), so each problem belongs to the
    field that was set; the message is SamplingParams's own."""
    from minillm.engine.sampling import (  # lazy: it imports torch
        SamplingParams,
        sampling_problems,
    )
    probe = SamplingParams()              # the defaults, all valid...
    setattr(probe, name, value)           # ...with one field set, unchecked: the check is next
    problems = sampling_problems(probe)
    if problems:
        message = problems[0] if key == name else problems[0].replace(name, key, 1)
        raise invalid(key, f"Invalid '{key}': {message}.")


def check_model(name: str | None, served: list[str]) -> str:
    """Return the model to use (``None`` means the first served model), or raise 404."""
    if name is None:
        return served[0]
    if name not in served:
        raise GatewayError(404, "model_not_found",
                           f"The model '{name[:100]}' does not exist. Available models: {', '.join(served)}.",
                           param="model")
    return name


def check_context(prompt_tokens: int, max_tokens: int, max_model_len: int,
                  prompt_param: str = "prompt") -> None:
    """Raise 400 ``context_length_exceeded`` if prompt + output would not fit the KV cache
    positions the model has. Checked here, before queueing, because finding out after a long
    prefill would waste the prefill and the client's time. The error names the field to change:
    the prompt (``prompt_param``: 'prompt', or 'messages' for a chat) when it alone leaves no room
    for one output token, else max_tokens."""
    check_prompt_fits(prompt_tokens, max_model_len, prompt_param)
    total = prompt_tokens + max_tokens
    if total > max_model_len:
        raise GatewayError(
            400, "context_length_exceeded",
            f"This model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{prompt_tokens} tokens and max_tokens asks for {max_tokens} more ({total} in total). "
            f"Reduce the prompt or max_tokens.", param="max_tokens")


def check_prompt_fits(prompt_tokens: int, max_model_len: int, prompt_param: str = "prompt") -> None:
    """Raise 400 ``context_length_exceeded``, naming the prompt, if it leaves no room for one
    output token: no max_tokens could make that request fit."""
    if prompt_tokens >= max_model_len:
        raise GatewayError(
            400, "context_length_exceeded",
            f"This model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{prompt_tokens} tokens, which leaves no room for any output token. Reduce the prompt.",
            param=prompt_param)


def default_max_tokens(prompt_tokens: int, max_model_len: int, cap: int = 256,
                       prompt_param: str = "prompt") -> int:
    """``max_tokens`` for a request that did not set it: what is left of the context, at most ``cap``.

    (The OpenAI completions API defaults to 16; vLLM to "the rest of the context". A cap keeps
    one forgetful client from holding a batch slot for thousands of steps.)
    """
    check_prompt_fits(prompt_tokens, max_model_len, prompt_param)
    return min(cap, max_model_len - prompt_tokens)
