"""What the app holds: the model, the gateway, the engine thread, the recent traces and step
records. ``minillm.serving.app`` puts HTTP in front of it."""
from __future__ import annotations

import logging
import threading
import time
import uuid

from minillm.core.trace import Trace
from minillm.serving.admission import AdmissionControl
from minillm.serving.auth import APIKeyAuth
from minillm.serving.config import ServerConfig
from minillm.serving.engine_loop import EngineLoop
from minillm.serving.errors import GatewayError, invalid, parse_json_body
from minillm.serving.gateway import Gateway
from minillm.serving.prom import ServingMetrics
from minillm.serving.rate_limit import RateLimiter
from minillm.serving.trace_store import ADMIN, TraceStore
from minillm.serving.validation import (
    CompletionRequest,
    check_model,
    integral,
    parse_messages,
    undecodable_text,
)

log = logging.getLogger(__name__)
_STEP_COPY_TRIES = 5           # lock-free copies of the step history before taking the engine's lock

# ---------------------------------------------------------------------------------------------
# What the app holds
# ---------------------------------------------------------------------------------------------

class ServingState:
    """The model, the gateway, the engine thread and the recent traces; :func:`create_app`
    puts HTTP in front of it."""

    def __init__(self, config: ServerConfig | None = None, llm=None) -> None:
        from minillm.engine.llm import LLM
        config = config or ServerConfig()
        self.config = config
        if config.torch_threads:
            import torch
            torch.set_num_threads(config.torch_threads)
        self.llm = llm if llm is not None else LLM(config=config.engine)
        self.engine = self.llm.engine
        self.tokenizer = self.llm.tokenizer
        self.model_name = config.served_model_name or str(config.engine.model)
        self.created = int(time.time())
        self.auth = APIKeyAuth(config.api_keys, config.admin_key)
        limiter = (RateLimiter(config.requests_per_s, config.tokens_per_min, config.burst)
                   if config.requests_per_s or config.tokens_per_min else None)
        self.gateway = Gateway(self.auth, limiter, AdmissionControl(config.max_queue_depth),
                               [self.model_name],
                               self.engine.max_model_len, self.tokenize,
                               max_tokens_cap=config.max_tokens_cap)
        self.loop = EngineLoop(self.engine)
        self.trace_store = TraceStore(config.trace_history, config.trace_store_bytes)
        self.metrics = ServingMetrics(self.model_name, max_model_len=self.engine.max_model_len)
        self._ids_in_use: set[str] = set()                 # engine ids in flight (global)
        self._client_ids: set[tuple[str, str]] = set()     # (key, X-Request-Id) in flight
        self._ids_lock = threading.Lock()

    # -- prompts -------------------------------------------------------------------------
    def prompt_text(self, req: CompletionRequest) -> str:
        return self.chat_text(req.prompt) if req.chat else req.prompt

    def chat_text(self, messages: list[dict]) -> str:
        """The chat template's text for ``messages``. Many models' templates refuse some
        conversations (roles that do not alternate, a system message) through ``raise_exception``:
        that is the client's conversation, so a 400 naming 'messages' with the template's reason,
        not a 500. A template that does not even parse is the server's fault and stays one."""
        from minillm.engine.tokenizer import apply_chat
        try:
            from jinja2.exceptions import TemplateError, TemplateSyntaxError
        except ImportError:           # no jinja2: no template can run, hence none can refuse
            return apply_chat(self.tokenizer, messages)
        try:
            return apply_chat(self.tokenizer, messages)
        except TemplateSyntaxError:
            raise
        except TemplateError as e:
            raise invalid("messages", f"The model's chat template refused these messages: {e}") from None

    def tokenize(self, req: CompletionRequest) -> list[int]:
        """The prompt's ids, counted once: the gateway needs the length to check the context
        *before* queueing (vLLM's frontend does the same), and the engine takes these ids as
        they are. Runs off the event loop (a 1 MiB prompt takes seconds on a small CPU)."""
        from minillm.engine.tokenizer import encode_prompt
        return encode_prompt(self.tokenizer, self.prompt_text(req))

    def admit(self, key_id: str, raw: bytes, chat: bool, trace: Trace):
        """The part of admission that costs: JSON, validation, tokenizing, the context and the
        token quota, the queue; then the engine's sequence, built from the ids counted here.
        Runs in a worker thread. Returns (AdmittedRequest, Sequence) or raises GatewayError
        (nothing held)."""
        from minillm.engine.engine import RequestError
        from minillm.engine.sampling import SamplingParams
        try:
            body = parse_json_body(raw)
        except GatewayError:
            self.gateway.refund_request(key_id)
            raise
        trace.record("body_read", n_bytes=len(raw))
        admitted = self.gateway.admit_body(key_id, body, chat=chat, trace=trace)
        try:
            params = SamplingParams(**admitted.sampling_kwargs())
            seq = self.engine.prepare(admitted.prompt_ids, params, request_id=trace.request_id, trace=trace)
            seq.prompt = admitted.request.prompt if isinstance(admitted.request.prompt, str) else None
        except (RequestError, ValueError) as e:
            self.gateway.undo(admitted)
            param = "min_tokens" if "min_tokens" in str(e) else None    # the one check that needs max_tokens
            raise GatewayError(400, "invalid_request", str(e), param=param) from None
        except BaseException:
            self.gateway.undo(admitted)       # whatever failed, the queue place must not stay taken
            raise
        return admitted, seq

    # -- request ids -----------------------------------------------------------------------
    def claim_request_id(self, key_id: str, theirs: str) -> tuple[str, str]:
        """A client's X-Request-Id, scoped to its key: returns (the engine's id, the id the client
        sees). The client sees its own id, suffixed only when the same key already has a request in
        flight under it; the engine's id is the same unless another key's request holds it, and the
        client cannot tell which (another key's traffic is none of its business)."""
        with self._ids_lock:
            visible = (theirs if (key_id, theirs) not in self._client_ids
                       else f"{theirs}-{uuid.uuid4().hex[:8]}")
            self._client_ids.add((key_id, visible))
            internal = visible if visible not in self._ids_in_use else f"req-{uuid.uuid4().hex[:24]}"
            self._ids_in_use.add(internal)
            return internal, visible

    def release_request_id(self, key_id: str | None, internal: str, visible: str) -> None:
        with self._ids_lock:
            self._ids_in_use.discard(internal)
            self._client_ids.discard((key_id, visible))

    # -- tokenizer endpoints -----------------------------------------------------------------
    def tokenize_body(self, body: dict) -> dict:
        from minillm.engine.tokenizer import encode_prompt
        bad = undecodable_text(body)
        if bad is not None:
            raise invalid(bad, f"'{bad}' holds text that is not valid Unicode.")
        if ("prompt" in body) == ("messages" in body):      # the schema's oneOf, by presence
            raise invalid("prompt", "Give exactly one of 'prompt' (a string) and 'messages' (a list).")
        if "messages" in body:
            text = self.chat_text(parse_messages(body))
        elif isinstance(body["prompt"], str):
            text = body["prompt"]
        else:
            raise invalid("prompt", "'prompt' must be a string.")
        self._check_model_field(body)
        add = body.get("add_special_tokens")
        add = True if add is None else add
        if not isinstance(add, bool):
            raise invalid("add_special_tokens", "'add_special_tokens' must be a boolean.")
        ids = (encode_prompt(self.tokenizer, text) if add
               else list(self.tokenizer.encode(text, add_special_tokens=False)))
        return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids}

    def _check_model_field(self, body: dict) -> None:
        """``model`` of a tokenizer endpoint: absent or null, else this server's model (400 for
        what is not a name at all, 404 for another model)."""
        name = body.get("model")
        if name is None:
            return
        if not isinstance(name, str):
            raise invalid("model", f"'model' must be a string, got {type(name).__name__}.")
        check_model(name, [self.model_name])

    def detokenize_body(self, body: dict) -> dict:
        self._check_model_field(body)
        ids = body.get("tokens")
        if isinstance(ids, list):
            ids = [integral(i) for i in ids]                    # JSON's 7.0 is the integer 7
        vocab = self.engine.config.vocab_size
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise invalid("tokens", "'tokens' must be a list of token ids (integers).")
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise invalid("tokens", f"token ids {bad[:5]} are outside the vocabulary [0, {vocab}).")
        known = len(self.tokenizer)
        # ids the tokenizer does not know (a shape twin's 128k vocabulary) show as <unk:ID>
        parts, run = [], []
        for i in ids:
            if i < known:
                run.append(i)
                continue
            parts.append(self.tokenizer.decode(run))
            parts.append(f"<unk:{i}>")
            run = []
        parts.append(self.tokenizer.decode(run))
        return {"prompt": "".join(parts)}

    # -- traces --------------------------------------------------------------------------
    def remember(self, trace: Trace, client_id: str | None = None) -> None:
        """Store a finished trace for the key that sent it (``authenticated``), under the id that
        key knows it by (``client_id``: its X-Request-Id; default the trace's own); a request that
        never showed a valid key is only counted."""
        auth, rejected = trace.first("authenticated"), trace.last("rejected")
        if rejected is not None:
            self.metrics.count_rejected(rejected.extra.get("code", "unknown"))
        self.trace_store.add(trace, auth.extra.get("key_id") if auth is not None else None, client_id)
        admitted, scheduled = trace.first("admitted"), trace.first("scheduled")
        if admitted is not None:       # a request the gateway let in: Prometheus counts it (vLLM's names)
            self.metrics.observe_request(trace, max_tokens=admitted.extra.get("max_tokens"))
        if scheduled is not None:      # prefix cache: prompt tokens looked up, and found (vLLM counts tokens)
            self.metrics.add_prefix_cache(int(admitted.extra.get("prompt_tokens", 0)) if admitted else 0,
                                          int(scheduled.extra.get("cached_tokens", 0)))

    def traces(self, request_ids: list[str] | None = None, limit: int | None = None) -> list[Trace]:
        """Every caller's stored traces, oldest first (in-process access: a notebook, a test).
        A trace is stored once its response is complete and is never written to afterwards.
        Over HTTP, ``GET /v1/traces`` shows a key only its own (:meth:`TraceStore.query`)."""
        items, _ = self.trace_store.query(ADMIN, request_ids)
        out = [it.trace for it in items]
        if limit is not None:
            out = out[-limit:] if limit > 0 else []
        return out

    def trace(self, request_id: str, key_id: str | None = None) -> Trace:
        """The trace a request id names. Two keys may use the same X-Request-Id: then ``key_id``
        says whose (else the answer would be a guess, so it is refused)."""
        items, _ = self.trace_store.query(ADMIN if key_id is None else key_id, [request_id])
        if not items:
            raise KeyError(f"no trace for request {request_id!r} (yet): a trace is stored when its response "
                           "is complete")
        owners = {it.owner for it in items}
        if len(owners) > 1:
            raise KeyError(f"request id {request_id!r} names traces of {len(owners)} keys: pass key_id= to "
                           "say whose")
        return items[-1].trace

    def traces_page(self, reader: str, request_ids: list[str] | None, after: int, limit: int) -> dict:
        """One page of ``reader``'s traces as plain JSON (``next``: the cursor for ``?after=``)."""
        items, nxt = self.trace_store.query(reader, request_ids, after, limit)
        return {"object": "list", "next": nxt,
                "data": [{"request_id": it.request_id, "events": [e.as_dict() for e in it.trace.events]}
                         for it in items]}

    def clear_traces(self) -> None:
        self.trace_store.clear()

    def server_info(self) -> dict:
        """What a benchmark report needs to know about this server (design.md §4): the model,
        its precision, the hardware, the parallel configuration, prefix caching, every engine option,
        and how many start-up objects are frozen out of full garbage collections (0 unless the
        process is `minillm serve`'s own; minillm.engine.gc_pauses)."""
        import gc
        from dataclasses import asdict

        from minillm.core.device import dtype_name
        from minillm.hardware.machine import describe_hardware
        return {"model": self.model_name, "root": str(self.config.engine.model),
                "dtype": dtype_name(self.llm.dtype), "device": str(self.llm.device),
                "hardware": describe_hardware(self.llm.device).summary(), "parallel": "tp=1, pp=1, dp=1",
                "prefix_caching": self.config.engine.enable_prefix_caching,
                "engine": asdict(self.config.engine), "max_model_len": self.engine.max_model_len,
                "gc_frozen_objects": gc.get_freeze_count()}

    def render_metrics(self) -> tuple[bytes, str]:
        """``GET /metrics``: the load right now, then every series (Prometheus text format)."""
        s = self.loop.stats()
        self.metrics.set_load(s["running"], s["waiting"], 1 - s["free_slots"] / max(1, s["num_slots"]))
        return self.metrics.render()

    def may_read_steps(self, key_id: str) -> bool:
        """Step records hold no request content, only counts and times, but they are the whole
        engine's: the admin key reads them; without an admin key configured, any valid key."""
        return key_id == ADMIN or not self.auth.has_admin

    # -- steps ---------------------------------------------------------------------------
    def steps(self, limit: int | None = None) -> list[dict]:
        """The engine's last ``limit`` StepRecords (all it keeps, if None) as dicts, oldest first.
        Call it off the event loop: turning thousands of records into dicts takes a while."""
        records = self._step_snapshot()
        if limit is not None:
            records = records[max(0, len(records) - limit):]    # (records[-0:] would be all of them)
        return [r.to_dict() for r in records]

    def _step_snapshot(self) -> list:
        """A copy of the engine's step history. The engine thread appends to it while we read,
        and copying a deque that changes underneath raises RuntimeError. A copy takes
        microseconds, so a retry almost always succeeds; the last try holds the engine's lock
        (step() appends under it), which waits for at most one step. A record is complete
        when it is appended and never changes afterwards."""
        history = self.engine.step_history
        for _ in range(_STEP_COPY_TRIES):
            try:
                return list(history)
            except RuntimeError:
                continue
        with self.engine._lock:
            return list(history)

    # -- health --------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        return {**self.loop.stats(), "admitted": self.gateway.admission.depth}

    def idle(self) -> bool:
        """True when nothing is inside: no stream, no sequence, every KV slot free, no admission held,
        no abort whose callback (which stores the request's trace) has yet to run."""
        s = self.stats()
        return (s["running"] == 0 and s["waiting"] == 0 and s["streams"] == 0 and s["inbox"] == 0
                and s["aborts"] == 0 and s["sequences"] == 0 and s["free_slots"] == s["num_slots"]
                and s["admitted"] == 0)

    def start(self) -> None:
        if self.auth.open:
            log.warning("no API key configured: the server is OPEN to anyone who can reach it")
        self.loop.start()

    def drain(self, timeout_s: float, poll_s: float = 0.05) -> bool:
        """Take no new request and wait, up to ``timeout_s``, for every admitted one to finish
        (a rolling restart loses no work). True when everything inside finished in time; the
        caller then stops the engine, which ends what is left with an error event."""
        self.loop.draining = True
        deadline = time.monotonic() + timeout_s
        while not self.idle():
            if time.monotonic() >= deadline:
                log.warning("shutdown: %s still inside after %.0f s; aborting them", self.stats(), timeout_s)
                return False
            time.sleep(poll_s)
        return True

    @property
    def draining(self) -> bool:
        return self.loop.draining

    def shutdown(self) -> None:
        self.loop.stop()

    # the names of an earlier draft of this module
    stop = shutdown


MiniServer = ServingState
