"""CUDA graphs for the decode step (chapter 10.5: launch overhead).

At batch 1 a decode step is a few hundred small kernels; launched one by one from Python, the
GPU waits for the CPU and the step never reaches the bandwidth bound. A CUDA graph records the
whole forward once and replays it with one launch. Inputs must live in fixed tensors (the
graph reads their memory), so we capture with static ``tokens`` and ``meta`` and update them in
place between replays.
"""
from __future__ import annotations

from typing import Callable

import torch


def capture_decode(model, cache, tokens: torch.Tensor, meta, warmup: int = 3) -> Callable[[], torch.Tensor]:
    """Capture ``model(tokens, cache, meta)``; returns a function that replays it and gives the
    (static) logits tensor. ``tokens`` / ``meta`` tensors may be overwritten in place later."""
    if tokens.device.type != "cuda":
        raise ValueError("CUDA graphs need a CUDA device")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):               # warm up kernels/allocator outside the capture
        for _ in range(warmup):
            model(tokens, cache, meta)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            logits = model(tokens, cache, meta)     # [B, 1, V], lives in the graph's memory pool
    except RuntimeError as e:
        # capture_end() replaces the real error (often out of memory) with "operation failed
        # due to a previous error during capture": report the cause
        raise (e.__context__ or e) from None
    static = (tokens, meta, cache)                  # the graph reads these addresses: keep them alive

    def replay() -> torch.Tensor:
        graph.replay()
        return logits

    replay.graph, replay.static = graph, static     # type: ignore[attr-defined]
    return replay
