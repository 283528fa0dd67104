"""minillm: a small, readable LLM inference engine for the chapter
"the lifecycle of an inference request and its performance metrics".

    from minillm import LLM, SamplingParams
    llm = LLM(model="tiny")
    out = llm.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0))[0]
    print(out.text, out.metrics.ttft_s)

Imports are lazy so that ``python -m minillm doctor`` works even when torch is broken.
"""
from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "LLM": "minillm.engine.llm",
    "LLMEngine": "minillm.engine.engine",
    "RequestOutput": "minillm.engine.engine",
    "SamplingParams": "minillm.engine.sampling",
    "EngineConfig": "minillm.engine.config",
    "load_model": "minillm.model.loader",
    "ModelConfig": "minillm.model.config",
    "PRESETS": "minillm.model.config",
    "Trace": "minillm.core.trace",
}

__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'minillm' has no attribute {name!r}")
