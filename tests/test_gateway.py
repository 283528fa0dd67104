"""The gateway (chapter 10.1): every rejection with its status, code and message, and the
trace events of an admitted and a rejected request. Pure logic: no HTTP, no engine, a fake clock."""
from __future__ import annotations

import hmac
import threading

import pytest

from minillm.core.trace import Trace
from minillm.serving import auth as auth_module
from minillm.serving import validation
from minillm.serving.admission import AdmissionControl
from minillm.serving.auth import APIKeyAuth, keys_from_env_and_args
from minillm.serving.errors import GatewayError
from minillm.serving.gateway import Gateway
from minillm.serving.rate_limit import RateLimiter, TokenBucket
from minillm.serving.validation import check_context, check_model, default_max_tokens, parse_completion_body

KEY = "sk-test-Very-Secret-0123456789"
OTHER = "sk-other-Also-Secret-9876543210"


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def words(req) -> list[int]:
    """A stand-in tokenizer: one token per whitespace-separated word."""
    text = req.prompt if isinstance(req.prompt, str) else " ".join(m["content"] for m in req.prompt)
    return [len(w) for w in text.split()]


def make_gateway(*, keys=(KEY,), limiter=None, admission=None, max_model_len=64, **kw) -> Gateway:
    return Gateway(APIKeyAuth(keys), limiter, admission, ["tiny", "tiny-chat"], max_model_len, words, **kw)


def raises(fn, status: int, code: str, *, param=..., match: str | None = None) -> GatewayError:
    with pytest.raises(GatewayError) as ei:
        fn()
    e = ei.value
    assert (e.status, e.code) == (status, code), repr(e)
    if param is not ...:
        assert e.param == param, repr(e)
    if match is not None:
        assert match in e.message, e.message
    return e


# ---- errors ------------------------------------------------------------------------------

def test_error_has_openai_shape():
    e = GatewayError(429, "rate_limited", "slow down", headers={"Retry-After": "3"}, param=None)
    assert e.to_openai_error() == {"error": {"message": "slow down", "type": "rate_limit_error",
                                             "param": None, "code": "rate_limited"}}
    assert GatewayError(400, "invalid_request", "x",
                        param="top_p").to_openai_error()["error"]["param"] == "top_p"
    assert GatewayError(503, "queue_full", "x").type == "server_error"
    assert GatewayError(401, "invalid_api_key", "x").type == "invalid_request_error"
    assert str(e) == "slow down"


# ---- authentication ----------------------------------------------------------------------

def test_auth_accepts_bearer_and_returns_an_alias_not_the_key_nor_its_hash():
    import hashlib
    auth = APIKeyAuth([KEY, OTHER], admin_key="sk-admin-Xx-0000")
    kid = auth.check(f"Bearer {KEY}")
    assert kid == "key-1" and KEY not in kid
    assert hashlib.sha256(KEY.encode()).hexdigest()[:8] not in repr(auth)  # no fingerprint to test guesses on
    assert auth.check(f"bearer   {OTHER}  ") == "key-2"                    # scheme is case-insensitive
    assert auth.check("Bearer sk-admin-Xx-0000") == "admin" and auth.has_admin
    assert not auth.open
    with pytest.raises(ValueError, match="admin key must differ"):
        APIKeyAuth([KEY], admin_key=KEY)


@pytest.mark.parametrize("header, fragment", [
    (None, "Missing API key"),
    ("", "Missing API key"),
    (KEY, "Malformed Authorization header"),               # no scheme
    (f"Basic {KEY}", "Malformed Authorization header"),
    ("Bearer", "Malformed Authorization header"),
    ("Bearer sk-wrong", "Incorrect API key"),
    (f"Bearer {KEY}x", "Incorrect API key"),
    (f"Bearer {KEY[:-1]}", "Incorrect API key"),
])
def test_auth_rejects_with_401(header, fragment):
    e = raises(lambda: APIKeyAuth([KEY]).check(header), 401, "invalid_api_key", match=fragment)
    # The presented credential is never echoed back (it may be a real key in the wrong format).
    assert KEY not in e.message and KEY[:-1] not in e.message and "sk-wrong" not in e.message


def test_auth_compares_every_key_in_constant_time(monkeypatch):
    calls = []
    real = hmac.compare_digest

    def counting(a, b):
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(auth_module.hmac, "compare_digest", counting)
    auth = APIKeyAuth([KEY, OTHER, "sk-third-key"])
    assert auth.check(f"Bearer {KEY}") == "key-1"                     # the first key matches...
    assert len(calls) == 3                                            # ...and all three are compared
    assert all(a == b == 32 for a, b in calls)                        # equal-length digests, not raw keys
    calls.clear()
    with pytest.raises(GatewayError):
        auth.check("Bearer nope")
    assert len(calls) == 3


def test_auth_open_when_no_keys():
    for keys in (None, []):
        auth = APIKeyAuth(keys)
        assert auth.open and auth.check(None) == "anonymous" and auth.check("Bearer whatever") == "anonymous"
    with pytest.raises(ValueError):
        APIKeyAuth(["  "])                                            # an empty key must not open the door


def test_key_never_in_repr_or_attributes():
    auth = APIKeyAuth([KEY, OTHER])
    text = repr(auth) + str(vars(auth)) + repr(make_gateway(keys=[KEY, OTHER]))
    assert KEY not in text and OTHER not in text
    assert "key-1" in repr(auth)


def test_keys_from_env_and_args():
    assert keys_from_env_and_args(None, env={}) == []
    assert keys_from_env_and_args(None, env={"MINILLM_API_KEY": ""}) == []
    assert keys_from_env_and_args("a, b", env={"MINILLM_API_KEY": "c,a"}) == ["a", "b", "c"]
    assert keys_from_env_and_args(["a", "d,e"], env={}) == ["a", "d", "e"]


# ---- rate limiting -----------------------------------------------------------------------

def test_token_bucket_take_wait_and_refill():
    clock = FakeClock()
    b = TokenBucket(rate_per_s=2.0, capacity=4, clock=clock)
    assert b.try_take(3) == 0.0
    assert b.try_take(3) == pytest.approx(1.0)        # 1 left, needs 2 more at 2/s
    assert b.available == pytest.approx(1.0)          # a failed take takes nothing
    clock.advance(1.0)
    assert b.try_take(3) == 0.0
    clock.advance(100)
    assert b.available == pytest.approx(4.0)          # never above capacity
    with pytest.raises(ValueError, match="never fit"):
        b.try_take(5)
    clock.t -= 50                                     # a clock going backwards does not refill or drain
    assert b.try_take(4) == 0.0 and b.try_take(1) > 0


def test_rate_limit_requests_per_second_429_then_ok_after_wait():
    clock = FakeClock()
    lim = RateLimiter(requests_per_s=2, tokens_per_min=None, clock=clock)   # burst defaults to 2
    lim.check("key-a", 10)
    lim.check("key-a", 10)
    e = raises(lambda: lim.check("key-a", 10), 429, "rate_limited", match="2 requests per second")
    assert e.headers["Retry-After"] == "1"                     # 0.5 s → ceil → 1, never 0
    lim.check("key-b", 10)                                     # another caller has its own bucket
    clock.advance(0.5)
    lim.check("key-a", 10)


def test_rate_limit_tokens_per_minute_429_with_retry_after():
    clock = FakeClock()
    lim = RateLimiter(requests_per_s=None, tokens_per_min=600, clock=clock)  # 10 tokens/s
    lim.check("k", 500)
    e = raises(lambda: lim.check("k", 200), 429, "rate_limited", match="600 tokens per minute")
    assert "200 tokens" in e.message
    assert e.headers["Retry-After"] == "10"                    # 100 missing at 10/s
    clock.advance(9.0)
    with pytest.raises(GatewayError):
        lim.check("k", 200)
    clock.advance(1.0)
    lim.check("k", 200)


def test_rate_limit_request_larger_than_a_minute_is_400():
    lim = RateLimiter(tokens_per_min=100, clock=FakeClock())
    e = raises(lambda: lim.check("k", 101), 400, "request_too_large", match="100 tokens per minute")
    assert "Retry-After" not in e.headers


def test_rate_limit_refunds_request_token_when_token_bucket_fails():
    clock = FakeClock()
    # One request per 1000 s: a lost request token would not come back within this test.
    lim = RateLimiter(requests_per_s=0.001, tokens_per_min=60, burst=1, clock=clock)
    lim._buckets_for("k").tokens.try_take(60)                 # empty the token bucket
    raises(lambda: lim.check("k", 30), 429, "rate_limited", match="60 tokens per minute")
    # The token bucket said no, so the request bucket must still hold its one request...
    assert lim._buckets_for("k").requests.available == pytest.approx(1.0, abs=1e-6)
    clock.advance(30)                                          # 30 tokens back at 1 token/s
    lim.check("k", 30)                                         # ...and this passes at once
    raises(lambda: lim.check("k", 1), 429, "rate_limited", match="requests per second")


def test_rate_limit_none_disables():
    lim = RateLimiter(None, None)
    assert not lim.enabled
    for _ in range(1000):
        lim.check("k", 10 ** 9)


# ---- validation --------------------------------------------------------------------------

def test_parse_completion_normalises():
    r = parse_completion_body({"prompt": "hi", "model": "tiny", "max_tokens": 8, "temperature": 0,
                               "top_k": 5, "seed": 3, "stop": "\n", "stream": True,
                               "stream_options": {"include_usage": True}, "ignore_eos": True,
                               "user": "u1", "logprobs": None, "frequency_penalty": 0}, chat=False)
    assert (r.prompt, r.model, r.max_tokens, r.temperature, r.top_k, r.seed) == ("hi", "tiny", 8, 0.0, 5, 3)
    assert r.stop == ["\n"] and r.stream and r.include_usage and r.ignore_eos and r.user == "u1"
    d = parse_completion_body({"prompt": "hi"}, chat=False)
    assert (d.max_tokens, d.temperature, d.top_p, d.top_k, d.stop, d.stream,
            d.model) == (None, 1.0, 1.0, -1, [], False, None)


def test_parse_chat_messages():
    r = parse_completion_body({"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "he"}, {"type": "text", "text": "llo"}],
         "name": "x"},
    ], "max_completion_tokens": 5, "max_tokens": 9}, chat=True)
    assert r.chat and r.prompt == [{"role": "system", "content": "be brief"},
                                   {"role": "user", "content": "hello"}]
    assert r.max_tokens == 5                                   # the new name wins


@pytest.mark.parametrize("body, param, fragment", [
    ({}, "prompt", "required"),
    ({"prompt": ""}, "prompt", "required"),
    ({"prompt": ["a", "b"]}, "prompt", "Batched prompts are not supported"),
    ({"prompt": [1, 2, 3]}, "prompt", "single string"),
    ({"prompt": 5}, "prompt", "string"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "≥ 1"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens", "integer"),      # bool is not an int
    ({"prompt": "x", "max_tokens": 4.5}, "max_tokens", "integer"),      # 4.0 is an integer (JSON Schema)
    ({"prompt": "x", "max_tokens": "4"}, "max_tokens", "integer"),
    ({"prompt": "x", "temperature": -0.1}, "temperature", "[0, 100]"),
    ({"prompt": "x", "temperature": 101}, "temperature", "[0, 100]"),
    ({"prompt": "x", "temperature": float("nan")}, "temperature", "[0, 100]"),
    ({"prompt": "x", "temperature": float("inf")}, "temperature", "[0, 100]"),
    ({"prompt": "x", "temperature": "0.5"}, "temperature", "number"),
    ({"prompt": "x", "temperature": True}, "temperature", "number"),
    ({"prompt": "x", "top_p": 0}, "top_p", "(0, 1]"),
    ({"prompt": "x", "top_p": 1.5}, "top_p", "(0, 1]"),
    ({"prompt": "x", "top_k": -2}, "top_k", "-1"),
    ({"prompt": "x", "top_k": 1.5}, "top_k", "integer"),
    ({"prompt": "x", "seed": "7"}, "seed", "integer"),
    ({"prompt": "x", "seed": 2 ** 70}, "seed", "64-bit"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"prompt": "x", "stop": [1]}, "stop", "non-empty strings"),
    ({"prompt": "x", "stop": ""}, "stop", "non-empty strings"),
    ({"prompt": "x", "stop": 3}, "stop", "string or a list"),
    ({"prompt": "x", "n": 2}, "n", "Only n=1"),
    ({"prompt": "x", "stream": "yes"}, "stream", "boolean"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "only allowed"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}}, "include_usage", "boolean"),
    ({"prompt": "x", "ignore_eos": 1}, "ignore_eos", "true or false"),
    ({"prompt": "x", "include_stop_str_in_output": "yes"}, "include_stop_str_in_output", "true or false"),
    ({"prompt": "x", "model": 3}, "model", "string"),
    ({"prompt": "x", "model": ""}, "model", "non-empty"),
    ({"prompt": "x", "user": 3}, "user", "string"),
])
def test_parse_completion_rejects(body, param, fragment):
    raises(lambda: parse_completion_body(body, chat=False), 400, "invalid_request", param=param,
           match=fragment)


def test_parse_accepts_what_sampling_params_accepts():
    # tiny values the sampler handles safely (greedy below 1e-5; top-p keeps the top token)
    r = parse_completion_body({"prompt": "x", "temperature": 3e-39, "top_p": 1e-300, "top_k": 0,
                               "include_stop_str_in_output": True, "temperature_ignored": 1}, chat=False)
    assert (r.temperature, r.top_p, r.top_k, r.include_stop_str_in_output) == (3e-39, 1e-300, 0, True)
    assert isinstance(parse_completion_body({"prompt": "x", "temperature": 1}, chat=False).temperature, float)


# One set of rules: for each value, the gateway accepts it exactly when SamplingParams does,
# and the SamplingParams the server builds from an admitted request is the one built directly.
# (JSON null is the API's "not given": it takes the default, so it is not compared here.)
@pytest.mark.parametrize("field, value", [
    ("top_k", 0), ("top_k", -1), ("top_k", 1), ("top_k", -2), ("top_k", 1.5), ("top_k", True),
    ("temperature", 0), ("temperature", 3e-39), ("temperature", 2.5), ("temperature", 100),
    ("temperature", 100.5),
    ("temperature", -1e-9), ("top_p", 1e-300), ("top_p", 1), ("top_p", 0), ("top_p", 1.01),
    ("seed", 2 ** 64 - 1), ("seed", 2 ** 64), ("seed", -(2 ** 63)), ("seed", -(2 ** 63) - 1),
    ("max_tokens", 1), ("max_tokens", 0), ("ignore_eos", True), ("ignore_eos", 0),
    ("include_stop_str_in_output", False), ("include_stop_str_in_output", 1),
    ("stop", ["a"]), ("stop", [""]),
])
def test_gateway_and_sampling_params_agree(field, value):
    from minillm.engine.sampling import SamplingParams
    try:
        direct = SamplingParams(**{"max_tokens": 4, field: value})
    except ValueError:
        direct = None
    gate = make_gateway(keys=(), max_model_len=1000)
    body = {"prompt": "x", "max_tokens": 4, field: value}
    if direct is None:
        raises(lambda: gate.admit(None, body, chat=False), 400, "invalid_request", param=field)
    else:
        admitted = gate.admit(None, body, chat=False)
        assert SamplingParams(**admitted.sampling_kwargs()) == direct
        gate.release(admitted)


@pytest.mark.parametrize("body, param, fragment", [
    ({"prompt": "hi"}, "messages", "required"),
    ({"messages": []}, "messages", "required"),
    ({"messages": "hi"}, "messages", "list"),
    ({"messages": ["hi"]}, "messages[0]", "object"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role", "must be one of"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "wizard", "content": "hi"}]},
     "messages[1].role", "wizard"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "required"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "string"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]", "text"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens",
     "≥ 1"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 4, "max_tokens": -1},
     "max_tokens", "≥ 1"),
])
def test_parse_chat_rejects(body, param, fragment):
    raises(lambda: parse_completion_body(body, chat=True), 400, "invalid_request", param=param,
           match=fragment)


@pytest.mark.parametrize("body", [None, [], "prompt", 3])
def test_parse_rejects_non_object_body(body):
    raises(lambda: parse_completion_body(body, chat=False), 400, "invalid_request", param=None,
           match="JSON object")


def test_check_model():
    assert check_model("b", ["a", "b"]) == "b"
    assert check_model(None, ["a", "b"]) == "a"
    e = raises(lambda: check_model("gpt-4", ["a", "b"]), 404, "model_not_found", param="model")
    assert "gpt-4" in e.message and "Available models: a, b" in e.message


def test_check_context_names_the_limit():
    check_context(2032, 16, 2048)                              # exactly full is fine
    e = raises(lambda: check_context(2040, 16, 2048), 400, "context_length_exceeded", param="max_tokens")
    assert e.message.startswith("This model's maximum context length is 2048 tokens; the prompt has "
                                "2040 tokens and max_tokens asks for 16 more (2056 in total).")


@pytest.mark.parametrize("prompt_param", ["prompt", "messages"])
def test_a_prompt_that_alone_fills_the_context_is_named_not_max_tokens(prompt_param):
    """No max_tokens could make it fit: the field to change is the prompt (or the chat)."""
    for check in (lambda: check_context(2048, 1, 2048, prompt_param),
                  lambda: default_max_tokens(2100, 2048, prompt_param=prompt_param)):
        e = raises(check, 400, "context_length_exceeded", param=prompt_param)
        assert "2048 tokens" in e.message and "no room for any output token" in e.message


def test_default_max_tokens():
    assert default_max_tokens(10, 2048) == 256
    assert default_max_tokens(2000, 2048) == 48
    assert default_max_tokens(10, 2048, cap=16) == 16
    raises(lambda: default_max_tokens(2048, 2048), 400, "context_length_exceeded", match="no room")


# ---- admission ---------------------------------------------------------------------------

def test_admission_bound_503_and_release():
    adm = AdmissionControl(2)
    adm.acquire()
    with adm:
        assert adm.depth == 2
        e = raises(adm.acquire, 503, "queue_full", match="2 requests in flight")
        assert e.headers == {"Retry-After": "1"}
    assert adm.depth == 1
    adm.acquire()                                              # room again after a release
    adm.release()
    adm.release()
    with pytest.raises(RuntimeError, match="more often than acquire"):
        adm.release()
    assert adm.depth == 0
    with pytest.raises(ValueError):
        AdmissionControl(0)


def test_admission_thread_safety_never_exceeds_bound():
    adm = AdmissionControl(3)
    seen_max = 0
    seen_lock = threading.Lock()
    admitted = rejected = 0

    def worker() -> None:
        nonlocal seen_max, admitted, rejected
        for _ in range(300):
            try:
                adm.acquire()
            except GatewayError:
                with seen_lock:
                    rejected += 1
                continue
            with seen_lock:
                seen_max = max(seen_max, adm.depth)
                admitted += 1
            adm.release()

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen_max <= 3 and adm.depth == 0
    assert admitted + rejected == 8 * 300 and admitted > 0


# ---- the whole gateway -------------------------------------------------------------------

def test_admit_records_events_in_order():
    g = make_gateway()
    tr = Trace("r1")
    a = g.admit(f"Bearer {KEY}", {"prompt": "one two three", "max_tokens": 4}, chat=False, trace=tr)
    assert [e.event for e in tr] == ["received", "authenticated", "tokenized", "admitted"]
    assert tr.first("authenticated").extra == {"key_id": "key-1"}
    assert tr.first("admitted").extra == {"prompt_tokens": 3, "max_tokens": 4}
    assert (a.key_id, a.prompt_tokens, a.max_tokens, a.request.model) == ("key-1", 3, 4, "tiny")
    assert a.prompt_ids == [3, 3, 5]                                  # the engine takes these ids as they are
    assert a.sampling_kwargs()["max_tokens"] == 4
    ts = [e.t_ns for e in tr]
    assert ts == sorted(ts)
    assert KEY not in tr.to_json()


def test_admit_keeps_an_earlier_received():
    tr = Trace("r")
    tr.record("received", t_ns=1)
    make_gateway().admit(f"Bearer {KEY}", {"prompt": "x"}, chat=False, trace=tr)
    assert tr.times("received") == [1]


def test_admit_default_max_tokens_fits_context():
    a = make_gateway(max_model_len=20).admit(f"Bearer {KEY}", {"prompt": "a " * 15}, chat=False)
    assert a.max_tokens == 5 and a.request.max_tokens is None


@pytest.mark.parametrize("header, body, status, code", [
    (None, {"prompt": "x"}, 401, "invalid_api_key"),
    (f"Bearer {KEY}", {"prompt": "x", "top_p": 2}, 400, "invalid_request"),
    (f"Bearer {KEY}", {"prompt": "x", "model": "llama-70b"}, 404, "model_not_found"),
    (f"Bearer {KEY}", {"prompt": "w " * 60, "max_tokens": 10}, 400, "context_length_exceeded"),
])
def test_admit_rejection_recorded(header, body, status, code):
    tr = Trace("r")
    raises(lambda: make_gateway().admit(header, body, chat=False, trace=tr), status, code)
    events = [e.event for e in tr]
    assert events[0] == "received" and events[-1] == "rejected" and "admitted" not in events
    assert tr.last("rejected").extra == {"status": status, "code": code}


def test_admit_auth_runs_before_parsing():
    # A stranger's malformed body gets 401, not a 400 that would tell them about our validation.
    raises(lambda: make_gateway().admit("Bearer nope", "garbage", chat=False), 401, "invalid_api_key")


def test_admit_rate_limit_then_queue_then_release():
    clock = FakeClock()
    g = make_gateway(limiter=RateLimiter(requests_per_s=10, tokens_per_min=None, burst=3, clock=clock),
                     admission=AdmissionControl(2))
    auth, body = f"Bearer {KEY}", {"prompt": "hello", "max_tokens": 2}
    a1 = g.admit(auth, body, chat=False)
    a2 = g.admit(auth, body, chat=False)
    tr = Trace("r3")
    e = raises(lambda: g.admit(auth, body, chat=False, trace=tr), 503, "queue_full")
    assert e.headers["Retry-After"] == "1" and tr.last("rejected").extra["code"] == "queue_full"
    # The 503 refunded its rate-limit charge: the burst of 3 still has one request left.
    g.release(a1)
    g.release(a1)                                              # idempotent: no double release
    assert g.admission.depth == 1
    a3 = g.admit(auth, body, chat=False)
    g.release(a2)
    raises(lambda: g.admit(auth, body, chat=False), 429, "rate_limited", match="requests per second")
    clock.advance(0.1)
    a4 = g.admit(auth, body, chat=False)
    for a in (a3, a4):
        g.release(a)
    assert g.admission.depth == 0


def test_admit_tokens_per_minute_charges_prompt_plus_max_tokens():
    clock = FakeClock()
    g = make_gateway(limiter=RateLimiter(tokens_per_min=60, clock=clock))
    g.admit(f"Bearer {KEY}", {"prompt": "a b c d", "max_tokens": 46}, chat=False)     # 50 tokens
    e = raises(lambda: g.admit(f"Bearer {KEY}", {"prompt": "a b c d", "max_tokens": 16}, chat=False),
               429, "rate_limited", match="needs 20 tokens")
    assert e.headers["Retry-After"] == "10"                    # 10 missing at 1 token/s
    clock.advance(10)
    g.admit(f"Bearer {KEY}", {"prompt": "a b c d", "max_tokens": 16}, chat=False)


def test_key_never_in_errors_or_traces():
    g = make_gateway(limiter=RateLimiter(requests_per_s=1, burst=1, clock=FakeClock()),
                     admission=AdmissionControl(1))
    texts = []
    for header, body in [(f"Token {KEY}", {"prompt": "x"}), (KEY, {"prompt": "x"}),
                         (f"Bearer {KEY}", {"prompt": "x", "model": KEY}),
                         (f"Bearer {KEY}", {"prompt": "x"}), (f"Bearer {KEY}", {"prompt": "x"})]:
        tr = Trace("r")
        try:
            g.admit(header, body, chat=False, trace=tr)
        except GatewayError as e:
            texts += [e.message, str(e.to_openai_error()), repr(e), str(e.headers)]
        texts.append(tr.to_json())
    joined = "\n".join(texts)
    # The model name echo is the client's own field; strip it before looking for the credential.
    joined = joined.replace(f"The model '{KEY}'", "")
    assert KEY not in joined


# ---- the defences: keys, limits, admission ---------------------------------------------------

def test_a_caller_over_its_rate_is_refused_before_anything_is_tokenized():
    calls = []

    def counting(req):
        calls.append(1)
        return words(req)
    clock = FakeClock()
    g = Gateway(APIKeyAuth([KEY]), RateLimiter(requests_per_s=1, burst=1, clock=clock), None, ["tiny"], 64,
                counting)
    g.admit(f"Bearer {KEY}", {"prompt": "a b", "max_tokens": 2}, chat=False)
    raises(lambda: g.admit(f"Bearer {KEY}", {"prompt": "x " * 100_000}, chat=False), 429, "rate_limited")
    assert len(calls) == 1                                     # the second prompt was never tokenized


def test_default_max_tokens_fits_a_small_token_quota():
    """No max_tokens given: the default shrinks to what a minute's quota leaves, instead of
    refusing every such request for a default of 256 the client never chose."""
    g = make_gateway(limiter=RateLimiter(tokens_per_min=100, clock=FakeClock()), max_model_len=1000)
    a = g.admit(f"Bearer {KEY}", {"prompt": "a b c d"}, chat=False)
    assert a.max_tokens == 96 and a.prompt_tokens + a.max_tokens == 100


@pytest.mark.parametrize("field, value", [
    ("logit_bias", {"5": 3}), ("presence_penalty", 0.5), ("frequency_penalty", -1), ("echo", True),
    ("best_of", 3), ("response_format", {"type": "json_object"}), ("tools", [{"type": "function"}]),
    ("suffix", "x"), ("repetition_penalty", 1.2)])
def test_unsupported_fields_are_refused_by_name_unless_neutral(field, value):
    g = make_gateway()
    raises(lambda: g.admit(f"Bearer {KEY}", {"prompt": "a", field: value}, chat=False), 400,
           "invalid_request",
           param=field, match="not supported")
    neutral = validation.UNSUPPORTED_UNLESS_NEUTRAL[field]
    if neutral:
        g.admit(f"Bearer {KEY}", {"prompt": "a", field: neutral[0]}, chat=False)   # the neutral value is fine


@pytest.mark.parametrize("body, param", [
    ({"prompt": "ok \ud800 bad"}, "prompt"),
    ({"prompt": "ok", "stop": ["\udfff"]}, "stop[0]"),
    ({"prompt": "ok", "user": "\ud83d"}, "user"),
])
def test_lone_surrogates_give_400_naming_the_field(body, param):
    raises(lambda: make_gateway().admit(f"Bearer {KEY}", body, chat=False), 400, "invalid_request",
           param=param)


def test_chat_messages_with_a_lone_surrogate_name_the_message():
    body = {"messages": [{"role": "user", "content": "fine"}, {"role": "user", "content": "\ud800"}]}
    raises(lambda: make_gateway().admit(f"Bearer {KEY}", body, chat=True), 400, "invalid_request",
           param="messages[1].content")


def test_logprobs_and_min_tokens_reach_sampling_params():
    g = make_gateway()
    a = g.admit(f"Bearer {KEY}", {"prompt": "a", "logprobs": 3, "min_tokens": 2, "max_tokens": 5}, chat=False)
    assert a.sampling_kwargs()["logprobs"] == 3 and a.sampling_kwargs()["min_tokens"] == 2
    c = g.admit(f"Bearer {KEY}", {"messages": [{"role": "user", "content": "a"}], "logprobs": True,
                                  "top_logprobs": 4}, chat=True)
    assert c.sampling_kwargs()["logprobs"] == 4
    raises(lambda: g.admit(f"Bearer {KEY}", {"prompt": "a", "logprobs": 99}, chat=False), 400,
           "invalid_request",
           param="logprobs")
    raises(lambda: g.admit(f"Bearer {KEY}",
                           {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2},
                           chat=True), 400, "invalid_request", param="top_logprobs")


def test_an_integral_number_is_an_integer_as_json_schema_says():
    """JSON Schema's "integer" is any number with no fractional part: the schema lets a client
    send 4.0 for max_tokens (schemathesis' positive examples do), so the server takes it as 4."""
    req = parse_completion_body({"prompt": "x", "max_tokens": 4.0, "top_k": 2.0, "seed": 7.0}, chat=False)
    assert (req.max_tokens, req.top_k, req.seed) == (4, 2, 7)
    assert all(type(v) is int for v in (req.max_tokens, req.top_k, req.seed))
