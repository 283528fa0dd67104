"""How requests are run (design.md §8). Read in the order a request meets them:

    tokenizer → sequence → scheduler (+ prefix_cache, kv_cache) → runner (+ attention,
    cuda_graphs, sampling) → output (detokenize, stop rules) → engine (LLMEngine.step) → llm (LLM)

Imports are lazy: ``minillm.engine.config`` (read by the CLI to build its flags) must not pay
for torch.
"""
from __future__ import annotations

from importlib import import_module
from typing import Any

_LAZY = {
    "LLM": "minillm.engine.llm",
    "LLMEngine": "minillm.engine.engine",
    "RequestError": "minillm.engine.engine",
    "RequestOutput": "minillm.engine.engine",
    "StepOutput": "minillm.engine.engine",
    "EngineConfig": "minillm.engine.config",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'minillm.engine' has no attribute {name!r}")
