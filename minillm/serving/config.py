"""The server's options: its own (gateway, limits, traces) and the engine's, held as one
``EngineConfig`` so every engine option is defined once (design.md §8)."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, fields
from typing import Any

from minillm.core.device import default_server_threads
from minillm.engine.config import EngineConfig
from minillm.serving.auth import keys_from_env_and_args

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 1 << 20       # 1 MiB: far more than any prompt our contexts can hold

# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------

@dataclass
class _ServerOptions:
    """The HTTP side's own options (the engine's are in :class:`EngineConfig`, defined once)."""
    host: str = "127.0.0.1"            # loopback: exposing a server is a decision, not a default
    port: int = 8000
    api_keys: list[str] = field(default_factory=list)
    requests_per_s: float | None = None
    tokens_per_min: float | None = None
    burst: float | None = None
    max_queue_depth: int = 256         # requests inside the server (waiting + running), else 503
    max_tokens_cap: int = 256          # max_tokens of a request that does not say
    max_body_bytes: int = MAX_BODY_BYTES
    trace_history: int = 10_000        # traces kept for /v1/traces, at most (count bound)
    trace_store_bytes: int = 64 << 20  # ... and at most this many bytes of them (estimated)
    admin_key: str | None = None       # reads every key's traces and the engine's steps
    served_model_name: str | None = None
    log_level: str = "warning"
    shutdown_timeout_s: float = 30.0   # SIGTERM/SIGINT: how long admitted requests may take to finish
    # torch's intra-op threads (process-wide; None: torch's default, one per core). On a machine
    # with few cores, leaving one core to the HTTP side keeps streaming smooth: with every core
    # in torch, each chunk written competes with the next step (see `python -m minillm bench-http`).
    torch_threads: int | None = None
    # Receiving a request (serving/guard.py): strangers must not hold connections by sending
    # slowly or never finishing. The deadlines cover receiving the request, not the response.
    # connection open (or a next request's 1st byte) → headers complete, else 408 + close
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0       # headers complete → body complete, else 408 + close
    max_header_bytes: int = 64 * 1024  # a larger request head: 431 + close
    # connections served at once; a request on one more gets 503 (None: no limit)
    max_connections: int | None = 1024
    # an idle kept-alive connection is closed after this (uvicorn's timeout_keep_alive)
    keep_alive_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.max_queue_depth < 1:
            raise ValueError(f"max_queue_depth must be ≥ 1, got {self.max_queue_depth}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if self.trace_history < 1:
            raise ValueError(f"trace_history must be ≥ 1, got {self.trace_history}")
        if self.trace_store_bytes < 1 << 16:
            raise ValueError(f"trace_store_bytes must be at least 65536, got {self.trace_store_bytes}")
        if self.port is not None and not 0 <= self.port <= 65535:   # before loading a model
            raise ValueError(f"port must be in 0..65535 (0: any free port), got {self.port}")
        if (not isinstance(self.shutdown_timeout_s, (int, float))
                or isinstance(self.shutdown_timeout_s, bool)
                or not 0 <= self.shutdown_timeout_s < float("inf")):
            raise ValueError("shutdown_timeout_s must be a number of seconds ≥ 0, got "
                             f"{self.shutdown_timeout_s!r}")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
        if self.max_header_bytes < 1024:
            raise ValueError(f"max_header_bytes must be at least 1024, got {self.max_header_bytes}")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"max_connections must be ≥ 1 (or None: no limit), got {self.max_connections}")


_ENGINE_OPTIONS = frozenset(EngineConfig.names())


@dataclass(init=False)
class ServerConfig(_ServerOptions):
    """Everything ``python -m minillm serve`` can be told. ``port=0`` binds a free port.

    The engine's options live in ``engine`` (an :class:`EngineConfig`: every engine option is
    defined once, there). For convenience they are also accepted as keywords and read as
    attributes: ``ServerConfig(model="tiny", max_batch_size=16, port=0).max_batch_size == 16``.
    """
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __init__(self, engine: EngineConfig | None = None, **options: Any) -> None:
        engine_options = {k: options.pop(k) for k in list(options) if k in _ENGINE_OPTIONS}
        if engine is not None and engine_options:
            raise TypeError("give either engine=EngineConfig(...) or engine keywords "
                            f"({', '.join(engine_options)}), not both")
        unknown = sorted(set(options) - {f.name for f in fields(_ServerOptions)})
        if unknown:
            raise TypeError(f"ServerConfig got unknown option(s): {', '.join(unknown)}")
        super().__init__(**options)       # the server's own fields
        self.engine = engine if engine is not None else EngineConfig(**engine_options)

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails: ``config.model`` reads ``config.engine.model``.
        engine = self.__dict__.get("engine")
        if engine is not None and name in _ENGINE_OPTIONS:
            return getattr(engine, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


def config_from_args(a, engine: EngineConfig | None = None) -> ServerConfig:
    """``argparse`` namespace of ``python -m minillm serve`` → :class:`ServerConfig`. The engine's
    flags are generated from :class:`EngineConfig` (``EngineConfig.add_arguments``/``from_args``)."""
    if engine is None:
        engine = EngineConfig.from_args(a)

    def opt(name: str, default=None):
        return getattr(a, name, default)
    return ServerConfig(engine=engine, host=opt("host", "127.0.0.1"), port=opt("port", 8000),
                        api_keys=keys_from_env_and_args(opt("api_key")),
                        requests_per_s=opt("requests_per_s"), tokens_per_min=opt("tokens_per_min"),
                        burst=opt("burst"), max_queue_depth=opt("max_queue_depth", 256),
                        log_level=opt("log_level", "info"),
                        header_timeout_s=opt("header_timeout_s", 10.0),
                        body_timeout_s=opt("body_timeout_s", 30.0),
                        max_header_bytes=opt("max_header_bytes", 64 * 1024),
                        max_connections=opt("max_connections", 1024) or None,      # 0: no limit
                        keep_alive_timeout_s=opt("keep_alive_timeout_s", 5.0),
                        shutdown_timeout_s=opt("shutdown_timeout_s", 30.0),
                        admin_key=opt("admin_key") or os.environ.get("MINILLM_ADMIN_KEY") or None,
                        trace_history=opt("trace_history", 10_000),
                        trace_store_bytes=opt("trace_store_bytes", 64 << 20),
                        torch_threads=opt("torch_threads") or default_server_threads(engine.device))
