"""Fuzzing the server: schemathesis against the app's own OpenAPI schema, then
hand-made bad inputs, over real HTTP (tiny model, CPU fp32, short generations).

* **schema-driven** (schemathesis 4): every operation in ``/openapi.json``, schema-valid
  ("positive") and schema-violating ("negative") requests, a bounded number of examples each,
  derandomized (the same examples every run), no example database. Checks: no 5xx, a documented
  content type (SSE checked by hand: see ``test_openapi_documents_the_event_stream``), the
  documented response schema, and every 4xx is OpenAI's error JSON.
* **hand-made**: malformed JSON, a wrong type for every field, huge integers, NaN/Infinity,
  nesting 10,000 deep, empty and non-object bodies: each a 4xx with OpenAI's error JSON, and the
  server serves a normal request afterwards.

Runs in seconds, not minutes (``MAX_EXAMPLES`` per operation and mode).
"""
from __future__ import annotations

import contextlib
import json
import time

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import positive_data_acceptance

from minillm.serving.server import ServerConfig, ServerThread

KEY = "sk-fuzz-0123456789abcdef"
# 400s no schema can foresee: the prompt's length once tokenized, and min_tokens against max_tokens
# (a comparison of two fields, which JSON Schema cannot state)
# code → param (None: any)
SEMANTIC_REFUSALS = {"context_length_exceeded": None, "invalid_request": "min_tokens"}
MAX_EXAMPLES = 30
# Every operation of the API. A new route must be added here (test_every_operation_is_fuzzed).
OPERATIONS = ["GET /health", "GET /v1/models", "GET /v1/models/{model_id}", "POST /tokenize",
              "POST /detokenize",
              "GET /v1/traces", "GET /v1/steps", "GET /v1/server-info", "POST /v1/completions",
              "POST /v1/chat/completions"]
# Operations with a body or parameters to break: the others have nothing a negative example can change.
NEGATIVE = [op for op in OPERATIONS if op.startswith("POST")]

FUZZ_SETTINGS = settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                         phases=[Phase.explicit, Phase.generate, Phase.shrink],
                         suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def server():
    # short generations (max_tokens_cap 4; max_model_len 128 bounds what a client may ask for)
    srv = ServerThread(ServerConfig(model="tiny", device="cpu", dtype="fp32", port=0, api_keys=[KEY],
                                    max_model_len=128, max_tokens_cap=4, max_batch_size=8,
                                    max_queue_depth=64)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def schema(server):
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


@pytest.fixture(scope="module")
def operations(schema) -> dict:
    return {op.label: op for op in (res.ok() for res in schema.get_all_operations())}


def requests_done(srv, timeout: float = 30.0) -> None:
    """Wait until uvicorn runs no request task. A 500 is logged with its traceback by the server
    thread *after* the response is sent (Starlette re-raises), and on CPython 3.11 formatting a
    traceback calls ``ast.parse``, whose recursion bookkeeping is shared between threads: pytest
    formatting a failure (also ``ast.parse``) at the same moment dies with "SystemError: AST
    constructor recursion depth mismatch" (an INTERNALERROR instead of the failure's report)."""
    tasks = getattr(getattr(getattr(srv, "_server", None), "server_state", None), "tasks", None)
    t_end = time.monotonic() + timeout
    while tasks and time.monotonic() < t_end:
        time.sleep(0.01)
    time.sleep(0.05)


@contextlib.contextmanager
def settled(srv):
    """Let the server finish (and log) before pytest reports a failure (see requests_done)."""
    try:
        yield
    except BaseException:
        requests_done(srv)
        raise


def settle(test):
    """``settled(server)`` around a whole test (its ``server`` argument)."""
    import functools

    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        with settled(kwargs["server"]):
            return test(*args, **kwargs)
    return wrapper


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def assert_openai_error_body(status: int, content: bytes, context: str = "") -> dict:
    """A 4xx body is OpenAI's error JSON: {"error": {"message", "type", "param", "code"}}."""
    assert 400 <= status < 500, (status, content[:300], context)
    err = json.loads(content)["error"]
    assert set(err) == {"message", "type", "param", "code"}, (err, context)
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["code"], str), err
    assert err["type"] in ("invalid_request_error", "rate_limit_error"), err
    return err


def assert_serves(srv) -> None:
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "still here?", "max_tokens": 2},
                   headers=auth(),
                   timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text


def _header(r, name: str) -> str:
    v = r.headers.get(name)
    return (v[0] if isinstance(v, list) else v) or ""


# ---- schema-driven -------------------------------------------------------------------------------

def test_every_operation_is_fuzzed(operations):
    assert sorted(operations) == sorted(OPERATIONS)


def _fuzz(server, operation, mode: GenerationMode) -> dict[int, int]:
    codes: dict[int, int] = {}

    @FUZZ_SETTINGS
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case):
        r = case.call(base_url=server.url, headers=auth(), timeout=60)
        codes[r.status_code] = codes.get(r.status_code, 0) + 1
        if _header(r, "content-type").startswith("text/event-stream"):
            # a stream: only for a body that asked for one, and it ends properly
            assert r.status_code == 200 and isinstance(case.body, dict) and case.body.get("stream") is True
            assert r.content.rstrip().endswith(b"data: [DONE]"), r.content[-300:]
        # every check schemathesis has; a schema-valid request refused (ST202) only for what the
        # schema cannot say: a prompt too long for the context once tokenized
        case.validate_response(r, headers=auth(), excluded_checks=[positive_data_acceptance])
        if mode == GenerationMode.POSITIVE and r.status_code == 400:
            err = json.loads(r.content)["error"]
            assert err["code"] in SEMANTIC_REFUSALS, (err, case.body)
            assert SEMANTIC_REFUSALS[err["code"]] in (None, err["param"]), (err, case.body)
        if 400 <= r.status_code < 500:
            assert_openai_error_body(r.status_code, r.content,
                                     f"{case.method} {case.path} {case.body!r:.300}")

    run()
    return codes


@pytest.mark.parametrize("label", OPERATIONS)
def test_schema_positive(server, operations, label):
    with settled(server):
        codes = _fuzz(server, operations[label], GenerationMode.POSITIVE)
    print(label, "positive", codes)
    assert codes and all(c < 500 for c in codes)


@pytest.mark.parametrize("label", NEGATIVE)
def test_schema_negative(server, operations, label):
    with settled(server):
        codes = _fuzz(server, operations[label], GenerationMode.NEGATIVE)
    print(label, "negative", codes)
    assert codes and all(400 <= c < 500 or c == 200 for c in codes)
    assert any(400 <= c < 500 for c in codes), "no negative example was refused"


def test_openapi_documents_the_event_stream(server):
    """The completion routes answer ``stream: true`` with text/event-stream; the schema should
    say so (clients generated from it, and schemathesis' content-type check, rely on it)."""
    spec = httpx.get(server.url + "/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        content = spec["paths"][path]["post"]["responses"]["200"].get("content", {})
        assert "text/event-stream" in content and "application/json" in content, (path, sorted(content))


def _check_query(r, params) -> None:
    assert r.status_code in (200, 400), (params, r.status_code, r.text[:300])
    if r.status_code == 400:
        err = assert_openai_error_body(r.status_code, r.content, repr(params))
        assert err["param"] in params, (err, params)


_QUERY_TEXT = st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=40)


@pytest.mark.parametrize("route", ["/v1/traces", "/v1/steps", "/v1/models"])
def test_query_parameters_fuzz(server, route):
    """The GET routes read their query parameters by hand (the schema declares none): any value
    is a 200 or a 400 naming the parameter, never a 5xx."""
    seen: dict[int, int] = {}
    with httpx.Client(timeout=60) as c:
        @settings(max_examples=60, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(params=st.dictionaries(st.sampled_from(["limit", "after", "request_id", "x"]),
                                      st.one_of(_QUERY_TEXT, st.integers(-10**30, 10**30).map(str),
                                                st.sampled_from(["²", "٣", "1e3", "0x1", " 1", "1 ", "+1",
                                                                 "9" * 5000])),
                                      max_size=3))
        def run(params):
            with settled(server):
                r = c.get(server.url + route, params=params, headers=auth())
                _check_query(r, params)
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
        run()
    print(route, seen)


@settle
def test_authorization_header_fuzz(server):
    """Any Authorization header other than the key: 401 with OpenAI's error JSON, never 5xx,
    and the header is never echoed."""
    with httpx.Client(timeout=60) as c:
        @settings(max_examples=60, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(value=st.one_of(st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7e),
                                       max_size=80),
                               st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7e),
                                       max_size=40)
                               .map(lambda s: "Bearer " + s)))
        def run(value):
            value = value.strip()            # a header value cannot start or end with blanks (RFC 9110)
            if value.strip() in (KEY, f"Bearer {KEY}") or value.strip().split(None, 1)[-1:] == [KEY]:
                return
            r = c.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                       headers={"Authorization": value})
            assert r.status_code == 401, (value, r.status_code, r.text[:200])
            err = assert_openai_error_body(r.status_code, r.content, repr(value))
            assert err["code"] == "invalid_api_key"
            if len(value.strip()) >= 8:
                assert value.strip() not in r.text
        run()


# ---- hand-made bad inputs -----------------------------------------------------------------------

CHAT_MSGS = [{"role": "user", "content": "hi"}]
INT_FIELDS = ["max_tokens", "top_k", "seed", "min_tokens", "n", "logprobs"]
WRONG_TYPES = {
    "int": ["1", 1.5, True, [], {}, [1]],
    "number": ["0.5", True, [], {}, [0.5]],
    "bool": ["true", 1, 0, [], {}],
    "str": [1, 1.5, True, [], {}, ["a"]],
    "stop": [1, True, {}, [1], [None], [["a"]], ["a"] * 5],
    "object": ["x", 1, [], True],
}
COMPLETION_FIELDS = {"prompt": "str", "model": "str", "max_tokens": "int", "temperature": "number",
                     "top_p": "number",
                     "top_k": "int", "seed": "int", "stop": "stop", "stream": "bool", "ignore_eos": "bool",
                     "include_stop_str_in_output": "bool", "min_tokens": "int", "n": "int", "user": "str",
                     "logprobs": "int", "stream_options": "object"}
CHAT_FIELDS = {**{k: v for k, v in COMPLETION_FIELDS.items() if k not in ("prompt", "logprobs")},
               "max_completion_tokens": "int", "logprobs": "bool", "top_logprobs": "int"}


def _typed_cases():
    out = []
    for chat, fields in ((False, COMPLETION_FIELDS), (True, CHAT_FIELDS)):
        for name, kind in fields.items():
            for v in WRONG_TYPES[kind]:
                base = {"messages": CHAT_MSGS} if chat else {"prompt": "hi"}
                body = {**base, "max_tokens": 2, name: v}
                if name == "stream_options":
                    body["stream"] = True
                if name == "top_logprobs":
                    body["logprobs"] = True
                path = "/v1/chat/completions" if chat else "/v1/completions"
                out.append(pytest.param(path, json.dumps(body).encode(), name,
                                        id=f"{'chat' if chat else 'cmpl'}-{name}-{json.dumps(v)[:12]}"))
    for v in (1, None, [], {}, "x", [{"role": "user"}], [{"content": "x"}],
              [{"role": "robot", "content": "x"}],
              [{"role": "user", "content": 5}],
              [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
              [{"role": "user", "content": [{"type": "text", "text": 5}]}], ["hi"]):
        out.append(pytest.param("/v1/chat/completions",
                                json.dumps({"messages": v, "max_tokens": 2}).encode(), None,
                                id=f"chat-messages-{json.dumps(v)[:20]}"))
    return out


def _huge_cases():
    out = []
    for path, base in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": CHAT_MSGS})):
        short = "cmpl" if "chat" not in path else "chat"
        fields = ["max_tokens", "seed", "min_tokens", "n", "temperature", "top_p"] + (
            ["max_completion_tokens", "top_logprobs"] if short == "chat" else ["logprobs"])
        for name in fields:
            for sign in (1, -1):
                body = {**base, "max_tokens": 2, name: sign * 10**400}
                if name == "top_logprobs":
                    body["logprobs"] = True
                marks = []
                out.append(pytest.param(path, json.dumps(body).encode(), name, marks=marks,
                                        id=f"{short}-{name}-{'+' if sign > 0 else '-'}1e400"))
    return out


def _nonfinite_cases():
    """Python's json reads NaN, Infinity and -Infinity (not JSON, but accepted): a number field
    given one must be refused like any other bad value."""
    out = []
    for token in ("NaN", "Infinity", "-Infinity"):
        for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "min_tokens", "logprobs", "n"):
            raw = f'{{"prompt": "hi", "max_tokens": 2, "{name}": {token}}}'.encode()
            out.append(pytest.param("/v1/completions", raw, name, id=f"cmpl-{name}-{token}"))
        raw = (f'{{"messages": [{{"role": "user", "content": "hi"}}], "max_tokens": 2, '
               f'"temperature": {token}}}').encode()
        out.append(pytest.param("/v1/chat/completions", raw, "temperature", id=f"chat-temperature-{token}"))
        out.append(pytest.param("/detokenize", f'{{"tokens": [1, {token}]}}'.encode(), "tokens",
                                id=f"detokenize-{token}"))
    return out


MALFORMED = [b"", b" ", b"{", b"}", b"{]", b'{"prompt": "hi",}', b"{'prompt': 'hi'}",
             b'{"prompt": "hi"} trailing',
             b"\xff\xfe\x00\x00", b'{"prompt": "\xff\xfe"}', b"[]", b"[1, 2, 3]", b'[{"prompt": "hi"}]',
             b"null",
             b"true", b"1", b'"prompt"', b"[" * 10_000 + b"]" * 10_000,
             b'{"a": ' * 10_000 + b"1" + b"}" * 10_000,
             b'{"prompt": "hi", "x": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
             b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
             b'{"prompt": "hi", "max_tokens": 1e400}',
             b'{"\\ud800": 1, "prompt": "hi"}', b'{"prompt": "hi", "stop": ["\\udfff"]}']


IGNORED_BY_TOKENIZE = (b'{"prompt": "hi", "max_tokens": 1e400}',)    # a field /tokenize does not read


@pytest.mark.parametrize("path,raw", [
    pytest.param(path, raw, id=f"{path}-{raw[:24]!r}")
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize") for raw in MALFORMED
    if not (path in ("/tokenize", "/detokenize") and raw in IGNORED_BY_TOKENIZE)])
@settle
def test_malformed_bodies_are_4xx(server, path, raw):
    r = httpx.post(server.url + path, content=raw, headers={**auth(), "Content-Type": "application/json"},
                   timeout=60)
    assert_openai_error_body(r.status_code, r.content, repr(raw[:60]))
    assert r.status_code in (400, 404, 413), r.status_code


@pytest.mark.parametrize("path,raw,param", _typed_cases() + _huge_cases() + _nonfinite_cases())
@settle
def test_bad_field_values_are_400_naming_the_field(server, path, raw, param):
    r = httpx.post(server.url + path, content=raw, headers={**auth(), "Content-Type": "application/json"},
                   timeout=60)
    assert r.status_code != 500, r.text[:300]
    err = assert_openai_error_body(r.status_code, r.content, repr(raw[:120]))
    assert r.status_code == 400, (r.status_code, err)
    if param is None or param == "min_tokens":        # min_tokens > max_tokens: found late, param null
        return
    named = {param, "stream_options"}                 # include_usage is named as such
    if err["code"] == "context_length_exceeded":      # the length asked for, or the prompt that fills it
        named |= {"max_tokens", "prompt", "messages"}  # (max_completion_tokens is named max_tokens)
    assert (err["param"] is not None
            and err["param"].split(".")[0].split("[")[0] in named | {"include_usage"}), err


@settle
def test_the_server_serves_after_all_that(server):
    assert_serves(server)
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"messages": CHAT_MSGS, "max_tokens": 2, "stream": True},
                   headers=auth(), timeout=60)
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    t_end = time.monotonic() + 30
    while not server.state.idle():
        assert time.monotonic() < t_end, server.state.stats()
        time.sleep(0.02)
    assert server.state.loop.failures == 0 and server.state.loop.alive
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
