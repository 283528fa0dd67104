"""What the app holds: the model, the gateway, the engine thread, the recent traces and step
records. ``minillm.serving.app`` puts HTTP in front of it."""
from __future__ import annotations

import collections
import logging
import threading
import time

from minillm.measure.trace import Trace
from minillm.serving.config import ServerConfig
from minillm.serving.engine_loop import EngineLoop
from minillm.serving.gateway import (
    AdmissionControl,
    APIKeyAuth,
    CompletionRequest,
    Gateway,
    RateLimiter,
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
        self.auth = APIKeyAuth(config.api_keys)
        limiter = (RateLimiter(config.requests_per_s, config.tokens_per_min, config.burst)
                   if config.requests_per_s or config.tokens_per_min else None)
        self.gateway = Gateway(self.auth, limiter, AdmissionControl(config.max_queue_depth), [self.model_name],
                               self.engine.max_model_len, self._count_tokens,
                               max_tokens_cap=config.max_tokens_cap)
        self.loop = EngineLoop(self.engine)
        self._traces: collections.deque[Trace] = collections.deque(maxlen=config.trace_history)
        self._traces_lock = threading.Lock()

    # -- prompts -------------------------------------------------------------------------
    def prompt_text(self, req: CompletionRequest) -> str:
        from minillm.engine.tokenizer import apply_chat
        return apply_chat(self.tokenizer, req.prompt) if req.chat else req.prompt

    def _count_tokens(self, req: CompletionRequest) -> int:
        # The gateway needs the prompt length to check the context *before* queueing (vLLM's
        # frontend does the same). prepare() tokenizes again: we pay twice (tens of µs for a
        # chat-sized prompt) so that the trace's `tokenize` stage is the tokenizer's time.
        from minillm.engine.tokenizer import encode_prompt
        return len(encode_prompt(self.tokenizer, self.prompt_text(req)))

    # -- traces --------------------------------------------------------------------------
    def remember(self, trace: Trace) -> None:
        with self._traces_lock:
            self._traces.append(trace)

    def traces(self, request_ids: list[str] | None = None, limit: int | None = None) -> list[Trace]:
        """Traces of completed (and rejected) requests, oldest first. A trace is stored once its
        response is complete and is never written to afterwards."""
        with self._traces_lock:
            out = list(self._traces)
        if request_ids:
            want = set(request_ids)
            out = [t for t in out if t.request_id in want]
        if limit is not None:
            out = out[-limit:] if limit > 0 else []
        return out

    def trace(self, request_id: str) -> Trace:
        found = self.traces([request_id])
        if not found:
            raise KeyError(f"no trace for request {request_id!r} (yet): a trace is stored when its response is complete")
        return found[-1]

    def clear_traces(self) -> None:
        with self._traces_lock:
            self._traces.clear()

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
        """True when nothing is inside: no stream, no sequence, every KV slot free, no admission held."""
        s = self.stats()
        return (s["running"] == 0 and s["waiting"] == 0 and s["streams"] == 0 and s["inbox"] == 0
                and s["sequences"] == 0 and s["free_slots"] == s["num_slots"] and s["admitted"] == 0)

    def start(self) -> None:
        if self.auth.open:
            log.warning("no API key configured: the server is OPEN to anyone who can reach it")
        self.loop.start()

    def shutdown(self) -> None:
        self.loop.stop()

    # the names of an earlier draft of this module
    stop = shutdown


MiniServer = ServingState
