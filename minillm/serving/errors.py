"""The gateway's one error type: an HTTP status, an OpenAI-style code and a message that names the
limit that was hit, so a client can tell "fix your request" (4xx) from "come back later" (429/503
with ``Retry-After``)."""
from __future__ import annotations

import json
import math
import re
import sys
from typing import Any, Mapping

# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------

def _default_error_type(status: int) -> str:
    # The "type" field of OpenAI's error JSON. 429 and 5xx get their own types so that a client
    # can decide to retry from the body alone; every other 4xx means "the request is wrong".
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


class GatewayError(Exception):
    """A request turned away by the gateway.

    ``status`` is the HTTP status, ``code`` a stable machine-readable reason (``invalid_api_key``,
    ``rate_limited``, ``queue_full``, ``invalid_request``, ``context_length_exceeded``,
    ``model_not_found``, ``request_too_large``), ``param`` the offending request field if any,
    and ``headers`` extra response headers (``Retry-After`` for 429/503).
    """

    def __init__(self, status: int, code: str, message: str, *, param: str | None = None,
                 headers: Mapping[str, str] | None = None, type: str | None = None) -> None:
        message = message if len(message) <= 500 else message[:497] + "..."   # never echo a huge value back
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.headers: dict[str, str] = dict(headers or {})
        self.type = type or _default_error_type(status)

    def to_openai_error(self) -> dict[str, Any]:
        """The JSON body OpenAI-compatible clients expect."""
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}

    def __repr__(self) -> str:
        return f"GatewayError(status={self.status}, code={self.code!r}, message={self.message!r})"


def invalid(param: str | None, message: str) -> GatewayError:
    return GatewayError(400, "invalid_request", message, param=param)


def parse_json_body(raw: bytes | str) -> Any:
    """The body as JSON, or a 400 that says where it broke, in the client's terms (line and
    column), never Python's exception text."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise invalid(None, "The request body is not valid JSON: it is nested too deeply.") from None
    except json.JSONDecodeError as e:
        raise invalid(None, f"The request body is not valid JSON: {e.msg.lower()} at line {e.lineno}, "
                            f"column {e.colno}.") from None
    except ValueError:   # bytes that are not UTF-8/16/32, or an integer too long for int()
        long_int = _long_integer(raw)
        if long_int is not None:
            raise long_int from None
        raise invalid(None, "The request body is not valid JSON: it is not UTF-8 text.") from None


class _LongInteger(ValueError):
    def __init__(self, literal: str) -> None:
        super().__init__(literal)
        self.literal = literal


def _strict_int(literal: str) -> int:
    try:
        return int(literal)
    except ValueError:
        raise _LongInteger(literal) from None


def _long_integer(raw: bytes | str) -> GatewayError | None:
    """The 400 for a body whose integer has more digits than ``int()`` reads
    (``sys.get_int_max_str_digits()``, 4300 by default): valid JSON, so the client is told which
    number and where, not that the text is broken. None when that is not the problem. Runs only
    after a failed parse: the happy path keeps the C parser's own integers."""
    try:
        text = raw.decode(json.detect_encoding(raw), "surrogatepass") if isinstance(raw, bytes) else raw
        json.loads(text, parse_int=_strict_int)
        return None
    except _LongInteger as e:
        literal = e.literal
    except (ValueError, RecursionError):
        return None
    # where: the first occurrence standing alone (not inside a longer number or a word)
    m = re.search(rf"(?<![\w.+-]){re.escape(literal)}(?![\w.])", text)
    at = m.start() if m else text.find(literal)
    line, column = text.count("\n", 0, at) + 1, at - text.rfind("\n", 0, at)
    limit = sys.get_int_max_str_digits() if hasattr(sys, "get_int_max_str_digits") else 0
    return invalid(None, f"The request body has an integer of {len(literal.lstrip('-'))} digits at line "
                         f"{line}, column {column}; this server reads integers of at most {limit} digits.")


def retry_after(seconds: float) -> dict[str, str]:
    # Retry-After is an integer number of seconds (RFC 9110). Round *up*, and never say 0:
    # a client told "retry in 0 s" would hammer us in a tight loop.
    return {"Retry-After": str(max(1, math.ceil(seconds)))}
