"""How requests are run (design.md §8). Read in the order a request meets them:

    tokenizer → sequence → scheduler (+ kv_cache, prefix_cache) → runner (+ attention metadata,
    cuda_graphs, sampling) → output (detokenize, stop rules) → engine (LLMEngine.step) → llm (LLM)
"""
from minillm.engine.engine import LLMEngine, RequestError, RequestOutput, StepOutput
from minillm.engine.engine import LLM

__all__ = ["LLM", "LLMEngine", "RequestError", "RequestOutput", "StepOutput"]
