"""Which SDPA kernels the engine allows on CUDA (10.5): cuDNN out of eager steps, whose shapes change
every step, and back inside a CUDA-graph capture, whose shape is fixed. Flags only: runs on a CPU."""
from __future__ import annotations

import torch

from minillm.engine.attention import attention_for_capture, avoid_per_shape_attention_plans


def _restore(flag: bool) -> None:
    torch.backends.cuda.enable_cudnn_sdp(flag)


def test_a_cpu_engine_leaves_the_order_alone():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        assert avoid_per_shape_attention_plans(torch.device("cpu")) is False
        assert torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        _restore(before)


def test_cuda_takes_cudnn_out_and_a_capture_puts_it_back():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        assert avoid_per_shape_attention_plans(torch.device("cuda")) is True
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        with attention_for_capture():
            assert torch.backends.cuda.cudnn_sdp_enabled()
            assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
        assert not torch.backends.cuda.cudnn_sdp_enabled()      # restored after the capture
    finally:
        _restore(before)
