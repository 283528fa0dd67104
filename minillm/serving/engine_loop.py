"""The one engine thread (chapter 10.1): it owns the engine and runs the step loop; HTTP
handlers talk to it through an inbox one way and ``loop.call_soon_threadsafe`` into one
``asyncio.Queue`` per request the other way. See ``minillm.serving.server`` for the picture."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable

from minillm.serving.errors import GatewayError

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# The engine thread
# ---------------------------------------------------------------------------------------------

class Closed:
    """Pushed into a request's queue instead of a StepOutput when the engine lets it go
    without finishing it: the server shutting down (the client may retry: a 503), or the engine
    failing on it (the server's fault: a 500)."""

    def __init__(self, message: str, shutting_down: bool = True) -> None:
        self.message = message
        self.shutting_down = shutting_down


@dataclass(eq=False)
class Stream:
    """One request as the engine thread sees it: its sequence and where its outputs go."""
    seq: Any                                  # minillm.engine.sequence.Sequence
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    every_output: bool = True                 # False (non-streaming): only the final output


@dataclass
class Abort:
    request_id: str
    then: Callable[[], None] | None = None    # runs on the engine thread once the slot is free


class EngineLoop:
    """The one thread that owns the engine and runs ``engine.step()`` while there is work."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self._cv = threading.Condition()
        self._inbox: list[Stream] = []
        self._aborts: list[Abort] = []
        self._streams: dict[str, Stream] = {}       # touched by the engine thread only
        self._aborting = 0                          # aborts taken from the inbox, their callbacks not yet run
        self._stopping = False
        self.draining = False                       # shutting down: finish what is inside, take nothing new
        self._thread: threading.Thread | None = None
        self.steps = 0
        self.failures = 0

    # -- called from the event loop (or any thread) -------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="minillm-engine", daemon=True)
            self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def submit(self, seq, every_output: bool = True) -> Stream:
        """Hand a prepared sequence to the engine thread. Its outputs arrive in the returned
        stream's queue; call this on the event loop that should receive them."""
        stream = Stream(seq, asyncio.get_running_loop(), asyncio.Queue(), every_output)
        with self._cv:
            if not self.alive or self.draining:
                raise GatewayError(503, "server_shutting_down", "The server is shutting down; retry later.",
                                   headers={"Retry-After": "1", "Connection": "close"})
            self._inbox.append(stream)
            self._cv.notify()
        return stream

    def abort(self, request_id: str, then: Callable[[], None] | None = None) -> None:
        """Ask the engine thread to abort a request; ``then`` runs after its KV slot is free."""
        with self._cv:
            queued = self.alive
            if queued:
                self._aborts.append(Abort(request_id, then))
                self._cv.notify()
        if not queued and then is not None:    # stopped: the engine has let everything go already
            then()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop after the current step; every request still inside gets a :class:`Closed`."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)
            if t.is_alive():
                log.error("the engine thread did not stop within %.0f s", timeout)

    def stats(self) -> dict[str, int]:
        """A snapshot for tests and notebooks (read without the engine's lock: approximate)."""
        e = self.engine
        return {"running": e.num_running, "waiting": e.num_waiting, "free_slots": e.allocator.num_free,
                "num_slots": e.cache.num_slots, "streams": len(self._streams), "inbox": len(self._inbox),
                "aborts": len(self._aborts) + self._aborting, "sequences": len(e._seqs), "steps": self.steps}

    # -- the engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._stopping or self._inbox or self._aborts or self.engine.has_unfinished()):
                        self._cv.wait()           # idle: sleep until a request (or stop) arrives
                    if self._stopping:
                        break
                    inbox, self._inbox = self._inbox, []
                    aborts, self._aborts = self._aborts, []
                    self._aborting = len(aborts)  # still "inside" until each callback has run (stats)
                for s in inbox:
                    self._admit(s)
                for a in aborts:                  # after the inbox: an abort may follow its submit
                    self._abort(a)
                if self.engine.has_unfinished():
                    self._step()
        finally:
            self._close_all("The server is shutting down; the request was not completed.")

    def _admit(self, s: Stream) -> None:
        try:
            self.engine.enqueue(s.seq)            # records `enqueued`
        except Exception as e:                    # e.g. a duplicate request id: fail this one only
            self._push(s, Closed(f"The engine could not take the request: {type(e).__name__}: {e}",
                                 shutting_down=False))
            return
        self._streams[s.seq.request_id] = s

    def _abort(self, a: Abort) -> None:
        if self._streams.pop(a.request_id, None) is not None:
            self.engine.abort(a.request_id)       # records `finished` reason=abort, frees the slot
            self.engine.pop_finished(a.request_id)
        try:
            if a.then is not None:
                a.then()
        except Exception:
            log.exception("abort callback failed for %s", a.request_id)
        finally:
            self._aborting -= 1

    def _step(self) -> None:
        try:
            outs = self.engine.step()
        except Exception as e:   # a bug below step() (it fails a batch itself): end those requests, go on
            self.failures += 1
            log.exception("engine step failed")
            for rid, s in list(self._streams.items()):
                with contextlib.suppress(Exception):
                    self.engine.abort(rid)
                    self.engine.pop_finished(rid)
                self._push(s, Closed(f"The engine failed on this request: {type(e).__name__}: {e}",
                                     shutting_down=False))
            self._streams.clear()
            return
        self.steps += 1
        # One wake-up of each event loop per step, not one per token: at batch 64 that is one
        # self-pipe write (and one loop iteration) per step instead of 64.
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        for o in outs:
            s = self._streams.get(o.request_id)
            if s is None:
                continue
            if o.finished:
                del self._streams[o.request_id]
                self.engine.pop_finished(o.request_id)   # the engine keeps no history by itself
            if s.every_output or o.finished:
                by_loop.setdefault(s.loop, []).append((s.queue, o))
        for loop, items in by_loop.items():
            _call_soon(loop, _put_all, items)

    def _push(self, s: Stream, item: Any) -> None:
        _call_soon(s.loop, _put_all, [(s.queue, item)])

    def _close_all(self, message: str) -> None:
        with self._cv:
            self._stopping = True
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
        for s in inbox:
            self._push(s, Closed(message))
        for rid, s in list(self._streams.items()):
            with contextlib.suppress(Exception):
                self.engine.abort(rid)
                self.engine.pop_finished(rid)
            self._push(s, Closed(message))
        self._streams.clear()
        for a in aborts:
            if a.then is not None:
                with contextlib.suppress(Exception):
                    a.then()


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in items:
        q.put_nowait(item)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:      # that event loop is closed: nobody is listening any more
        pass
