"""CUDA graphs for the decode step (chapter 10.5: launch overhead).

At batch 1 a decode step is a few hundred small kernels; launched one by one from Python, the
GPU waits for the CPU and the step never reaches the bandwidth bound. A CUDA graph records the
whole forward once and replays it with one launch. Its inputs must live in fixed tensors (the
graph reads their addresses), so the runner keeps static buffers per bucket and copies each
step's values into them (``prepare_for_replay``); padding rows point at the cache's reserved
slot. All graphs share one memory pool.
"""
from __future__ import annotations

from typing import Callable

import torch


class GraphPool:
    def __init__(self):
        self.pool = None
        self.graphs: dict[tuple[int, int], Callable[[], torch.Tensor]] = {}

    def capture(self, key: tuple[int, int], fn: Callable[[], torch.Tensor], warmup: int = 2
                ) -> Callable[[], torch.Tensor]:
        """Capture ``fn()`` (which reads only static buffers); return a replay that gives the
        graph's static output tensor."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):               # warm up kernels/allocator outside the capture
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                out = fn()
        except RuntimeError as e:
            # capture_end() replaces the real error (often out of memory) with "operation failed
            # due to a previous error during capture": report the cause
            raise (e.__context__ or e) from None
        if self.pool is None:
            self.pool = graph.pool()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        replay.graph = graph                         # type: ignore[attr-defined]
        self.graphs[key] = replay
        return replay
